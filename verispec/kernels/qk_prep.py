"""Queries and keys made ready for attention in one launch: the optional per-head RMSNorm (Qwen3,
Gemma), RoPE (whole or partial), heads moved first.

Why a kernel of our own: torch.compile fused `layers.fused.prepare_qk` into two kernels a layer
(queries, keys), and compiled a separate specialisation for one-token passes. The two forms
summed a head's squares in different orders, so a plain decode step and a verify pass normed the
same row to different bits; on Qwen3 (which norms q and k per head) speculative greedy then left
plain greedy after some tens of tokens (a layer-by-layer trace found the first differing
bits in a layer's attention output). Here one program takes one token's heads, with a layout
that depends only on the model's head counts and head dim: a row's result does not depend on how
many tokens or sequences share the pass, and prefill, decode and verify passes all run it.

Numerics: statistics in float32, the normed value rounded to the activations' dtype before the
weight is applied (as `layers.fused.rms_norm`), RoPE computed in float32 and rounded once.
"""
from __future__ import annotations

import torch

from verispec.kernels import kv_fp8, launch
from verispec.kernels.kv_write import KVDestination
from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs: the torch functions stand in
    triton = None
    tl = None


if triton is not None:

    # the pass's token count and the strides that follow it vary call to call: specialising on
    # them would compile again inside requests and change nothing but the addressing
    @triton.jit(do_not_specialize=["T", "sq_b", "sk_b", "sv_b", "sc_b", "sc_t", "sr_b"])
    def _qk_prep_kernel(Q, K, V, QW, KW, COS, SIN, QO, KO, KC, VC, KS, VS, ROWS, T,
                        sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sc_b, sc_t,
                        sr_b, sd_row, sd_b, sd_h, ss_row, eps,
                        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                        HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, WRITE_KV: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
                        FP8: tl.constexpr = False):
        """Program (token, head): a query head (head < HQ), a key head (HQ <= head < HQ + HKV) or,
        with WRITE_KV, a value head copied into the cache (the rest)."""
        token = tl.program_id(0)  # b * T + t
        head = tl.program_id(1)
        if PDL:  # q, k and v were written by the kernel before this one
            gdc_wait()
        if EARLY:
            gdc_launch_dependents()
        b = (token // T).to(tl.int64)
        t = token % T
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        dst = b * 0
        row = b * 0
        if WRITE_KV:
            row = tl.load(ROWS + b * sr_b + t).to(tl.int64)
            dst = row * sd_row + b * sd_b
        if head >= HQ + HKV:  # only launched with WRITE_KV
            h = head - HQ - HKV
            v = tl.load(V + b * sv_b + t * sv_t + h * sv_h + d, mask=ok, other=0.0)
            _store_row(VC + dst + h * sd_h, VS + row * ss_row + h, v, d, ok, FP8, BLOCK_D)
        else:
            if head < HQ:
                h = head
                src = Q + b * sq_b + t * sq_t + h * sq_h
                weight = QW
                out = QO + ((b * HQ + h) * T + t) * D  # [B, HQ, T, D] contiguous
            else:
                h = head - HQ
                src = K + b * sk_b + t * sk_t + h * sk_h
                weight = KW
                out = KO + ((b * HKV + h) * T + t) * D
            half: tl.constexpr = ROT // 2
            # the rotate-half partner of each rotated dim: d + half in the first half, d - half in the second
            partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
            x = tl.load(src + d, mask=ok, other=0.0)
            xp = tl.load(src + partner, mask=ok, other=0.0)
            dtype = x.dtype
            if HAS_NORM:
                xf = x.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
                w = tl.load(weight + d, mask=ok, other=0.0).to(tl.float32)
                wp = tl.load(weight + partner, mask=ok, other=0.0).to(tl.float32)
                if UNIT_OFFSET:
                    y = (xf * rstd * (1.0 + w)).to(dtype)
                    yp = (xp.to(tl.float32) * rstd * (1.0 + wp)).to(dtype)
                else:
                    y = (w * (xf * rstd).to(dtype).to(tl.float32)).to(dtype)
                    yp = (wp * (xp.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype)
            else:
                y, yp = x, xp
            cos = tl.load(COS + b * sc_b + t * sc_t + d, mask=d < ROT, other=1.0).to(tl.float32)
            sin = tl.load(SIN + b * sc_b + t * sc_t + d, mask=d < ROT, other=0.0).to(tl.float32)
            sign = tl.where(d < half, -1.0, 1.0)
            rotated = (y.to(tl.float32) * cos + sign * yp.to(tl.float32) * sin).to(dtype)
            result = tl.where(d < ROT, rotated, y)
            tl.store(out + d, result, mask=ok)
            if WRITE_KV:
                if head >= HQ:
                    _store_row(KC + dst + h * sd_h, KS + row * ss_row + h, result, d, ok, FP8, BLOCK_D)

    @triton.jit
    def _store_row(dst, scale_dst, x, d, ok, FP8: tl.constexpr, BLOCK_D: tl.constexpr):
        """One head's row x [BLOCK_D] into the cache: as it is, or (FP8) as codes and a scale exponent."""
        if FP8:
            codes, exponent = kv_fp8.encode(tl.where(ok, x, 0.0)[None, :])
            tl.store(dst + d, tl.reshape(codes, (BLOCK_D,)), mask=ok)
            tl.store(scale_dst + tl.arange(0, 1), exponent)
        else:
            tl.store(dst + d, x, mask=ok)


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
               unit_offset: bool, v: torch.Tensor | None = None,
               cache_rows: KVDestination | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What `layers.fused.prepare_qk` computes, in one launch: q [B, T, Hq, D], k [B, T, Hkv, D]
    (any strides, head dim contiguous), cos / sin [B, T, rot] (rot <= D: partial RoPE on the
    first rot dims), per-head norm weights [D] (both or neither) -> q [B, Hq, T, D], k [B, Hkv,
    T, D], contiguous. With `cache_rows` (and v [B, Hkv, T, D], any strides) the finished keys
    and the values are also written into the cache there, in the same launch (what
    kernels/kv_write.py would do next; an fp8 destination gets codes and scales, a tq one is written
    by kv_write after this launch)."""
    if cache_rows is not None and cache_rows.tq:
        # tq rows are encoded a token's heads at a time by kv_write's kernel: a second launch here
        qo, ko = prepare_qk(q, k, cos, sin, q_weight, k_weight, eps, unit_offset)
        cache_rows.write(ko, v)
        return qo, ko
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
    write = cache_rows is not None
    if write:
        cache_rows.check(v, b, t)
        kc, vc, rows = cache_rows.k_cache, cache_rows.v_cache, cache_rows.rows
        sr_b = cache_rows.rows_batch_stride(b, t)
        sd = (cache_rows.stride_row, cache_rows.stride_batch, cache_rows.stride_head)
        sv = (v.stride(0), v.stride(2), v.stride(1))  # v is [B, Hkv, T, D]: (b, t, h) strides
    else:
        kc, vc, rows, v, sr_b, sd, sv = qo, qo, qo, q, 0, (0, 0, 0), (0, 0, 0)
    fp8 = write and cache_rows.fp8
    ks, vs = (cache_rows.k_scale, cache_rows.v_scale) if fp8 else (kc, vc)
    pdl, early = launch.small_kernel_pdl(q.device)
    _qk_prep_kernel[(b * t, hq + hkv * (2 if write else 1))](
        q, k, v, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin, qo, ko, kc, vc, ks, vs, rows, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), *sv,
        cos.stride(0), cos.stride(1), sr_b, *sd, hkv if fp8 else 0, eps,
        HQ=hq, HKV=hkv, D=d, ROT=cos.shape[-1], HAS_NORM=has_norm, UNIT_OFFSET=unit_offset, WRITE_KV=write,
        BLOCK_D=triton.next_power_of_2(d), PDL=pdl, EARLY=early, FP8=fp8, num_warps=1, launch_pdl=pdl)
    return qo, ko
