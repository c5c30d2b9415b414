"""The Gluon GEMV for quantized weights (verispec/quant/kernels/gemv.py) against its torch
reference for every supported bits / group size / decode and verify width, both offset forms,
ragged N and K, and row invariance (a row's result is bit-identical whatever M and whatever the
other rows hold). Gluon kernels do not run in Triton's CPU interpreter: these run on CUDA (the GPU
run: `python3 -m pytest tests/quant/kernels/test_gemv.py` on the device); the CPU checks below
cover which layers the kernel takes."""
from __future__ import annotations

import pytest
import torch

from verispec.quant.kernels import gemv as kernel
from verispec.quant.kernels.matmul import dequant_matmul_reference
from tests.quant.kernels.test_matmul import random_operands  # on CUDA when there is one

gpu = pytest.mark.skipif(not torch.cuda.is_available() or kernel.gluon is None, reason="needs CUDA and Gluon")


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


def random_experts(num_experts: int, n: int, k: int, bits: int, group: int, dtype, seed: int):
    packed, scales, offsets = random_operands(num_experts * n, k, bits, group, False, dtype, seed)
    return packed.view(num_experts, n, -1), scales.view(num_experts, n, -1), offsets.view(num_experts, n, -1)


@gpu
@pytest.mark.parametrize("bits", kernel.SUPPORTED_BITS)
def test_expert_gemv_matches_reference_and_is_pair_invariant(bits):
    num_experts, n, k, group, top_k = 6, 72, 640, 64, 2
    packed, scales, offsets = random_experts(num_experts, n, k, bits, group, torch.float32, bits)
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(4, k, generator=gen).cuda()
    experts = torch.randint(0, num_experts, (4 * top_k,), generator=gen).cuda()
    y = kernel.expert_gemv(x, packed, scales, offsets, experts, bits, group, rows_per_x=top_k)
    assert y.shape == (4 * top_k, n)
    for p, e in enumerate(experts.tolist()):
        ref = dequant_matmul_reference(x[p // top_k:p // top_k + 1].double(), packed[e], scales[e], offsets[e],
                                       bits, group)
        assert float((y[p:p + 1].double() - ref).norm() / ref.norm()) < 1e-6, p
    # the first token's pairs alone: the same bits
    alone = kernel.expert_gemv(x[:1], packed, scales, offsets, experts[:top_k], bits, group, rows_per_x=top_k)
    assert torch.equal(alone, y[:top_k])


def quantized_experts(bits: int, seed: int):
    """MLXQuantizedExperts over random bf16 stacks (8 experts, hidden 256, intermediate 128)."""
    from verispec.quant.layers.experts import MLXQuantizedExperts, QuantizedExpertStack

    num_experts, hidden, inter, group = 8, 256, 128, 64
    stacks = {}
    for i, (name, n, k) in enumerate((("gate_proj", inter, hidden), ("up_proj", inter, hidden),
                                      ("down_proj", hidden, inter))):
        stack = QuantizedExpertStack(num_experts, k, n, bits, group).cuda().to(torch.bfloat16)
        packed, scales, offsets = random_experts(num_experts, n, k, bits, group, torch.bfloat16, seed + i)
        stack.weight.copy_(packed)
        stack.scales.data.copy_(scales)
        stack.biases.data.copy_(offsets)
        stacks[name] = stack
    return MLXQuantizedExperts(num_experts, "gelu_pytorch_tanh", **stacks)


@gpu
@pytest.mark.parametrize("tokens,method", [(3, "gemv"), (100, "grouped")])
def test_quantized_experts_paths_equal_the_loop(tokens, method):
    """Decode's path (the GEMV per pair) and prefill's (every expert dequantized once, torch's
    grouped GEMM) against the per-expert loop."""
    experts = quantized_experts(4 if method == "gemv" else 8, tokens)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16).cuda()
    index = torch.randint(0, experts.num_experts, (tokens, 2), generator=gen).cuda()
    weights = torch.rand(tokens, 2, generator=gen).to(torch.bfloat16).cuda()
    assert experts.default_method(x, index.numel()) == method
    fast = experts(x, index, weights)
    experts.method = "loop"
    slow = experts(x, index, weights)
    assert float((fast.float() - slow.float()).norm() / slow.float().norm()) < 2e-2
