"""The 8-bit GEMV kernel against the torch reference (float64), in both offset forms, every group
size and the decode / verify widths; and a row's result independent of how many rows share the
pass (bitwise), which keeps speculation lossless. Runs on CUDA, and on CPU through Triton's
interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import int8_gemv
from verispec.kernels.quant_matmul import dequant_matmul_reference
from verispec.quant.packing import pack_rows

pytestmark = pytest.mark.skipif(int8_gemv.triton is None, reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIDTHS = list(range(1, int8_gemv.MAX_ROWS + 1)) if torch.cuda.is_available() else [1, 3, 8]


def operands(n: int, k: int, group: int, zero_point: bool, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.001).to(dtype)
    if zero_point:
        offsets = torch.randint(0, 256, (n, k // group), generator=gen).to(dtype)
    else:
        offsets = (torch.randn(n, k // group, generator=gen) * 0.1).to(dtype)
    return pack_rows(q, 8).to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE)


@pytest.mark.parametrize("group", int8_gemv.GROUP_SIZES)
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("m", WIDTHS)
def test_matches_reference(group, zero_point, m):
    n, k = 72, 512  # N not a multiple of the output tile: masked outputs
    packed, scales, offsets = operands(n, k, group, zero_point, torch.float32, group + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    y = int8_gemv.gemv(x, packed, scales, offsets, group, zero_point)
    ref = dequant_matmul_reference(x.double(), packed, scales, offsets, 8, group, zero_point)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_that_row_among_others(dtype):
    n, k, group = 96, 1024, 64
    packed, scales, offsets = operands(n, k, group, False, dtype, 3)
    x = torch.randn(int8_gemv.MAX_ROWS, k, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    alone = int8_gemv.gemv(x[:1], packed, scales, offsets, group)
    for m in WIDTHS:
        assert torch.equal(int8_gemv.gemv(x[:m], packed, scales, offsets, group)[:1], alone), f"{m} rows"
    ref = dequant_matmul_reference(x.double(), packed, scales, offsets, 8, group)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert float((int8_gemv.gemv(x, packed, scales, offsets, group).double() - ref).norm() / ref.norm()) < tol


def test_refuses_what_it_does_not_compute():
    packed, scales, offsets = operands(8, 256, 64, False, torch.float32, 1)
    with pytest.raises(ValueError, match="1..8 rows"):
        int8_gemv.gemv(torch.zeros(9, 256, device=DEVICE), packed, scales, offsets, 64)
    with pytest.raises(ValueError, match="groups"):
        int8_gemv.gemv(torch.zeros(1, 256, device=DEVICE), packed, scales, offsets, 48)
