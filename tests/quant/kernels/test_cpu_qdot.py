"""The CPU integer-dot kernel (quant/kernels/cpu_qdot.py, qdot.c) on GGUF's Q4_0, Q4_1 and Q8_0
blocks, quantized by the `gguf` library and unpacked by verispec's reader into a quantized layer:
against the library's own dequantization times the kernel's int16 activations in float64 (tightly:
only float32 sums and the output's rounding), against the same times x itself (the activation
rounding's bound), and a row's bits whatever the pass's width and thread count, as speculative
verify == plain decode and batch == alone need."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.kernels.cpu_build import Library
from verispec.loading.gguf.quants import read_tensor
from verispec.quant import dispatch
from verispec.quant.kernels import cpu_qdot
from verispec.quant.layers.linear import MLXAffineLinear
from verispec.quant.packing import pack_rows
from tests.quant.kernels.rows import assert_rows_do_not_depend_on_the_pass

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_qdot.failure() is not None, reason=f"no kernel: {cpu_qdot.failure()}")

N, K = 48, 160  # K in whole 32-blocks, an odd count of them (the kernel pairs blocks); N for tinygemm's packing
DTYPES = [torch.float16, torch.bfloat16]
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}  # the output's unit roundoff
QTYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


class Tensor:
    """What read_tensor reads from a gguf ReaderTensor: the type, the shape (innermost first) and the blocks."""

    def __init__(self, blocks: np.ndarray, qtype, rows: int, cols: int):
        self.data, self.tensor_type, self.name = blocks, qtype, "blk.0.ffn_down.weight"
        self.shape = np.array([cols, rows])


def layer_for(qtype_name: str, dtype: torch.dtype, seed: int = 0) -> tuple[MLXAffineLinear, torch.Tensor]:
    """The layer as the GGUF loader builds it, its kernel copy made; and its weight [N, K] float64:
    the library's dequantization in float16 (whose scales hold the file's exactly), the file's
    scales rounded to bfloat16 in a bfloat16 model (as the loader's cast rounds them)."""
    layer, blocks = checkpoint_layer(qtype_name, dtype, seed)
    dispatch.make_copies(torch.nn.Sequential(layer), dtype)
    weight = layer.dequantized_weight(torch.float64)  # from the kernel's blocks alone (released)
    if dtype == torch.float16:
        assert torch.equal(weight, torch.from_numpy(dequantize(blocks, gguf.GGMLQuantizationType[qtype_name])).double())
    return layer, weight


def checkpoint_layer(qtype_name: str, dtype: torch.dtype, seed: int = 0) -> tuple[MLXAffineLinear, np.ndarray]:
    """The layer as the GGUF loader builds it, before any kernel copy; and the file's blocks."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    w[:, :32] += 0.03  # a block whose values do not straddle zero: Q4_1's minimum far from the scale's
    blocks = quantize(w, qtype)
    affine = read_tensor(Tensor(blocks, qtype, N, K))
    layer = MLXAffineLinear(K, N, affine.bits, 32)
    layer.weight.copy_(pack_rows(affine.q, affine.bits))
    layer.scales.data, layer.biases.data = affine.scales.to(dtype), affine.biases.to(dtype)
    return layer, blocks


def int16_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel rounds it: per block of 32, d = max|x| / 32767 and codes round(x / d)
    (float32 arithmetic, ties to even), returned as codes * d in float64."""
    blocks = x.float().view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inverse).clamp(-32767, 32767)
    return (codes.double() * d.double()).view_as(x)


