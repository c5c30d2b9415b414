"""Routed experts stored as fused 3-D tensors (transformers' layout for Gemma 4, Qwen3-MoE, ...):
`gate_up_proj` [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and `down_proj` [E, H, I].

Three ways to run the same computation, picked by device and size:
- `loop`: one matmul pair per expert that has tokens, summed with index_add_ in expert order —
  transformers' reference ("eager") experts, bit for bit; host-synchronising (nonzero), so CPU
  and eager passes only;
- `grouped`: token/expert pairs sorted by expert and one grouped GEMM per projection reading the
  expert weights in place (torch's grouped_mm, device-side offsets): static shapes, no host sync,
  so decode/verify steps can be captured in CUDA graphs (CUDA bf16/fp16 with 16-byte aligned rows);
- `gathered`: each pair's expert matrices gathered and multiplied with bmm: static shapes in
  any dtype, but copies the weights, so only for the few pairs of a decode/verify step;
- `gemv`: our Triton kernels (kernels/expert_gemv.py) reading each expert of the pass's union in
  place once, the activation and the weighted sum fused: static shapes, no sort or copy; CUDA's
  path for decode/verify steps (up to expert_gemv.MAX_TOKENS tokens), where the grouped GEMM runs
  mostly empty tiles around a few rows;
- `blocks`: our Triton grouped kernel (pairs sorted by expert, blocks of one expert's pairs) with
  the same chain of products over K as `gemv`, so a token's bits do not depend on the pass: under
  exact numerics CUDA's path for passes of more tokens (`exact`, set at load).
"""
from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.layers.mlp import activation

from verispec.kernels import expert_gemv

# mlx-lm's container of the three expert stacks (its SwitchGLU), float or quantized
MLX_SWITCH_GLU = "switch_glu."
# Above this many token/expert pairs the gathered path would copy too many weights.
MAX_GATHERED_PAIRS = 64


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, gated) -> torch.Tensor:
    """The grouped-GEMM form: pairs sorted by expert, one grouped GEMM per projection over the
    expert stacks gate_up [E, 2I, H] and down [E, H, I]; `gated` maps [.., 2I] -> [.., I]."""
    n, k = top_k_index.shape
    num_experts = gate_up.shape[0]
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    rows = x[order // k]  # [N*K, H] grouped by expert
    offsets = torch.cumsum(expert_gemv.expert_counts(expert_ids, num_experts), dim=0, dtype=torch.int32)
    h = gated(F.grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets))
    h = F.grouped_mm(h, down.transpose(-2, -1), offs=offsets)
    h = h * top_k_weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(h).index_copy_(0, order, h)
    return unsorted.view(n, k, -1).sum(dim=1).to(x.dtype)


class ExpertsMethod(str, Enum):
    LOOP = "loop"
    GROUPED = "grouped"
    GATHERED = "gathered"
    GEMV = "gemv"
    BLOCKS = "blocks"


def grouped_mm_usable(x: torch.Tensor, gate_up_rows: int, down_cols: int) -> bool:
    """torch's grouped GEMM wants float32/bf16/fp16 operands whose rows are 16-byte aligned (x's,
    the gate/up stack's 2I and the down stack's I); on CUDA it runs bf16/fp16 only."""
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.device.type == "cuda" and x.dtype == torch.float32:
        return False
    per_16_bytes = 16 // x.element_size()
    return all(n % per_16_bytes == 0 for n in (x.shape[-1], gate_up_rows, down_cols))


