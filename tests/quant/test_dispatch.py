"""Which kernel a quantized layer binds (quant/dispatch.py, docs/quantization.md), checked on the
CPU with the GPU's answers faked: the rule by bits, group size, shape, GPU generation and dtype,
what a layer with a copy binds, and that forward runs what was bound without asking again."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import launch
from verispec.quant import dispatch
from verispec.quant.dispatch import Kernel
from verispec.quant.kernels import cpu_qdot, frag, matmul
from verispec.quant.layers.linear import MLXAffineLinear, PackedIntLinear
from verispec.quant.packing import pack_rows

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of the given compute capability, as the kernels' checks see it (nothing runs
    on it: only the rule is asked)."""

    def fake(capability=(9, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(launch, "gluon", launch.gluon or object())  # Gluon present
        monkeypatch.setattr(matmul, "available", lambda device: device.type == "cuda")  # Triton present
        launch.is_sm90.cache_clear()

    yield fake
    launch.is_sm90.cache_clear()


def layer(bits: int, group: int, n: int = 4096, k: int = 4096, kind=MLXAffineLinear):
    with torch.device("meta"):  # the rule reads the shape and the quantization only
        if kind is PackedIntLinear:
            return PackedIntLinear(k, n, bits, group, symmetric=True)
        return MLXAffineLinear(k, n, bits, group)


@pytest.mark.parametrize("bits,group,n,k,dtype,want", [
    (4, 64, 4096, 4096, BF16, Kernel.FRAG),  # Qwen3-8B's 4-bit layers
    (4, 128, 12288, 4096, FP16, Kernel.FRAG),
    (4, 64, 151936, 4096, BF16, Kernel.FRAG),  # the vocabulary-sized head
    (4, 32, 4096, 4096, BF16, Kernel.MMA),  # groups of 32: the words as they are
    (4, 32, 4096, 4128, BF16, Kernel.TINYGEMM),  # K not a multiple of 128
    (4, 32, 4096, 4128, FP16, Kernel.GEMV),  # tinygemm takes bfloat16 only
    (4, 64, 4096, 4096, FP32, Kernel.GEMV),  # the tensor-core kernels take 16-bit activations
    (8, 64, 4096, 4096, BF16, Kernel.GEMV),
    (2, 64, 4096, 4096, BF16, Kernel.GEMV),
    (3, 64, 4096, 4096, BF16, Kernel.TRITON),  # the GEMV reads 2 / 4 / 8 bits
    (6, 64, 4096, 4096, FP16, Kernel.TRITON),
    (4, 64, 4096, 4096, FP64, Kernel.DEQUANTIZE),
])
def test_the_rule_on_an_h200(gpu, bits, group, n, k, dtype, want):
    gpu((9, 0))
    kernel, reasons = dispatch.choose(layer(bits, group, n, k), CUDA, dtype)
    assert kernel is want, reasons
    assert len(reasons) == list(Kernel).index(want)  # one reason for each kernel ahead of it


def test_the_rule_before_sm90_and_on_a_cpu(gpu):
    assert dispatch.choose(layer(4, 64), CPU, FP32)[0] is Kernel.DEQUANTIZE
    # 8-bit on a CPU: the integer-dot kernel where it builds (tests/quant/kernels/test_cpu_qdot.py)
    assert dispatch.choose(layer(8, 64), CPU, BF16)[0] is (Kernel.QDOT if cpu_qdot.failure() is None
                                                          else Kernel.DEQUANTIZE)
    gpu((8, 0))  # an A100: no tensor-core kernel of ours
    assert dispatch.choose(layer(4, 64), CUDA, BF16)[0] is Kernel.TINYGEMM
    assert dispatch.choose(layer(4, 64, kind=PackedIntLinear), CUDA, BF16)[0] is Kernel.TINYGEMM
    assert dispatch.choose(layer(4, 64), CUDA, FP16)[0] is Kernel.GEMV
    reasons = dispatch.choose(layer(4, 64), CUDA, FP16)[1]
    assert "sm_90" in reasons[0] and "tinygemm" in reasons[2]


def test_a_bound_layer_keeps_its_kernels_by_width(gpu):
    gpu((9, 0))
    assert dispatch.bind(layer(4, 32), CUDA, BF16).kernels == (Kernel.MMA, Kernel.TRITON, Kernel.DEQUANTIZE)
    assert dispatch.bind(layer(8, 64), CUDA, BF16).kernels == (Kernel.GEMV, Kernel.TRITON, Kernel.DEQUANTIZE)
    assert dispatch.bind(layer(3, 64), CUDA, BF16).kernels == (Kernel.TRITON, Kernel.DEQUANTIZE)
    # a 4-bit group-64 layer the loader did not prepare (no copy): the tensor-core kernel on its words
    assert dispatch.bind(layer(4, 64), CUDA, BF16).kernels[0] is Kernel.MMA
    bound = dispatch.bind(layer(8, 64), CUDA, BF16)
    assert bound.kernel_for(8) is not None and bound.kernel_for(9) is not bound.kernel_for(8)
    assert bound.kernel_for(128) is not None and bound.kernel_for(129) is None  # prefill: the dequantized GEMM
    assert dispatch.bind(layer(4, 64), CPU, FP32).kernels == (Kernel.DEQUANTIZE,)


def small_layer(seed: int = 0) -> MLXAffineLinear:
    gen = torch.Generator().manual_seed(seed)
    n, k, group = 32, 128, 64
    out = MLXAffineLinear(k, n, 4, group)
    out.weight.copy_(pack_rows(torch.randint(0, 16, (n, k), generator=gen), 4))
    out.scales.data = torch.rand(n, k // group, generator=gen) * 0.1
    out.biases.data = torch.randn(n, k // group, generator=gen) * 0.1
    return out


def test_a_copy_decides_the_kernel_and_follows_the_rows():
    plain, copied = small_layer(), small_layer()
    copied.use_fragment_order(FP32)
    bound = dispatch.bind(copied, CPU, FP32)
    assert bound.kernels == (Kernel.FRAG, Kernel.FRAG, Kernel.DEQUANTIZE)
    assert bound.kernel_for(frag.MAX_ROWS) is not bound.kernel_for(frag.MAX_ROWS + 1)  # 8 rows a launch
    assert bound.kernel_for(dispatch.FRAG_CHUNKED_MAX_ROWS + 1) is None
    assert dispatch.bind(copied, CPU, BF16).kernels == (Kernel.DEQUANTIZE,)  # terms in float32, not bfloat16
    copied.release_checkpoint()  # the copy alone holds the weight: no kernel reads the words any more
    assert dispatch.bind(copied, CPU, BF16).kernels == (Kernel.DEQUANTIZE,)
    x = torch.randn(40, 128, dtype=FP32)
    torch.testing.assert_close(copied(x), plain(x), rtol=1e-5, atol=1e-5)


def test_forward_runs_what_was_bound_without_asking_again(monkeypatch):
    layer_ = small_layer(3)
    calls = []
    real_bind = dispatch.bind
    monkeypatch.setattr(dispatch, "bind", lambda *args: calls.append(args[1:]) or real_bind(*args))
    x = torch.randn(3, 5, 128)
    first = layer_(x)
    assert calls == [(CPU, FP32)] and layer_.bound.kernels == (Kernel.DEQUANTIZE,)

    def never(*args):
        raise AssertionError("the rule was asked again")

    for name in ("bind", "choose", "frag_reason", "mma_reason", "tinygemm_reason", "gemv_reason", "triton_reason"):
        monkeypatch.setattr(dispatch, name, never)
    for rows in (1, 4, 9, 40, 300):
        layer_(torch.randn(rows, 128))
    assert torch.equal(layer_(x), first)
    # another dtype is another binding
    monkeypatch.undo()
    monkeypatch.setattr(dispatch, "bind", lambda *args: calls.append(args[1:]) or real_bind(*args))
    layer_(x.double())
    assert calls == [(CPU, FP32), (CPU, FP64)]


def test_prepare_binds_every_layer_once_and_can_run_again():
    model = torch.nn.Sequential(small_layer(1), small_layer(2))
    dispatch.prepare(model)
    bound = [m.bound for m in model]
    assert all(b is not None and b.kernels == (Kernel.DEQUANTIZE,) for b in bound)
    dispatch.prepare(model)  # a second engine on the model: the same choice
    assert [m.bound.kernels for m in model] == [b.kernels for b in bound]
