"""Offline mode: our engine (and peers) on one model in this process, no server.

For each method and context: one warm-up generation, then `repeats` timed generations of
exactly gen-tokens tokens (eos ignored), each on its own prompt; every number is the median.
Speculative methods also get their parts timed one step at a time (see steps.py).
This module must not import the server (the GPU machine has no fastapi/uvicorn).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from verispec.bench import compare
from verispec.bench.bandwidth import DEFAULT_COPY_BYTES, measure_copy_bandwidth
from verispec.bench.build import Target, load_target, random_eagle3, random_mtp_head, random_target
from verispec.bench.options import BenchOptions, Method, Peer
from verispec.bench.progress import Progress
from verispec.bench.prompts import token_prompt, tokenized_prompt
from verispec.bench.workloads import Workload, tokenized_workload_prompt
from verispec.bench.report import BenchReport, run_metadata
from verispec.bench.roofline import mean_decode_context, roofline_tok_s, token_bytes, weight_bytes
from verispec.bench.shapes import default_eagle3_shape, eagle3_config, get_shape
from verispec.bench.steps import measure_step_costs
from verispec.config import EngineConfig
from verispec.engine import warmup
from verispec.engine.engine import Engine
from verispec.sampling.params import SamplingParams
from verispec.errors import VerispecError
from verispec.loading.device import parse_device, parse_dtype
from verispec.loading.model_loader import prepare_for_device, resolve_numerics

WARMUP_TOKENS = 16  # a warm-up generation: enough rounds to touch every kernel shape


@dataclass
class Setup:
    opts: BenchOptions
    target: Target
    device: torch.device
    dtype: torch.dtype
    bandwidth: float | None  # bytes/s
    bandwidth_source: str

    def close(self) -> None:
        """Stop a split target's worker ranks (the process group goes with them)."""
        if self.target.peers is not None:
            self.target.peers.stop()


def setup_target(opts: BenchOptions) -> Setup:
    """The target (random weights of a --shape, or a checkpoint), quantized if asked, and the bandwidth."""
    device = parse_device(opts.device)
    dtype = parse_dtype(opts.dtype, device)
    shape = get_shape(opts.shape) if opts.shape else None  # a bad shape fails before any work
    if shape is not None:
        _check_contexts(opts, shape.config.get("max_position_embeddings"))
    bandwidth, source = _bandwidth(opts, device)
    target = (random_target(shape.name, shape.config, device, dtype, opts.seed, opts.tensor_parallel_size)
              if shape is not None
              else load_target(opts.model, device, dtype, opts.tensor_parallel_size))
    if opts.quant:
        from verispec.quant.in_memory import quantize_model_

        quantize_model_(target.model, opts.quant)
        target.name = f"{target.name} ({opts.quant})"
        _free(device)
    _check_contexts(opts, target.model.max_position_embeddings)
    return Setup(opts, target, device, dtype, bandwidth, source)


def run_offline(opts: BenchOptions) -> BenchReport:
    setup = setup_target(opts)
    target, device, dtype = setup.target, setup.device, setup.dtype
    bandwidth, source = setup.bandwidth, setup.bandwidth_source
    shape = get_shape(opts.shape) if opts.shape else None
    grammar = _grammar(opts, target)
    runs_per_context = (1 + opts.repeats) * (2 if grammar is not None else 1)
    total = len(opts.methods) * len(opts.contexts) * runs_per_context
    total += sum(len(opts.contexts) for m in opts.methods if m.speculative)
    if opts.concurrency:
        total = len(opts.methods) * len(opts.contexts) * len(opts.concurrency) * runs_per_context
    total += len(opts.compare) * len(opts.contexts) * (1 + opts.repeats)
    progress = Progress(total)
    rows: list[dict] = []
    drafter_note = None
    graphs: dict[str, bool] = {}
    wrote_costs = False
    try:
        for method in opts.methods:
            engine, note = _engine(setup, method)
            drafter_note = note or drafter_note
            graphs[method.value] = _capture_graphs(engine)
            if opts.write_draft_costs is not None and method.speculative and not wrote_costs:
                _write_draft_costs(setup, engine)
                wrote_costs = True
                progress.note(f"wrote the draft-cost table {opts.write_draft_costs}")
            for context in opts.contexts:
                for constraint in (None, grammar) if grammar is not None else (None,):
                    if opts.concurrency:
                        rows.extend(_measure_concurrency(setup, engine, method, context, progress, constraint))
                    else:
                        rows.append(_measure_engine(setup, engine, method, context, progress, constraint))
            del engine
            _free(device)
        for peer in opts.compare:
            rows.extend(_measure_peer(setup, peer, progress))
    finally:
        progress.close()
        setup.close()
    _speedups(rows)
    meta = run_metadata(opts, device, dtype)
    meta.update({
        "target": target.name,
        "weights": "random weights" if target.random else f"checkpoint {target.model_dir}",
        "summary": shape.summary if shape is not None else None,
        "bandwidth_tbs": bandwidth / 1e12 if bandwidth else None,
        "bandwidth_source": source,
        "weight_bytes_per_token": token_bytes(target.model, 0).weights,
        "kv_context": "KV bytes at the mean decode position: context + gen_tokens/2",
        "kv_cache_dtype": opts.kv_cache_dtype,
        "drafter": drafter_note,
        "tokenizer": "stub (no detokenization cost)" if target.random else "checkpoint's",
        "cuda_graphs": graphs,
        "overlap_decode": opts.overlap_decode and any(graphs.values()),
        "json_schema": opts.json_schema,
        "workload": opts.workload.value,
        "draft_costs_table": str(opts.write_draft_costs) if opts.write_draft_costs else None,
    })
    if grammar is not None and target.random:
        meta["tokenizer"] = (f"a {target.model.vocab_size}-token byte vocabulary (bench/vocabulary.py) for the "
                             "grammar's masks")
    return BenchReport("offline", meta, rows)


