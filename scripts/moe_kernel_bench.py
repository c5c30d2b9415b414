"""Bandwidth of the MoE decode kernels (verispec/kernels/expert_gemv.py) at real MoE shapes, on CUDA:
the gate/up (activation fused) and down products over the union of T tokens' experts, as GB/s of
the union's weight bytes, at T = 1, 4, 8, 16 random routings.

    python scripts/moe_kernel_bench.py [--shapes qwen3-30b-a3b,gemma4-26b-a4b,qwen3.6-35b-a3b]
"""
from __future__ import annotations

import argparse

# (experts, top-k, hidden, expert intermediate) of the bench shapes of the same names
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "gemma4-26b-a4b": (128, 8, 2816, 704),
          "qwen3.6-35b-a3b": (256, 8, 2048, 512)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    import torch  # after the arguments: --help imports no torch

    from verispec.kernels import expert_gemv

    if not torch.cuda.is_available() or expert_gemv.triton is None:
        raise SystemExit("moe_kernel_bench: needs CUDA and Triton")
    from triton.testing import do_bench

    torch.manual_seed(0)
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"moe_kernel_bench: unknown shape '{name}' (known: {', '.join(SHAPES)})")
        experts, top_k, hidden, inter = SHAPES[name]
        gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
        down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
        for tokens in (1, 4, 8, 16):
            ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
            union = len(set(ids.flatten().tolist()))
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            h = torch.randn(tokens * top_k, inter, device="cuda", dtype=torch.bfloat16)
            us_gate_up = 1e3 * do_bench(lambda: expert_gemv.union_products(x, gate_up, ids, x_per_pair=False,
                                                                           gated_act="silu"))
            us_down = 1e3 * do_bench(lambda: expert_gemv.union_products(h, down, ids, x_per_pair=True))
            gb = union * inter * hidden * 2 / 1e9  # one projection of the union, bf16
            print(f"{name} tokens {tokens:2d} ({union:3d} experts): gate/up {us_gate_up:6.1f} us "
                  f"({2 * gb / us_gate_up * 1e3:5.0f} GB/s), down {us_down:6.1f} us ({gb / us_down * 1e3:5.0f} GB/s)",
                  flush=True)
        del gate_up, down
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
