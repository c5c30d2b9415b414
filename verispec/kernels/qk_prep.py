"""Queries and keys made ready for attention in one launch: the optional per-head RMSNorm (Qwen3,
Gemma), RoPE (whole or partial), heads moved first.

Why a kernel of our own: torch.compile fused `layers.fused.prepare_qk` into two kernels a layer
(queries, keys), and compiled a separate specialisation for one-token passes. The two forms
summed a head's squares in different orders, so a plain decode step and a verify pass normed the
same row to different bits; on Qwen3 (which norms q and k per head) speculative greedy then left
plain greedy after some tens of tokens (scripts/gpu_identity_trace.py found the first differing
bits in a layer's attention output). Here one program takes one token's heads, with a layout
that depends only on the model's head counts and head dim: a row's result does not depend on how
many tokens or sequences share the pass, and prefill, decode and verify passes all run it.

Numerics: statistics in float32, the normed value rounded to the activations' dtype before the
weight is applied (as `layers.fused.rms_norm`), RoPE computed in float32 and rounded once.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch functions stand in
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _norm_rope_heads(X, W, COS, SIN, OUT, x_row, stride_xh, cs_row, out_row, stride_oh, eps,
                         H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
                         UNIT_OFFSET: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """One token's H heads [H, D] at X + x_row (head stride stride_xh) -> OUT + out_row (head
        stride stride_oh): RMSNorm per head (if HAS_NORM), then RoPE on the first ROT dims."""
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < H) & (d < D)
        half: tl.constexpr = ROT // 2
        # the rotate-half partner of each rotated dim: d + half in the first half, d - half in the second
        partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
        x = tl.load(X + x_row + h * stride_xh + d, mask=ok, other=0.0)
        xp = tl.load(X + x_row + h * stride_xh + partner, mask=ok, other=0.0)
        dtype = x.dtype
        if HAS_NORM:
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [BLOCK_H]
            w = tl.load(W + d, mask=d < D, other=0.0).to(tl.float32)
            wp = tl.load(W + partner, mask=d < D, other=0.0).to(tl.float32)
            if UNIT_OFFSET:
                y = (xf * rstd[:, None] * (1.0 + w)).to(dtype)
                yp = (xp.to(tl.float32) * rstd[:, None] * (1.0 + wp)).to(dtype)
            else:
                y = (w * (xf * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
                yp = (wp * (xp.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
        else:
            y, yp = x, xp
        cos = tl.load(COS + cs_row + d, mask=d < ROT, other=1.0).to(tl.float32)
        sin = tl.load(SIN + cs_row + d, mask=d < ROT, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        rotated = (y.to(tl.float32) * cos + sign * yp.to(tl.float32) * sin).to(dtype)
        out = tl.where(d < ROT, rotated, y)
        tl.store(OUT + out_row + h * stride_oh + d, out, mask=ok)

    # the pass's token count and the strides that follow it vary call to call: specialising on
    # them would compile again inside requests and change nothing but the addressing
    @triton.jit(do_not_specialize=["T", "sq_b", "sk_b", "sc_b", "sc_t"])
    def _qk_prep_kernel(Q, K, QW, KW, COS, SIN, QO, KO, T,
                        sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sc_b, sc_t, eps,
                        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                        HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                        BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0)  # b * T + t
        b = token // T
        t = token % T
        cs_row = b.to(tl.int64) * sc_b + t * sc_t
        # outputs [B, H, T, D] contiguous: head stride T * D
        _norm_rope_heads(Q, QW, COS, SIN, QO, b.to(tl.int64) * sq_b + t * sq_t, sq_h, cs_row,
                         (b.to(tl.int64) * HQ * T + t) * D, T * D, eps,
                         HQ, D, ROT, HAS_NORM, UNIT_OFFSET, BLOCK_HQ, BLOCK_D)
        _norm_rope_heads(K, KW, COS, SIN, KO, b.to(tl.int64) * sk_b + t * sk_t, sk_h, cs_row,
                         (b.to(tl.int64) * HKV * T + t) * D, T * D, eps,
                         HKV, D, ROT, HAS_NORM, UNIT_OFFSET, BLOCK_HKV, BLOCK_D)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> str | None:
    """Why `prepare_qk` cannot take these inputs (None: it can)."""
    if triton is None:
        return "Triton is not installed"
    if q.device.type != "cuda":
        return f"device {q.device.type}"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q.dtype}"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1:
        return "a head dimension that is not contiguous"
    if cos.shape[-1] % 2 or cos.shape[-1] > q.shape[-1]:
        return f"a rotary dimension of {cos.shape[-1]} for heads of {q.shape[-1]}"
    return None


def prepare_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
               unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What `layers.fused.prepare_qk` computes, in one launch: q [B, T, Hq, D], k [B, T, Hkv, D]
    (any strides, head dim contiguous), cos / sin [B, T, rot] (rot <= D: partial RoPE on the
    first rot dims), per-head norm weights [D] (both or neither) -> q [B, Hq, T, D], k [B, Hkv,
    T, D], contiguous."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qo = torch.empty((b, hq, t, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((b, hkv, t, d), dtype=k.dtype, device=k.device)
    if b * t == 0:
        return qo, ko
    has_norm = q_weight is not None
    cos = cos.expand(b, t, cos.shape[-1])
    sin = sin.expand(b, t, sin.shape[-1])
    if sin.stride() != cos.stride():
        sin = sin.contiguous()
        cos = cos.contiguous()
    _qk_prep_kernel[(b * t,)](
        q, k, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin, qo, ko, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1), eps,
        HQ=hq, HKV=hkv, D=d, ROT=cos.shape[-1], HAS_NORM=has_norm, UNIT_OFFSET=unit_offset,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d), num_warps=4)
    return qo, ko
