"""The fragment-order 4-bit product (verispec/quant/kernels/frag.py). On the CPU: the repacked
layout holds exactly the checkpoint's values (every position of a block once, dequantized values
equal to the format's reference), and the layer routes decode passes and the SiLU epilogue to it.
On CUDA (sm_90+, Gluon; the GPU run: `python3 -m pytest tests/quant/kernels/test_frag.py` on the
device): against the float64 reference for both dtypes, both offset forms, groups 64 / 128, every
decode and verify width and ragged N / K, with a row's result bit-identical whatever M is."""
from __future__ import annotations

import pytest
import torch

from verispec.quant.kernels import frag_dequantize
from verispec.quant.kernels import frag as kernel
from verispec.quant import dispatch
from verispec.quant.kernels.matmul import dequant_matmul_reference, dequantize_reference
from verispec.quant.layers.linear import MLXAffineLinear
from verispec.quant.packing import pack_rows

cuda = torch.device("cuda")
gpu = pytest.mark.skipif(not torch.cuda.is_available() or kernel.gluon is None
                         or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm_90 GPU and Gluon")


def operands(n: int, k: int, group: int, zero_point: bool, dtype: torch.dtype, seed: int, device="cpu"):
    """Random 4-bit values, their words, scales and offsets (zero points, or MLX-like biases)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    if zero_point:
        offsets = torch.randint(0, 16, (n, k // group), generator=gen).float()
    else:
        offsets = -8 * scales + torch.randn(n, k // group, generator=gen) * 1e-3
    return q, pack_rows(q, 4).to(device), scales.to(device, dtype), offsets.to(device, dtype)


@pytest.mark.parametrize("n,k,group,zero_point", [(200, 512, 64, False), (48, 4096, 128, True), (37, 128, 64, False),
                                                  (16, 64, 64, True)])
def test_repacked_words_hold_the_checkpoint_values(n, k, group, zero_point):
    q, packed, scales, offsets = operands(n, k, group, zero_point, torch.bfloat16, n + k)
    fw = kernel.repack(packed, scales, offsets, group, zero_point)
    # tiles of 16 rows, padded with zero rows to a multiple of MAX_ROW_TILES tiles
    assert fw.words.shape == (-(-n // 64) * kernel.MAX_ROW_TILES, k // 64, 128) and fw.words.dtype == torch.int32
    assert torch.equal(frag_dequantize.unpack_fragments(fw).long(), q)
    want = dequantize_reference(packed, scales, offsets, 4, group, zero_point).float()
    assert torch.equal(frag_dequantize.dequantize(fw, torch.float32), want)


def test_every_position_of_a_block_is_one_nibble_and_pairs_are_the_mma_operands():
    row, position = kernel.fragment_positions()  # over (g, t, c, j)
    flat = (row * 64 + position).flatten()
    assert sorted(flat.tolist()) == list(range(16 * 64))
    g = torch.arange(8).view(8, 1, 1, 1)
    t = torch.arange(4).view(1, 4, 1, 1)
    c = torch.arange(4).view(1, 1, 4, 1)
    j = torch.arange(8).view(1, 1, 1, 8)
    # the mma's A fragment of k-step c: register i holds rows g / g + 8 (i odd) at k 2t + 8 (i >= 2),
    # low half the nibble i, high half nibble i + 4 (k + 1)
    assert torch.equal(row, g + 8 * (j % 4 % 2) + 0 * (t + c))
    k_in_step = 8 * (j % 4 // 2) + 2 * t + j // 4
    # the B fragment of lane t holds k 2t, 2t + 1, 2t + 8, 2t + 9 of a step: the kernel loads lane
    # t's 16 activations from position 16t on, pair p = 2c + h at k = 8h + 2t + (0, 1)
    half, low = k_in_step // 8, k_in_step % 2
    assert torch.equal(position, 16 * t + 2 * (2 * c + half) + low + 0 * g)


def test_reasons_and_tiles():
    cpu = torch.device("cpu")
    assert "cpu" in kernel.unsupported_reason(cpu, torch.bfloat16, 4, 64, 4096) or kernel.gluon is None
    assert kernel.tiles_for(151936, 4096) == kernel.FragTiles(1, 2, 2, 4)
    assert kernel.tiles_for(24576, 4096) == kernel.FragTiles(1, 4, 2, 4)
    assert kernel.tiles_for(4096, 12288) == kernel.FragTiles(1, 8, 2)
    assert kernel.tiles_for(6144, 4096) == kernel.FragTiles(1, 8, 1)
    assert kernel.tiles_for(6144, 4096, 4) == kernel.FragTiles(1, 8, 2)
    # a row's sums are added in an order set by the warps and blocks a step: never by the width
    for n, k in ((151936, 4096), (24576, 4096), (4096, 12288), (6144, 4096), (200, 1408)):
        one = kernel.tiles_for(n, k, 1)
        for m in range(2, kernel.MAX_ROWS + 1):
            wide = kernel.tiles_for(n, k, m)
            assert (wide.blocks, wide.num_warps, wide.row_tiles) == (one.blocks, one.num_warps, one.row_tiles)
    if kernel.gluon is None or not torch.cuda.is_available():
        return
    assert "float32" in kernel.unsupported_reason(cuda, torch.float32, 4, 64, 4096)
    assert "8-bit" in kernel.unsupported_reason(cuda, torch.bfloat16, 8, 64, 4096)
    assert "group size 32" in kernel.unsupported_reason(cuda, torch.bfloat16, 4, 32, 4096)
    assert "4000 input features" in kernel.unsupported_reason(cuda, torch.bfloat16, 4, 64, 4000)


def emulated_frag_gemv(x, fw, tiles=None, silu_gate=False):
    """What the kernel computes, in torch (the layer's routing is what these CPU tests check)."""
    y = (x.double() @ frag_dequantize.dequantize(fw, torch.float64).T).to(x.dtype)
    if not silu_gate:
        return y
    tiles_of = y.view(x.shape[0], -1, 2, kernel.GATE_CHUNK)
    gate, up = tiles_of[:, :, 0].flatten(1), tiles_of[:, :, 1].flatten(1)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)


def layer_with(q_weights: tuple, n: int, k: int, group: int) -> MLXAffineLinear:
    _, packed, scales, offsets = q_weights
    layer = MLXAffineLinear(k, n, 4, group)
    layer.weight.copy_(packed)
    layer.scales.data = scales.clone()
    layer.biases.data = offsets.clone()
    return layer


def plain_and_converted(n: int, k: int, group: int, integer_offsets: bool, seed: int,
                        copy_dtype: torch.dtype) -> tuple[MLXAffineLinear, MLXAffineLinear]:
    """Two float32 layers of the same random 4-bit weight, the second with its fragment-order copy
    (terms in copy_dtype)."""
    weights = operands(n, k, group, integer_offsets, torch.float32, seed)
    plain, layer = layer_with(weights, n, k, group), layer_with(weights, n, k, group)
    layer.use_fragment_order(copy_dtype)
    return plain, layer


def layer_order(n: int) -> torch.Tensor:
    """The rows of a merged [gate; up] layer after interleave_gate_up (chunks of GATE_CHUNK)."""
    chunk = kernel.GATE_CHUNK
    return torch.arange(n).view(2, n // 2 // chunk, chunk).transpose(0, 1).reshape(-1)


def test_a_layer_takes_the_copy_for_decode_passes_and_the_silu_epilogue(monkeypatch):
    n, k, group = 64, 256, 64
    plain, layer = plain_and_converted(n, k, group, False, 5, torch.float32)
    calls = []
    monkeypatch.setattr(kernel, "frag_gemv", lambda *a, **kw: calls.append(kw) or emulated_frag_gemv(*a, **kw))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    want = plain(x)
    # float64 sums (the emulation) against float32 ones (torch's GEMM)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=2e-4)
    assert calls == [{}]
    # the merged gate/up's rows interleave in chunks of 8, and the copy follows them
    layer.interleave_gate_up()
    assert layer.gate_chunk == kernel.GATE_CHUNK
    got = layer.silu_gated(x, lambda gate, up: torch.nn.functional.silu(gate) * up)
    gate, up = want[:, :n // 2], want[:, n // 2:]
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=2e-4)
    assert calls[-1] == {"silu_gate": True}
    # up to 32 rows: 8 rows a launch; wider passes keep the checkpoint's words
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer(x), plain(x)[:, layer_order(n)], rtol=1e-5, atol=2e-4)
    assert len(calls) == 4
    assert layer(torch.randn(40, k)).shape == (40, n) and len(calls) == 4


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("group", [64, 128])
def test_matches_reference_and_rows_are_independent(dtype, zero_point, group):
    # N not a multiple of 16; K not a multiple of a program's step (the masked last step)
    n, k = 200, 1408
    _, packed, scales, offsets = operands(n, k, group if k % group == 0 else 64, zero_point, dtype, group, cuda)
    if k % group:
        pytest.skip("K is not a multiple of the group")
    fw = kernel.repack(packed, scales, offsets, group, zero_point)
    x = torch.randn(kernel.MAX_ROWS, k, generator=torch.Generator().manual_seed(3)).to(cuda, dtype)
    ref = dequant_matmul_reference(x.double(), packed, scales, offsets, 4, group, zero_point)
    w = dequantize_reference(packed, scales, offsets, 4, group, zero_point).to(dtype)
    baseline = float(((x @ w.T).double() - ref).norm() / ref.norm())
    for tiles in (kernel.FragTiles(1, 8, 1), kernel.FragTiles(1, 2, 2), kernel.FragTiles(2, 4, 1),
                  kernel.FragTiles(1, 4, 2), kernel.FragTiles(1, 4, 1, 2), kernel.FragTiles(1, 2, 2, 4)):
        alone = kernel.frag_gemv(x[:1], fw, tiles)
        for m in range(1, kernel.MAX_ROWS + 1):
            y = kernel.frag_gemv(x[:m], fw, tiles)
            assert y.shape == (m, n) and y.dtype == dtype
            err = float((y.double() - ref[:m]).norm() / ref[:m].norm())
            assert err < 2 * baseline + 1e-4, (tiles, m, err, baseline)
            assert torch.equal(y[0], alone[0]), (tiles, m)
    # the default tiles (their depth follows the width)
    alone = kernel.frag_gemv(x[:1], fw)
    for m in range(2, kernel.MAX_ROWS + 1):
        assert torch.equal(kernel.frag_gemv(x[:m], fw)[0], alone[0]), m


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_gate_epilogue_matches_the_unfused_activation(dtype):
    chunk, half, k = kernel.GATE_CHUNK, 96, 1024
    _, packed, scales, offsets = operands(2 * half, k, 64, False, dtype, 11, cuda)
    fw = kernel.repack(packed, scales, offsets, 64)
    x = torch.randn(kernel.MAX_ROWS, k, generator=torch.Generator().manual_seed(5)).to(cuda, dtype)
    for tiles in (kernel.FragTiles(1, 2, 2), kernel.FragTiles(1, 4, 1, 2), kernel.FragTiles(1, 2, 2, 4)):
        alone = kernel.frag_gemv(x[:1], fw, tiles, silu_gate=True)
        for m in range(1, kernel.MAX_ROWS + 1):
            y = kernel.frag_gemv(x[:m], fw, tiles, silu_gate=True)
            plain = kernel.frag_gemv(x[:m], fw, tiles).view(m, half // chunk, 2, chunk)
            gate, up = plain[:, :, 0].reshape(m, half), plain[:, :, 1].reshape(m, half)
            expected = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
            assert y.shape == (m, half) and y.dtype == dtype
            torch.testing.assert_close(y, expected, rtol=2 ** -7, atol=1e-5)
            assert torch.equal(y[0], alone[0]), (tiles, m)


@gpu
def test_refuses_what_it_cannot_take_and_names_why():
    _, packed, scales, offsets = operands(32, 256, 64, False, torch.bfloat16, 1, cuda)
    fw = kernel.repack(packed, scales, offsets, 64)
    with pytest.raises(ValueError, match="9 rows"):
        kernel.frag_gemv(torch.zeros(9, 256, device=cuda, dtype=torch.bfloat16), fw)
    with pytest.raises(ValueError, match="float16"):
        kernel.frag_gemv(torch.zeros(1, 256, device=cuda, dtype=torch.float16), fw)


def test_once_the_words_are_released_the_copy_serves_every_width(monkeypatch):
    n, k, group = 48, 256, 64
    plain, layer = plain_and_converted(n, k, group, True, 9, torch.float32)
    layer.release_checkpoint()
    assert layer.released() and layer.weight.numel() == 0
    widths = []
    monkeypatch.setattr(kernel, "frag_gemv",
                        lambda x, *a, **kw: widths.append(x.shape[0]) or emulated_frag_gemv(x, *a, **kw))
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 8, 12, 32, 40):  # a launch; launches of 8 rows; the dequantized copy (prefill)
        x = torch.randn(rows, k, generator=gen)
        # float64 sums (the emulation) against float32 ones (torch's GEMM) of outputs of ~1
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=2e-4)
    assert widths == [1, 8, 8, 4, 8, 8, 8, 8]
    torch.testing.assert_close(layer.dequantized_weight(torch.float32), plain.dequantized_weight(torch.float32))
    with pytest.raises(RuntimeError, match="released"):
        layer.interleave_gate_up()


