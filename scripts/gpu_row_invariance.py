"""On the lent GPU: is a row's result the same alone as among M rows, over many random inputs?
For `quant_frag.frag_gemv` with given tiles and for the MLP's streaming kernel with given plans
(kernels/stream_chain.py): each trial draws x [8, K], runs the 8 rows together and each row
alone, and counts the rows whose bits differ; and the largest relative error against float64.

  python3 scripts/gpu_row_invariance.py [--trials 20]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_persistent_bound import random_frag, synchronize_or_exit  # noqa: E402
from verispec.quant.kernels import frag_dequantize, grid_sync, frag as qf  # noqa: E402
from verispec.quant.kernels.stream_chain import stream_chain  # noqa: E402


def tiles(text: str) -> qf.FragTiles:
    return qf.FragTiles(*(int(v) for v in text.split("x")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--gemv", default="3072x512:1x4x1x4,1x8x1x1,2x4x1x2,1x4x2x4;24576x4096:1x4x2x4,1x4x1x4;"
                                           "512x1536:2x4x1x2,4x4x1x1,1x8x1x1")
    parser.add_argument("--stream", default="512x1536:2x2,2x2;4096x12288:2x2,1x4")
    parser.add_argument("--silu", action="store_true", help="frag_gemv with the SiLU epilogue")
    parser.add_argument("--repeat", default="", help="stream cases run again and again on one input: "
                        "'SHAPE:PLAN:SLOTS:PARTS:PDL;...' (distinct results, mismatches against frag_gemv)")
    args = parser.parse_args()
    if args.repeat:
        repeat(args.repeat.split(";"), args.trials)
        return
    torch.manual_seed(0)
    for case in filter(None, args.gemv.split(";")):
        shape, tile_list = case.split(":")
        n, k = (int(v) for v in shape.split("x"))
        fw = random_frag(n, k)
        w = frag_dequantize.dequantize(fw, torch.float64)
        for t in tile_list.split(","):
            differing, worst = 0, 0.0
            for _ in range(args.trials):
                x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
                together = qf.frag_gemv(x, fw, tiles(t), silu_gate=args.silu)
                for r in range(8):
                    differing += not torch.equal(qf.frag_gemv(x[r:r + 1], fw, tiles(t), silu_gate=args.silu)[0],
                                                 together[r])
                if not args.silu:
                    ref = x.double() @ w.T
                    worst = max(worst, float(((together.double() - ref).norm(dim=1) / ref.norm(dim=1)).max()))
            print(json.dumps({"gemv": shape, "tiles": t, "rows_differing": differing, "of": 8 * args.trials,
                              "worst_rel_err": worst}), flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = grid_sync.counter_for(torch.device("cuda"), 2 * sms)
    for case in filter(None, args.stream.split(";")):
        shape, plan_text = case.split(":")
        hidden, inter = (int(v) for v in shape.split("x"))
        plan = [tuple(int(v) for v in step.split("x")) for step in plan_text.split(",")]
        gate_up, down = random_frag(2 * inter, hidden), random_frag(hidden, inter)

        def run(x):
            h = torch.empty(x.shape[0], inter, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(x.shape[0], hidden, device="cuda", dtype=torch.bfloat16)
            stream_chain(x, x, h, y, (gate_up, down), plan, counter, sms, 3, 4)
            return h, y

        differing_h = differing_y = 0
        for _ in range(args.trials):
            x = torch.randn(8, hidden, device="cuda", dtype=torch.bfloat16)
            h8, y8 = run(x)
            for r in range(8):
                h1, y1 = run(x[r:r + 1].contiguous())
                differing_h += not torch.equal(h1[0], h8[r])
                differing_y += not torch.equal(y1[0], y8[r])
        synchronize_or_exit()
        print(json.dumps({"stream": shape, "plan": plan_text, "h_rows_differing": differing_h,
                          "y_rows_differing": differing_y, "of": 8 * args.trials}), flush=True)


def repeat(cases, trials: int) -> None:
    """Each case's streaming kernel run `trials` times on one input of 8 rows: how many distinct h
    and y it gives, and how many runs differ from frag_gemv with the same tiles."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case in cases:
        shape, plan_text, slots, parts, pdl = case.split(":")
        hidden, inter = (int(v) for v in shape.split("x"))
        plan = [tuple(int(v) for v in step.split("x")) for step in plan_text.split(",")]
        parts = int(parts)
        counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        gate_up, down = random_frag(2 * inter, hidden), random_frag(hidden, inter)
        x = torch.randn(8, hidden, device="cuda", dtype=torch.bfloat16)
        (rt1, kb1), (rt2, kb2) = plan
        h_ref = qf.frag_gemv(x, gate_up, qf.FragTiles(kb1, 4, 1, rt1), silu_gate=True)
        y_ref = qf.frag_gemv(h_ref, down, qf.FragTiles(kb2, 4, 1, rt2))
        hs, ys = set(), set()
        bad_h = bad_y = 0
        groups, rows = set(), set()
        for _ in range(trials):
            h = torch.empty(8, inter, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(8, hidden, device="cuda", dtype=torch.bfloat16)
            stream_chain(x, x, h, y, (gate_up, down), plan, counter, sms, int(slots), 4, parts=parts,
                         pdl=pdl == "1")
            synchronize_or_exit()
            hs.add(hash(h.view(torch.int16).cpu().numpy().tobytes()))
            ys.add(hash(y.view(torch.int16).cpu().numpy().tobytes()))
            bad_h += not torch.equal(h, h_ref)
            bad_y += not torch.equal(y, y_ref)
            wrong = (h != h_ref).nonzero()
            groups.update((wrong[:, 1] // (8 * rt1)).unique().tolist())
            rows.update(wrong[:, 0].unique().tolist())
        print(json.dumps({"case": case, "distinct_h": len(hs), "distinct_y": len(ys), "h_wrong": bad_h,
                          "y_wrong": bad_y, "of": trials,
                          "wrong_h_groups": sorted(groups)[:40], "wrong_h_rows": sorted(rows)}), flush=True)


if __name__ == "__main__":
    main()
