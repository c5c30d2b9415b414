"""The row-invariant linear kernel (verispec/kernels/linear.py) against torch's product, and a row's
bits the same at every row count and with every tile choice. Runs on CUDA, and on CPU through
Triton's interpreter (tests/conftest.py), where the products are numpy's; the GPU's own tensor-core
chains are held to the same bits by tests/gpu/test_gpu_exact_kernels.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.kernels import linear as lin

pytestmark = pytest.mark.skipif(lin.triton is None, reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(m, n, k, dtype, seed, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 40), (5, 70, 96), (33, 64, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_torch_linear(dtype, m, n, k, bias):
    x, w, b = inputs(m, n, k, dtype, seed=m + n + k, bias=bias)
    got = lin.linear(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_leading_dimensions_and_an_empty_pass():
    x, w, _ = inputs(6, 32, 48, torch.float32, seed=1)
    assert lin.linear(x.reshape(2, 3, 48), w).shape == (2, 3, 32)
    assert lin.linear(x[:0], w).shape == (0, 32)


# the interpreter sums a whole K tile before adding it to the running sum (the GPU chains 16 columns at
# a time whatever the tile), so here the tiles differ in rows and columns only
@pytest.mark.parametrize("tiles", [lin.Tiles(16, 32, 32, 4, 2), lin.Tiles(32, 16, 32, 4, 2),
                                   lin.Tiles(64, 64, 32, 4, 2)], ids=str)
def test_a_row_alone_equals_the_row_among_others(tiles):
    x, w, _ = inputs(40, 48, 96, torch.float32, seed=3)
    together = lin.linear(x, w, tiles=tiles)
    for r in (0, 17, 39):
        assert torch.equal(lin.linear(x[r:r + 1], w)[0], together[r])


def test_unsupported_reasons_name_the_input():
    w = torch.zeros(4, 8, dtype=torch.float64)
    assert lin.unsupported_reason(torch.zeros(1, 8, dtype=torch.float64), w) is not None
    if DEVICE == "cpu":
        assert "device cpu" in lin.unsupported_reason(torch.zeros(1, 8), torch.zeros(4, 8))
