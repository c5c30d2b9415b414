"""torch's built-in int4 product (kernels/int4_builtin.py): the (scale, zero) mapping of both of
our layouts onto tinygemm's w = (q - 8)*s + zero, checked on the CPU variant of the kernel
against the exact float64 reference; the layer's conversion and what it releases; the engine's
choice. The CUDA packing (nibble order) is checked on the GPU by tests/gpu/test_gpu_int4_builtin.py."""
from __future__ import annotations

import pytest
import torch

from verispec.errors import UnsupportedModelError
from verispec.kernels import int4_builtin
from verispec.kernels.quant_matmul import dequant_matmul_reference
from verispec.models.layers.quant_convert import convert_for_builtin_int4
from verispec.models.layers.quant_linear import QUANT_KERNEL_ENV, MLXAffineLinear, PackedIntLinear
from verispec.quant import mlx_affine
from verispec.quant.packing import pack_rows

N, K = 48, 256


def mlx_layer(group: int) -> MLXAffineLinear:
    torch.manual_seed(group)
    packed, scales, biases = mlx_affine.quantize(torch.randn(N, K) * 0.05, mlx_affine.AffineSpec(4, group))
    layer = MLXAffineLinear(K, N, 4, group)
    layer.weight.copy_(packed)
    layer.scales.data, layer.biases.data = scales.bfloat16(), biases.bfloat16()
    return layer


