"""Multi-head attention with GQA over the KV cache, and the masks it needs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.cache.kv import KVCache


def attention_mask(positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor | None:
    """Boolean mask [B, 1, T, S] (True = attend) for queries at `positions` [B, T].

    Key s sits at position s (one cache row per position). Returns None when every query may
    see every key (a single decode token without a window), so SDPA takes its fast path.
    """
    t = positions.shape[1]
    if t == 1 and (window is None or num_keys <= window):
        return None
    key_pos = torch.arange(num_keys, device=positions.device)
    q = positions[:, :, None]
    allowed = key_pos[None, None, :] <= q
    if window is not None:
        allowed &= key_pos[None, None, :] > q - window
    return allowed[:, None]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] (new rows) -> out [B, Hq, T, D]."""
    k_all, v_all = cache.append(layer, k, v)
    gqa = q.shape[1] != k_all.shape[1]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=gqa)
