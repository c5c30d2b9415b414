"""The gated MLP's activation kernel (verispec/kernels/silu_mul.py) against the torch definition
(layers.fused.silu_mul), on the merged gate/up product's halves (strided views) as the MLP passes
them; and a row's bits the same whatever the pass's width. Runs on CUDA, and on CPU through
Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import silu_mul
from verispec.models.layers.fused import silu_mul as reference

pytestmark = pytest.mark.skipif(silu_mul.triton is None, reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def halves(shape, dtype, seed):
    """gate, up: the two halves of one [..., 2N] product, as MLP.forward chunks it."""
    gen = torch.Generator().manual_seed(seed)
    merged = (torch.randn((*shape[:-1], 2 * shape[-1]), generator=gen) * 3).to(DEVICE, dtype)
    return merged.chunk(2, dim=-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 1536), (1, 5, 1000), (3, 2500)])
def test_equals_the_torch_definition(dtype, tol, shape):
    gate, up = halves(shape, dtype, seed=sum(shape))
    assert gate.stride(-2) == 2 * shape[-1]  # a view into the merged product
    out = silu_mul.silu_mul(gate, up)
    assert out.shape == gate.shape and out.dtype == dtype
    want = reference(gate.float(), up.float())
    torch.testing.assert_close(out.float(), want, atol=tol * 4, rtol=tol)


def test_a_rows_bits_do_not_depend_on_the_pass():
    gate, up = halves((6, 1536), torch.bfloat16, seed=4)
    wide = silu_mul.silu_mul(gate, up)
    for r in (0, 3, 5):
        assert torch.equal(silu_mul.silu_mul(gate[r:r + 1], up[r:r + 1])[0], wide[r])


def test_reasons():
    x = torch.zeros(2, 8)
    assert "device cpu" in silu_mul.unsupported_reason(x, x)