def _check_contexts(opts: BenchOptions, max_len: int | None) -> None:
    if not max_len:
        return
    extra = opts.gen_tokens + opts.draft_block + 1
    too_long = [c for c in opts.contexts if c + extra > max_len]
    if too_long:
        raise VerispecError(f"--contexts {too_long[0]} plus {opts.gen_tokens} generated tokens does not fit this "
                            f"model's {max_len}-token context (at most {max_len - extra} with --gen-tokens "
                            f"{opts.gen_tokens})")


def _bandwidth(opts: BenchOptions, device: torch.device) -> tuple[float | None, str]:
    if opts.bandwidth_tbs is not None:
        return opts.bandwidth_tbs * 1e12, "--bandwidth"
    measured = measure_copy_bandwidth(device)
    if measured is None:
        return None, f"not measured on {device.type}; give --bandwidth TB/s"
    return measured, f"measured: {DEFAULT_COPY_BYTES >> 30} GiB device-to-device copy, read + written, median"


def _engine(setup: Setup, method: Method, prefix_cache: bool = True, max_num_seqs: int | None = None,
            max_model_len: int | None = None) -> tuple[Engine, str | None]:
    opts, target = setup.opts, setup.target
    config = EngineConfig(model=target.name, prefill_step_size=opts.prefill_step_size, cuda_graphs=opts.cuda_graphs,
                          numerics=opts.numerics, kv_cache_dtype=opts.kv_cache_dtype,
                          overlap_decode=None if opts.overlap_decode else False,
                          max_num_seqs=max_num_seqs or max(opts.concurrency or (1,)), prefix_cache=prefix_cache,
                          max_model_len=max_model_len or max(opts.contexts) + opts.gen_tokens + opts.draft_block + 8,
                          max_num_batched_tokens=max(opts.prefill_step_size, 2048),
                          draft_schedule=_draft_schedule(opts), tensor_parallel_size=opts.tensor_parallel_size)
    if method is Method.AR:
        return _new_engine(target, config), None
    if method is Method.EAGLE3:
        from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3

        if opts.eagle3:
            drafter = load_eagle3(opts.eagle3, target.model)
            note = f"EAGLE3 {opts.eagle3}"
        else:
            text_config = target.config.get("text_config") or target.config  # multimodal wrappers
            shape = get_shape(opts.shape).eagle3 if opts.shape else None
            shape = shape or default_eagle3_shape(text_config)
            raw = eagle3_config(text_config, shape)
            drafter = random_eagle3(target, raw, shape.with_embedding, seed=opts.seed + 1)
            note = (f"EAGLE3 random weights (never accepted: read the cost columns), draft vocab "
                    f"{raw['draft_vocab_size']}, {shape.layer_type} layer of hidden {raw['transformer_layer_config']['hidden_size']}")
        proposer = Eagle3Proposer(drafter, target.model.vocab_size)
        return _new_engine(target, config, proposer, opts.draft_block), note
    if method is Method.SUFFIX:
        from verispec.spec.suffix import SuffixOptions, SuffixProposer

        return _new_engine(target, config, SuffixProposer(SuffixOptions()), opts.draft_block), "suffix decoding"
    if method is Method.MTP:
        from verispec.spec.mtp import MtpProposer, load_mtp_head, supports_mtp

        if not supports_mtp(target.model):
            raise VerispecError(f"--methods mtp: model type '{target.config.get('model_type')}' has no MTP head "
                                "(MTP self-speculation is for Qwen3.5 / Qwen3.6; Gemma 4's drafter is "
                                "--mtp on `serve`)")
        head = load_mtp_head(target.model_dir, target.model) if target.model_dir else None
        if head is not None:
            note = f"MTP head of {target.model_dir}"
        else:
            head = random_mtp_head(target, seed=opts.seed + 1)
            note = "MTP head with random weights (never accepted: read the cost columns)"
        # vocabulary rows past the tokenizer's are padding, never drafted (as Engine.load does)
        proposer = MtpProposer(head, num_real_tokens=min(target.tokenizer.vocab_size, target.model.vocab_size))
        return _new_engine(target, config, proposer, opts.draft_block), note
    raise VerispecError(f"method {method.value} has no offline runner")


