"""The tensor-core 4-bit product (verispec/quant/kernels/mma.py) against its torch reference for
both dtypes, both offset forms, every group size, every decode and verify width, ragged N and K,
and row invariance (a row's result is bit-identical whatever M and whatever the other rows hold).
Gluon kernels do not run in Triton's CPU interpreter: these run on CUDA (sm_90+; the GPU run:
`python3 -m pytest tests/quant/kernels/test_mma.py` on the device); the CPU checks below cover
which layers the kernel takes and why."""
from __future__ import annotations

import pytest
import torch

from verispec.quant.kernels import mma as kernel
from verispec.quant.kernels.matmul import dequant_matmul_reference, dequantize_reference
from verispec.quant.packing import pack_rows

cuda = torch.device("cuda")
gpu = pytest.mark.skipif(not torch.cuda.is_available() or kernel.gluon is None
                         or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm_90 GPU and Gluon")


def operands(n: int, k: int, group: int, zero_point: bool, dtype: torch.dtype, seed: int):
    """Random 4-bit words, scales and offsets on the GPU (offsets: zero points, or MLX-like biases)."""
    gen = torch.Generator().manual_seed(seed)
    packed = pack_rows(torch.randint(0, 16, (n, k), generator=gen), 4)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    if zero_point:
        offsets = torch.randint(0, 16, (n, k // group), generator=gen).float()
    else:
        offsets = -8 * scales + torch.randn(n, k // group, generator=gen) * 1e-3
    return packed.to(cuda), scales.to(cuda, dtype), offsets.to(cuda, dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_matches_reference_and_rows_are_independent(dtype, zero_point, group):
    # N not a multiple of any tile's rows; K a multiple of 128 but not of a program's step
    n, k = 200, 1408
    packed, scales, offsets = operands(n, k, group, zero_point, dtype, group + zero_point)
    x = torch.randn(kernel.MAX_ROWS, k, generator=torch.Generator().manual_seed(3)).to(cuda, dtype)
    ref = dequant_matmul_reference(x.double(), packed, scales, offsets, 4, group, zero_point)
    # the same weights dequantized in the dtype and multiplied by torch: the error to be expected
    w = dequantize_reference(packed, scales, offsets, 4, group, zero_point).to(dtype)
    baseline = float(((x @ w.T).double() - ref).norm() / ref.norm())
    for tiles in (kernel.TILES, kernel.WIDE_TILES, kernel.LONG_TILES, kernel.HEAD_TILES):
        alone = kernel.mma_gemv(x[:1], packed, scales, offsets, 4, group, zero_point, tiles)
        for m in range(1, kernel.MAX_ROWS + 1):
            y = kernel.mma_gemv(x[:m], packed, scales, offsets, 4, group, zero_point, tiles)
            assert y.shape == (m, n) and y.dtype == dtype
            err = float((y.double() - ref[:m]).norm() / ref[:m].norm())
            assert err < 2 * baseline + 1e-4, (tiles, m, err, baseline)
            assert torch.equal(y[0], alone[0]), (tiles, m)


@gpu
def test_other_rows_do_not_change_a_row():
    packed, scales, offsets = operands(512, 4096, 64, False, torch.bfloat16, 7)
    x = torch.randn(8, 4096, device=cuda, dtype=torch.bfloat16)
    y = kernel.mma_gemv(x, packed, scales, offsets, 4, 64)
    x2 = x.clone()
    x2[1:] = torch.randn(7, 4096, device=cuda, dtype=torch.bfloat16) * 100
    assert torch.equal(kernel.mma_gemv(x2, packed, scales, offsets, 4, 64)[0], y[0])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("k", [1024, 512])  # 512: under one program's step (warps 2-3 idle)
def test_silu_gate_epilogue_matches_the_unfused_activation(dtype, zero_point, k):
    """Rows in chunks of GATE_CHUNK gate rows then their up rows: the kernel's SiLU(gate) * up
    equals the plain product's chunks taken apart and activated (within a rounding of the
    activation), and a row's result still does not depend on the pass's width."""
    chunk, half = kernel.GATE_CHUNK, 96
    packed, scales, offsets = operands(2 * half, k, 64, zero_point, dtype, 11)
    x = torch.randn(kernel.MAX_ROWS, k, generator=torch.Generator().manual_seed(5)).to(cuda, dtype)
    alone = kernel.mma_gemv(x[:1], packed, scales, offsets, 4, 64, zero_point, silu_gate=True)
    for m in range(1, kernel.MAX_ROWS + 1):
        y = kernel.mma_gemv(x[:m], packed, scales, offsets, 4, 64, zero_point, silu_gate=True)
        plain = kernel.mma_gemv(x[:m], packed, scales, offsets, 4, 64, zero_point).view(m, half // chunk, 2, chunk)
        gate, up = plain[:, :, 0].reshape(m, half), plain[:, :, 1].reshape(m, half)
        expected = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
        assert y.shape == (m, half) and y.dtype == dtype
        torch.testing.assert_close(y, expected, rtol=2 ** -7, atol=1e-5)
        assert torch.equal(y[0], alone[0]), m
    with pytest.raises(ValueError, match="gate/up rows"):
        kernel.mma_gemv(x[:1], packed[:40], scales[:40], offsets[:40], 4, 64, zero_point, silu_gate=True)


def test_reasons():
    cpu = torch.device("cpu")
    assert "cpu" in kernel.unsupported_reason(cpu, torch.bfloat16, 4, 64, 4096) or kernel.gluon is None
    if kernel.gluon is None:
        return
    assert "float32" in kernel.unsupported_reason(cuda, torch.float32, 4, 64, 4096)
    assert "8-bit" in kernel.unsupported_reason(cuda, torch.bfloat16, 8, 64, 4096)
    assert "group size 16" in kernel.unsupported_reason(cuda, torch.bfloat16, 4, 16, 4096)
    assert "4000 input features" in kernel.unsupported_reason(cuda, torch.bfloat16, 4, 32, 4000)


def test_tiles_by_shape():
    assert kernel.tiles_for(151936, 4096) == kernel.HEAD_TILES
    assert kernel.tiles_for(24576, 4096) == kernel.WIDE_TILES
    assert kernel.tiles_for(4096, 12288) == kernel.LONG_TILES
    assert kernel.tiles_for(6144, 4096) == kernel.TILES


def test_refuses_wide_passes_and_names_why():
    if kernel.gluon is None or not torch.cuda.is_available():
        with pytest.raises(ValueError, match="mma.mma_gemv"):
            kernel.mma_gemv(torch.zeros(1, 128), torch.zeros(4, 16, dtype=torch.int32), torch.ones(4, 2),
                            torch.zeros(4, 2), 4, 64)
        return
    with pytest.raises(ValueError, match="9 rows"):
        kernel.mma_gemv(torch.zeros(9, 128, device=cuda, dtype=torch.bfloat16),
                        torch.zeros(4, 16, dtype=torch.int32, device=cuda), torch.ones(4, 2, device=cuda),
                        torch.zeros(4, 2, device=cuda), 4, 64)
