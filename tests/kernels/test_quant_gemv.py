"""The Gluon GEMV for quantized weights (verispec/kernels/quant_gemv.py) against its torch
reference for every supported bits / group size / decode and verify width, both offset forms,
ragged N and K, and row invariance (a row's result is bit-identical whatever M and whatever the
other rows hold). Gluon kernels do not run in Triton's CPU interpreter: these run on CUDA (the GPU
run: `python3 -m pytest tests/kernels/test_quant_gemv.py` on the device); the CPU checks below
cover which layers the kernel takes."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import quant_gemv as kernel
from verispec.kernels.quant_matmul import dequant_matmul_reference
from verispec.quant.packing import pack_rows

gpu = pytest.mark.skipif(not torch.cuda.is_available() or kernel.gluon is None, reason="needs CUDA and Gluon")


def random_operands(n: int, k: int, bits: int, group: int, zero_point: bool, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).to(dtype)
    if zero_point:
        offsets = torch.randint(0, 1 << bits, (n, k // group), generator=gen).to(dtype)
    else:
        offsets = (torch.randn(n, k // group, generator=gen) * 0.1).to(dtype)
    return pack_rows(q, bits).cuda(), scales.cuda(), offsets.cuda()


@gpu
@pytest.mark.parametrize("bits", kernel.SUPPORTED_BITS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("zero_point", [False, True])
def test_matches_reference_every_width(bits, group, zero_point):
    if kernel.unsupported_reason(torch.device("cuda"), torch.float32, bits, group):
        pytest.skip(kernel.unsupported_reason(torch.device("cuda"), torch.float32, bits, group))
    # N not a multiple of the tile's rows and K not of its words per iteration: both masked
    n, k = 40, 1024 + 3 * group
    packed, scales, offsets = random_operands(n, k, bits, group, zero_point, torch.float32, bits * 100 + group)
    for m in range(1, kernel.MAX_ROWS + 1):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).cuda()
        y = kernel.gemv(x, packed, scales, offsets, bits, group, zero_point)
        ref = dequant_matmul_reference(x.double(), packed, scales, offsets, bits, group, zero_point)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert float((y.double() - ref).norm() / ref.norm()) < 1e-6, (m, bits, group)


@gpu
@pytest.mark.parametrize("bits", kernel.SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_row_invariance(bits, dtype):
    n, k, group = 4096, 4096, 64  # a real layer's shape: whole tiles, the fast path
    packed, scales, offsets = random_operands(n, k, bits, group, False, dtype, 3)
    x = torch.randn(kernel.MAX_ROWS, k, generator=torch.Generator().manual_seed(5)).to(dtype).cuda()
    full = kernel.gemv(x, packed, scales, offsets, bits, group)
    ref = dequant_matmul_reference(x.double(), packed, scales, offsets, bits, group)
    assert full.dtype == dtype and float((full.double() - ref).norm() / ref.norm()) < 1e-2
    for m in range(1, kernel.MAX_ROWS + 1):
        part = kernel.gemv(x[:m].contiguous(), packed, scales, offsets, bits, group)
        assert torch.equal(part, full[:m]), m
    # a row next to different rows: unchanged
    other = torch.cat([x[:1], torch.randn(3, k, dtype=dtype, device="cuda")])
    assert torch.equal(kernel.gemv(other, packed, scales, offsets, bits, group)[0], full[0])


def test_which_layers_it_takes():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    if kernel.gluon is None:
        assert kernel.unsupported_reason(cuda, torch.bfloat16, 4, 64) == "this Triton has no Gluon"
        return
    assert kernel.unsupported_reason(cuda, torch.bfloat16, 4, 64) is None
    assert kernel.unsupported_reason(cuda, torch.float16, 8, 32) is None
    assert "device cpu" in kernel.unsupported_reason(cpu, torch.bfloat16, 4, 64)
    assert "3-bit" in kernel.unsupported_reason(cuda, torch.bfloat16, 3, 64)
    assert "float64" in kernel.unsupported_reason(cuda, torch.float64, 4, 64)
    assert "group size 48" in kernel.unsupported_reason(cuda, torch.bfloat16, 4, 48)
