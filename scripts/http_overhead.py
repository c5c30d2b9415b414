#!/usr/bin/env python3
"""How much the server's streaming costs the engine: the demo engine on the CPU with its decode
rounds replaced by a synthetic one (hold the GIL for a host time, release it for a "device" time,
then commit `--tokens` tokens per sequence through the real output path: detokenizing, stop checks,
chunks to the sinks). Prefill stays real. The same synthetic engine is timed offline (sinks that
only count) and behind the real server with N streaming HTTP clients, so the difference is what the
HTTP path takes from the engine's thread, on any machine, with no GPU.

  python scripts/http_overhead.py --clients 1,8 --host-ms 0.5 --per-seq-ms 0.08 --device-ms 1.0
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def synthetic_engine(args):
    from pathlib import Path

    from verispec.config import EngineConfig
    from verispec.engine.engine import Engine

    model = Path(__file__).resolve().parents[1] / "verispec" / "demo" / "model"
    engine = Engine.load(EngineConfig(model=str(model), device="cpu"))
    token = engine.tokenizer.encode(" the")[-1]

    def round_(seqs, num_drafts):
        _busy(args.host_ms + args.per_seq_ms * len(seqs))
        time.sleep(args.device_ms / 1000)  # a device wait releases the GIL
        chunks = []
        for seq in seqs:
            k = min(args.tokens, seq.remaining_tokens) - 1
            chunks.append(engine._commit_round(seq, [token] * k, k, token, None))
        for seq, chunk in zip(seqs, chunks):
            engine._emit(seq, chunk)

    engine._round = round_
    return engine


def offline(engine, n: int, gen_tokens: int) -> tuple[float, float]:
    from verispec.bench.concurrency import run_batch

    prompts = [engine.tokenizer.encode(f"prompt {i} " + "word " * 100) for i in range(n)]
    result = run_batch(engine, prompts, gen_tokens)
    return result["decode_tok_s"], result["per_request_tok_s"]


def http_clients(url: str, n: int, gen_tokens: int, repeats: int) -> tuple[float, float]:
    """(median aggregate decode tok/s, median per-request tok/s) of n streaming clients, each timed
    from its first to its last text chunk (this runs in a process of its own)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one(i: int) -> tuple[float, float]:
        body = {"model": "demo", "prompt": f"prompt {i} " + "word " * 100, "max_tokens": gen_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        t_first = t_last = None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
        return t_first, t_last

    aggregates, per_request = [], []
    for r in range(repeats):
        with ThreadPoolExecutor(n) as pool:
            spans = list(pool.map(one, [1000 * (r + 1) + i for i in range(n)]))
        rates = [(gen_tokens - 1) / (e - s) for s, e in spans]
        per_request.append(statistics.median(rates))
        aggregates.append(sum(rates))
    return statistics.median(aggregates), statistics.median(per_request)


def main() -> None:
    import multiprocessing
    import socket
    import sys

    import httpx
    import uvicorn

    from verispec.server.app import SWITCH_INTERVAL_S, create_app

    p = argparse.ArgumentParser()
    p.add_argument("--clients", default="1,8")
    p.add_argument("--host-ms", type=float, default=0.5, help="GIL-holding host time per round")
    p.add_argument("--per-seq-ms", type=float, default=0.08, help="more host time per sequence in the round")
    p.add_argument("--device-ms", type=float, default=1.0, help="GIL-free wait per round")
    p.add_argument("--tokens", type=int, default=3, help="tokens each sequence commits per round")
    p.add_argument("--gen-tokens", type=int, default=600)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    engine = synthetic_engine(args)
    counts = [int(x) for x in args.clients.split(",")]
    offline(engine, 2, 32)  # warm-up
    for n in counts:
        rates = [offline(engine, n, args.gen_tokens) for _ in range(args.repeats)]
        agg = statistics.median(r[0] for r in rates)
        print(f"offline x{n}: {agg:.0f} tok/s aggregate decode, {statistics.median(r[1] for r in rates):.0f} "
              f"per request", flush=True)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "demo"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.apply(http_clients, (url, 2, 32, 1))  # warm-up
        for n in counts:
            agg, per = pool.apply(http_clients, (url, n, args.gen_tokens, args.repeats))
            print(f"HTTP x{n}: {agg:.0f} tok/s aggregate decode, {per:.0f} per request", flush=True)
    server.should_exit = True
    thread.join(timeout=10)


if __name__ == "__main__":
    main()
