"""The one-pass dequantization kernel (verispec/quant/kernels/dequantize.py) against torch's form of
the same computation, bit for bit: float32 and bfloat16 outputs, both offset forms, ragged shapes.
Runs on CUDA, and on CPU through Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from verispec.quant.kernels import dequantize as kernel
from verispec.quant.kernels.matmul import dequantize_reference
from verispec.quant.packing import pack_rows

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bits", kernel.SUPPORTED_BITS)
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("zero_point", [False, True])
def test_equals_torch_form(bits, group, zero_point):
    gen = torch.Generator().manual_seed(bits * 10 + group)
    rows, k = 21, 5 * group  # neither a multiple of the kernel's block
    q = torch.randint(0, 1 << bits, (rows, k), generator=gen)
    scales = torch.rand(rows, k // group, generator=gen) * 0.1 + 0.01
    offsets = (torch.randint(0, 1 << bits, (rows, k // group), generator=gen).float() if zero_point
               else torch.randn(rows, k // group, generator=gen) * 0.1)
    packed = pack_rows(q, bits).to(DEVICE)
    scales, offsets = scales.to(DEVICE), offsets.to(DEVICE)
    expected = dequantize_reference(packed, scales, offsets, bits, group, zero_point)  # float32
    got = kernel.dequantize(packed, scales, offsets, bits, group, zero_point, torch.float32)
    assert torch.equal(got, expected)
    got16 = kernel.dequantize(packed, scales.bfloat16(), offsets.bfloat16(), bits, group, zero_point, torch.bfloat16)
    ref16 = dequantize_reference(packed, scales.bfloat16(), offsets.bfloat16(), bits, group, zero_point)
    if DEVICE == "cuda":
        assert torch.equal(got16, ref16.to(torch.bfloat16))
    else:  # the interpreter rounds float32 to bfloat16 its own way: within one bfloat16 step
        torch.testing.assert_close(got16.float(), ref16.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-6)
