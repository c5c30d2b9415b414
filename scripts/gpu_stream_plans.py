"""On the lent GPU: the MLP's streaming kernel (kernels/stream_chain.py) against two frag_gemv
launches with the same tiles, product by product (gate_up's SiLU output h, then down's y), for
each plan and width, and a row alone against the same row among M. One JSON line a case.

  python3 scripts/gpu_stream_plans.py [--shapes 512x1536,4096x12288] [--plans "2x2,1x4;4x1,4x1"]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_persistent_bound import random_frag, synchronize_or_exit  # noqa: E402
from verispec.quant.kernels import grid_sync, frag as qf  # noqa: E402
from verispec.quant.kernels.stream_chain import stream_chain  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="512x1536,768x1280,4096x12288", help="hidden x intermediate")
    parser.add_argument("--plans", default="2x2,1x4;2x2,2x2;4x1,4x1;2x2,4x1;4x1,1x4",
                        help="gate_up step, down step (row tiles x blocks a warp); ';' between plans")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--slots", type=int, default=3)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = grid_sync.counter_for(torch.device("cuda"), 2 * sms)
    torch.manual_seed(0)
    for shape, plan_text in itertools.product(args.shapes.split(","), args.plans.split(";")):
        hidden, inter = (int(v) for v in shape.split("x"))
        plan = [tuple(int(v) for v in step.split("x")) for step in plan_text.split(",")]
        if any((k // 64) % (4 * kb) for k, (_, kb) in zip((hidden, inter), plan)):
            continue
        gate_up, down = random_frag(2 * inter, hidden), random_frag(hidden, inter)
        rows = [int(v) for v in args.rows.split(",")]
        x = torch.randn(max(rows), hidden, device="cuda", dtype=torch.bfloat16)
        for m in rows:
            h = torch.full((m, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
            y = torch.full((m, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
            stream_chain(x[:m], x[:m], h, y, (gate_up, down), plan, counter, sms, args.slots, 4)
            synchronize_or_exit()
            (rt1, kb1), (rt2, kb2) = plan
            h_ref = qf.frag_gemv(x[:m], gate_up, qf.FragTiles(kb1, 4, 1, rt1), silu_gate=True)
            y_from_h = qf.frag_gemv(h, down, qf.FragTiles(kb2, 4, 1, rt2))
            row = {"shape": shape, "plan": plan_text, "rows": m, "h_same": bool(torch.equal(h, h_ref)),
                   "h_nan": int(h.isnan().sum()), "y_same_given_h": bool(torch.equal(y, y_from_h)),
                   "y_nan": int(y.isnan().sum())}
            if not row["h_same"]:
                bad = (h != h_ref).nonzero()
                row["h_bad_rows_cols"] = [bad[:, 0].unique().tolist()[:8], bad[:, 1].unique().tolist()[:16]]
            if not row["y_same_given_h"]:
                bad = (y != y_from_h).nonzero()
                row["y_bad_rows_cols"] = [bad[:, 0].unique().tolist()[:8], bad[:, 1].unique().tolist()[:16]]
            if m > 1:
                one = torch.empty_like(y[:1])
                stream_chain(x[:1], x[:1], torch.empty_like(h[:1]), one, (gate_up, down), plan, counter, sms,
                             args.slots, 4)
                synchronize_or_exit()
                row["row_alone_same"] = bool(torch.equal(one, y[:1]))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