def sum_bound(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 block sums over K, then the output's rounding to `dtype`: [M, N]."""
    terms = x.abs() @ w.abs().T
    return (K // 32 + 8) * 2.0 ** -23 * terms + UNIT[dtype] * (x @ w.T).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", list(QTYPES))
def test_product_is_the_librarys_weights_times_int16_activations(qtype, dtype):
    layer, w = layer_for(qtype, dtype)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = layer(x)
    assert layer.bound.kernels[0] is dispatch.Kernel.QDOT and layer.qdot_blocks is not None
    assert y.dtype == dtype and y.shape == (5, N)
    xq = int16_activations(x)
    err = (y.double() - xq @ w.T).abs()
    assert (err <= sum_bound(xq, w, dtype)).all(), float((err - sum_bound(xq, w, dtype)).max())
    # against x itself: each activation is within half its block's step (max|x| / 65534) of x
    step = x.double().abs().view(5, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(5, K) / 65534
    rounding = step @ w.abs().T
    err = (y.double() - x.double() @ w.T).abs()
    assert (err <= rounding + sum_bound(x.double(), w, dtype)).all()


def test_the_bound_catches_a_lost_offset():
    """The first test can fail: a Q4_1 layer whose blocks lost their offsets is outside it."""
    layer, w = layer_for("Q4_1", torch.float16)
    blocks = layer.qdot_blocks.view(N, K // 32, cpu_qdot.BLOCK_BYTES[4]).clone()
    blocks[..., 2:4] = 0  # the float16 offset of every block
    layer.qdot_blocks = blocks.view(N, -1)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3)).half()
    xq = int16_activations(x)
    assert not ((layer(x).double() - xq @ w.T).abs() <= sum_bound(xq, w, torch.float16)).all()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_pass(qtype, dtype):
    layer, _ = layer_for(qtype, dtype, seed=1)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(4)).to(dtype)
    assert_rows_do_not_depend_on_the_pass(layer, x)


def test_float32_models_keep_the_dequantized_product():
    """The kernel rounds activations to int16: a float32 model's layers do not take it."""
    layer, _ = layer_for("Q4_0", torch.float32)
    assert layer.qdot_blocks is None
    assert dispatch.Kernel.QDOT not in layer.bind(torch.device("cpu"), torch.float32).kernels


def test_scales_that_are_not_float16_fall_back_to_torchs_int4_kernel():
    layer, _ = checkpoint_layer("Q4_0", torch.bfloat16)
    fresh = MLXAffineLinear(K, N, 4, 32)
    fresh.weight.copy_(layer.weight)
    fresh.scales.data = layer.scales.float() * (1 + 2.0 ** -20)  # between two float16 values
    fresh.biases.data = layer.biases.float()
    dispatch.make_copies(torch.nn.Sequential(fresh), torch.bfloat16)
    assert fresh.qdot_blocks is None and fresh.int4_packed is not None
    assert fresh.bind(torch.device("cpu"), torch.bfloat16).kernels[0] is dispatch.Kernel.TINYGEMM


def test_without_a_compiler_the_kernel_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built before
    library = Library(cpu_qdot._library.source, lambda lib: None)
    assert library.get() is None and "no-such-cc" in library.failure()


def tied_table(rows: int, seed: int = 3) -> torch.nn.Module:
    """An 8-bit table and the lm_head tied to it (as a GGUF's tied vocabulary loads)."""
    from verispec.quant.layers.linear import MLXAffineEmbedding

    gen = torch.Generator().manual_seed(seed)
    table = MLXAffineEmbedding(rows, K, 8, 32)
    table.weight.copy_(pack_rows(torch.randint(0, 256, (rows, K), generator=gen), 8))
    table.scales.data = (torch.rand(rows, K // 32, generator=gen) * 0.01 + 0.001).half().to(torch.bfloat16)
    table.biases.data = (-128 * table.scales.data.float()).to(torch.bfloat16)
    model = torch.nn.Module()
    model.embed, model.head = table, table.as_linear()
    return model


def test_a_tied_vocabularys_words_go_back_as_its_blocks_are_made():
    """The head's words are handed back row by row as the blocks are made (a CPU load's peak holds the
    vocabulary once): the blocks, the table's lookups and the head's product are those of the words."""
    import verispec.quant.layers.linear as linear_module

    model = tied_table(rows=4096)  # 8 MiB of words: whole pages to hand back
    words = model.head.packed_values()
    ids = torch.tensor([0, 7, 4095])
    weight, looked_up = model.head.dequantized_weight(torch.float64), model.embed(ids)
    handed = []
    original = linear_module.release_converted_rows
    linear_module.release_converted_rows = lambda w, rows: handed.append(original(w, rows)) or handed[-1]
    try:
        dispatch.make_copies(model, torch.bfloat16)
    finally:
        linear_module.release_converted_rows = original
    assert sum(handed) >= words.numel() * words.element_size() - 2 * 4096  # all but the edge pages
    assert int((words != 0).sum()) * 4 <= 2 * 4096  # handed back, the pages read as zeros (the edge pages stay)
    assert model.head.released() and model.embed.qdot_blocks is model.head.qdot_blocks
    assert torch.equal(model.embed(ids), looked_up)
    assert torch.equal(model.head.dequantized_weight(torch.float64), weight)


def test_only_a_whole_storage_is_handed_back():
    from verispec.quant.layers.linear import release_converted_rows

    words = torch.ones(64, 1024, dtype=torch.int32)
    assert release_converted_rows(words[8:], 16) == 0  # a view into another tensor's memory
    assert release_converted_rows(words.t(), 16) == 0
    assert torch.equal(words, torch.ones_like(words))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qtype", list(QTYPES))
def test_rows_decoded_in_c_are_the_unpacked_values(qtype, dtype):
    """A tied table's embedding lookup (decode_rows, one C call) gives the bits of the blocks unpacked
    and decoded by torch (unpack + dequantize.decode_values), which are the checkpoint's values; an
    id past the table is refused before anything is read."""
    from verispec.quant.layers.linear import decode_qdot

    layer, _ = layer_for(qtype, torch.float16 if dtype == torch.float32 else dtype)
    blocks, bits = layer.qdot_blocks, QTYPES[qtype]
    ids = torch.tensor([3, 0, N - 1, 3])
    assert torch.equal(cpu_qdot.decode_rows(blocks, ids, bits, K, dtype), decode_qdot(blocks[ids], bits, K, dtype))
    with pytest.raises(IndexError, match=f"row ids must lie in \\[0, {N}\\)"):
        cpu_qdot.decode_rows(blocks, torch.tensor([0, N]), bits, K, dtype)
