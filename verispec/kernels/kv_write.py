"""A pass's new keys and values written into the cache in one launch.

torch writes them with two `index_copy_` calls per layer, each a kernel of a few hundred bytes
whose cost is its launch: in a 36-layer decode step that is 72 launches, about 5% of a 4-bit
Qwen3-8B step on the H200. This kernel copies both in one, reading
k and v in whatever strides they come in ([B, Hkv, T, D] views, no reshape copy), and is
capturable (the destination rows come from a device tensor).

Destinations: row r of token (b, t) is `rows[b * T + t]` of a cache whose element (r, b, h, d)
sits at r * stride_row + b * stride_batch + h * stride_head + d: the paged pools ([slots, Hkv, D],
batch stride 0) and the contiguous cache ([B, Hkv, capacity, D], rows = positions) both fit.
An fp8 cache (kernels/kv_fp8.py) takes codes there and each (row, head)'s scale exponent in scale
pools [slots, Hkv]: the kernel encodes as it copies. A tq cache (kernels/kv_turboquant.py) takes
packed codes of the rotated rows and a float32 scale per (row, head), from its own kernel
(`_tq_write_kernel`: its K and V rows differ in length, so their strides do).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.kernels import kv_fp8, kv_turboquant
from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: index_copy_ stands in
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _kv_write_kernel(K, V, KC, VC, KS, VS, ROWS, T, sr_b,
                         sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sc_row, sc_b, sc_h, ss_row,
                         H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         FP8: tl.constexpr = False):
        token = tl.program_id(0)  # b * T + t
        b = token // T
        t = token % T
        row = tl.load(ROWS + b * sr_b + t).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < H) & (d < D)
        dst = row * sc_row + b * sc_b + h * sc_h + d
        k = tl.load(K + b * sk_b + h * sk_h + t * sk_t + d, mask=ok, other=0.0)
        v = tl.load(V + b * sv_b + h * sv_h + t * sv_t + d, mask=ok, other=0.0)
        if FP8:  # scale pools [slots, Hkv]: one exponent per (row, head)
            heads = tl.arange(0, BLOCK_H)
            k, k_exp = kv_fp8.encode(k)
            v, v_exp = kv_fp8.encode(v)
            tl.store(KS + row * ss_row + heads, k_exp, mask=heads < H)
            tl.store(VS + row * ss_row + heads, v_exp, mask=heads < H)
        tl.store(KC + dst, k, mask=ok)
        tl.store(VC + dst, v, mask=ok)

    @triton.jit
    def _tq_write_kernel(K, V, KC, VC, KS, VS, ROWS, SIGNS, KB, VB, T, sr_b, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                         skc_row, skc_h, svc_row, svc_h, ss_row, inv_sqrt_d, H: tl.constexpr, D: tl.constexpr,
                         BLOCK_H: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr):
        """One token's heads into tq pools: each row encoded (`kv_turboquant.encode`), its codes
        packed, its scale into KS / VS [slots, Hkv]."""
        token = tl.program_id(0)  # b * T + t
        b = token // T
        t = token % T
        row = tl.load(ROWS + b * sr_b + t).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        h = heads[:, None]
        d = tl.arange(0, D)[None, :]
        ok = heads < H
        k = tl.load(K + b * sk_b + h * sk_h + t * sk_t + d, mask=ok[:, None], other=0.0)
        v = tl.load(V + b * sv_b + h * sv_h + t * sv_t + d, mask=ok[:, None], other=0.0)
        codes, scales = kv_turboquant.encode_tile(k, SIGNS, KB, inv_sqrt_d, BLOCK_H, D, KBITS)
        kv_turboquant.store_packed(KC + row * skc_row + heads * skc_h, codes, ok, BLOCK_H, D, KBITS)
        tl.store(KS + row * ss_row + heads, scales, mask=ok)
        codes, scales = kv_turboquant.encode_tile(v, SIGNS, VB, inv_sqrt_d, BLOCK_H, D, VBITS)
        kv_turboquant.store_packed(VC + row * svc_row + heads * svc_h, codes, ok, BLOCK_H, D, VBITS)
        tl.store(VS + row * ss_row + heads, scales, mask=ok)


@dataclass(frozen=True)
class KVDestination:
    """Where a pass's new keys and values go in one layer's cache, for a kernel that writes them
    itself (kernels/qk_prep.py): element (row, b, h, d) of k_cache / v_cache sits at row *
    stride_row + b * stride_batch + h * stride_head + d, and token (b, t) goes to row
    rows[b * T + t] ([B * T]) or rows[t] ([T]: every sequence the same rows)."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    rows: torch.Tensor
    row_dim: int
    batch_dim: int | None
    head_dim: int
    # fp8 pools: each (row, head)'s scale exponent, [slots, Hkv] (None: the cache stores values);
    # tq pools: each (row, head)'s float32 scale
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    codec: kv_turboquant.LayerCodec | None = None  # tq pools: the layer's rotation and codebooks

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None and self.codec is None

    @property
    def tq(self) -> bool:
        return self.codec is not None

    @property
    def stride_row(self) -> int:
        return self.k_cache.stride(self.row_dim)

    @property
    def stride_batch(self) -> int:
        return 0 if self.batch_dim is None else self.k_cache.stride(self.batch_dim)

    @property
    def stride_head(self) -> int:
        return self.k_cache.stride(self.head_dim)

    def rows_batch_stride(self, b: int, t: int) -> int:
        """How far apart two sequences' rows sit in `rows` for a pass of b x t tokens: t with a row
        per token of several sequences, 0 when the sequences share rows (or there is one)."""
        return t if self.rows.numel() == b * t and b > 1 else 0

    def check(self, v: torch.Tensor | None, b: int, t: int) -> None:
        """A pass of b x t tokens with values v can be written here (ValueError naming what not)."""
        if v is None:
            raise ValueError("a cache destination needs the values too")
        alike = self.tq or self.k_cache.stride() == self.v_cache.stride()  # tq: K and V rows differ in length
        if self.k_cache.stride(-1) != 1 or not alike or v.stride(-1) != 1:
            raise ValueError("KVDestination: the head dimension must be contiguous and both caches laid out alike")
        if self.rows.numel() not in (b * t, t) or self.rows.stride(-1) != 1:
            raise ValueError(f"KVDestination: {self.rows.numel()} rows for {b} x {t} tokens")
        if self.fp8 and (self.batch_dim is not None or self.k_scale.stride() != (self.k_scale.shape[1], 1)
                         or self.v_scale.stride() != self.k_scale.stride()):
            raise ValueError("KVDestination: fp8 scales need paged pools and contiguous [slots, Hkv] scale pools")
        if self.tq and (self.batch_dim is not None or self.k_scale.stride() != (self.k_scale.shape[1], 1)
                        or self.v_scale.stride() != self.k_scale.stride()):
            raise ValueError("KVDestination: tq codes need paged pools and contiguous [slots, Hkv] scale pools")

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, Hkv, T, D] written here (write_kv; index_copy_ off CUDA)."""
        if available(k.device):
            write_kv(k, v, self.k_cache, self.v_cache, self.rows, self.row_dim, self.batch_dim, self.head_dim,
                     self.k_scale, self.v_scale, self.codec)
            return
        b, h, t, d = k.shape
        if self.tq:  # paged pools: packed codes and scales, encoded as the kernel encodes
            codec = self.codec
            for x, cache, scales, code in ((k, self.k_cache, self.k_scale, codec.key),
                                           (v, self.v_cache, self.v_scale, codec.value)):
                packed, row_scales = kv_turboquant.encode_rows(x.transpose(1, 2).reshape(b * t, h, d), codec.signs,
                                                               code, codec.inv_sqrt_d)
                cache.index_copy_(0, self.rows, packed)
                scales.index_copy_(0, self.rows, row_scales)
            return
        if self.fp8:  # paged pools: codes and scale exponents, encoded as the kernel encodes
            for x, cache, scales in ((k, self.k_cache, self.k_scale), (v, self.v_cache, self.v_scale)):
                codes, exponents = kv_fp8.encode_reference(x.transpose(1, 2).reshape(b * t, h, d))
                # as bytes: torch's CPU index_copy_ has no float8 kernel
                cache.view(torch.uint8).index_copy_(0, self.rows, codes.view(torch.uint8))
                scales.index_copy_(0, self.rows, exponents)
            return
        if self.batch_dim is None:  # pools [slots, Hkv, D]
            self.k_cache.index_copy_(self.row_dim, self.rows, k.transpose(1, 2).reshape(b * t, h, d))
            self.v_cache.index_copy_(self.row_dim, self.rows, v.transpose(1, 2).reshape(b * t, h, d))
        else:
            self.k_cache.index_copy_(self.row_dim, self.rows, k)
            self.v_cache.index_copy_(self.row_dim, self.rows, v)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
             row_dim: int, batch_dim: int | None, head_dim: int, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, codec: kv_turboquant.LayerCodec | None = None) -> None:
    """k, v [B, Hkv, T, D] (any strides, last dim contiguous) into k_cache / v_cache (same shape
    and strides) along `row_dim` at rows [B * T] (one row per token) or [T] (every sequence the
    same rows); `batch_dim` is the caches' batch dimension (None: no batch dimension, as in the
    paged pools), `head_dim` their head dimension; k_scale / v_scale: an fp8 cache's scale pools, or
    with `codec` a tq cache's (kernels/kv_turboquant.py)."""
    b, h, t, d = k.shape
    dest = KVDestination(k_cache, v_cache, rows, row_dim, batch_dim, head_dim, k_scale, v_scale, codec)
    if k.stride(-1) != 1:
        raise ValueError("kv_write.write_kv: the head dimension must be contiguous and both caches laid out alike")
    dest.check(v, b, t)
    if dest.tq:
        _tq_write_kernel[(b * t,)](
            k, v, k_cache, v_cache, k_scale, v_scale, rows, codec.signs, codec.key.bounds, codec.value.bounds, t,
            dest.rows_batch_stride(b, t), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), k_scale.stride(0),
            codec.inv_sqrt_d, H=h, D=d, BLOCK_H=triton.next_power_of_2(h), KBITS=codec.key.bits,
            VBITS=codec.value.bits, num_warps=4)
        return
    _kv_write_kernel[(b * t,)](
        k, v, k_cache, v_cache, k_scale if dest.fp8 else k_cache, v_scale if dest.fp8 else v_cache, rows, t,
        dest.rows_batch_stride(b, t),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        dest.stride_row, dest.stride_batch, dest.stride_head, h,
        H=h, D=d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d), FP8=dest.fp8, num_warps=2)
