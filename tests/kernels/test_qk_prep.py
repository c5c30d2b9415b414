"""Queries and keys made ready in one launch (verispec/kernels/qk_prep.py) against the torch
definition (layers.fused.prepare_qk): per-head norm or none, unit-offset weights, whole and
partial RoPE, several sequences; and a row's bits the same whatever the pass's width, which is
what speculative greedy == plain greedy needs. Runs on CUDA, and on CPU through Triton's
interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import qk_prep
from verispec.models.layers.fused import prepare_qk as reference

pytestmark = pytest.mark.skipif(qk_prep.triton is None, reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(b, t, hq, hkv, d, rot, dtype, seed, positions=None):
    """q, k as the attention layer hands them over (views of one [B, T, (Hq + 2 Hkv) D] projection),
    cos / sin for positions 7.. (or `positions` [B, T]), norm weights."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, t, (hq + 2 * hkv) * d, generator=gen) * 3).to(DEVICE, dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(b, t, hq, d), k.view(b, t, hkv, d)
    if positions is None:
        positions = torch.arange(7, 7 + t).expand(b, t)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = positions[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    qw = (torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype)
    kw = (torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype)
    return q, k, cos, sin, qw, kw


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("norm,unit_offset", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("shape", [(1, 1, 4, 2, 64, 64), (2, 3, 6, 2, 128, 128), (1, 5, 3, 1, 64, 32)])
def test_equals_the_torch_definition(dtype, tol, norm, unit_offset, shape):
    b, t, hq, hkv, d, rot = shape
    q, k, cos, sin, qw, kw = inputs(b, t, hq, hkv, d, rot, dtype, seed=sum(shape))
    weights = (qw, kw) if norm else (None, None)
    got_q, got_k = qk_prep.prepare_qk(q, k, cos, sin, *weights, 1e-6, unit_offset)
    want_q, want_k = reference(q.float(), k.float(), cos.float(), sin.float(),
                               *(w.float() if w is not None else None for w in weights), 1e-6, unit_offset)
    assert got_q.shape == (b, hq, t, d) and got_k.shape == (b, hkv, t, d) and got_q.dtype == dtype
    torch.testing.assert_close(got_q.float(), want_q, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(got_k.float(), want_k, atol=tol * 4, rtol=tol)


def test_a_rows_bits_do_not_depend_on_the_pass():
    """Token j of a 6-token pass, of a 1-token pass, and inside a batch of 3 sequences: same bits."""
    hq, hkv, d = 8, 2, 64
    q, k, cos, sin, qw, kw = inputs(3, 6, hq, hkv, d, d, torch.bfloat16, seed=3,
                                    positions=torch.arange(100, 118).view(3, 6))
    wide_q, wide_k = qk_prep.prepare_qk(q, k, cos, sin, qw, kw, 1e-6, False)
    for b in range(3):
        for j in (0, 4):
            one_q, one_k = qk_prep.prepare_qk(q[b:b + 1, j:j + 1], k[b:b + 1, j:j + 1], cos[b:b + 1, j:j + 1],
                                              sin[b:b + 1, j:j + 1], qw, kw, 1e-6, False)
            assert torch.equal(one_q[0, :, 0], wide_q[b, :, j])
            assert torch.equal(one_k[0, :, 0], wide_k[b, :, j])


def test_broadcast_cos_over_sequences():
    """cos / sin [1, T, rot] (every sequence at the same positions) serve a batch."""
    q, k, cos, sin, qw, kw = inputs(2, 3, 4, 2, 64, 64, torch.float32, seed=5)
    got_q, _ = qk_prep.prepare_qk(q, k, cos[:1], sin[:1], qw, kw, 1e-6, False)
    want_q, _ = reference(q, k, cos[:1], sin[:1], qw, kw, 1e-6, False)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)


def test_reasons():
    q = torch.zeros(1, 1, 2, 64)
    assert "device cpu" in qk_prep.unsupported_reason(q, q, torch.zeros(1, 1, 64))


def test_chunked_queries_as_gated_attention_hands_them():
    """Qwen3.5 splits each head's [q; gate] projection: q is a view with a head stride of 2 D."""
    b, t, h, hkv, d = 1, 3, 4, 2, 64
    gen = torch.Generator().manual_seed(11)
    qg = torch.randn(b, t, h, 2 * d, generator=gen).to(DEVICE)
    q = qg.chunk(2, dim=-1)[0]
    _, k, cos, sin, qw, kw = inputs(b, t, h, hkv, d, 16, torch.float32, seed=2)
    got, _ = qk_prep.prepare_qk(q, k, cos, sin, qw, kw, 1e-6, True)
    want, _ = reference(q, k, cos, sin, qw, kw, 1e-6, True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_writes_keys_and_values_into_the_cache(paged):
    """With cache rows the same launch writes the finished keys and the values where
    kernels/kv_write.py would: the paged pools (a row per token) and the contiguous cache (rows
    shared by the sequences)."""
    from verispec.kernels.kv_write import KVDestination

    b, t, hq, hkv, d = 2, 3, 4, 2, 64
    q, k, cos, sin, qw, kw = inputs(b, t, hq, hkv, d, d, torch.bfloat16, seed=9)
    v = torch.randn(b, t, hkv, d, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    v = v.transpose(1, 2)  # [B, Hkv, T, D] as attention hands it over
    if paged:
        shape, rows = (20, hkv, d), torch.tensor([3, 17, 5, 0, 11, 8], device=DEVICE)
        dest = lambda kc, vc: KVDestination(kc, vc, rows, row_dim=0, batch_dim=None, head_dim=1)  # noqa: E731
    else:
        shape, rows = (b, hkv, 12, d), torch.tensor([4, 5, 6], device=DEVICE)
        dest = lambda kc, vc: KVDestination(kc, vc, rows, row_dim=2, batch_dim=0, head_dim=1)  # noqa: E731
    caches = [torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    got_q, got_k = qk_prep.prepare_qk(q, k, cos, sin, qw, kw, 1e-6, False, v, dest(caches[0], caches[1]))
    want_q, want_k = qk_prep.prepare_qk(q, k, cos, sin, qw, kw, 1e-6, False)
    dest(caches[2], caches[3]).write(want_k, v)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0 and caches[1].abs().sum() > 0
