"""The target's embedding table and output head, whole, for a drafter on rank 0 of a
tensor-parallel group. The target's own are split by vocabulary rows over the ranks, so a lookup
or a projection there is a collective every rank must join; a drafter runs on rank 0 alone, so it
reads these copies instead (loaded by `loading.model_loader.load_whole_tables`)."""
from __future__ import annotations

import torch
from torch import nn

from verispec.models.base import CausalLM, HFLayoutLM


class WholeTables(HFLayoutLM):
    """`model.embed_tokens` and `lm_head` at the target's full vocabulary, under its checkpoint
    names, so that the loader and the quantized layers treat them as the target's."""

    def __init__(self, target: CausalLM):
        super().__init__()
        self.settings = target.settings  # hidden_size and tie_word_embeddings, which sharding keeps
        self.config = target.config
        self.checkpoint_prefix_map = target.checkpoint_prefix_map
        self.vocab_size = target.vocab_size
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(target.vocab_size, target.hidden_size)
        self.lm_head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        # a plain projection: the MTP head's Qwen3.5 target has no logit softcapping
        return self.lm_head(hidden)
