"""On a GPU: `verispec bench` with one of the step's kernels changed or left out, to bound what a
fusion would gain before it is built (the outputs of the `no-*` runs are wrong: only their speed
means anything). The README's products-only bound comes from here, e.g.

  python3 scripts/gpu_fusion_bounds.py products-only -- --shape qwen3-8b --quant mlx-4bit \
      --methods ar --contexts 512 --gen-tokens 128 --repeats 3

PATCH (several joined by +):
  base                      as shipped
  tiles-KIND=BxWxDxR        the 4-bit tiles for one kind of layer at every width (small = qkv / o,
                            wide = gate_up, long = down, vocab = lm_head)
  no-norm                   the residual add + RMSNorm kernels left out: the bound for folding
                            them into the products
  no-combine                the split-K attention's combine left out: the bound for folding it
                            into the split kernel
  no-attention              the q/k preparation and both split-K attention kernels left out
  products-only             no-norm + no-attention: the step's weight products (and embedding,
                            lm_head, argmax) alone - what a step of these products costs if
                            everything between them were free
  attention-prefetch-off    the split-K programs do not ask L2 for their first key block before
                            their launch wait (decode_attention.PREFETCH)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verispec import cli  # noqa: E402
from verispec.kernels import decode_attention, qk_prep, rms_norm
from verispec.quant.kernels import frag as quant_frag  # noqa: E402


def _layer_kind(n: int, k: int) -> str:
    """Which of the 4-bit tiles' cases a weight [n, k] falls in (as quant_frag.tiles_for splits them)."""
    if n >= 65536:
        return "vocab"
    if n >= 16384:
        return "wide"
    return "long" if k >= 8192 else "small"


def _patch_tiles(kind: str, spec: str) -> None:
    tiles = quant_frag.FragTiles(*(int(v) for v in spec.split("x")))
    original = quant_frag.tiles_for

    def tiles_for(n: int, k: int, m: int = 1) -> quant_frag.FragTiles:
        return tiles if _layer_kind(n, k) == kind else original(n, k, m)
    quant_frag.tiles_for = tiles_for


def _unprepared_qk(q, k, cos, sin, q_weight, k_weight, eps, unit_offset, v=None, cache_rows=None):
    """q and k in the shapes `qk_prep.prepare_qk` returns, with no kernel launched (values unset)."""
    b, t, hq, d = q.shape
    return (torch.empty((b, hq, t, d), dtype=q.dtype, device=q.device),
            torch.empty((b, k.shape[2], t, d), dtype=k.dtype, device=k.device))


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def apply(patch: str) -> None:
    if "+" in patch:  # several patches at once
        for part in patch.split("+"):
            apply(part)
        return
    if patch == "base":
        return
    if patch.startswith("tiles-"):
        _patch_tiles(*patch.removeprefix("tiles-").split("="))
    elif patch == "no-norm":
        rms_norm.add_rms_norm = lambda x, update, weight, eps, unit_offset: (x, x)
    elif patch == "no-combine":
        decode_attention._combine_kernel = _NoLaunch()
    elif patch == "no-attention":
        decode_attention._split_kernel = _NoLaunch()
        decode_attention._combine_kernel = _NoLaunch()
        qk_prep.prepare_qk = _unprepared_qk
    elif patch == "products-only":
        apply("no-norm+no-attention")
    elif patch == "attention-prefetch-off":
        decode_attention.PREFETCH = False
    else:
        raise SystemExit(f"gpu_fusion_bounds.py: unknown patch {patch!r}")


def main() -> int:
    argv = sys.argv[1:]
    own, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    parser = argparse.ArgumentParser(usage="%(prog)s PATCH -- BENCH ARGS...", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("patch", help="one patch, or several joined by +")
    args = parser.parse_args(own)
    if bench_args is None:
        parser.error("verispec bench's arguments follow --")
    apply(args.patch)
    return cli.main(["bench", *bench_args])


if __name__ == "__main__":
    sys.exit(main())
