"""What every verispec model provides, and the weight-loading shared by all of them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from verispec.cache.kv import KVCache, LayerCacheSpec
from verispec.models.layers.attention import AttentionInputs
from verispec.models.layers.fused import add_rms_norm, fast_add_rms_norm


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [B, T, H] final-norm hidden states
    aux: list[torch.Tensor]  # residual streams entering the captured layers, each [B, T, H]
    pre_norm: torch.Tensor | None = None  # [B, T, H] the residual stream before the final norm


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint name with a model's `checkpoint_renames` applied (or their inverse, swapped)."""
    for src, dst in renames:
        if src in name:
            name = name.replace(src, dst)
    return name


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
    # (checkpoint infix, ours) substitutions after the prefix map (loading/parts.py)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # checkpoint name prefixes to ignore silently (e.g. vision towers); logged once under debug
    ignored_prefixes: tuple[str, ...] = ()

    def checkpoint_tensor(self, ckpt_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (by the checkpoint's name) as our parameter holds it: formats that
        store a weight in another convention (mlx-lm's Qwen3.5 norms, say) convert it here."""
        return tensor

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
        """The CUDA fast path (see the module function); the model itself may define `fuse()`."""
        fuse_small_ops(self, compile)


class HFLayoutLM(CausalLM):
    """A model laid out as Hugging Face's decoder-only families: `model.embed_tokens`, `lm_head`,
    `settings` (hidden_size, tie_word_embeddings)."""

    @property
    def hidden_size(self) -> int:
        return self.settings.hidden_size

    def input_embeddings(self) -> nn.Embedding:
        """The raw table (Gemma's sqrt(H) scale is not in it: EAGLE3 drafters sharing it embed unscaled)."""
        return self.model.embed_tokens

    def tie_weights(self) -> None:
        if self.settings.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class FoldedDecoderLM(HFLayoutLM):
    """An HF-layout model (also `model.layers`, `model.norm`, `rotary`) whose layers fold each
    residual add into the next norm: layer(x, update, cos, sin, inputs) -> (x, its MLP output
    not yet added). Llama/Qwen3 and Qwen3.5 share this forward."""

    final_add_norm = staticmethod(add_rms_norm)  # fuse() swaps in the kernel (fast_add_rms_norm)
    # runs a range of layers in one call where a kernel can (set at load: quant/layer_stack.py):
    # takes(inputs) -> bool; (x, update, cos, sin, inputs, start, stop) -> (x, update), as the layers
    layer_stack = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                capture: tuple[int, ...] = ()) -> ForwardOutput:
        """input_ids, positions: [B, T]; returns final hidden [B, T, H] and captured streams."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        inputs = AttentionInputs(positions, cache)
        stack = self.layer_stack if self.layer_stack is not None and self.layer_stack.takes(inputs) else None
        layers = self.model.layers
        captured: dict[int, torch.Tensor] = {}
        update = None
        bounds = sorted({0, len(layers), *(i for i in capture if 0 < i < len(layers))})
        for start, stop in zip(bounds, bounds[1:]):  # the captured layers' inputs between the ranges
            if start in capture:
                captured[start] = x if update is None else x + update
            if stack is not None:
                x, update = stack(x, update, cos, sin, inputs, start, stop)
            else:
                for layer in layers[start:stop]:
                    x, update = layer(x, update, cos, sin, inputs)
        norm = self.model.norm
        x, hidden = self.final_add_norm(x, update, norm.weight, norm.eps, norm.unit_offset)
        return ForwardOutput(hidden, [captured[i] for i in capture], pre_norm=x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def fuse(self) -> None:  # fuse_small_ops() calls it
        self.final_add_norm = fast_add_rms_norm


def fuse_small_ops(root: nn.Module, compile: bool = True) -> None:
    """Every module under `root` (itself included) that can merges its projections into single
    GEMMs (`merge_projections()`, weights released) and, with compile=True, switches its small ops
    (norms, RoPE, residual adds, activations) to compiled single kernels (`fuse()`). Idempotent.
    Used for targets and for drafters alike."""
    # only the modules that merge or fuse: a list of every module held each merged-away projection
    # until the end, its weights beside the merged copy (a CPU load's peak)
    for module in [m for m in root.modules() if hasattr(m, "merge_projections") or hasattr(m, "fuse")]:
        if hasattr(module, "merge_projections"):
            module.merge_projections()
        if compile and hasattr(module, "fuse"):
            module.fuse()
