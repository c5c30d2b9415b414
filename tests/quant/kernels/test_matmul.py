"""The Triton dequant-matmul against its torch reference for every supported bits / group size
and the decode / verify widths, in both offset forms. Runs on CUDA, and on CPU through Triton's
interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from verispec.quant.kernels import matmul as kernel
from verispec.quant.packing import pack_rows

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_operands(n: int, k: int, bits: int, group: int, zero_point: bool, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).to(dtype)
    if zero_point:
        offsets = torch.randint(0, 1 << bits, (n, k // group), generator=gen).to(dtype)
    else:
        offsets = (torch.randn(n, k // group, generator=gen) * 0.1).to(dtype)
    return pack_rows(q, bits).to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE)


# every decode / verify width on a GPU; a sample of them in Triton's (slow) interpreter
WIDTHS = list(range(1, 17)) if torch.cuda.is_available() else [1, 3, 16]


@pytest.mark.parametrize("bits", kernel.SUPPORTED_BITS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", WIDTHS)
def test_matches_reference_float32(bits, group, m):
    n, k = 40, 256  # N not a multiple of the tile: masked rows
    packed, scales, offsets = random_operands(n, k, bits, group, False, torch.float32, bits * 1000 + group + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    y = kernel.dequant_matmul(x, packed, scales, offsets, bits, group)
    ref = kernel.dequant_matmul_reference(x.double(), packed, scales, offsets, bits, group)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # float32 sums in another order than the reference: compare to float64, relative to the norm
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("bits,group", [(4, 128), (8, 32), (3, 64)])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_forms_and_half_precision(bits, group, zero_point, dtype):
    n, k, m = 64, 384, 5
    packed, scales, offsets = random_operands(n, k, bits, group, zero_point, dtype, 7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    y = kernel.dequant_matmul(x, packed, scales, offsets, bits, group, zero_point=zero_point)
    ref = kernel.dequant_matmul_reference(x.double(), packed, scales, offsets, bits, group, zero_point)
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((y.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("split_k", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_matches_reference(split_k, dtype):
    """K split into slices whose partial sums are added afterwards (few output tiles on a big GPU)."""
    n, k, m = 24, 640, 3  # 640 = 10 tiles of 64: uneven slices for 3 (4+4+2), one per 2 for 5
    packed, scales, offsets = random_operands(n, k, 4, 64, False, dtype, 11)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    y = kernel.dequant_matmul(x, packed, scales, offsets, 4, 64, split_k=split_k)
    ref = kernel.dequant_matmul_reference(x.double(), packed, scales, offsets, 4, 64)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert float((y.double() - ref).norm() / ref.norm()) < tol


TILE_VARIANTS = [kernel.TileConfig(unpack_words=u, w_first=f, half_dot=h, block_k=bk)
                 for u in (True, False) for f in (True, False) for h in (True, False) for bk in (128, 256)]


@pytest.mark.parametrize("tiles", TILE_VARIANTS, ids=lambda t: f"words{int(t.unpack_words)}-wfirst{int(t.w_first)}"
                                                           f"-half{int(t.half_dot)}-k{t.block_k}")
@pytest.mark.parametrize("bits,group,zero_point", [(4, 64, False), (8, 32, True), (2, 128, False), (3, 64, False)])
def test_every_tile_form_matches_reference(tiles, bits, group, zero_point):
    """Each unpacking / operand-order / product-dtype form the tile sweep may pick, with a
    partial last K tile (K = 384) and split-K, in float32 and bf16 (half_dot applies to bf16 only)."""
    if tiles.half_dot and DEVICE == "cpu":
        pytest.skip("Triton's interpreter multiplies bf16 tiles wrongly (numpy has no bf16; dequant_matmul "
                    "turns half_dot off there): checked on CUDA")
    n, k, m = 72, 384, 5
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        packed, scales, offsets = random_operands(n, k, bits, group, zero_point, dtype, bits + group)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
        for split_k in (1, 2):
            y = kernel.dequant_matmul(x, packed, scales, offsets, bits, group, zero_point, split_k=split_k,
                                      tiles=tiles)
            ref = kernel.dequant_matmul_reference(x.double(), packed, scales, offsets, bits, group, zero_point)
            assert y.dtype == dtype and y.shape == (m, n)
            assert float((y.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: Triton's interpreter multiplies tiles with numpy, whose BLAS is not row-invariant")
def test_rows_do_not_depend_on_the_pass_width():
    """Row r of a verify pass (or a batch of them) equals the decode of row r alone: the tile is
    always 16 rows and the split depends on the weight only, so the sum order ignores M."""
    packed, scales, offsets = random_operands(40, 256, 4, 64, False, torch.float32, 3)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    wide = kernel.dequant_matmul(x, packed, scales, offsets, 4, 64, split_k=2)
    for r in (0, 7, 15, 16, 39):
        assert torch.equal(kernel.dequant_matmul(x[r:r + 1], packed, scales, offsets, 4, 64, split_k=2)[0], wide[r])


def test_batches_of_rows_tile_by_16():
    """A batch of verify passes (40 rows: three row tiles, the last partial)."""
    packed, scales, offsets = random_operands(24, 128, 4, 32, True, torch.float32, 9)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    y = kernel.dequant_matmul(x, packed, scales, offsets, 4, 32, zero_point=True, split_k=2)
    ref = kernel.dequant_matmul_reference(x.double(), packed, scales, offsets, 4, 32, zero_point=True)
    assert y.shape == (40, 24)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-6


def test_rejects_bad_operands():
    packed, scales, offsets = random_operands(8, 64, 4, 32, False, torch.float32, 0)
    with pytest.raises(ValueError, match="bits=7"):
        kernel.dequant_matmul(torch.zeros(1, 64, device=DEVICE), packed, scales, offsets, 7, 32)
    with pytest.raises(ValueError, match="group_size"):
        kernel.dequant_matmul(torch.zeros(1, 96, device=DEVICE), packed, scales, offsets, 4, 32)


def random_layers():
    """An MLX affine layer with a bias and an asymmetric compressed-tensors layer, filled at random."""
    from verispec.quant.layers.linear import MLXAffineLinear, PackedIntLinear

    gen = torch.Generator().manual_seed(5)
    mlx = MLXAffineLinear(128, 48, bits=3, group_size=32, bias=True)
    mlx.weight = pack_rows(torch.randint(0, 8, (48, 128), generator=gen), 3)
    mlx.scales.data = torch.rand(48, 4, generator=gen) * 0.1
    mlx.biases.data = torch.randn(48, 4, generator=gen) * 0.1
    mlx.bias.data = torch.randn(48, generator=gen)
    ct = PackedIntLinear(128, 40, bits=4, group_size=64, symmetric=False)
    ct.weight_packed = pack_rows(torch.randint(0, 16, (40, 128), generator=gen), 4)
    ct.weight_scale.data = torch.rand(40, 2, generator=gen) * 0.1
    ct.weight_zero_point = pack_rows(torch.randint(0, 16, (40, 2), generator=gen).T, 4).T.contiguous()
    ct.weight_shape = torch.tensor([40, 128])
    ct.finish_loading()
    return [mlx.to(DEVICE), ct.to(DEVICE)]


@pytest.mark.parametrize("rows", [1, 4, 16, 33])
def test_layer_forward_through_kernel_equals_dequantized_path(monkeypatch, rows):
    """The layers hand the kernel the right operands (offset form, zero points, bias, shapes)."""
    for layer in random_layers():
        x = torch.randn(1, rows, 128, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        # the kernel is chosen when the layer binds (once per device and dtype), so rebind after each patch
        monkeypatch.setattr(kernel, "available", lambda device: False)
        assert layer.bind(x.device, x.dtype).kernel_for(rows) is None
        expected = layer(x)
        monkeypatch.setattr(kernel, "available", lambda device: True)  # the interpreter on CPU
        assert layer.bind(x.device, x.dtype).kernel_for(rows) is not None
        got = layer(x)
        assert got.shape == (1, rows, layer.out_features)
        assert float((got - expected).norm() / expected.norm()) < 1e-6