@pytest.mark.skipif(frag_dequantize.tl is None, reason="Triton")
def test_dequantizing_kernel_equals_the_reference():
    # on the CPU through Triton's interpreter (tests/conftest.py): float32 output there, since the
    # interpreter truncates where the GPU rounds to 16-bit floats
    device = cuda if torch.cuda.is_available() else torch.device("cpu")
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    for n, k, group, zero_point in ((200, 512, 64, False), (48, 256, 128, True)):
        _, packed, scales, offsets = operands(n, k, group, zero_point, torch.bfloat16, n, device)
        fw = kernel.repack(packed, scales, offsets, group, zero_point)
        want = dequantize_reference(packed, scales, offsets, 4, group, zero_point)
        for dtype in dtypes:
            assert torch.equal(frag_dequantize.dequantize_kernel(fw, dtype), want.to(dtype))


def test_activations_in_another_dtype_than_the_copy_skip_both_epilogues(monkeypatch):
    """A copy with bfloat16 terms cannot take float32 activations, and its rows are interleaved in
    chunks of 8, which quant_mma's SiLU epilogue (chunks of 16) must not be given either: the pass
    runs unfused on the checkpoint's words."""
    n, k, group = 64, 256, 64
    plain, layer = plain_and_converted(n, k, group, False, 6, torch.bfloat16)
    layer.interleave_gate_up()
    monkeypatch.setattr(kernel, "frag_gemv", lambda *a, **kw: pytest.fail("the copy's terms are bfloat16"))
    monkeypatch.setattr(dispatch, "silu_gate_reason", lambda layer, device, dtype: None)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    want = plain(x)
    got = layer.silu_gated(x, lambda gate, up: torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(got, torch.nn.functional.silu(want[:, :n // 2]) * want[:, n // 2:])
