"""On the lent GPU: `verispec bench` with one of the step's kernels changed or left out, to bound
what a fusion would gain before it is built (the outputs of the `no-*` runs are wrong: only
their speed means anything).

  python3 scripts/gpu_fusion_bounds.py PATCH -- BENCH ARGS...

PATCH: base (as shipped) | small-pdl-off (the small kernels launched without programmatic
launch) | small-pdl-wait (with it, releasing their dependents at their end) | small-pdl-early
(at their start) | product-release-{start,loop} (the 4-bit products release their dependents
once their first loads are issued, or once their K loop is done) | no-norm (the residual
add + RMSNorm kernels left out: the bound for folding them into the products) | no-combine (the
split-K attention's combine left out: the bound for folding it into the split kernel).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verispec import cli  # noqa: E402
from verispec.kernels import decode_attention, quant_gemv, rms_norm  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def apply(patch: str) -> None:
    if patch == "base":
        return
    if patch == "small-pdl-off":
        quant_gemv.SMALL_PDL = "off"
    elif patch == "small-pdl-wait":
        quant_gemv.SMALL_PDL = "wait"
    elif patch == "small-pdl-early":
        quant_gemv.SMALL_PDL = "early"
    elif patch.startswith("product-release-"):
        quant_gemv.PRODUCT_RELEASE = patch.removeprefix("product-release-")
    elif patch == "no-norm":
        rms_norm.add_rms_norm = lambda x, update, weight, eps, unit_offset: (x, x)
    elif patch == "no-combine":
        decode_attention._combine_kernel = _NoLaunch()
    else:
        raise SystemExit(f"gpu_fusion_bounds.py: unknown patch {patch!r}")


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    apply(sys.argv[1])
    return cli.main(["bench", *sys.argv[3:]])


if __name__ == "__main__":
    sys.exit(main())
