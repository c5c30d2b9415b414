"""On the lent GPU: why quantized decode ran at 6.5 tok/s (bench --quant mlx-4bit/8bit on the
Qwen3-8B shape, 2026-11-23; bf16 184 tok/s). Prints, for one layer shape of that model:
  - the fused kernel's time (dequant_matmul) at M = 1, 4, 16 rows, against a bf16 F.linear and the
    whole-matrix dequantize path, with the bytes each reads and the implied GB/s;
and for a small quantized model's decode step (eager and under the bench's CUDA graph):
  - which QuantizedLinear path each call took (fused kernel / dequantize), counted by a hook;
  - the top kernels by device time (torch.profiler).
Run: python3 scripts/gpu_quant_diagnose.py [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verispec.quant.kernels import matmul as quant_matmul  # noqa: E402
from verispec.models.layers import quant_linear  # noqa: E402
from verispec.quant import mlx_affine  # noqa: E402


def cuda_time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def layer_times(n: int, k: int, bits: int) -> list[dict]:
    device = torch.device("cuda")
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    packed, scales, biases = mlx_affine.quantize(weight, mlx_affine.AffineSpec(bits, 64))
    rows = []
    for m in (1, 4, 16):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        fused = cuda_time_ms(lambda: quant_matmul.dequant_matmul(x, packed, scales, biases, bits, 64))
        dense = cuda_time_ms(lambda: F.linear(x, weight))
        deq = cuda_time_ms(lambda: F.linear(x, quant_matmul.dequantize_reference(
            packed, scales, biases, bits, 64, False).to(x.dtype)), iters=5)
        qbytes = packed.numel() * 4 + scales.numel() * scales.element_size() * 2
        rows.append({"n": n, "k": k, "bits": bits, "m": m, "fused_ms": fused, "bf16_ms": dense,
                     "dequantize_path_ms": deq, "fused_gbs": qbytes / fused / 1e6,
                     "bf16_gbs": weight.numel() * 2 / dense / 1e6,
                     "split_k": quant_matmul.default_split_k(n, k, device)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def path_counts_and_profile(bits: int) -> dict:
    """A quantized random-weight model (bench's tiny-ish shape scaled up) decoding a few tokens."""
    from verispec.bench.build import random_target
    from verispec.bench.shapes import get_shape
    from verispec.config import EngineConfig
    from verispec.engine.engine import Engine
    from verispec.engine.params import SamplingParams
    from verispec.quant.in_memory import quantize_model_

    shape = get_shape("qwen3-8b")
    config = dict(shape.config, num_hidden_layers=4)
    target = random_target("qwen3-8b/4 layers", config, torch.device("cuda"), torch.bfloat16, 0)
    quantize_model_(target.model, f"mlx-{bits}bit")
    counts: collections.Counter = collections.Counter()
    original = quant_linear.QuantizedLinear.forward

    def counting(self, x):
        rows = x.numel() // self.in_features
        fused = (rows <= quant_matmul.FUSED_MAX_ROWS and quant_matmul.available(x.device)
                 and x.dtype != torch.float64)
        counts[("fused" if fused else "dequantize", rows)] += 1
        return original(self, x)

    quant_linear.QuantizedLinear.forward = counting
    try:
        engine = Engine(target.model, target.tokenizer, EngineConfig(model="diag", max_num_seqs=1,
                                                                     max_model_len=256))
        ids = list(range(10, 74))
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.generate_all(ids, params)  # eager (no graphs captured yet)
        eager_counts = dict((f"{p} rows={r}", c) for (p, r), c in counts.items())
        counts.clear()
        engine.capture_graphs()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.generate_all(ids, params)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    finally:
        quant_linear.QuantizedLinear.forward = original
    print(table, flush=True)
    return {"eager_path_counts": eager_counts,
            "graph_path_counts": dict((f"{p} rows={r}", c) for (p, r), c in counts.items()),
            "profile_top": table}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--decode-only", action="store_true",
                        help="only the path counts and profile (scripts/gpu_quant_tiles.py times the kernel)")
    args = parser.parse_args()
    result = {"layers": [], "device": torch.cuda.get_device_name()}
    for bits in () if args.decode_only else (4, 8):
        for n, k in ((4096, 4096), (12288, 4096), (4096, 12288)):
            result["layers"] += layer_times(n, k, bits)
    result["decode"] = path_counts_and_profile(4)
    print(json.dumps({k: v for k, v in result["decode"].items() if k != "profile_top"}, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "quant_diagnose.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
