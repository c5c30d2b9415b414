"""The target's side of drafter training: one forward over a batch of windows (no gradients),
giving the drafter's inputs (captured residual streams, final hidden) and labels (logits)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.models.base import CausalLM


@dataclass
class TargetBatch:
    token_ids: torch.Tensor  # [B, T]
    aux: list[torch.Tensor]  # residual streams entering the captured layers, each [B, T, H_t]
    hidden: torch.Tensor  # [B, T, H] after the final norm
    pre_norm: torch.Tensor | None  # [B, T, H] before it
    logits: torch.Tensor  # [B, T, V'] float32: the full vocabulary, or the draft vocabulary's columns
    argmax: torch.Tensor  # [B, T] the target's greedy choice over its real (unpadded) vocabulary


@torch.no_grad()
def target_batch(model: CausalLM, token_ids: torch.Tensor, capture: tuple[int, ...], num_real_tokens: int,
                 vocab_ids: torch.Tensor | None = None) -> TargetBatch:
    """token_ids [B, T] on the model's device. `vocab_ids` [Vd]: keep only those logit columns."""
    b, t = token_ids.shape
    cache = model.make_cache(t, batch_size=b)
    positions = torch.arange(t, device=token_ids.device)[None].expand(b, -1)
    out = model(token_ids, positions, cache, capture)
    logits, argmax = [], []
    for row in range(b):  # one row at a time: full-vocabulary logits of a large model are big
        full = model.logits(out.hidden[row]).float()
        full[:, num_real_tokens:] = float("-inf")
        argmax.append(full.argmax(-1))
        logits.append(full if vocab_ids is None else full[:, vocab_ids])
    return TargetBatch(token_ids, out.aux, out.hidden, out.pre_norm, torch.stack(logits), torch.stack(argmax))
