"""Does a served request's answer depend on anything but the request? Boots `verispec serve ARGS`
for each --serve, sends the same chat prompts in several ways and compares every answer's tokens
and logprobs (bit for bit, as the server's JSON gives them) with the first server's answer alone:

- alone: one request at a time;
- repeated: the same again (a prefix-cache hit where the server caches);
- together: all prompts at once;
- N clients: N concurrent clients sending max(N, prompts) requests, prompt i % prompts each;
- seeded: temperature 0.8 with a seed per prompt, alone then all at once (compared with the first
  server's seeded answers alone).

    python scripts/served_identity.py "--serve=--no-spec" "--serve=" --max-tokens 1024 --clients 1,8,32

Prints one table row per (server, way) and writes the JSON to --out. Exit status 1 when any answer
differs, so it can gate a run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


PROMPTS = [
    "Explain how a bicycle's gears make climbing easier.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a recipe for a simple vegetable soup.",
    "Why is the sky blue? Answer in detail.",
    "Write a polite email asking a colleague to review my report by Friday.",
    "List five tips for learning a new language, with a sentence on each.",
    "How does a refrigerator keep food cold?",
    "Summarize the plot of a heist movie you invent, in three paragraphs.",
    "What is the difference between weather and climate?",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Describe a walk through a busy market in the morning.",
    "What should someone consider before adopting a dog?",
    "Explain what a prime number is and give examples.",
    "Write a poem about autumn leaves.",
]


def _ask(client, model: str, prompt: str, max_tokens: int, seed: int | None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0 if seed is None else 0.8, "logprobs": True}
    if seed is not None:
        body["seed"] = seed
    resp = client.post("/v1/chat/completions", json=body)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    entries = (choice.get("logprobs") or {}).get("content") or []
    return {"text": choice["message"].get("content") or "", "finish": choice.get("finish_reason"),
            "tokens": [(e["token"], e["logprob"]) for e in entries]}


def _first_difference(a: dict, b: dict) -> str:
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        if x != y:
            kind = "token" if x[0] != y[0] else "logprob"
            return f"{kind} {i}"
    return "length" if len(a["tokens"]) != len(b["tokens"]) else "text"


def _agree(answers: list[dict], reference: list[dict], indices: list[int]) -> tuple[int, int, list[str]]:
    """(answers with the reference's tokens, of which also its logprobs bit for bit, where each differs)"""
    same_tokens, same, where = 0, 0, []
    for answer, i in zip(answers, indices):
        same_tokens += [t for t, _ in answer["tokens"]] == [t for t, _ in reference[i]["tokens"]]
        if answer == reference[i]:
            same += 1
        else:
            where.append(f"prompt {i}: {_first_difference(answer, reference[i])}")
    return same_tokens, same, where


def run_server(serve_args: str, prompts: list[str], max_tokens: int, clients: list[int], log: Path) -> dict:
    import httpx

    from verispec.bench.http import served  # here, not at the top: --help imports no torch
    from verispec.bench.options import BenchOptions

    opts = BenchOptions()
    with served(serve_args, opts, log) as (url, ready_s):
        with httpx.Client(base_url=url, timeout=httpx.Timeout(900.0, connect=10.0)) as client:
            listed = client.get("/v1/models").json()["data"][0]
            model = listed["id"]

            def ask_all(items: list[tuple[str, int | None]], workers: int) -> list[dict]:
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    return list(pool.map(lambda item: _ask(client, model, item[0], max_tokens, item[1]), items))

            n = len(prompts)
            greedy = [(p, None) for p in prompts]
            seeded = [(p, 1000 + i) for i, p in enumerate(prompts)]
            ways: dict[str, tuple[list[dict], list[int]]] = {}
            started = time.monotonic()
            ways["alone"] = (ask_all(greedy, 1), list(range(n)))
            ways["repeated"] = (ask_all(greedy, 1), list(range(n)))
            ways["together"] = (ask_all(greedy, n), list(range(n)))
            for c in clients:
                indices = [i % n for i in range(max(c, n))]
                ways[f"{c} clients"] = (ask_all([greedy[i] for i in indices], c), indices)
            ways["seeded alone"] = (ask_all(seeded, 1), list(range(n)))
            ways["seeded together"] = (ask_all(seeded, n), list(range(n)))
            print(f"[{serve_args!r}] ready in {ready_s:.1f} s, answered in {time.monotonic() - started:.1f} s, "
                  f"numerics {listed.get('numerics')}", flush=True)
    return {"serve": serve_args, "ready_s": ready_s, "numerics": listed.get("numerics"), "ways": ways}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="append", required=True, metavar="ARGS",
                        help="arguments of one `verispec serve` (repeat; the first is the reference)")
    parser.add_argument("--prompts", type=int, default=16, help=f"how many chat prompts (at most {len(PROMPTS)})")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--clients", default="1,8,32", help="client counts of the load test, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("served-identity.json"))
    args = parser.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts: {args.prompts} is outside 1..{len(PROMPTS)}")
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    prompts = PROMPTS[:args.prompts]

    results = []
    for index, serve_args in enumerate(args.serve):
        log = args.out.with_name(f"{args.out.stem}-server{index}.log")
        results.append(run_server(serve_args, prompts, args.max_tokens, clients, log))

    reference = results[0]["ways"]["alone"][0]
    seeded_reference = results[0]["ways"]["seeded alone"][0]
    rows, differs = [], False
    print("| server | way | same tokens as the first server alone | and the same logprobs | first differences |\n"
          "|---|---|---|---|---|")
    for result in results:
        for way, (answers, indices) in result["ways"].items():
            same_tokens, same, where = _agree(answers, seeded_reference if way.startswith("seeded") else reference,
                                              indices)
            differs |= same != len(answers)
            rows.append({"serve": result["serve"], "way": way, "same_tokens": same_tokens, "same": same,
                         "of": len(answers), "differences": where})
            print(f"| `{result['serve'] or '(defaults)'}` | {way} | {same_tokens}/{len(answers)} | {same}/{len(answers)} "
                  f"| {'; '.join(where[:3])} |", flush=True)
    lengths = [len(a["tokens"]) for a in reference]
    print(f"reference answers: {sum(lengths)} tokens, {min(lengths)}-{max(lengths)} each")
    args.out.write_text(json.dumps({"rows": rows, "servers": [{k: r[k] for k in ("serve", "ready_s", "numerics")}
                                                              for r in results],
                                    "reference": reference}, indent=1))
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
