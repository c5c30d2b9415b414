"""`verispec bench --prefix-cache`: what the prefix cache saves, and that it costs nothing on a miss.

In one run, on one target (a checkpoint or a random-weight `--shape`), per context C:
- repeat: a C-token prompt answered cold (nothing cached), then sent again; TTFT of each (median
  over --repeats distinct prompts) and the ratio.
- conversation: a 10-turn exchange replayed as a client would send it, each turn's prompt the last
  prompt + the answer + a new user message (rendered by the chat template when the model has one,
  so what the template does to earlier turns counts; token-level for random shapes): prompt tokens
  computed with the cache against every prompt token, and the summed TTFT with and without it.
- misses: N distinct random prompts decoded together (--concurrency, default 8), cache on and off:
  aggregate decode tok/s of each and their ratio (a miss must cost nothing).
The cache-off numbers come from an engine built with `prefix_cache=False` on the same weights.
"""
from __future__ import annotations

import contextlib
import random
import statistics

from verispec.bench.concurrency import run_batch
from verispec.bench.http import ServerClient, served
from verispec.bench.offline import _capture_graphs, _engine, _free, _prompt, setup_target
from verispec.bench.options import BenchOptions
from verispec.bench.progress import Progress
from verispec.bench.prompts import random_words
from verispec.bench.report import BenchReport, run_metadata
from verispec.sampling.params import SamplingParams
from verispec.errors import VerispecError

TURNS = 10
NEW_MESSAGE_TOKENS = 64  # token-level conversations: random ids per new user message
NEW_MESSAGE_WORDS = 40  # chat conversations: words per new user message


def run_prefix(opts: BenchOptions) -> BenchReport:
    setup = setup_target(opts)
    n = (opts.concurrency or (8,))[0]
    progress = Progress(len(opts.methods) * len(opts.contexts) * (3 * opts.repeats + TURNS) + 1)
    rows: list[dict] = []
    try:
        for method in opts.methods:
            engines = {}
            for cached in (True, False):
                engine, _ = _engine(setup, method, prefix_cache=cached, max_num_seqs=max(n, 1),
                                    max_model_len=max(opts.contexts) * 2 + TURNS * (opts.gen_tokens + 2 * NEW_MESSAGE_TOKENS))
                _capture_graphs(engine)
                engine.generate_all(_prompt(setup, 64, -7), SamplingParams(max_tokens=4, temperature=0.0,
                                                                           ignore_eos=True))  # warm-up
                engines[cached] = engine
            progress.step(f"{method.value} engines ready")
            for context in opts.contexts:
                def send(r, engine=engines[True], context=context):
                    stats = _one_token(engine, _prompt(setup, context, 500 + r))
                    return stats.ttft_ms, stats.cached_tokens

                rows.append(_repeat_row(method.value, context, opts.repeats, progress, send))
                rows.append(_conversation_row(setup, engines, method.value, context, progress))
                rows.append(_miss_row(setup, engines, method.value, context, n, progress))
            del engines
            _free(setup.device)
    finally:
        progress.close()
        setup.close()
    meta = run_metadata(opts, setup.device, setup.dtype)
    meta.update({"target": setup.target.name,
                 "weights": "random weights" if setup.target.random else f"checkpoint {setup.target.model_dir}",
                 "turns": TURNS, "misses_concurrency": n})
    return BenchReport("prefix", meta, rows)


