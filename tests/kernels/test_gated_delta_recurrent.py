"""The Triton Gated DeltaNet recurrent kernel (per-position states) against the torch definition.

Runs on CUDA, and on CPU through Triton's interpreter (tests/conftest.py turns it on when there is
no GPU), so CI checks the kernel's arithmetic too."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import gated_delta_recurrent as kernel
from verispec.models.layers.gated_delta_net import torch_gated_delta_rule

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(b, t, hk, h, dk, dv, dtype, seed, strided):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # as the model passes them: q/k/v split out of one [B, C, T] conv output, transposed
        conv = torch.randn(b, 2 * hk * dk + h * dv, t, generator=gen).to(dtype).to(DEVICE)
        q, k, v = conv.transpose(1, 2).split([hk * dk, hk * dk, h * dv], dim=-1)
        q, k, v = q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, h, dv)
    else:
        q = torch.randn(b, t, hk, dk, generator=gen).to(dtype).to(DEVICE)
        k = torch.randn(b, t, hk, dk, generator=gen).to(dtype).to(DEVICE)
        v = torch.randn(b, t, h, dv, generator=gen).to(dtype).to(DEVICE)
    g = (-torch.rand(b, t, h, generator=gen) * 2).to(DEVICE)  # log decays in (-2, 0]
    beta = torch.rand(b, t, h, generator=gen).to(dtype).to(DEVICE)
    state = torch.randn(b, h, dk, dv, generator=gen).to(DEVICE)
    return q, k, v, g, beta, state


def reference(q, k, v, g, beta, state):
    groups = v.shape[2] // q.shape[2]
    q64, k64 = (x.double().repeat_interleave(groups, dim=2) for x in (q, k))
    out, states = torch_gated_delta_rule(q64, k64, v.double(), g.double(), beta.double(), state.double(),
                                         per_position=True)
    return out, states


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,t,hk,h,dk,dv,strided", [
    (1, 1, 2, 4, 32, 32, True),      # decode step, 2 value heads per key head
    (1, 5, 2, 2, 16, 64, False),     # verify pass, one value head per key head
    (2, 3, 1, 3, 48, 40, True),      # batch, dims that are not powers of two
    (1, 16, 4, 8, 64, 16, True),     # the longest per-position pass
])
def test_matches_torch_recurrence(b, t, hk, h, dk, dv, strided, dtype, tol):
    q, k, v, g, beta, state = inputs(b, t, hk, h, dk, dv, dtype, seed=t * 100 + h, strided=strided)
    out, states = kernel.gated_delta_recurrent(q, k, v, g, beta, state)
    ref_out, ref_states = reference(q, k, v, g, beta, state)
    assert out.dtype == v.dtype and out.shape == (b, t, h, dv)
    assert states.dtype == torch.float32 and states.shape == (t, b, h, dk, dv)
    out_err = (out.double() - ref_out).norm() / ref_out.norm()
    state_err = (states.double() - ref_states).norm() / ref_states.norm()
    assert out_err < tol and state_err < tol, (float(out_err), float(state_err))


def test_every_position_state_is_kept():
    """State t is the state after token t: restarting from it reproduces the rest of the pass."""
    q, k, v, g, beta, state = inputs(1, 6, 2, 4, 32, 32, torch.float32, seed=7, strided=False)
    out, states = kernel.gated_delta_recurrent(q, k, v, g, beta, state)
    tail_out, tail_states = kernel.gated_delta_recurrent(q[:, 3:], k[:, 3:], v[:, 3:], g[:, 3:], beta[:, 3:],
                                                         states[2])
    torch.testing.assert_close(tail_out, out[:, 3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail_states, states[3:], rtol=1e-5, atol=1e-5)


def test_rejects_uneven_heads():
    q, k, v, g, beta, state = inputs(1, 1, 2, 3, 16, 16, torch.float32, seed=0, strided=False)
    with pytest.raises(ValueError, match="multiple"):
        kernel.gated_delta_recurrent(q, k, v, g, beta, state)
