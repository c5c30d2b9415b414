"""The 8-bit GEMV (decode and verify passes on CUDA cores) against the torch reference, in both
offset forms, group sizes and activation dtypes; on CUDA, and on CPU through Triton's interpreter
(tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from test_quant_matmul import DEVICE, random_operands
from verispec.kernels import gemv_int8 as kernel
from verispec.kernels.quant_matmul import dequant_matmul_reference

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")

SMALL = kernel.GemvConfig(block_n=8, block_k=128)  # K of 256 spans two steps of the loop


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("zero_point", [False, True])
def test_matches_reference_float32(group, m, zero_point):
    n, k = 21, 256  # N not a multiple of the rows a program takes: masked rows
    packed, scales, offsets = random_operands(n, k, 8, group, zero_point, torch.float32, group + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    y = kernel.gemv_int8(x, packed, scales, offsets, group, zero_point, SMALL)
    ref = dequant_matmul_reference(x.double(), packed, scales, offsets, 8, group, zero_point)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations(dtype):
    n, k, m = 16, 512, 2
    packed, scales, offsets = random_operands(n, k, 8, 64, False, dtype, 5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    y = kernel.gemv_int8(x, packed, scales, offsets, 64, cfg=kernel.GemvConfig(block_n=4, block_k=256))
    ref = dequant_matmul_reference(x.double(), packed, scales, offsets, 8, 64)
    assert y.dtype == dtype
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-2


def test_a_block_longer_than_k():
    """block_k past K: the tail of the only step is masked."""
    packed, scales, offsets = random_operands(10, 192, 8, 64, False, torch.float32, 8)
    x = torch.randn(1, 192, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    y = kernel.gemv_int8(x, packed, scales, offsets, 64, cfg=kernel.GemvConfig(block_n=8, block_k=256))
    ref = dequant_matmul_reference(x.double(), packed, scales, offsets, 8, 64)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-6


def test_rows_do_not_depend_on_the_pass_width():
    """Row r of a pass of 8 equals the pass of row r alone, bitwise: a program always takes 4 rows,
    in the same layout, so a decode step and a verify pass sum each row in the same order."""
    packed, scales, offsets = random_operands(24, 256, 8, 64, False, torch.float32, 3)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    wide = kernel.gemv_int8(x, packed, scales, offsets, 64, cfg=SMALL)
    for r in (0, 3, 4, 7):
        assert torch.equal(kernel.gemv_int8(x[r:r + 1], packed, scales, offsets, 64, cfg=SMALL)[0], wide[r])


def test_rejects_bad_operands():
    packed, scales, offsets = random_operands(8, 128, 8, 32, False, torch.float32, 0)
    with pytest.raises(ValueError, match="group_size 64"):
        kernel.gemv_int8(torch.zeros(1, 128, device=DEVICE), packed, scales, offsets, 64)
    with pytest.raises(ValueError, match="block_k 48"):
        kernel.gemv_int8(torch.zeros(1, 128, device=DEVICE), packed, scales, offsets, 32,
                         cfg=kernel.GemvConfig(block_k=48))
    assert kernel.supported(8, 64, 4096) and not kernel.supported(4, 64, 4096)
