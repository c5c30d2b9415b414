#!/usr/bin/env python3
"""Measure plain vs EAGLE3 decoding of a model on held-out chat prompts, on this machine's device,
and record the fastest as that device type's default speculation.

Each configuration (plain, then EAGLE3 at each --drafts count) runs the engine as `verispec serve`
does (CUDA graphs and prewarm on CUDA), greedy, stopping at the model's end of turn, over the same
prompts: decode tok/s (generated tokens after the first / decode time), acceptance, tokens per
target pass, and whether the output is token-for-token plain greedy's. A speculative
configuration becomes the default only if it beats plain decoding and its output is plain
greedy's on every prompt; otherwise the default is plain.

The record (--record, e.g. the drafter directory's speculation.json) keeps other device types'
entries, so the GPU run and a CPU run fill one table:
  {"speculation_by_device": {"cuda": {"method": "eagle3", "draft_block": 3}, "cpu": {"method": "none"}},
   "why_by_device": {...}, "measurements": [...]}
verispec/default_model.py reads it for `verispec serve` without -m.

  python scripts/measure_speculation.py -m smollm2 --eagle3 verispec/drafters/smollm2-eagle3 \\
      --prompts build/smollm2-corpus/heldout.jsonl --record verispec/drafters/smollm2-eagle3/speculation.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def device_label(engine) -> str:
    """"cuda (NVIDIA H200, bfloat16)" / "cpu (2 threads, float32)": what a timing was taken on."""
    import torch

    dtype = str(engine.dtype).removeprefix("torch.")
    if engine.device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(engine.device)}, {dtype})"
    return f"{engine.device.type} ({torch.get_num_threads()} threads, {dtype})"


def measure(config, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    engine = Engine.load(config)
    engine.prewarm()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    generated = drafted = accepted = rounds = 0
    decode_s = 0.0
    outputs = []
    for ids in prompts:
        result = engine.generate_all(ids, params)
        st = result.stats
        # the first token comes from prefill; decode speed counts the tokens after it
        generated += st.generated_tokens - 1
        drafted, accepted, rounds = drafted + st.drafted, accepted + st.accepted, rounds + st.rounds
        decode_s += st.decode_ms / 1000
        outputs.append(result.token_ids)
    row = {"decode_tok_per_s": round(generated / max(decode_s, 1e-9), 1), "decoded_tokens": generated,
           "acceptance": round(accepted / drafted, 4) if drafted else None,
           "tokens_per_round": round(generated / rounds, 3) if rounds else None, "device": device_label(engine)}
    return row, outputs


def choose_default(rows: list[dict], num_prompts: int, max_tokens: int) -> tuple[dict, str]:
    """The device's default speculation from the measured rows (plain first) and why."""
    plain = rows[0]
    # lossless or nothing: a configuration whose greedy output differs from plain greedy on any
    # prompt (half-precision products summed in a width-dependent order, e.g. on a CPU) is never
    # the default, however fast
    exact = [r for r in rows if r["identical_to_plain_greedy"] == f"{num_prompts}/{num_prompts}"]
    best = max(exact, key=lambda r: r["decode_tok_per_s"])
    choice = ({"method": "none"} if best is plain else
              {"method": "eagle3", "draft_block": int(best["config"].split("-")[1])})
    rival = best if best is not plain else max(rows[1:], key=lambda r: r["decode_tok_per_s"], default=plain)
    why = (f"measured {time.strftime('%Y-%m-%d')} on {plain['device']}: {rival['config']} {rival['decode_tok_per_s']} "
           f"tok/s vs plain {plain['decode_tok_per_s']} tok/s (greedy, {num_prompts} held-out chat prompts, "
           f"up to {max_tokens} tokens)")
    if rival not in exact:
        why += (f"; not chosen: its greedy output equals plain greedy's on {rival['identical_to_plain_greedy']} "
                f"prompts only in {str(rows[0]['device']).split(', ')[-1].rstrip(')')}")
    return choice, why


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="the target (directory, .gguf, or smollm2)")
    p.add_argument("--eagle3", required=True, help="the EAGLE3 drafter directory")
    p.add_argument("--prompts", required=True, help="held-out prompts: JSONL with a rendered \"prompt\" per line")
    p.add_argument("--drafts", default="1,2,3,4", help="EAGLE3 drafts per round to measure (default 1,2,3,4)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--record", default=None, help="JSON file to write the measurements and the choice into")
    p.add_argument("--max-seconds", type=float, default=None, help="measure no more configurations after this")
    args = p.parse_args(argv)

    from verispec.config import EngineConfig
    from verispec.loading.resolve import resolve_model
    from verispec.loading.tokenizer import Tokenizer
    from verispec.train.data import read_gen_prompts

    model = str(resolve_model(args.model))
    tok = Tokenizer.from_dir(Path(model))
    prompts = [tok.encode(t) for t in read_gen_prompts(args.prompts)[:args.num_prompts]]
    base = dict(model=model, device=args.device, dtype=args.dtype)
    t0 = time.perf_counter()
    rows, reference = [], None
    for k in [0] + [int(x) for x in args.drafts.split(",")]:
        if args.max_seconds and rows and time.perf_counter() - t0 > args.max_seconds:
            print(f"stopping after {len(rows)} configurations (--max-seconds)", file=sys.stderr)
            break
        config = EngineConfig(**base) if k == 0 else EngineConfig(**base, eagle3=args.eagle3, num_draft_tokens=k)
        row, outputs = measure(config, prompts, args.max_tokens)
        if reference is None:
            reference = outputs
        row = {"config": "plain" if k == 0 else f"eagle3-{k}",
               "identical_to_plain_greedy": f"{sum(a == b for a, b in zip(outputs, reference))}/{len(prompts)}",
               **row}
        rows.append(row)
        print(f"{row['config']:9s} {row['decode_tok_per_s']:9.1f} tok/s  acceptance {row['acceptance']}  "
              f"tokens/round {row['tokens_per_round']}  identical {row['identical_to_plain_greedy']}  {row['device']}",
              flush=True)
    choice, why = choose_default(rows, len(prompts), args.max_tokens)
    device_type = rows[0]["device"].split(" ")[0]
    print(f"default on {device_type}: {choice} ({why})")
    if args.record:
        path = Path(args.record)
        record = json.loads(path.read_text()) if path.is_file() else {}
        record.setdefault("speculation_by_device", {})[device_type] = choice
        record.setdefault("why_by_device", {})[device_type] = why
        kept = [r for r in record.get("measurements", []) if not r["device"].startswith(device_type + " ")]
        record["measurements"] = kept + rows
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
