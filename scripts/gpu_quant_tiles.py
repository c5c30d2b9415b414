"""On the lent GPU: the fused dequant-matmul's forms and tile sizes swept over the Qwen3-8B layer
shapes, each timed under a CUDA graph (as the engine runs it: no launch overhead in the number)
against a bf16 F.linear of the same shape. Chooses, per bits, the configuration with the least
summed time over one decode step's layers at M = 1, reports its GB/s and the implied decode
step, and checks every timed configuration against the torch reference.

  python3 scripts/gpu_quant_tiles.py [--out DIR] [--families dot,x-first,tf32] [--budget-s S]

The table printed last is what `quant_matmul.tile_config` should be set to (the choice may not
depend on M: each row's sum must run in the same order in decode and verify passes).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import graph_time_us  # noqa: E402
from verispec.quant.kernels import matmul as qm  # noqa: E402
from verispec.quant import mlx_affine  # noqa: E402

# Qwen3-8B: merged qkv, o, merged gate_up, down (x 36 layers), lm_head (x 1)
LAYERS = [("qkv", 6144, 4096, 36), ("o", 4096, 4096, 36), ("gate_up", 24576, 4096, 36),
          ("down", 4096, 12288, 36), ("lm_head", 151936, 4096, 1)]


class Layer:
    def __init__(self, n: int, k: int, bits: int, group: int = 64):
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        self.bits, self.group = bits, group
        self.packed, self.scales, self.biases = mlx_affine.quantize(weight, mlx_affine.AffineSpec(bits, group))
        self.bytes = self.packed.numel() * 4 + self.scales.numel() * self.scales.element_size() * 2

    def run(self, x, tiles):
        return qm.dequant_matmul(x, self.packed, self.scales, self.biases, self.bits, self.group, tiles=tiles)

    def error(self, x, tiles) -> float:
        y = self.run(x, tiles).double()
        ref = qm.dequant_matmul_reference(x.double(), self.packed, self.scales, self.biases, self.bits, self.group)
        return float((y - ref).norm() / ref.norm())


# the default form (whole words split in registers, W the left operand, bf16 products) and its
# operand-order / product-dtype neighbours; the per-bit-slot and CUDA-core forms the fifth session
# tried were slower (docs/benchmarks.md) and are gone from the kernel
FAMILIES = {
    "dot": qm.DEFAULT_TILES,
    "x-first": dataclasses.replace(qm.DEFAULT_TILES, w_first=False),
    "tf32": dataclasses.replace(qm.DEFAULT_TILES, half_dot=False),
}
AXES = {"block_n": (32, 64, 128, 256), "block_k": (128, 256, 512, 1024), "num_warps": (2, 4, 8),
        "num_stages": (1, 2, 3, 4), "w_first": (True, False)}


def descend(layers, start: qm.TileConfig, deadline: float, family: str) -> dict:
    """Coordinate descent from `start` over AXES on the summed M=1 step time."""
    best = time_config(layers, start)
    improved = True
    while improved and time.time() < deadline:
        improved = False
        for axis, values in AXES.items():
            for value in values:
                if time.time() > deadline or value == getattr(qm.TileConfig(**best["tiles"]), axis):
                    continue
                row = time_config(layers, dataclasses.replace(qm.TileConfig(**best["tiles"]), **{axis: value}))
                if row and row["step_us"][1] < best["step_us"][1] * 0.98:
                    print(f"  {family}: {axis}={value}: {row['step_us'][1]:.0f} us", flush=True)
                    best, improved = row, True
    return best


def time_config(layers, tiles, ms=(1,)) -> dict | None:
    """Summed decode-step time of one configuration over the model's layers, or None if it fails."""
    total, per_layer = {m: 0.0 for m in ms}, {}
    try:
        for name, n, k, count in LAYERS:
            layer = layers[(n, k)]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                err = layer.error(x, tiles)
                if not err < 2e-2:
                    print(f"  {tiles}: {name} M={m} relative error {err:.2e}: rejected", flush=True)
                    return None
                if m > 1 and not torch.equal(layer.run(x[:1], tiles)[0], layer.run(x, tiles)[0]):
                    print(f"  {tiles}: {name} row 0 alone != row 0 of {m} rows (sum order depends on M)", flush=True)
                t = graph_time_us(lambda: layer.run(x, tiles), iters=10)
                per_layer[f"{name} M={m}"] = t
                total[m] += t * count
    except Exception as exc:  # a config Triton cannot compile (shared memory, registers)
        print(f"  {tiles}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None
    return {"tiles": dataclasses.asdict(tiles), "step_us": total, "per_layer_us": per_layer}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--families", default="dot,x-first,tf32", help="which kernel forms to descend from")
    parser.add_argument("--budget-s", type=float, default=300, help="stop sweeping tiles after this long")
    args = parser.parse_args()
    began = time.time()
    result = {"device": torch.cuda.get_device_name(), "bits": {}}
    bf16 = {}
    for name, n, k, count in LAYERS:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16[f"{name} M={m}"] = graph_time_us(lambda x=x, w=w: F.linear(x, w), iters=10)
        del w
    bf16_step = sum(bf16[f"{name} M=1"] * count for name, n, k, count in LAYERS)
    result["bf16_per_layer_us"], result["bf16_step_us"] = bf16, bf16_step
    print(f"bf16 F.linear step (M=1): {bf16_step:.0f} us", flush=True)
    for bits in (4, 8):
        layers = {(n, k): Layer(n, k, bits) for _, n, k, _ in LAYERS}
        weight_bytes = sum(layers[(n, k)].bytes * count for _, n, k, count in LAYERS)
        found = {}
        families = args.families.split(",")
        for index, family in enumerate(families):
            start = FAMILIES[family]
            share = ((bits == 8) * len(families) + index + 1) / (2 * len(families))
            deadline = began + args.budget_s * share
            best = descend(layers, start, deadline, family)
            found[family] = time_config(layers, qm.TileConfig(**best["tiles"]), ms=(1, 4, 16))
            for name, row in found.items():
                print(f"{bits}-bit {name}: {row['tiles']}: step M=1 {row['step_us'][1]:.0f} us, "
                      f"M=4 {row['step_us'][4]:.0f}, M=16 {row['step_us'][16]:.0f}", flush=True)
        result["bits"][bits] = {"found": found, "weight_bytes": weight_bytes,
                                "best": min(found.values(), key=lambda r: r["step_us"][1] + r["step_us"][4] / 4)}
        del layers
    print("\n| bits | best tiles | step us M=1 | M=4 | M=16 | GB/s M=1 | vs bf16 F.linear step |")
    print("|---|---|---|---|---|---|---|")
    for bits, r in result["bits"].items():
        b = r["best"]
        t = b["tiles"]
        desc = (f"n{t['block_n']} k{t['block_k']} w{t['num_warps']} s{t['num_stages']} words{int(t['unpack_words'])} "
                f"wfirst{int(t['w_first'])} half{int(t['half_dot'])}")
        print(f"| {bits} | {desc} | {b['step_us'][1]:.0f} | {b['step_us'][4]:.0f} | {b['step_us'][16]:.0f} | "
              f"{r['weight_bytes'] / b['step_us'][1] / 1e3:.0f} | {bf16_step / b['step_us'][1]:.2f}x |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "quant_tiles.json").write_text(json.dumps(result, indent=1))
        # for VERISPEC_QUANT_TILES (per bits)
        (Path(args.out) / "best_tiles.json").write_text(json.dumps(
            {bits: r["best"]["tiles"] for bits, r in result["bits"].items()}))


if __name__ == "__main__":
    main()