def run_prefix_http(opts: BenchOptions) -> BenchReport:
    """Over HTTP (--url / --serve, any OpenAI-compatible server that reports
    usage.prompt_tokens_details.cached_tokens): the repeated prompt and the conversation rows."""
    configs = [(opts.url, None)] if opts.url else [(s, s) for s in opts.serve]
    progress = Progress(len(configs) * len(opts.contexts) * (2 * opts.repeats + TURNS))
    rows: list[dict] = []
    try:
        for label, serve_args in configs:
            with contextlib.ExitStack() as stack:
                url, _ = stack.enter_context(served(serve_args, opts)) if serve_args is not None else (label, None)
                client = ServerClient(url, opts)
                stack.callback(client.close)
                for context in opts.contexts:
                    def send(r, client=client, context=context):
                        reply = client.chat_turn(_user(max(context // 2, 8), f"http repeat {context} {r}"), 1)
                        return reply["ttft_ms"], reply["cached_tokens"]

                    rows.append(_repeat_row(label, context, opts.repeats, progress, send))
                    rows.append(_http_conversation_row(client, label, context, opts, progress))
    finally:
        progress.close()
    meta = run_metadata(opts)
    meta.update({"target": ", ".join(c for c, _ in configs), "weights": "over HTTP", "turns": TURNS})
    return BenchReport("prefix", meta, rows)


def _user(words: int, seed: str) -> list[dict]:
    return [{"role": "user", "content": random_words(words, seed)}]


def _http_conversation_row(client, label: str, context: int, opts: BenchOptions, progress: Progress) -> dict:
    messages = _user(max(context // 2, 8), f"http turn 0 ctx {context}")
    total = cached = turns = 0
    ttft = 0.0
    for turn in range(TURNS):
        try:
            reply = client.chat_turn(messages, opts.gen_tokens)
        except VerispecError as exc:
            if turn == 0 or "context length" not in str(exc):
                raise
            progress.note(f"{label}: the conversation outgrew the server's context after {turn} turns")
            break
        turns += 1
        total += reply["prompt_tokens"] or 0
        cached += reply["cached_tokens"] or 0
        ttft += reply["ttft_ms"] or 0.0
        progress.step(f"{label} ctx {context} turn {turn + 1}")
        messages = messages + [{"role": "assistant", "content": reply["text"]}] + \
            _user(NEW_MESSAGE_WORDS, f"http turn {turn + 1} {context}")
    return {"test": "conversation", "method": label, "context": context, "turns": turns, "prompt_tokens": total,
            "computed_tokens": total - cached, "computed_fraction": (total - cached) / total if total else None,
            "ttft_sum_ms": ttft, "ttft_sum_off_ms": None, "ttft_speedup": None, "rendering": "HTTP chat"}


def _one_token(engine, ids: list[int]):
    return engine.generate_all(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)).stats


def _repeat_row(method: str, context: int, repeats: int, progress: Progress, send) -> dict:
    """`send(r)` sends the r-th distinct prompt of about `context` tokens for one token and returns
    (TTFT ms, cached tokens); each prompt is sent twice: cold, then again."""
    cold, warm, cached = [], [], []
    for r in range(repeats):
        cold.append(send(r)[0])
        progress.step(f"{method} ctx {context} cold {r + 1}")
        ttft, hit = send(r)
        warm.append(ttft)
        cached.append(hit or 0)
        progress.step(f"{method} ctx {context} repeat {r + 1}")
    c, w = statistics.median(cold), statistics.median(warm)
    return {"test": "repeat", "method": method, "context": context, "cold_ttft_ms": c, "warm_ttft_ms": w,
            "cached_tokens": statistics.median(cached), "ttft_speedup": c / w if w else None}


def _conversation_row(setup, engines: dict, method: str, context: int, progress: Progress) -> dict:
    """The same conversation (the cached engine's answers) sent to both engines turn by turn."""
    tokenizer = setup.target.tokenizer
    chat = not setup.target.random and getattr(tokenizer, "has_chat_template", False)
    rng = random.Random(f"conversation {context}")
    params = SamplingParams(max_tokens=setup.opts.gen_tokens, temperature=0.0, ignore_eos=False)
    if chat:
        messages = [{"role": "user", "content": random_words(max(context // 2, 8), f"turn 0 ctx {context}")}]
    else:
        ids = _prompt(setup, context, 900)
    total = computed = turns = 0
    ttft = {True: 0.0, False: 0.0}
    for turn in range(TURNS):
        if chat:
            _, ids = tokenizer.chat_prompt_ids(messages)
        if len(ids) + setup.opts.gen_tokens > engines[True].max_model_len:
            break  # the conversation outgrew the context: report the turns that fit
        turns += 1
        result = engines[True].generate_all(ids, params)
        ttft[True] += result.stats.ttft_ms
        ttft[False] += _one_token(engines[False], ids).ttft_ms
        total += len(ids)
        computed += len(ids) - result.stats.cached_tokens
        progress.step(f"{method} ctx {context} turn {turn + 1}")
        if chat:
            messages.append({"role": "assistant", "content": result.text})
            messages.append({"role": "user", "content": random_words(NEW_MESSAGE_WORDS, f"turn {turn + 1} {context}")})
        else:
            vocab = setup.target.model.vocab_size
            ids = ids + result.token_ids + [rng.randrange(3, vocab) for _ in range(NEW_MESSAGE_TOKENS)]
    return {"test": "conversation", "method": method, "context": context, "turns": turns,
            "prompt_tokens": total, "computed_tokens": computed, "computed_fraction": computed / total,
            "ttft_sum_ms": ttft[True], "ttft_sum_off_ms": ttft[False],
            "ttft_speedup": ttft[False] / ttft[True] if ttft[True] else None,
            "rendering": "chat template" if chat else "token ids"}


def _miss_row(setup, engines: dict, method: str, context: int, n: int, progress: Progress) -> dict:
    runs: dict[bool, list[float]] = {True: [], False: []}
    for r in range(setup.opts.repeats):  # interleaved, so drift (clocks, other load) hits both alike
        for cached in (False, True):
            prompts = [_prompt(setup, context, 2000 + 1000 * r + 100 * cached + i) for i in range(n)]
            batch = run_batch(engines[cached], prompts, setup.opts.gen_tokens)
            # no window where every sequence decodes (a short run where one finished before another's
            # first token): the aggregate rate, measured the same way with the cache on and off
            runs[cached].append(batch["decode_tok_s"] or batch["aggregate_tok_s"])
        progress.step(f"{method} ctx {context} x{n} misses, run {r + 1}")
    rates = {cached: statistics.median(v) for cached, v in runs.items()}
    return {"test": "misses", "method": method, "context": context, "concurrency": n,
            "decode_tok_s": rates[True], "decode_tok_s_off": rates[False],
            "on_vs_off": rates[True] / rates[False] if rates[False] else None}


def prefix_markdown(report: BenchReport) -> str:
    meta = report.meta
    lines = [f"## verispec bench --prefix-cache: {meta.get('target')} ({meta.get('weights')})",
             f"device {meta.get('device', 'of the server')}, {meta.get('dtype', '')}, torch {meta.get('torch')}; medians of "
             f"{meta['repeats']} prompts; {meta['gen_tokens']} tokens per answer", "",
             "| method | context | repeated prompt: TTFT cold → cached | cached tokens | speedup |",
             "|---|---|---|---|---|"]
    for r in (r for r in report.rows if r["test"] == "repeat"):
        lines.append(f"| {r['method']} | {r['context']} | {r['cold_ttft_ms']:.1f} → {r['warm_ttft_ms']:.1f} ms | "
                     f"{r['cached_tokens']:.0f} | {r['ttft_speedup']:.1f}x |")
    lines += ["", "| method | first prompt | turns | conversation: prompt tokens computed | "
                  "summed TTFT cached vs off | rendering |", "|---|---|---|---|---|---|"]
    for r in (r for r in report.rows if r["test"] == "conversation"):
        ttft = (f"{r['ttft_sum_ms']:.0f} vs {r['ttft_sum_off_ms']:.0f} ms ({r['ttft_speedup']:.1f}x)"
                if r["ttft_sum_off_ms"] is not None else f"{r['ttft_sum_ms']:.0f} ms (no cache-off run over HTTP)")
        lines.append(f"| {r['method']} | {r['context']} | {r['turns']} | {r['computed_tokens']} of {r['prompt_tokens']} "
                     f"({100 * (r['computed_fraction'] or 0):.1f}%) | {ttft} | {r['rendering']} |")
    if not any(r["test"] == "misses" for r in report.rows):  # over HTTP
        return "\n".join(lines) + "\n"
    lines += ["", "| method | context | sequences | decode tok/s, all misses: cache on / off | ratio |",
              "|---|---|---|---|---|"]
    for r in (r for r in report.rows if r["test"] == "misses"):
        lines.append(f"| {r['method']} | {r['context']} | {r['concurrency']} | {r['decode_tok_s']:.1f} / "
                     f"{r['decode_tok_s_off']:.1f} | {r['on_vs_off']:.3f} |")
    return "\n".join(lines) + "\n"