def _draft_schedule(opts: BenchOptions) -> str | None:
    """--draft-schedule as given ("adaptive": the engine's own per-sequence choice); none given, a run
    with several N keeps speculation on at every N (k drafts each), a single-sequence run adapts."""
    if opts.draft_schedule is not None:
        return None if opts.draft_schedule == "adaptive" else opts.draft_schedule
    return f"1:{opts.draft_block}" if opts.concurrency else None


def _write_draft_costs(setup: Setup, engine: Engine) -> None:
    """--write-draft-costs: the engine's verify passes and drafting timed at each --concurrency N
    (default 1) into the table `serve --draft-costs FILE` reads."""
    from verispec.engine.cost_measure import measure_costs

    opts = setup.opts
    costs = measure_costs(engine, batches=list(opts.concurrency or (1,)))
    costs.save(opts.write_draft_costs, device=str(setup.device), dtype=str(setup.dtype).removeprefix("torch."),
               model=setup.target.name, method=engine.method, num_drafts=engine.num_drafts)


def _new_engine(target: Target, config: EngineConfig, proposer=None, num_drafts: int = 0) -> Engine:
    """An engine on the target, its model first rewritten for the device as the loader does (once:
    later engines on the same model find nothing left to do)."""
    warmup.pin_triton_cache_dir(next(target.model.parameters()).device)  # before anything compiles
    prepare_for_device(target.model, config.fuse_small_ops, resolve_numerics(target.model, config.numerics)[0])
    return Engine(target.model, target.tokenizer, config, proposer=proposer, num_drafts=num_drafts, peers=target.peers)


def _capture_graphs(engine: Engine) -> bool:
    """Capture the engine's CUDA graphs up front, as `serve` does at prewarm (when the engine has
    them: CUDA with Triton). Returns whether decode/verify steps run as graphs."""
    capture = getattr(engine, "capture_graphs", None)
    if callable(capture):
        capture()
    runner = getattr(engine, "runner", None)
    return getattr(runner, "graphs", None) is not None


def _prompt(setup: Setup, context: int, repeat: int) -> list[int]:
    target = setup.target
    if target.random:
        return token_prompt(context, repeat, target.model.vocab_size, setup.opts.seed)
    if setup.opts.workload is not Workload.RANDOM:
        return tokenized_workload_prompt(target.tokenizer, setup.opts.workload, "offline", context, repeat)
    return tokenized_prompt(target.tokenizer, "offline", context, repeat)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def _out_of_memory(exc: Exception, what: str) -> VerispecError:
    return VerispecError(f"out of device memory {what}: {str(exc).splitlines()[0]}")


def _grammar(opts: BenchOptions, target):
    """--json-schema: the grammar every run is also measured under; a random shape gets a byte vocabulary
    of its size (the masks walk every token's bytes)."""
    if opts.json_schema is None:
        return None
    from verispec.bench.options import load_json_schema
    from verispec.grammar.spec import json_schema_grammar

    if target.random:
        from verispec.bench.vocabulary import ByteVocabularyTokenizer

        target.tokenizer = ByteVocabularyTokenizer(target.model.vocab_size)
    return json_schema_grammar(load_json_schema(opts.json_schema), param="--json-schema")


def _label(method: Method, grammar) -> str:
    return method.value + ("+json" if grammar is not None else "")


