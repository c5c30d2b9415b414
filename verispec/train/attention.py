"""Attention for the multi-step ("test-time training") unroll of a drafter, as EAGLE-3 trains it.

At inference a drafter's cache holds one row per committed position p (built from the target's
features), and the j-th chained draft after position p is a new row at position p + j that
attends those committed rows 0..p and the earlier draft rows of its own chain. Training computes
all positions at once: unroll step j makes row p (input token t[p+j+1], the drafter's own
hidden from step j-1, position p + j); its queries see step 0's keys at rows <= p and, for every
step 1..j, the key of the same row p — exactly the rows the chained draft sees at inference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def unroll_mask(num_rows: int, step: int, device: torch.device) -> torch.Tensor:
    """Bool [num_rows, (step + 1) * num_rows] (True = attend): causal over step 0's keys,
    the diagonal over each later step's."""
    causal = torch.ones(num_rows, num_rows, dtype=torch.bool, device=device).tril()
    blocks = [causal] + [torch.eye(num_rows, dtype=torch.bool, device=device)] * step
    return torch.cat(blocks, dim=1)


def unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
                       ) -> torch.Tensor:
    """q [B, Hq, T, D]; keys/values: one [B, Hkv, T, D] per unroll step so far (this step's last)
    -> out [B, Hq, T, D]."""
    step = len(keys) - 1
    mask = unroll_mask(q.shape[2], step, q.device)
    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def distill_loss(logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The drafter's loss against the target, float32, mean over valid rows: half the soft
    cross-entropy -sum p_target * log q (matching the distribution sampling verifies against),
    half the cross-entropy of the target's argmax (what greedy verification accepts; the only
    clear signal when the target's distribution is flat). logits, target_logits [B, T, V];
    valid [B, T] bool. Columns where the target's logit is -inf (padding) are never the argmax."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    p = torch.softmax(target_logits.float(), dim=-1)
    soft = -(p * log_q).sum(-1)
    hard = -log_q.gather(-1, target_logits.argmax(-1, keepdim=True))[..., 0]
    per_row = 0.5 * (soft + hard)
    return (per_row * valid).sum() / valid.sum().clamp(min=1)
