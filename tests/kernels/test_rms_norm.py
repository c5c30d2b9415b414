"""The residual add + RMSNorm kernel (verispec/kernels/rms_norm.py) against the torch definition
(layers.fused.add_rms_norm): with and without the add, plain and unit-offset weights, hidden
sizes that are not powers of two; and a row's bits the same whatever the pass's width. Runs on
CUDA, and on CPU through Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import rms_norm
from verispec.models.layers.fused import add_rms_norm as reference
from verispec.models.layers.fused import rms_norm as reference_norm

pytestmark = pytest.mark.skipif(rms_norm.triton is None, reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 4).to(DEVICE, dtype)
    u = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(DEVICE, dtype)
    return x, u, w


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 72), (1, 5, 1000)])
def test_equals_the_torch_definition(dtype, tol, unit_offset, shape):
    x, u, w = rows(shape, dtype, seed=sum(shape))
    summed, normed = rms_norm.add_rms_norm(x, u, w, 1e-6, unit_offset)
    want_summed, want_normed = reference(x, u, w, 1e-6, unit_offset)
    if DEVICE == "cuda":  # one rounding of the exact sum, as torch's add
        assert torch.equal(summed, want_summed)
    else:  # Triton's interpreter narrows float32 to bfloat16 by truncating, not rounding
        torch.testing.assert_close(summed.float(), want_summed.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=tol, rtol=tol)


def test_the_norm_alone():
    x, _, w = rows((3, 40), torch.float32, seed=1)
    summed, normed = rms_norm.add_rms_norm(x, None, w, 1e-5, False)
    assert summed is x
    torch.testing.assert_close(normed, reference_norm(x, w, 1e-5, False), atol=1e-5, rtol=1e-5)


def test_a_rows_bits_do_not_depend_on_the_pass():
    x, u, w = rows((6, 128), torch.bfloat16, seed=4)
    _, wide = rms_norm.add_rms_norm(x, u, w, 1e-6, False)
    for r in (0, 3, 5):
        _, one = rms_norm.add_rms_norm(x[r:r + 1], u[r:r + 1], w, 1e-6, False)
        assert torch.equal(one[0], wide[r])


def test_reasons():
    x = torch.zeros(2, 8)
    assert "device cpu" in rms_norm.unsupported_reason(x, torch.zeros(8))
