"""torch's built-in int4 product (quant/kernels/int4_builtin.py): the (scale, zero) mapping of both
of our layouts onto tinygemm's w = (q - 8)*s + zero, checked on the CPU variant of the kernel
against the exact float64 reference; the layer's conversion and what it keeps; the load-time
choice. The CUDA packing (nibble order) is checked on the GPU by tests/gpu/test_gpu_int4_builtin.py."""
from __future__ import annotations

import pytest
import torch

from verispec.quant import dispatch
from verispec.quant.kernels import int4_builtin
from verispec.quant.kernels.matmul import dequant_matmul_reference
from verispec.quant.layers.linear import MLXAffineLinear, PackedIntLinear
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
    # the checkpoint's words stay for wider passes; the converted tensors are buffers
    assert not layer.released() and layer.weight.numel() > 0
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
    assert layer.weight_packed.numel() > 0


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


def test_kept_words_serve_wide_passes_on_cuda():
    """On CUDA a pass wider than MAX_ROWS takes the checkpoint's words (tinygemm is slow from 16
    rows there); on a CPU the copy serves every pass (tests/quant/kernels/test_int4_cpu.py)."""
    layer = mlx_layer(64)
    layer.use_builtin_int4()
    assert not layer.released() and layer.checkpoint_bytes() > 0
    bound = dispatch.bind(layer, torch.device("cuda"), torch.bfloat16)  # the rule only: nothing runs
    assert bound.steps[0][:2] == (int4_builtin.MAX_ROWS, dispatch.Kernel.TINYGEMM)
    assert bound.kernel_for(int4_builtin.MAX_ROWS + 1) is not bound.steps[0][2]


def test_reasons():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    ok = int4_builtin.unsupported_reason(cuda, torch.bfloat16, 4, 64, 4096, 4096)
    assert ok is None
    assert int4_builtin.unsupported_reason(cpu, torch.bfloat16, 4, 64, 4096, 4096) is None
    assert int4_builtin.unsupported_reason(cpu, torch.float16, 4, 32, 576, 576) is None  # through bfloat16
    assert "float32 on a CPU" in int4_builtin.unsupported_reason(cpu, torch.float32, 4, 64, 4096, 4096)
    assert "multiple of 16" in int4_builtin.unsupported_reason(cpu, torch.bfloat16, 4, 64, 4104, 4096)
    assert "device mps" in int4_builtin.unsupported_reason(torch.device("mps"), torch.bfloat16, 4, 64, 4096, 4096)
    assert "float16" in int4_builtin.unsupported_reason(cuda, torch.float16, 4, 64, 4096, 4096)
    assert "8-bit" in int4_builtin.unsupported_reason(cuda, torch.bfloat16, 8, 64, 4096, 4096)
    assert "group size 16" in int4_builtin.unsupported_reason(cuda, torch.bfloat16, 4, 16, 4096, 4096)
    assert "output features" in int4_builtin.unsupported_reason(cuda, torch.bfloat16, 4, 64, 4100, 4096)
    assert "input features" in int4_builtin.unsupported_reason(cuda, torch.bfloat16, 4, 32, 4096, 4080)


def test_load_time_choice_on_a_cpu_and_each_reason(monkeypatch):
    from verispec.quant.kernels import gemv as quant_gemv
    from verispec.quant.kernels import mma as quant_mma

    # torch's int4 kernel: the CPU fallback where the integer-dot kernel does not run (tests/quant/kernels/test_cpu_qdot.py)
    monkeypatch.setattr(dispatch, "qdot_reason", lambda *args: "tested without it")
    model = torch.nn.Sequential(mlx_layer(64))
    assert dispatch.make_copies(model, torch.float32) == 0  # float32 on the CPU: the layer keeps its words only
    assert model[0].int4_packed is None
    assert dispatch.make_copies(model, torch.bfloat16) == 1
    assert model[0].int4_packed is not None and model[0].weight.numel() > 0
    layer, cuda, cpu = model[0], torch.device("cuda"), torch.device("cpu")
    assert dispatch.gemv_reason(layer, cpu, torch.bfloat16) == "device cpu"
    assert dispatch.mma_reason(layer, cpu, torch.bfloat16) == "device cpu"
    assert dispatch.gemv_reason(layer, cuda, torch.bfloat16) == quant_gemv.unsupported_reason(cuda, torch.bfloat16,
                                                                                              4, 64)
    assert dispatch.mma_reason(layer, cuda, torch.bfloat16) == quant_mma.unsupported_reason(cuda, torch.bfloat16, 4,
                                                                                            64, layer.in_features)
    assert dispatch.tinygemm_reason(layer, cpu, torch.bfloat16) is None
    assert "float32" in dispatch.tinygemm_reason(layer, cpu, torch.float32)
    # a float32 pass on a layer holding the copy dequantizes (the copy's product would round to bfloat16)
    assert dispatch.bind(layer, cpu, torch.float32).kernels == (dispatch.Kernel.DEQUANTIZE,)
