"""On the lent GPU: a chain of 4-bit products of Qwen3-8B's shape as one persistent kernel whose
weights never stop streaming (verispec/kernels/stream_chain.py: a producer warp copies every tile into a
shared-memory ring by TMA, across the grid barriers between the products; consumer partitions
multiply from it), against the launched products (docs/benchmarks.md, "Twentieth session").

Why (docs/gpu.md, eighteenth and nineteenth sessions): a 4-bit product pays a fixed ~4 us a launch
(its start: the first loads' full latency and a pipeline that fills only then; its tail), ~145
times a step; a persistent kernel with grid barriers pays less a boundary, but was slower while
each product's warps loaded their own weights after the barrier.

The chain: gate_up (SiLU(gate) * up in its epilogue) -> down (`--chain mlp`), or o -> gate_up ->
down (`--chain layer`; with `--norm` the residual add + RMSNorm between o and gate_up too, inside
the kernel, against the engine's add + RMSNorm kernel between the launches). Plans give each
product's row tiles x blocks a warp a step (`gate_up=2x2,down=1x4,o=1x4`; warps x both: the same
for every product, a slot).

Checks: the launched products with the same tiles (same bits; with `--norm`: the new residual's
bits, and the output's largest difference from the launched products around a torch norm: the
kernel applies 1 / RMS to gate_up's sums, so they round once less), a row alone == the same row
among M. Times: us per chain under a CUDA graph cycling through copies of the weights (read from
memory, not L2), against the launched products with the shipped tiles; `--mode 0` only reads the weights
from the slots (the copies' own pace), `--mode 2` copies nothing (the arithmetic's own pace).

  python3 scripts/gpu_stream_chain.py [--rows 1,4] [--slots 2,4] [--parts 2] [--warps 4] [--out DIR]
  python3 scripts/gpu_stream_chain.py --compile-only [--sass]   # CPU: registers, spills, shared memory
  ncu ... -k regex:_stream_kernel --launch-skip 1 --launch-count 1 python3 scripts/gpu_stream_chain.py --ncu
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

from verispec.quant.kernels import frag as qf  # noqa: E402
from verispec.quant.kernels.stream_chain import compile_offline, stream_chain  # noqa: E402

SHAPES = {"o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
CHAINS = {"mlp": ("gate_up", "down"), "layer": ("o", "gate_up", "down")}
MODES = {0: "_copies_only", 1: "", 2: "_arithmetic_only"}


class _Shape:
    def __init__(self, n: int, k: int):
        self.out_features, self.in_features, self.group_size = n, k, 64


def parse_plans(text: str) -> list[dict]:
    """"gate_up=2x2,down=1x4,o=1x4;..." -> [{name: (row tiles, blocks a warp a step)}, ...]."""
    plans = []
    for plan in text.split(";"):
        entries = (item.split("=") for item in plan.split(","))
        plans.append({name: tuple(int(v) for v in value.split("x")) for name, value in entries})
    return plans


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def compile_only(args, plans) -> None:
    for chain, plan, slots, mode, parts in itertools.product(args.chain.split(","), plans, ints(args.slots),
                                                             ints(args.mode), ints(args.parts)):
        names = CHAINS[chain]
        norm = args.norm and chain == "layer"
        c = compile_offline([_Shape(*SHAPES[n]) for n in names], [plan[n] for n in names], slots, 132, args.warps,
                            mode=mode, parts=parts, consumer_regs=args.consumer_regs, norm=norm)
        result = {"chain": chain, "plan": plan, "slots": slots, "mode": mode, "parts": parts, "norm": norm,
                  "registers": c.registers, "spill_bytes": c.stack, "shared": c.shared}
        if args.sass:
            from verispec.kernels import offline_sass
            result["opcodes"] = dict(offline_sass.opcode_counts(c.sass))
        print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--chain", default="mlp,layer")
    parser.add_argument("--plans", default="gate_up=2x2,down=1x4,o=1x4",
                        help="per product: row tiles x blocks a warp a step, ';' between plans")
    parser.add_argument("--slots", default="2,4", help="slots a consumer partition's ring holds")
    parser.add_argument("--warps", type=int, default=4, help="warps a consumer partition")
    parser.add_argument("--parts", default="2", help="consumer partitions (1 or 2), each with its own ring")
    parser.add_argument("--consumer-regs", type=int, default=200,
                        help="registers of the second partition's threads")
    parser.add_argument("--mode", default="1", help="1 the products; 0 the copies only; 2 the arithmetic only")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--sass", action="store_true", help="with --compile-only: each kernel's opcode counts too")
    parser.add_argument("--ncu", action="store_true", help="launch the first configuration twice, untimed")
    parser.add_argument("--norm", action="store_true",
                        help="layer chain: the residual add + RMSNorm between o and gate_up inside the kernel"
                             " (launched: the engine's kernel between the products)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    plans = parse_plans(args.plans)
    if args.compile_only:
        compile_only(args, plans)
        return

    from gpu_persistent_bound import random_frag, synchronize_or_exit
    from verispec.quant.kernels.grid_sync import resident_per_multiprocessor
    from gpu_timing import cycle_time_us
    from triton.runtime.errors import OutOfResources
    from verispec.kernels.rms_norm import add_rms_norm
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(2, dtype=torch.int64, device="cuda")  # [1]: MODE 0's never-stored sum
    if args.ncu:
        names = CHAINS[args.chain.split(",")[0]]
        weights = [random_frag(*SHAPES[name]) for name in names]
        x = torch.randn(ints(args.rows)[0], 4096, device="cuda", dtype=torch.bfloat16)
        a, y = torch.empty_like(x), torch.empty_like(x)
        h = torch.empty(x.shape[0], 12288, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            stream_chain(x, a, h, y, weights, [plans[0][n] for n in names], counter, sms, ints(args.slots)[0],
                         args.warps, mode=ints(args.mode)[0], parts=ints(args.parts)[0],
                         consumer_regs=args.consumer_regs)
            synchronize_or_exit()
        return
    sets = [{name: random_frag(*shape) for name, shape in SHAPES.items()} for _ in range(args.copies)]
    results = []

    eps = 1e-6
    residual = {m: torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for m in ints(args.rows)}
    norm_weight = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)

    def launched(x, ws, names, tiles_of, norm: bool = False):
        for name in names:
            if norm and name == "gate_up":  # the engine's add + RMSNorm kernel (kernels/rms_norm.py)
                _, x = add_rms_norm(residual[x.shape[0]], x, norm_weight, eps, False)
            x = qf.frag_gemv(x, ws[name], tiles_of(name, x), silu_gate=name == "gate_up")
        return x

    def reference_norm(o):
        """(residual + o, RMSNorm of it) in torch, as kernels/rms_norm.py rounds them."""
        summed = (residual[o.shape[0]].float() + o.float()).to(o.dtype)
        rstd = torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + eps)
        return summed, (norm_weight.float() * (summed.float() * rstd).to(o.dtype).float()).to(o.dtype)

    for chain, m in itertools.product(args.chain.split(","), ints(args.rows)):
        names = CHAINS[chain]
        norm = args.norm and chain == "layer"
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        a, y = torch.empty_like(x), torch.empty_like(x)
        h = torch.empty(m, 12288, device="cuda", dtype=torch.bfloat16)
        residual_out = torch.empty_like(x)
        partials = torch.empty(256, 8, device="cuda", dtype=torch.float32)  # o's 256 tile groups x rows
        norm_args = (residual[m], residual_out, norm_weight, partials, eps) if norm else None
        row = {"chain": chain, "rows": m, "norm": norm, "launched_shipped_tiles_us": round(cycle_time_us(
            [lambda s=s: launched(x, s, names, lambda name, x: qf.tiles_for(*SHAPES[name], x.shape[0]), norm)
             for s in sets], 10), 2)}
        if norm:  # what the engine runs today: o and the norm launched, then the MLP streamed (stream_mlp)
            from verispec.quant.kernels import stream_mlp

            def engine_path(x, ws):
                o = qf.frag_gemv(x, ws["o"], qf.tiles_for(*SHAPES["o"], x.shape[0]))
                _, normed = add_rms_norm(residual[x.shape[0]], o, norm_weight, eps, False)
                return streams[id(ws)](normed)

            streams = {id(ws): stream_mlp.StreamMLP(ws["gate_up"], ws["down"], torch.bfloat16) for ws in sets}
            row["launched_o_norm_streamed_mlp_us"] = round(cycle_time_us(
                [lambda s=s: engine_path(x, s) for s in sets], 10), 2)
        print(json.dumps(row), flush=True)
        for index, plan in enumerate(plans):
            steps = [plan[n] for n in names]
            row[f"plan{index}"] = ",".join(f"{n}={plan[n][0]}x{plan[n][1]}" for n in names)

            def same(name, x, plan=plan):
                return qf.FragTiles(plan[name][1], args.warps, 1, plan[name][0])

            if norm:  # o as launched, the norm in torch, then gate_up and down as launched
                ref_summed, normed = reference_norm(qf.frag_gemv(x, sets[0]["o"], same("o", x)))
                ref = launched(normed, sets[0], ("gate_up", "down"), same)
            else:
                ref = launched(x, sets[0], names, same)
            for slots, mode, parts in itertools.product(ints(args.slots), ints(args.mode), ints(args.parts)):
                label = f"plan{index}_S{slots}_parts{parts}{MODES[mode]}"
                opts = dict(mode=mode, parts=parts, consumer_regs=args.consumer_regs, norm=norm_args)
                fws = [sets[0][name] for name in names]
                kernel = stream_chain(x, a, h, y, fws, steps, counter, sms, slots, args.warps, compile_only=True,
                                      **opts)
                try:
                    resident = resident_per_multiprocessor(kernel, kernel.metadata.num_warps)
                except OutOfResources:  # the rings do not fit in a multiprocessor's shared memory
                    resident = 0
                if resident < 1:
                    row[f"{label}_resident"] = resident
                    continue
                programs = sms * resident  # a grid barrier needs every program resident at once
                counter.zero_()
                stream_chain(x, a, h, y, fws, steps, counter, programs, slots, args.warps, **opts)
                synchronize_or_exit()
                if mode == 1 and norm:  # the norm's float32 sums run in another order than torch's
                    row[f"{label}_residual_same_bits"] = bool(torch.equal(residual_out, ref_summed))
                    row[f"{label}_max_abs_diff"] = float((y.float() - ref.float()).abs().max())
                    row[f"{label}_ref_max_abs"] = float(ref.float().abs().max())
                elif mode == 1:
                    row[f"{label}_same_bits"] = bool(torch.equal(y, ref))
                if mode == 1 and m > 1:
                    one = torch.empty_like(y[:1])
                    alone = dict(opts, norm=(residual[m][:1].contiguous(), torch.empty_like(one), norm_weight,
                                             torch.empty_like(partials), eps) if norm else None)
                    stream_chain(x[:1].contiguous(), a[:1], h[:1], one, fws, steps, counter, programs, slots,
                                 args.warps, **alone)
                    synchronize_or_exit()
                    row[f"{label}_row_alone_same"] = bool(torch.equal(one, y[:1]))
                row[f"{label}_us"] = round(cycle_time_us(
                    [lambda s=s: stream_chain(x, a, h, y, [s[name] for name in names], steps, counter, programs,
                                              slots, args.warps, **opts) for s in sets], 10), 2)
                print(json.dumps({k: v for k, v in row.items() if k.startswith(label)}), flush=True)
        results.append(row)
    if args.out:
        Path(args.out, "stream_chain.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
