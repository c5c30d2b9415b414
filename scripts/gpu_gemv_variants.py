"""On the lent GPU: the Gluon GEMV for quantized weights (verispec/kernels/quant_gemv.py), in its
default tiles and neighbours, against torch's int4 kernel (tinygemm), our Triton dequant-matmul
and a bf16 F.linear, over one Qwen3-8B decode step's layers (MLX affine,
group 64, 4 and 8 bits). Each layer is timed under a CUDA graph that cycles through enough copies
of the weight to leave L2 (so small layers are not read from cache), and each variant's error
against the float64 reference is printed beside its time; whether row 0 alone equals row 0 of a
4-row pass is checked for every variant.

  python3 scripts/gpu_gemv_variants.py [--out DIR] [--bits 4,8] [--budget-s 420]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import cycle_time_us  # noqa: E402
from verispec.quant.kernels import int4_builtin, gemv as qg, matmul as qm  # noqa: E402
from verispec.quant import mlx_affine  # noqa: E402
from verispec.quant.packing import unpack_rows  # noqa: E402

LAYERS = [("qkv", 6144, 4096, 36), ("o", 4096, 4096, 36), ("gate_up", 24576, 4096, 36),
          ("down", 4096, 12288, 36), ("lm_head", 151936, 4096, 1)]
L2_DEFEAT_BYTES = 256 << 20


class Copies:
    """Copies of one quantized layer (random weights), enough to leave L2 when cycled."""

    def __init__(self, n: int, k: int, bits: int, group: int):
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed, scales, biases = mlx_affine.quantize(weight, mlx_affine.AffineSpec(bits, group))
        self.bytes = packed.numel() * 4 + scales.numel() * 2 * 2
        count = max(1, min(8, -(-L2_DEFEAT_BYTES // self.bytes)))
        self.sets = [(packed, scales, biases)] + [(packed.clone(), scales.clone(), biases.clone())
                                                  for _ in range(count - 1)]
        self.bits, self.group, self.n, self.k = bits, group, n, k
        self.dense = None
        self.tiny = None
        del weight

    def dense_copies(self):
        if self.dense is None:
            w = qm.dequantize_reference(*self.sets[0], self.bits, self.group, False).to(torch.bfloat16)
            count = max(1, min(4, -(-L2_DEFEAT_BYTES // w.numel() // 2)))
            self.dense = [w] + [w.clone() for _ in range(count - 1)]
        return self.dense

    def tinygemm_copies(self):
        if self.tiny is None:
            self.tiny = []
            for packed, scales, biases in self.sets:
                q = unpack_rows(packed, 4, self.k)
                self.tiny.append((int4_builtin.pack(q), int4_builtin.scales_and_zeros(scales, biases, False)))
        return self.tiny

    def free(self):
        self.sets = self.dense = self.tiny = None
        torch.cuda.empty_cache()


TILES = [qg.GemvTiles(4, 4), qg.GemvTiles(8, 2), qg.GemvTiles(4, 2), qg.GemvTiles(8, 4), qg.GemvTiles(4, 8),
         qg.GemvTiles(4, 4, 8)]
MS = (1, 2, 4, 8)


def variants(bits: int):
    out = [("triton", lambda x, p, s, b, bits, g: qm.dequant_matmul(x, p, s, b, bits, g))]
    default = qg.TILES[bits]
    for tiles in [default] + [t for t in TILES if t != default]:
        label = f"gemv r{tiles.r} tr{tiles.tr} w{tiles.num_warps}" + (" (default)" if tiles == default else "")
        out.append((label, lambda x, p, s, b, bits, g, tiles=tiles: qg.gemv(x, p, s, b, bits, g, tiles=tiles)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--bits", default="4,8,2")
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--budget-s", type=float, default=420)
    args = parser.parse_args()
    deadline = time.time() + args.budget_s
    torch.manual_seed(0)
    results = []
    for bits in (int(b) for b in args.bits.split(",")):
        step = {}  # variant -> M -> summed us (count-weighted)
        per_layer = {}
        for name, n, k, count in LAYERS:
            if time.time() > deadline:
                print("budget spent", flush=True)
                break
            layer = Copies(n, k, bits, args.group)
            x4 = torch.randn(max(MS), k, device="cuda", dtype=torch.bfloat16)
            ref = qm.dequant_matmul_reference(x4.double(), *layer.sets[0], bits, args.group)
            cands = variants(bits)
            cands.append(("bf16", None))
            if bits == 4:
                cands.append(("tinygemm", None))
            for label, fn in cands:
                if time.time() > deadline:
                    break
                row = {"bits": bits, "layer": name, "variant": label}
                try:
                    for m in MS:
                        x = x4[:m].contiguous()
                        if label == "bf16":
                            calls = [lambda w=w: F.linear(x, w) for w in layer.dense_copies()]
                        elif label == "tinygemm":
                            calls = [lambda t=t, sz=sz: int4_builtin.matmul(x, t, args.group, sz)
                                     for t, sz in layer.tinygemm_copies()]
                        else:
                            calls = [lambda st=st: fn(x, *st, bits, args.group) for st in layer.sets]
                        y = calls[0]()
                        row[f"err_M{m}"] = float((y.double() - ref[:m]).norm() / ref[:m].norm())
                        if m > 1:
                            x1 = x4[:1].contiguous()
                            if label == "bf16":
                                y1 = F.linear(x1, layer.dense_copies()[0])
                            elif label == "tinygemm":
                                t, sz = layer.tinygemm_copies()[0]
                                y1 = int4_builtin.matmul(x1, t, args.group, sz)
                            else:
                                y1 = fn(x1, *layer.sets[0], bits, args.group)
                            row[f"row0_invariant_M{m}"] = bool(torch.equal(y1[0], y[0]))
                        t = cycle_time_us(calls, iters=10)
                        row[f"us_M{m}"] = t
                        row[f"TBps_M{m}"] = layer.bytes / t / 1e6
                        step.setdefault(label, {}).setdefault(m, 0.0)
                        step[label][m] += t * count
                        per_layer.setdefault((name, m), []).append((t, label))
                except Exception as exc:  # a config Triton cannot build: note and go on
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    step.pop(label, None)
                print(json.dumps(row), flush=True)
                results.append(row)
            layer.free()
        print(f"## {bits}-bit, group {args.group}: one step's linears (us, count-weighted sums)")
        for label, ms in sorted(step.items(), key=lambda kv: kv[1].get(1, 1e18)):
            if len(ms) == len(MS):
                print(f"  {label:34s} " + "  ".join(f"M{m} {ms[m]:6.0f}" for m in MS)
                      + f"  (M4/M1 {ms[4] / ms[1]:.2f})")
        for (name, m), opts in sorted(per_layer.items()):
            quant = [o for o in opts if o[1] not in ("bf16",)]
            t, label = min(quant)
            print(f"  best {name} M{m}: {label} {t:.1f} us")
        results.append({"bits": bits, "step_us": step})
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "gemv_variants.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