def gated(act, gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """act(gate) * up, the gate and up halves side by side (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def loop_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
                 expert_mlp) -> torch.Tensor:
    """transformers' eager experts: for each expert that has tokens, in expert order,
    `expert_mlp(expert, rows)` ([T_e, H] -> [T_e, H]) weighted and summed into its tokens' rows.
    Host-synchronising (nonzero): CPU and eager passes only."""
    out = torch.zeros_like(x)
    expert_mask = F.one_hot(top_k_index, num_classes=num_experts).permute(2, 1, 0)  # [E, K, N]
    hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit[:, 0].tolist():
        slot, token = torch.where(expert_mask[expert])
        h = expert_mlp(expert, x[token]) * top_k_weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


def default_method(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, num_pairs: int,
                   exact: bool = False) -> ExpertsMethod:
    if x.device.type != "cuda":
        return ExpertsMethod.LOOP  # the reference: equal to transformers' eager experts
    if x.shape[0] <= expert_gemv.MAX_TOKENS and expert_gemv.available(x.device):
        return ExpertsMethod.GEMV
    if exact and expert_gemv.available(x.device):
        return ExpertsMethod.BLOCKS
    if grouped_mm_usable(x, gate_up.shape[1], down.shape[-1]):
        return ExpertsMethod.GROUPED
    return ExpertsMethod.GATHERED if num_pairs <= MAX_GATHERED_PAIRS else ExpertsMethod.LOOP


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = activation(act)
        self.act_name = act
        self.method: ExpertsMethod | None = None  # None: chosen per call by `default_method`
        self.exact = False  # exact numerics (set at load): every pass on the row-invariant kernels

    def checkpoint_part(self, local_name: str) -> tuple[str, tuple] | None:
        """Where one expert's matrix of a per-expert checkpoint lands (what transformers saves for
        Qwen3-MoE and the original releases ship): `{e}.gate_proj.weight` -> (`gate_up_proj`,
        index [e, :I]), `{e}.up_proj.weight` -> [e, I:], `{e}.down_proj.weight` -> (`down_proj`, [e]);
        and the gate or up stack of all experts, [E, I, H] (GGUF's ffn_gate_exps / ffn_up_exps, and
        mlx-lm's float `switch_glu.gate_proj.weight`): `gate_proj` -> [:, :I], `up_proj` -> [:, I:],
        `switch_glu.down_proj.weight` -> all of `down_proj`. None for any other name."""
        i = self.intermediate
        stack = local_name.removeprefix(MLX_SWITCH_GLU).removesuffix(".weight") \
            if local_name.startswith(MLX_SWITCH_GLU) else local_name
        if stack in ("gate_proj", "up_proj"):
            return "gate_up_proj", (slice(None), slice(0, i) if stack == "gate_proj" else slice(i, 2 * i))
        if stack == "down_proj" and local_name != stack:
            return "down_proj", ()
        expert, _, rest = local_name.partition(".")
        if not expert.isdigit() or int(expert) >= self.num_experts:
            return None
        e, i = int(expert), self.intermediate
        return {"gate_proj.weight": ("gate_up_proj", (e, slice(0, i))),
                "up_proj.weight": ("gate_up_proj", (e, slice(i, 2 * i))),
                "down_proj.weight": ("down_proj", (e,))}.get(rest)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; top_k_index [N, K] expert ids; top_k_weights [N, K] -> [N, H] weighted sum."""
        method = self.method or default_method(x, self.gate_up_proj, self.down_proj, top_k_index.numel(), self.exact)
        if method is ExpertsMethod.GROUPED:
            return self._grouped(x, top_k_index, top_k_weights)
        if method is ExpertsMethod.GATHERED:
            return self._gathered(x, top_k_index, top_k_weights)
        if method is ExpertsMethod.GEMV:
            return self._triton(expert_gemv.union_products, x, top_k_index, top_k_weights)
        if method is ExpertsMethod.BLOCKS:
            return self._triton(expert_gemv.grouped_products, x, top_k_index, top_k_weights)
        return self._loop(x, top_k_index, top_k_weights)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
        return gated(self.act, gate_up)

    def _loop(self, x, top_k_index, top_k_weights):
        return loop_experts(x, top_k_index, top_k_weights, self.num_experts, lambda expert, rows: F.linear(
            self._gated(F.linear(rows, self.gate_up_proj[expert])), self.down_proj[expert]))

    def _grouped(self, x, top_k_index, top_k_weights):
        return grouped_experts(x, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights, self._gated)

    def _gathered(self, x, top_k_index, top_k_weights):
        n, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        rows = x.repeat_interleave(k, dim=0)[:, :, None]  # [N*K, H, 1]
        h = self._gated(torch.bmm(self.gate_up_proj[experts], rows)[..., 0])
        h = torch.bmm(self.down_proj[experts], h[:, :, None])[..., 0]
        h = h * top_k_weights.reshape(-1, 1)
        return h.view(n, k, -1).sum(dim=1).to(x.dtype)

    def _triton(self, products, x, top_k_index, top_k_weights):
        """`products`: expert_gemv.union_products or grouped_products (the same bits for a pair)."""
        if self.act_name in expert_gemv.FUSED_ACTIVATIONS:
            h = products(x, self.gate_up_proj, top_k_index, x_per_pair=False, gated_act=self.act_name)  # [N*K, I]
        else:
            h = self._gated(products(x, self.gate_up_proj, top_k_index, x_per_pair=False))
        y = products(h, self.down_proj, top_k_index, x_per_pair=True)  # [N*K, H]
        return expert_gemv.combine(y, top_k_weights, x.dtype)
