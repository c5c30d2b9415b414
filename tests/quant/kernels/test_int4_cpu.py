"""torch's int4 product on a CPU (the fallback where the integer-dot kernel does not run) for GGUF's 4-bit blocks (quant/kernels/int4_builtin.py): Q4_0 and
Q4_1 weights quantized by the `gguf` library, unpacked by verispec's GGUF reader into a quantized
layer and multiplied by the CPU kernel (bfloat16 activations, and float16 through bfloat16),
against the library's own dequantization times x in float64; and a row's bits whatever the
pass's width, as speculative verify == plain decode and batch == alone need."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.loading.gguf.quants import read_tensor
from verispec.quant import dispatch
from verispec.quant.layers.linear import MLXAffineLinear
from verispec.quant.packing import pack_rows
from tests.quant.kernels.rows import assert_rows_do_not_depend_on_the_pass

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402


@pytest.fixture(autouse=True)
def without_the_integer_dot_kernel(monkeypatch):
    """torch's int4 kernel is the CPU fallback where ours does not run (tests/quant/kernels/test_cpu_qdot.py)."""
    monkeypatch.setattr(dispatch, "qdot_reason", lambda *args: "tested without it")

N, K = 48, 96  # the CPU packing takes N in multiples of 16; K in whole 32-blocks
DTYPES = [torch.bfloat16, torch.float16]
UNIT = 2.0 ** -8  # bfloat16's unit roundoff (2^-9), doubled: scale, zero and result are each rounded once or twice


class Tensor:
    """What read_tensor reads from a gguf ReaderTensor: the type, the shape (innermost first) and the blocks."""

    def __init__(self, blocks: np.ndarray, qtype, rows: int, cols: int):
        self.data, self.tensor_type, self.name = blocks, qtype, "blk.0.ffn_down.weight"
        self.shape = np.array([cols, rows])


def gguf_weight(qtype_name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray, object]:
    """(the blocks the library wrote, its own dequantization [N, K] float32, the type)."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    w[:, :32] += 0.03  # a block whose values do not straddle zero: Q4_1's minimum far from -8 scales
    blocks = quantize(w, qtype)
    return blocks, dequantize(blocks, qtype), qtype


def cpu_layer(qtype_name: str, dtype: torch.dtype, seed: int = 0) -> tuple[MLXAffineLinear, torch.Tensor]:
    """The layer as the GGUF loader builds it (scales and biases in the model's dtype), its tinygemm
    copy made; and the library's dequantized weight [N, K] float64."""
    blocks, reference, qtype = gguf_weight(qtype_name, seed)
    affine = read_tensor(Tensor(blocks, qtype, N, K))
    layer = MLXAffineLinear(K, N, 4, 32)
    layer.weight.copy_(pack_rows(affine.q, 4))
    layer.scales.data, layer.biases.data = affine.scales.to(dtype), affine.biases.to(dtype)
    dispatch.make_copies(torch.nn.Sequential(layer), dtype)
    return layer, torch.from_numpy(reference).double()


def error_bound(x: torch.Tensor, layer: MLXAffineLinear, w: torch.Tensor) -> torch.Tensor:
    """|y - x @ w^T| allowed per output [M, N]: each weight off by its scale and zero's rounding to
    bfloat16 (|q - 8| <= 8 scales, the zero once more), each input by its rounding to bfloat16, the
    result by its own, and float32 sums over K."""
    s = layer.scales.double().abs().repeat_interleave(32, dim=1)
    o = layer.biases.double().abs().repeat_interleave(32, dim=1)
    weight_error = UNIT * (16 * s + o)  # [N, K]
    xa = x.double().abs()
    exact = x.double() @ w.T
    return xa @ weight_error.T + UNIT * (xa @ w.abs().T) + UNIT * exact.abs() + K * 2.0 ** -23 * (xa @ w.abs().T)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_product_matches_the_librarys_dequantization(qtype, dtype):
    layer, w = cpu_layer(qtype, dtype)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (5, N)
    assert layer.int4_packed is not None and layer.bound.kernels[0] is dispatch.Kernel.TINYGEMM
    err = (y.double() - x.double() @ w.T).abs()
    assert (err <= error_bound(x, layer, w)).all(), float((err - error_bound(x, layer, w)).max())


def test_the_bound_catches_a_zero_off_by_one_scale():
    """The test above can fail: tinygemm's q - 8 needs the zero's + 8 scales, and 7 is not enough."""
    layer, w = cpu_layer("Q4_1", torch.bfloat16)
    layer.int4_scale_zero = torch.stack([layer.int4_scale_zero[..., 0],
                                         layer.int4_scale_zero[..., 1] - layer.int4_scale_zero[..., 0]], -1)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3)).bfloat16()
    err = (layer(x).double() - x.double() @ w.T).abs()
    assert not (err <= error_bound(x, layer, w)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_pass(dtype):
    layer, _ = cpu_layer("Q4_1", dtype, seed=1)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(4)).to(dtype)
    assert_rows_do_not_depend_on_the_pass(layer, x)


def test_float32_and_float64_passes_keep_the_dequantized_product():
    """The copy's product rounds to bfloat16: a float32 / float64 model's layers do not take it."""
    layer, _ = cpu_layer("Q4_0", torch.float32)  # make_copies with float32 made none...
    assert layer.int4_packed is None
    layer, w = cpu_layer("Q4_0", torch.float16)  # float16 holds the file's scales exactly
    x = torch.randn(2, K, dtype=torch.float64)
    layer.scales.data, layer.biases.data = layer.scales.double(), layer.biases.double()
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-12, atol=1e-12)  # ...and one that has it skips it
    assert layer.bound.kernels == (dispatch.Kernel.DEQUANTIZE,)


def test_a_cpu_fallback_logs_the_cpu_kernels_reason_only(monkeypatch):
    from verispec import log

    lines = []
    monkeypatch.setattr(log, "debug", lambda message, *args: lines.append(message % args))
    layer, _ = cpu_layer("Q4_0", torch.float32)  # its copy refused here, so prepare asks again
    dispatch.prepare(torch.nn.Sequential(layer), torch.float32)
    text = "\n".join(lines)
    assert "not tinygemm: activations in float32 on a CPU" in text
    assert "not frag" not in text and "not mma" not in text and "not gemv" not in text