def _measure_engine(setup: Setup, engine: Engine, method: Method, context: int, progress: Progress,
                    grammar=None) -> dict:
    opts = setup.opts
    label = f"{_label(method, grammar)} ctx {context}"
    params = SamplingParams(max_tokens=opts.gen_tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
    _reset_peak(setup.device)
    runs = []
    try:
        warm = SamplingParams(max_tokens=min(WARMUP_TOKENS, opts.gen_tokens), temperature=0.0, ignore_eos=True,
                              grammar=grammar)
        engine.generate_all(_prompt(setup, context, -1), warm)
        progress.step(f"{label} warm-up")
        for repeat in range(opts.repeats):
            stats = engine.generate_all(_prompt(setup, context, repeat), params).stats
            runs.append({
                "ttft_ms": stats.ttft_ms, "prefill_tok_s": stats.prefill_tok_per_s,
                "decode_tok_s": stats.decode_tok_per_s, "generated_tokens": stats.generated_tokens,
                "rounds": stats.rounds, "drafted": stats.drafted, "accepted": stats.accepted,
            })
            progress.step(f"{label} run {repeat + 1}/{opts.repeats}")
        costs = None
        if method.speculative and grammar is None:  # step costs are the same with or without a grammar
            costs = measure_step_costs(engine, _prompt(setup, context, -2), opts.step_iters)
            progress.step(f"{label} step costs")
    except torch.OutOfMemoryError as exc:
        raise _out_of_memory(exc, f"running {method.value} at context {context}") from None
    row = _row(setup, _label(method, grammar), context, runs)
    row["peak_memory_gib"] = _peak_gib(setup.device)
    if method.speculative:
        drafted = sum(r["drafted"] for r in runs)
        accepted = sum(r["accepted"] for r in runs)
        per_round = [(r["generated_tokens"] - 1) / r["rounds"] for r in runs if r["rounds"]]
        row.update({
            "draft_block": engine.num_drafts,
            "rounds": _median(runs, "rounds"),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            # tokens each target pass yields after prefill (accepted drafts + the bonus token)
            "tokens_per_round": statistics.median(per_round) if per_round else None,
        })
        if costs is not None:
            row.update(costs.as_dict())
    progress.note(_summary(row))
    return row


def _measure_concurrency(setup: Setup, engine: Engine, method: Method, context: int, progress: Progress,
                         grammar=None) -> list[dict]:
    """One row per --concurrency N: N distinct prompts of `context` tokens submitted together."""
    from verispec.bench.concurrency import batched_roofline_tok_s, run_batch

    opts = setup.opts
    tb = token_bytes(setup.target.model, mean_decode_context(context, opts.gen_tokens), opts.kv_cache_dtype)
    rows = []
    for n in opts.concurrency:
        label = f"{_label(method, grammar)} ctx {context} x{n}"
        prompts = [_prompt(setup, context, 1000 * r + i) for r in range(opts.repeats + 1) for i in range(n)]
        _reset_peak(setup.device)
        try:
            run_batch(engine, prompts[:n], min(WARMUP_TOKENS, opts.gen_tokens), grammar)
            progress.step(f"{label} warm-up")
            runs = []
            for r in range(opts.repeats):
                runs.append(run_batch(engine, prompts[(r + 1) * n:(r + 2) * n], opts.gen_tokens, grammar))
                progress.step(f"{label} run {r + 1}/{opts.repeats}")
        except torch.OutOfMemoryError as exc:
            raise _out_of_memory(exc, f"running {method.value} x{n} at context {context}") from None
        costs = None
        if method.speculative and grammar is None:
            costs = measure_step_costs(engine, _prompt(setup, context, -2), opts.step_iters, batch=n)
        best = sorted(runs, key=lambda x: x["decode_tok_s"] or 0)[len(runs) // 2]  # the median run
        weights = weight_bytes(setup.target.model, tokens=n)  # a MoE step reads its tokens' union of experts
        roofline = batched_roofline_tok_s(setup.bandwidth, weights, tb.kv, n)
        row = {"method": _label(method, grammar), "context": context, "gen_tokens": opts.gen_tokens, "repeats": len(runs),
               "ttft_ms": best["ttft_p50_ms"], "prefill_tok_s": None, "bytes_per_token": tb.total,
               "weight_bytes": weights, "kv_bytes": tb.kv, "roofline_tok_s": roofline,
               "roofline_fraction": best["decode_tok_s"] / roofline if roofline and best["decode_tok_s"] else None,
               "peak_memory_gib": _peak_gib(setup.device), "runs": runs, **best}
        if costs is not None:
            row.update(costs.as_dict())
        rows.append(row)
        progress.note(f"{label}: decode {best['decode_tok_s'] or 0:.1f} tok/s aggregate over {n} sequences, "
                      f"{best['per_request_tok_s'] or 0:.1f} per request, TTFT p50 {best['ttft_p50_ms']:.0f} ms; "
                      f"round ms: draft {best.get('round_draft_ms', 0):.2f}, launch {best.get('round_launch_ms', 0):.2f}, "
                      f"device {best.get('round_device_ms', 0):.2f}, host after {best.get('round_host_after_ms', 0):.2f}")
    base = next((r for r in rows if r["concurrency"] == 1), None)
    for r in rows:
        r["speedup_vs_batch1"] = r["decode_tok_s"] / base["decode_tok_s"] if base and r["decode_tok_s"] else None
    return rows


def _measure_peer(setup: Setup, peer: Peer, progress: Progress) -> list[dict]:
    opts, device = setup.opts, setup.device
    if peer is not Peer.TRANSFORMERS:
        raise VerispecError(f"--compare {peer.value} has no runner")
    model = compare.transformers_model(setup.target, device, setup.dtype)
    rows = []
    try:
        for context in opts.contexts:
            label = f"transformers ctx {context}"
            _reset_peak(device)
            try:
                compare.warm_up(model, _prompt(setup, context, -1), device)
                progress.step(f"{label} warm-up")
                runs = []
                for repeat in range(opts.repeats):
                    run = compare.run_once(model, _prompt(setup, context, repeat), opts.gen_tokens, device)
                    runs.append({"ttft_ms": run.ttft_ms, "prefill_tok_s": context / (run.ttft_ms / 1000),
                                 "decode_tok_s": run.decode_tok_s, "generated_tokens": run.gen_tokens})
                    progress.step(f"{label} run {repeat + 1}/{opts.repeats}")
            except torch.OutOfMemoryError as exc:
                raise _out_of_memory(exc, f"running transformers at context {context}") from None
            row = _row(setup, "transformers", context, runs)
            row["peak_memory_gib"] = _peak_gib(device)
            row["attention"] = compare.attention_implementation(model)
            rows.append(row)
            progress.note(_summary(row))
    finally:
        del model
        _free(device)
    return rows


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _row(setup: Setup, method: str, context: int, runs: list[dict]) -> dict:
    opts = setup.opts
    tb = token_bytes(setup.target.model, mean_decode_context(context, opts.gen_tokens), opts.kv_cache_dtype)
    decode = _median(runs, "decode_tok_s")
    roofline = roofline_tok_s(setup.bandwidth, tb.total)
    return {
        "method": method,
        "context": context,
        "gen_tokens": opts.gen_tokens,
        "repeats": len(runs),
        "ttft_ms": _median(runs, "ttft_ms"),
        "prefill_tok_s": _median(runs, "prefill_tok_s"),
        "decode_tok_s": decode,
        "bytes_per_token": tb.total,
        "weight_bytes": tb.weights,
        "kv_bytes": tb.kv,
        "bandwidth_tbs": setup.bandwidth / 1e12 if setup.bandwidth else None,
        "roofline_tok_s": roofline,
        "roofline_fraction": decode / roofline if roofline else None,
        "runs": runs,
    }


def _speedups(rows: list[dict]) -> None:
    """speedup_vs_ar: decode tok/s over our plain decode at the same context; speedup_vs_transformers:
    over transformers generate at the same context (both measured in this run)."""
    by = {(r["method"], r["context"], r.get("concurrency")): r["decode_tok_s"] for r in rows}
    for r in rows:
        if r["method"] == "transformers":
            continue
        ar = by.get(("ar", r["context"], r.get("concurrency")))
        hf = by.get(("transformers", r["context"], None))
        if r["method"] != "ar":
            r["speedup_vs_ar"] = r["decode_tok_s"] / ar if ar else None
        if r["method"].endswith("+json"):  # the grammar's cost: decode tok/s over the same method unconstrained
            free = by.get((r["method"][:-len("+json")], r["context"], r.get("concurrency")))
            r["vs_unconstrained"] = r["decode_tok_s"] / free if free and r["decode_tok_s"] else None
        r["speedup_vs_transformers"] = r["decode_tok_s"] / hf if hf else None


def _summary(row: dict) -> str:
    text = (f"{row['method']} ctx {row['context']}: ttft {row['ttft_ms']:.1f} ms, "
            f"decode {row['decode_tok_s']:.1f} tok/s")
    if row.get("roofline_fraction") is not None:
        text += f" ({100 * row['roofline_fraction']:.1f}% of roofline)"
    if row.get("verify_decode_ratio") is not None:
        text += (f", verify/decode {row['verify_decode_ratio']:.2f}, "
                 f"draft/token {row['draft_cost_fraction']:.2f} of a step")
    return text
