"""Group-quantized products under exact numerics (quant/kernels/exact.py) against the decoded
weight's float64 product, and a row's bits the same alone and among other rows. Runs on CUDA, and
on the CPU in Triton's interpreter; that the fused product and the wide path (decode the weight,
then the dense kernel) give the same bits on the GPU's tensor cores is tests/gpu/test_gpu_exact_kernels.py's."""
from __future__ import annotations

import pytest
import torch

from verispec.quant import mlx_affine
from verispec.quant.kernels import dequantize, exact

pytestmark = pytest.mark.skipif(exact.triton is None, reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantized(n: int, k: int, bits: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    packed, scales, biases = mlx_affine.quantize(w, mlx_affine.AffineSpec(bits, group))
    return packed.to(DEVICE), scales.to(DEVICE), biases.to(DEVICE)


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (8, 64), (3, 32)])
def test_rows_alone_equal_rows_together_and_the_decoded_product(bits, group):
    n, k = 48, 256
    packed, scales, biases = quantized(n, k, bits, group, seed=bits + group)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, k, generator=gen).to(DEVICE, torch.bfloat16)
    together = exact.exact_linear(x, packed, scales, biases, bits, group, False)
    for r in (0, 7, 19):
        assert torch.equal(exact.exact_linear(x[r:r + 1], packed, scales, biases, bits, group, False)[0], together[r])
    w = dequantize.decode(packed, scales, biases, bits, group, False, torch.float64)
    ref = x.double() @ w.T
    assert float((together.double() - ref).norm() / ref.norm()) < 1e-2


def test_the_decoder_gives_the_checkpoints_values():
    packed, scales, biases = quantized(40, 128, 4, 32)
    got = exact.decoded_weight(packed, scales, biases, 4, 32, False, torch.float32)
    want = dequantize.decode(packed, scales, biases, 4, 32, False, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_unsupported_reasons():
    assert "device cpu" in exact.unsupported_reason(torch.device("cpu"), torch.bfloat16, 4)
    assert exact.unsupported_reason(torch.device("cuda"), torch.float32, 4) is not None
