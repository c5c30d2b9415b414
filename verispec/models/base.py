"""What every verispec model provides, and the weight-loading shared by all of them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from verispec.cache.kv import KVCache, LayerCacheSpec


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [B, T, H] final-norm hidden states
    aux: list[torch.Tensor]  # residual streams entering the captured layers, each [B, T, H]
    pre_norm: torch.Tensor | None = None  # [B, T, H] the residual stream before the final norm


class CausalLM(nn.Module):
    """Model interface: forward(input_ids, positions, cache, capture) and logits(hidden).

    Subclasses name their submodules as the Hugging Face checkpoint does, so the checkpoint's
    tensor names are the state-dict names (after `checkpoint_prefix_map`).
    """

    config: dict
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    # checkpoint name prefix -> our module prefix, for wrappers (e.g. model.language_model.*)
    checkpoint_prefix_map: dict[str, str] = {}
    # checkpoint name prefixes to ignore silently (e.g. vision towers); logged once under debug
    ignored_prefixes: tuple[str, ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                capture: tuple[int, ...] = ()) -> ForwardOutput:
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        raise NotImplementedError

    def cache_specs(self) -> list[LayerCacheSpec]:
        raise NotImplementedError

    def make_cache(self, capacity: int, batch_size: int = 1) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.cache_specs(), capacity, p.dtype, p.device, batch_size)

    def input_embeddings(self) -> nn.Module:
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Point tied parameters at each other after loading."""

    def fuse_small_ops(self, compile: bool = True) -> None:
        """The CUDA fast path: every submodule that can merges its projections into single GEMMs
        (`merge_projections()`, weights released) and, with compile=True, switches its small ops
        (norms, RoPE, residual adds, activations) to compiled single kernels (`fuse()`; the model
        itself may define one too). Idempotent."""
        for module in list(self.modules()):
            if hasattr(module, "merge_projections"):
                module.merge_projections()
            if compile and hasattr(module, "fuse"):
                module.fuse()
