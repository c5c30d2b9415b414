"""HTTP mode: any OpenAI-compatible server, measured the way its users see it.

Per server configuration (--url, or each --serve booting `verispec serve ARGS`): one warm-up
request, then for each context `repeats` streaming requests at temperature 0, each with its own
prompt (prompts.py), and medians. TTFT = time to the first generated text (content or reasoning;
the role chunk does not count). Decode tok/s = (usage.completion_tokens - 1) / (t_last - t_first),
usage from `stream_options.include_usage` (SSE chunk counts are not tokens: a speculative round
sends several tokens in one chunk). The prompt's length in tokens is the server's
usage.prompt_tokens; word counts are calibrated from the warm-up to land near each context.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from verispec.bench.options import BenchOptions, Endpoint
from verispec.bench.progress import Progress
from verispec.bench.prompts import text_prompt
from verispec.bench.workloads import workload_prompt
from verispec.bench.report import BenchReport, run_metadata
from verispec.errors import VerispecError

WARMUP_WORDS = 64
WARMUP_MAX_TOKENS = 16


@dataclass
class RequestResult:
    prompt: str
    prompt_tokens: int | None
    completion_tokens: int
    tokens_from_usage: bool
    ttft_ms: float | None
    decode_tok_s: float | None

    def as_dict(self) -> dict:
        return {"prompt_head": self.prompt[:60], "prompt_words": len(self.prompt.split()),
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "tokens_from_usage": self.tokens_from_usage, "ttft_ms": self.ttft_ms,
                "decode_tok_s": self.decode_tok_s}


class ServerClient:
    def __init__(self, url: str, opts: BenchOptions):
        import httpx

        self.httpx = httpx
        self.url = url.rstrip("/")
        self.opts = opts
        headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers,
                                   timeout=httpx.Timeout(opts.request_timeout_s, connect=10.0))
        self.model_id = self._model_id()

    def close(self) -> None:
        self.client.close()

    def _get(self, path: str):
        try:
            return self.client.get(path)
        except self.httpx.TransportError as exc:
            raise VerispecError(f"cannot reach {self.url}: {_reason(exc)}") from None

    def _model_id(self) -> str:
        resp = self._get("/v1/models")
        if resp.status_code != 200:
            raise VerispecError(f"{self.url}/v1/models answered HTTP {resp.status_code}: {_error_message(resp)}")
        try:
            return resp.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise VerispecError(f"{self.url}/v1/models did not list a model") from None

    def _events(self, path: str, body: dict) -> Iterator[tuple[float, dict]]:
        """POST a streaming request; yields (arrival time, event) per server-sent event until [DONE].
        An HTTP error status or an error event mid-stream raises a VerispecError naming it."""
        try:
            with self.client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise VerispecError(f"{self.url}{path} answered HTTP {resp.status_code}: {_error_message(resp)}")
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    if "error" in event:
                        raise VerispecError(f"{self.url}{path} failed mid-stream: {event['error'].get('message')}")
                    yield now, event
        except self.httpx.TransportError as exc:
            raise VerispecError(f"cannot reach {self.url}: {_reason(exc)}") from None

    def stream(self, prompt: str, max_tokens: int) -> RequestResult:
        endpoint = self.opts.endpoint
        body = {"model": self.model_id, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if endpoint is Endpoint.CHAT:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
        t_first = t_last = None
        text_chunks = 0
        usage = None
        t_sent = time.perf_counter()
        for now, event in self._events(path, body):
            for choice in event.get("choices") or []:
                if _generated_text(choice):
                    t_first = t_first if t_first is not None else now
                    t_last = now
                    text_chunks += 1
            if event.get("usage"):
                usage = event["usage"]
        completion = int(usage["completion_tokens"]) if usage else text_chunks
        ttft = (t_first - t_sent) * 1000 if t_first is not None else None
        decode = None
        if t_first is not None and t_last > t_first and completion > 1:
            decode = (completion - 1) / (t_last - t_first)
        return RequestResult(prompt, int(usage["prompt_tokens"]) if usage else None, completion,
                             usage is not None, ttft, decode)

    def chat_turn(self, messages: list[dict], max_tokens: int) -> dict:
        """One streamed chat request (greedy): the reply's text, TTFT and usage, with the prompt
        tokens the server says came from its cache (`prompt_tokens_details.cached_tokens`; None
        when it does not report them)."""
        body = {"model": self.model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage, t_first = [], None, None
        t_sent = time.perf_counter()
        for now, event in self._events("/v1/chat/completions", body):
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    t_first = t_first if t_first is not None else now
                    text.append(piece)
            usage = event.get("usage") or usage
        details = (usage or {}).get("prompt_tokens_details") or {}
        return {"text": "".join(text), "ttft_ms": (t_first - t_sent) * 1000 if t_first is not None else None,
                "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": details.get("cached_tokens")}

    def spec_counters(self) -> tuple[float, float] | None:
        """(drafted, accepted) totals from /metrics, when the server exports them."""
        try:
            resp = self.client.get("/metrics")
        except self.httpx.TransportError:
            return None
        if resp.status_code != 200:
            return None
        drafted = accepted = 0.0
        found = False
        for line in resp.text.splitlines():
            m = re.match(r"^(\w*spec_(drafted|accepted)_tokens_total)(\{[^}]*\})?\s+([0-9.eE+-]+)", line)
            if m:
                found = True
                if m.group(2) == "drafted":
                    drafted += float(m.group(4))
                else:
                    accepted += float(m.group(4))
        return (drafted, accepted) if found else None

    def peak_memory_gib(self) -> float | None:
        """Peak device memory if the server reports it (/health JSON or a Prometheus gauge)."""
        with contextlib.suppress(Exception):
            health = self.client.get("/health").json()
            for key, value in _flatten(health):
                k = key.lower()
                if "peak" in k and "mem" in k and isinstance(value, (int, float)):
                    if k.endswith("bytes"):
                        return value / 2**30
                    if k.endswith("gib") or k.endswith("gb"):
                        return float(value)
        with contextlib.suppress(Exception):
            resp = self.client.get("/metrics")
            for line in resp.text.splitlines():
                m = re.match(r"^(\w*peak\w*mem\w*bytes|\w*mem\w*peak\w*bytes)(\{[^}]*\})?\s+([0-9.eE+-]+)", line)
                if m:
                    return float(m.group(3)) / 2**30
        return None


def _flatten(obj, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}_{k}" if prefix else str(k))
    else:
        yield prefix, obj


def _generated_text(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat: the role chunk has no text
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    return choice.get("text") or ""


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0]


def _error_message(resp) -> str:
    with contextlib.suppress(Exception):
        body = resp.json()
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return str(body["error"].get("message"))
    return resp.text[:200].replace("\n", " ")


# ---- serving a configuration ------------------------------------------------------------------

def _flag_value(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
    return None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(serve_args: str, opts: BenchOptions, log_path: Path | None = None) -> Iterator[tuple[str, float]]:
    """Boot `verispec serve ARGS` as a subprocess, wait for /health, yield its URL and the cold
    start (seconds from launching the process to /health answering 200: loading, compiling,
    graph capture and prewarm included), stop it. The server's output goes to `log_path` (kept),
    else to a temporary file."""
    import httpx

    args = shlex.split(serve_args)
    host = _flag_value(args, "-H", "--host") or "127.0.0.1"
    if _flag_value(args, "-p", "--port") is None:
        args += ["--port", str(_free_port(host))]
    if _flag_value(args, "-H", "--host") is None:
        args += ["--host", host]
    port = _flag_value(args, "-p", "--port")
    connect = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard bind: connect locally
    url = f"http://{'[' + connect + ']' if ':' in connect else connect}:{port}"
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "w+")
    else:
        log = tempfile.NamedTemporaryFile("w+", prefix="verispec-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "verispec", "serve", *args]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + opts.serve_timeout_s
        while True:
            if proc.poll() is not None:
                raise VerispecError(f"--serve \"{serve_args}\": the server exited with status {proc.returncode} "
                                    f"before it was ready: {_tail(log.name)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise VerispecError(f"--serve \"{serve_args}\": {url}/health not ready after "
                                    f"{opts.serve_timeout_s:.0f}s (log: {log.name})")
            time.sleep(0.25)
        yield url, time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _tail(path: str, num_lines: int = 3) -> str:
    with contextlib.suppress(OSError):
        lines = [ln.strip() for ln in open(path, errors="replace").read().splitlines() if ln.strip()]
        return " | ".join(lines[-num_lines:]) or "(no output)"
    return "(no output)"


# ---- the measurement --------------------------------------------------------------------------

def run_http(opts: BenchOptions) -> BenchReport:
    configs = [(opts.url, None)] if opts.url else [(s, s) for s in opts.serve]
    total = len(configs) * (1 + len(opts.contexts) * opts.repeats * max(1, len(opts.concurrency)))
    progress = Progress(total)
    rows: list[dict] = []
    models = []
    try:
        for index, (label, serve_args) in enumerate(configs):
            with contextlib.ExitStack() as stack:
                log_path = Path(opts.out) / f"serve-{index}.log" if opts.out is not None else None
                url, ready_s = (stack.enter_context(served(serve_args, opts, log_path)) if serve_args is not None
                                else (label, None))
                client = ServerClient(url, opts)
                stack.callback(client.close)
                models.append(client.model_id)
                rows.extend(_measure(client, label, index, opts, progress, ready_s))
    finally:
        progress.close()
    first = {r["context"]: r["decode_tok_s"] for r in rows if r["config_index"] == 0}
    if len(configs) > 1:
        for r in rows:
            base = first.get(r["context"])
            r["speedup_vs_first"] = r["decode_tok_s"] / base if base and r["decode_tok_s"] else None
    meta = run_metadata(opts)
    meta.update({"endpoint": opts.endpoint.value, "configs": [c for c, _ in configs], "models": models,
                 "workload": opts.workload.value})
    return BenchReport("http", meta, rows)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _measure(client: ServerClient, label: str, index: int, opts: BenchOptions, progress: Progress,
             ready_s: float | None) -> list[dict]:
    """ready_s: the server's cold start (--serve), None for --url. The warm-up request is the
    first the server sees: its TTFT is the first-token latency a user meets after start-up."""
    # every configuration gets the same prompts (its own server starts empty, so no cache carries
    # over): what a speculative method accepts depends on the text, and configs are compared
    tag = "c"
    warm = text_prompt(tag, 0, -1, WARMUP_WORDS)
    result = client.stream(warm, min(WARMUP_MAX_TOKENS, opts.gen_tokens))
    progress.step(f"{label} warm-up")
    if ready_s is not None:
        progress.note(f"{label}: ready {ready_s:.1f} s after launch, first request's TTFT {result.ttft_ms or 0:.1f} ms")
    # prompt tokens per word (tag and template included): the first estimate of prompt sizes
    tokens_per_word = (result.prompt_tokens or WARMUP_WORDS) / len(warm.split())
    rows = []
    if opts.concurrency:
        rows = _measure_clients(client, label, index, opts, progress, tag, tokens_per_word)
        for row in rows:
            row.update({"server_ready_s": ready_s, "first_request_ttft_ms": result.ttft_ms,
                        "peak_memory_gib": client.peak_memory_gib()})
        return rows
    for context in opts.contexts:
        words = max(1, round(context / tokens_per_word) - 6)
        before = client.spec_counters()
        results: list[RequestResult] = []
        for repeat in range(opts.repeats):
            prompt = workload_prompt(opts.workload, tag, context, repeat, words)
            r = client.stream(prompt, opts.gen_tokens)
            results.append(r)
            if r.prompt_tokens:  # aim the next prompt closer to the context
                words = max(1, round(words * context / r.prompt_tokens))
            progress.step(f"{label} ctx {context} run {repeat + 1}/{opts.repeats}")
        after = client.spec_counters()
        acceptance = None
        if before is not None and after is not None and after[0] > before[0]:
            acceptance = (after[1] - before[1]) / (after[0] - before[0])
        ttft = _median([r.ttft_ms for r in results])
        prompt_tokens = _median([r.prompt_tokens for r in results])
        row = {
            "config": label, "config_index": index, "model": client.model_id, "context": context,
            "prompt_tokens": prompt_tokens, "ttft_ms": ttft,
            "prefill_tok_s": _median([r.prompt_tokens / (r.ttft_ms / 1000) for r in results
                                      if r.prompt_tokens and r.ttft_ms]),
            "decode_tok_s": _median([r.decode_tok_s for r in results]),
            "completion_tokens": _median([r.completion_tokens for r in results]),
            "tokens_from_usage": all(r.tokens_from_usage for r in results),
            "acceptance": acceptance, "repeats": len(results),
            "server_ready_s": ready_s, "first_request_ttft_ms": result.ttft_ms,
            "requests": [r.as_dict() for r in results],
        }
        rows.append(row)
        decode = row["decode_tok_s"]
        progress.note(f"{label} ctx {context}: ttft {ttft or 0:.1f} ms, decode "
                      f"{'n/a' if decode is None else f'{decode:.1f}'} tok/s")
    peak = client.peak_memory_gib()
    for row in rows:
        row["peak_memory_gib"] = peak
    return rows


def _measure_clients(client: ServerClient, label: str, index: int, opts: BenchOptions, progress: Progress,
                     tag: str, tokens_per_word: float) -> list[dict]:
    """--concurrency over HTTP: N clients at once, each streaming its own prompt; aggregate tok/s
    is every completion token over the wall time of the whole group."""
    from concurrent.futures import ThreadPoolExecutor

    from verispec.bench.concurrency import _percentile

    rows = []
    for context in opts.contexts:
        words = max(1, round(context / tokens_per_word) - 6)
        for n in opts.concurrency:
            groups = []
            for repeat in range(opts.repeats):
                prompts = [workload_prompt(opts.workload, tag, context, 1000 * n + 100 * repeat + i, words)
                           for i in range(n)]
                before = client.spec_counters()
                t0 = time.perf_counter()
                with ThreadPoolExecutor(max_workers=n) as pool:
                    results = list(pool.map(lambda p: client.stream(p, opts.gen_tokens), prompts))
                wall = time.perf_counter() - t0
                after = client.spec_counters()
                acceptance = None
                if before is not None and after is not None and after[0] > before[0]:
                    acceptance = (after[1] - before[1]) / (after[0] - before[0])
                total = sum(r.completion_tokens for r in results)
                ttft = [r.ttft_ms for r in results if r.ttft_ms is not None]
                groups.append({"aggregate_tok_s": total / wall, "wall_s": wall, "acceptance": acceptance,
                               "per_request_tok_s": _median([r.decode_tok_s for r in results]),
                               "ttft_p50_ms": _percentile(ttft, 0.5) if ttft else None,
                               "ttft_p99_ms": _percentile(ttft, 0.99) if ttft else None,
                               "completion_tokens": total, "prompt_tokens": _median([r.prompt_tokens for r in results]),
                               "requests": [r.as_dict() for r in results]})
                progress.step(f"{label} ctx {context} x{n} run {repeat + 1}/{opts.repeats}")
            best = sorted(groups, key=lambda g: g["aggregate_tok_s"])[len(groups) // 2]
            row = {"config": label, "config_index": index, "model": client.model_id, "context": context,
                   "concurrency": n, "ttft_ms": best["ttft_p50_ms"], "decode_tok_s": best["per_request_tok_s"],
                   "prefill_tok_s": None, "repeats": len(groups), **best}
            rows.append(row)
            progress.note(f"{label} ctx {context} x{n}: {best['aggregate_tok_s']:.1f} tok/s aggregate, "
                          f"{best['per_request_tok_s'] or 0:.1f} per request, TTFT p50 {best['ttft_p50_ms'] or 0:.0f} ms")
        one = next((r for r in rows if r["context"] == context and r["concurrency"] == 1), None)
        for r in rows:
            if r["context"] == context and one:
                r["speedup_vs_one_client"] = r["aggregate_tok_s"] / one["aggregate_tok_s"]
    return rows
