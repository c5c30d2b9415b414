"""The sparse MoE MLP of the Qwen MoE families, as transformers' Qwen3MoeSparseMoeBlock and
Qwen3_5MoeSparseMoeBlock compute it, with their checkpoint names:

    weights, experts = top-k of softmax(gate(x))          (float32; renormalised to sum 1 if asked)
    y = sum_k weights_k * expert_k(x)                       (FusedExperts: act(gate) * up, then down)
    with a shared expert: y = y + sigmoid(shared_expert_gate(x)) * shared_expert(x)

The routing weights are cast back to the activations' dtype before they scale the experts, as
transformers does (in bfloat16 that rounding is part of the result).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import UnsupportedModelError
from verispec.kernels import expert_gemv
from verispec.models.layers.mlp import GatedMLP
from verispec.models.layers.moe import FusedExperts

# mlx-lm names these families' expert stacks `mlp.switch_mlp.*` (Gemma 4's: `experts.switch_glu.*`);
# a model lists this in `checkpoint_renames` so MLX conversions load into its FusedExperts' place.
MLX_SWITCH_MLP_RENAMES = ((".mlp.switch_mlp.", ".mlp.experts.switch_glu."),)


@dataclass(frozen=True)
class MoeSettings:
    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    renormalize: bool  # the top-k weights divided by their sum (`norm_topk_prob`)
    shared_intermediate_size: int = 0  # 0: no shared expert

    @classmethod
    def from_config(cls, c: dict, family: str, defaults: dict, renormalize: bool | None = None,
                    shared: bool = False) -> "MoeSettings":
        """The MoE fields of a config (`defaults`: transformers' config defaults for `family`).
        transformers 5 saves Qwen3-MoE's expert count as `num_local_experts`, the releases as `num_experts`."""
        def field(*names):
            for name in names:
                if c.get(name) is not None:
                    return c[name]
            return defaults[names[0]]

        s = cls(num_experts=int(field("num_experts", "num_local_experts")),
                top_k=int(field("num_experts_per_tok")),
                intermediate_size=int(field("moe_intermediate_size")),
                renormalize=bool(field("norm_topk_prob")) if renormalize is None else renormalize,
                shared_intermediate_size=int(field("shared_expert_intermediate_size")) if shared else 0)
        if not 0 < s.top_k <= s.num_experts:
            raise UnsupportedModelError(f"{family}: num_experts_per_tok {s.top_k} must be in 1..num_experts "
                                        f"({s.num_experts})")
        return s

    def block(self, hidden_size: int, act: str) -> "SparseMoeBlock":
        return SparseMoeBlock(hidden_size, self, act)


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, K] in the logits' dtype, expert ids [N, K]). The softmax
    runs in float32 (float64 stays), over all E experts, before the top-k; on CUDA in one kernel."""
    if expert_gemv.available(logits.device) and logits.dtype != torch.float64:
        return expert_gemv.softmax_top_k(logits, top_k, renormalize)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    weights, index = torch.topk(F.softmax(logits, dim=-1, dtype=dtype), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), index


class SparseMoeBlock(nn.Module):
    """`mlp` of a sparse layer: router `gate`, routed `experts`, optional `shared_expert` + gate."""

    def __init__(self, hidden_size: int, s: MoeSettings, act: str = "silu"):
        super().__init__()
        self.top_k, self.renormalize = s.top_k, s.renormalize
        self.gate = nn.Linear(hidden_size, s.num_experts, bias=False)
        self.experts = FusedExperts(s.num_experts, hidden_size, s.intermediate_size, act)
        if s.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, s.shared_intermediate_size, act)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, K], expert ids [N, K])."""
        return softmax_top_k(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H]
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.route(flat)
        out = self.experts(flat, index, weights).view(x.shape)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