def zero_point_layer(symmetric: bool) -> PackedIntLinear:
    torch.manual_seed(int(symmetric))
    group = 32
    layer = PackedIntLinear(K, N, 4, group, symmetric)
    layer.weight_packed.copy_(pack_rows(torch.randint(0, 16, (N, K)), 4))
    layer.weight_scale.data = (torch.rand(N, K // group) * 0.01 + 1e-3).bfloat16()
    layer.weight_shape.copy_(torch.tensor([N, K]))
    if not symmetric:
        layer.weight_zero_point.copy_(pack_rows(torch.randint(0, 16, (K // group, N)), 4).T.contiguous())
    layer.finish_loading()
    return layer


def close_to_reference(layer, x: torch.Tensor, reference: torch.Tensor) -> None:
    y = layer(x).double()
    # bfloat16 output and a zero rounded once to bfloat16: a few bfloat16 ulps of the result
    assert (y - reference).abs().max() <= 2 ** -6 * reference.abs().max() + 1e-3


@pytest.mark.parametrize("group", [32, 64, 128])
def test_affine_layer_matches_reference_after_conversion(group):
    layer = mlx_layer(group)
    x = torch.randn(5, K, dtype=torch.bfloat16)
    reference = dequant_matmul_reference(x.double(), layer.weight, layer.scales, layer.biases, 4, group)
    layer.use_builtin_int4()
    close_to_reference(layer, x, reference)
    # the checkpoint's words, scales and biases are released; the converted tensors are buffers
    assert layer.weight.numel() == layer.scales.numel() == layer.biases.numel() == 0
    names = dict(layer.named_buffers())
    assert names["int4_packed"] is layer.int4_packed and names["int4_scale_zero"].shape == (K // group, N, 2)


@pytest.mark.parametrize("symmetric", [True, False])
def test_zero_point_layer_matches_reference_after_conversion(symmetric):
    layer = zero_point_layer(symmetric)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    reference = dequant_matmul_reference(x.double(), layer.weight_packed, layer.weight_scale, layer.zeros, 4, 32,
                                         zero_point=True)
    layer.use_builtin_int4()
    close_to_reference(layer, x, reference)
    assert layer.weight_packed.numel() == 0


def test_mapping_is_wrong_without_the_midpoint_shift():
    """The test above can fail: tinygemm's q - 8 is what the zero's + 8s undoes."""
    layer = mlx_layer(64)
    x = torch.randn(2, K, dtype=torch.bfloat16)
    reference = dequant_matmul_reference(x.double(), layer.weight, layer.scales, layer.biases, 4, 64)
    layer.use_builtin_int4()
    layer.int4_scale_zero = torch.stack([layer.int4_scale_zero[..., 0], layer.int4_scale_zero[..., 1]
                                         - 8 * layer.int4_scale_zero[..., 0]], -1)
    with pytest.raises(AssertionError):
        close_to_reference(layer, x, reference)


def test_kept_words_serve_wide_passes():
    """Without release (the default's choice on CUDA) a pass wider than MAX_ROWS takes the words."""
    layer = mlx_layer(64)
    x = torch.randn(int4_builtin.MAX_ROWS + 1, K, dtype=torch.bfloat16)
    layer.use_builtin_int4(release=False)
    assert not layer.released() and layer.checkpoint_bytes() > 0
    wide = layer(x)
    assert torch.equal(wide, torch.nn.functional.linear(x, layer.dequantized_weight(torch.bfloat16)))
    narrow = layer(x[:int4_builtin.MAX_ROWS])
    assert torch.equal(narrow, int4_builtin.matmul(x[:int4_builtin.MAX_ROWS], layer.int4_packed, 64,
                                                   layer.int4_scale_zero))


def test_reasons():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    ok = int4_builtin.unsupported_reason(cuda, torch.bfloat16, 4, 64, 4096, 4096)
    assert ok is None
    assert "cpu" in int4_builtin.unsupported_reason(cpu, torch.bfloat16, 4, 64, 4096, 4096)
    assert "float16" in int4_builtin.unsupported_reason(cuda, torch.float16, 4, 64, 4096, 4096)
    assert "8-bit" in int4_builtin.unsupported_reason(cuda, torch.bfloat16, 8, 64, 4096, 4096)
    assert "group size 16" in int4_builtin.unsupported_reason(cuda, torch.bfloat16, 4, 16, 4096, 4096)
    assert "output features" in int4_builtin.unsupported_reason(cuda, torch.bfloat16, 4, 64, 4100, 4096)
    assert "input features" in int4_builtin.unsupported_reason(cuda, torch.bfloat16, 4, 32, 4096, 4080)


def test_engine_choice_leaves_cpu_layers_and_obeys_the_knob(monkeypatch):
    model = torch.nn.Sequential(mlx_layer(64))
    assert convert_for_builtin_int4(model, torch.bfloat16) == 0  # on the CPU: the layer keeps its words
    assert model[0].int4_packed is None and model[0].weight.numel() > 0
    monkeypatch.setenv(QUANT_KERNEL_ENV, "tinygemm")
    with pytest.raises(UnsupportedModelError, match="auto, mma, builtin, gemv, triton"):
        convert_for_builtin_int4(model, torch.bfloat16)


def test_gemv_choice_follows_the_knob(monkeypatch):
    """Which short passes take the Gluon GEMV: the knob's modes, each reason named."""
    from verispec.kernels import quant_gemv

    layer = mlx_layer(64)
    cuda = torch.device("cuda")
    assert layer.gemv_reason(torch.device("cpu"), torch.bfloat16) == "device cpu"
    auto = layer.gemv_reason(cuda, torch.bfloat16)
    assert auto == quant_gemv.unsupported_reason(cuda, torch.bfloat16, 4, 64)  # None where Gluon exists
    monkeypatch.setenv(QUANT_KERNEL_ENV, "triton")
    assert layer.gemv_reason(cuda, torch.bfloat16) == f"{QUANT_KERNEL_ENV}=triton"
    monkeypatch.setenv(QUANT_KERNEL_ENV, "gemv")
    assert layer.gemv_reason(cuda, torch.bfloat16) == auto
    assert convert_for_builtin_int4(torch.nn.Sequential(layer), torch.bfloat16) == 0  # no tinygemm copy


def test_mma_choice_follows_the_knob(monkeypatch):
    """4-bit decode / verify passes take the tensor-core kernel only in the default mode; each
    other mode, and the CPU, is named as the reason."""
    from verispec.kernels import quant_mma

    layer = mlx_layer(64)
    cuda = torch.device("cuda")
    assert layer.mma_reason(torch.device("cpu"), torch.bfloat16) == "device cpu"
    assert layer.mma_reason(cuda, torch.bfloat16) == quant_mma.unsupported_reason(cuda, torch.bfloat16, 4, 64,
                                                                                 layer.in_features)
    for mode in ("gemv", "builtin", "triton"):
        monkeypatch.setenv(QUANT_KERNEL_ENV, mode)
        assert layer.mma_reason(cuda, torch.bfloat16) == f"{QUANT_KERNEL_ENV}={mode}"
