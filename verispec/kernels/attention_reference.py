"""The plain-torch definitions of decode/verify attention that kernels/decode_attention.py's
kernels are tested against, and that CPUs run: a contiguous cache and a paged pool (fp8 or tq
codes decoded first)."""
from __future__ import annotations

import torch

from verispec.kernels import kv_fp8, kv_turboquant


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               positions: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q [B, Hq, T, D]; caches [B, Hkv, capacity, D]; positions [B, T] -> out [B, Hq, T, D].

    Query t attends key j when j <= positions[t] and (no window or j > positions[t] - window).
    """
    b, hq, t, d = q.shape
    hkv = k_cache.shape[1]
    num_keys = int(positions.max()) + 1
    compute = torch.promote_types(q.dtype, torch.float32)  # float32 at least, float64 stays
    k = k_cache[:, :, :num_keys].to(compute).repeat_interleave(hq // hkv, dim=1)
    v = v_cache[:, :, :num_keys].to(compute).repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("bhtd,bhnd->bhtn", q.to(compute), k) * scale
    key_pos = torch.arange(num_keys, device=q.device)
    allowed = key_pos[None, None, :] <= positions[:, :, None]
    if window is not None:
        allowed &= key_pos[None, None, :] > positions[:, :, None] - window
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhtn,bhnd->bhtd", scores.softmax(-1), v).to(q.dtype)


def paged_decode_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                     block_tables: torch.Tensor, block_size: int, positions: torch.Tensor,
                                     scale: float, window: int | None = None, k_scale: torch.Tensor | None = None,
                                     v_scale: torch.Tensor | None = None,
                                     codec: kv_turboquant.LayerCodec | None = None) -> torch.Tensor:
    """q [B, Hq, T, D]; pools [slots, Hkv, D]; block_tables [B, N]: key j of row b is pool row
    block_tables[b, j // block_size] * block_size + j % block_size. Otherwise as the contiguous one.
    k_scale / v_scale [slots, Hkv]: the pools hold fp8 codes, decoded to q's dtype (kernels/kv_fp8.py),
    or with `codec` tq codes, decoded in the layer's rotated basis: q must come rotated and the
    result is rotated too (kernels/kv_turboquant.py `LayerCodec.rotate` / `unrotate`)."""
    num_keys = int(positions.max()) + 1
    j = torch.arange(num_keys, device=q.device)
    column = torch.clamp(j // block_size, max=block_tables.shape[1] - 1)
    rows = block_tables[:, column] * block_size + j % block_size  # [B, num_keys]
    # keys past a row's last position belong to other sequences (or nothing): zeros, never read
    owned = (j[None, :] <= positions[:, -1:])[:, :, None, None]
    k, v = k_pool[rows], v_pool[rows]
    if codec is not None:
        k = kv_turboquant.decode_rows(k, k_scale[rows], codec.key, q.dtype)
        v = kv_turboquant.decode_rows(v, v_scale[rows], codec.value, q.dtype)
    elif k_scale is not None:
        k = kv_fp8.decode_reference(k, k_scale[rows], q.dtype)
        v = kv_fp8.decode_reference(v, v_scale[rows], q.dtype)
    k = torch.where(owned, k, 0).transpose(1, 2)
    v = torch.where(owned, v, 0).transpose(1, 2)
    return decode_attention_reference(q, k, v, positions, scale, window)
