"""The Triton expert GEMV (MoE decode path) against per-pair torch products, and the MoE layer's
`gemv` method against transformers' reference experts loop. Runs on CUDA, and on CPU through
Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import expert_gemv as kernel
from verispec.models.layers.moe import ExpertsMethod, FusedExperts

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("e,n,k,rows,per_x", [(6, 40, 96, 2, 3), (4, 64, 200, 5, 1), (3, 7, 33, 1, 2)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_matches_per_pair_products(e, n, k, rows, per_x, dtype, tol):
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(e, n, k, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    ids = torch.randint(0, e, (rows * per_x,), generator=gen).to(DEVICE)
    y = kernel.expert_gemv(x, weight, ids, rows_per_x=per_x)
    ref = torch.stack([weight[ids[p]].double() @ x[p // per_x].double() for p in range(rows * per_x)])
    assert y.dtype == dtype and y.shape == (rows * per_x, n)
    assert float((y.double() - ref).norm() / ref.norm()) < tol


def test_rejects_mismatched_shapes():
    w = torch.zeros(2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="expert ids"):
        kernel.expert_gemv(torch.zeros(2, 8, device=DEVICE), w, torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="K"):
        kernel.expert_gemv(torch.zeros(2, 9, device=DEVICE), w, torch.zeros(2, dtype=torch.long, device=DEVICE))


def test_moe_gemv_method_matches_reference_loop():
    torch.manual_seed(0)
    experts = FusedExperts(num_experts=8, hidden=48, intermediate=24, act="gelu_pytorch_tanh").to(DEVICE)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(3, 48, device=DEVICE)  # a verify pass of 3 tokens
    index = torch.tensor([[0, 5], [5, 7], [2, 0]], device=DEVICE)
    weights = torch.rand(3, 2, device=DEVICE)
    with torch.no_grad():
        experts.method = ExpertsMethod.LOOP
        ref = experts(x, index, weights)
        experts.method = ExpertsMethod.GEMV
        got = experts(x, index, weights)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
