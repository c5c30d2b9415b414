"""Routed experts stored MLX-affine quantized, as mlx-lm writes them (its `SwitchGLU` of three
`SwitchLinear` stacks): `<experts>.switch_glu.{gate,up,down}_proj.{weight,scales,biases}`, the
weight [E, N, K*bits/32] uint32 words and scales / biases [E, N, K/group], w = q * s + b.

The module takes the place of `FusedExperts` (models/layers/moe.py) with the same call, and runs
one of three paths, picked by device and size:
- `gemv` (CUDA with Gluon): each token/expert pair streams its expert's packed matrices in place
  (kernels/gemv.expert_gemv): device-side expert ids, so decode and verify steps need no
  host sync and can be captured in CUDA graphs; a pair's result does not depend on the others;
- `gathered` (small passes elsewhere): the chosen experts' matrices dequantized and multiplied
  with bmm: static shapes, no host sync;
- `grouped` (CUDA prefill): every expert's stacks dequantized once per pass (a few experts at a
  time into one bf16 copy per projection) and the pairs run through torch's grouped GEMM, as the
  float experts do; this costs a transient copy of one layer's experts (1.5 GB for Gemma 4
  26B-A4B) but reads each expert once for all its tokens;
- `loop` (CPU): one dequantized matmul pair per expert that has tokens, summed in expert order,
  as transformers' eager experts do (host-synchronising).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.kernels import expert_gemv
from verispec.quant.kernels import dequantize, gemv as gemv_kernel
from verispec.models.layers.mlp import activation
from verispec.models.layers.moe import gated, grouped_experts, grouped_mm_usable, loop_experts
from verispec.quant.layers.linear import float_param
from verispec.quant.packing import packed_words

MAX_GATHERED_PAIRS = 64  # past this the gathered path would dequantize too many weights per pass
MAX_GEMV_PAIRS = 64  # past this (prefill) each expert's weights are read once for all its tokens
DEQUANT_EXPERTS_PER_CHUNK = 16  # bounds the temporaries of dequantizing a whole stack


class QuantizedExpertStack(nn.Module):
    """One projection of every expert: y = x @ dequant(W[e])^T with W [E, out_features, in_features]."""

    checkpoint_buffers = ("weight",)

    def __init__(self, num_experts: int, in_features: int, out_features: int, bits: int, group_size: int):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.bits, self.group_size = bits, group_size
        words = packed_words(in_features, bits)
        self.register_buffer("weight", torch.zeros(num_experts, out_features, words, dtype=torch.int32))
        self.scales = float_param(num_experts, out_features, in_features // group_size)
        self.biases = float_param(num_experts, out_features, in_features // group_size)

    def dequantized(self, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """experts [P] ids -> their matrices [P, out_features, in_features] in `dtype`, decoded in float32."""
        weight, scales, biases = self.weight[experts], self.scales[experts], self.biases[experts]
        p, n = weight.shape[:2]
        w = dequantize.decode(weight.reshape(p * n, -1), scales.reshape(p * n, -1), biases.reshape(p * n, -1),
                              self.bits, self.group_size, False, dtype)
        return w.view(p, n, -1)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's matrix [E, out_features, in_features] in `dtype`, a chunk of experts at a time."""
        out = torch.empty(self.num_experts, self.out_features, self.in_features, dtype=dtype, device=self.weight.device)
        for start in range(0, self.num_experts, DEQUANT_EXPERTS_PER_CHUNK):
            ids = torch.arange(start, min(start + DEQUANT_EXPERTS_PER_CHUNK, self.num_experts), device=out.device)
            out[start:start + ids.numel()] = self.dequantized(ids, dtype)
        return out

    def gemv(self, x: torch.Tensor, experts: torch.Tensor, rows_per_x: int) -> torch.Tensor:
        """x [T, in_features]; experts [P] -> [P, out_features] (pair p reads x row p // rows_per_x)."""
        return gemv_kernel.expert_gemv(x, self.weight, self.scales, self.biases, experts, self.bits,
                                      self.group_size, rows_per_x=rows_per_x)

    def gemv_reason(self, x: torch.Tensor) -> str | None:
        return gemv_kernel.unsupported_reason(x.device, x.dtype, self.bits, self.group_size)


class SwitchGLU(nn.Module):
    """mlx-lm's container name, so the checkpoint's tensor names land as they are."""

    def __init__(self, gate_proj: QuantizedExpertStack, up_proj: QuantizedExpertStack, down_proj: QuantizedExpertStack):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj


class MLXQuantizedExperts(nn.Module):
    def __init__(self, num_experts: int, act, gate_proj: QuantizedExpertStack, up_proj: QuantizedExpertStack,
                 down_proj: QuantizedExpertStack):
        """`act`: the gate's activation (a name, or the callable of the FusedExperts replaced)."""
        super().__init__()
        self.num_experts = num_experts
        self.switch_glu = SwitchGLU(gate_proj, up_proj, down_proj)
        self.act = activation(act) if isinstance(act, str) else act
        self.method: str | None = None  # None: chosen per call (`default_method`); tests force one

    def default_method(self, x: torch.Tensor, num_pairs: int) -> str:
        stacks = (self.switch_glu.gate_proj, self.switch_glu.up_proj, self.switch_glu.down_proj)
        if x.device.type == "cuda" and all(s.gemv_reason(x) is None for s in stacks):
            capturing = torch.cuda.is_current_stream_capturing()
            if num_pairs <= MAX_GEMV_PAIRS or capturing:
                return "gemv"
        if x.device.type == "cuda" and num_pairs <= MAX_GATHERED_PAIRS:
            return "gathered"
        glu = self.switch_glu
        if x.device.type == "cuda" and grouped_mm_usable(x, 2 * glu.gate_proj.out_features, glu.down_proj.in_features):
            return "grouped"
        return "loop"

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; top_k_index [T, K] expert ids; top_k_weights [T, K] -> [T, H] weighted sum."""
        method = self.method or self.default_method(x, top_k_index.numel())
        if method == "gemv":
            return self._gemv(x, top_k_index, top_k_weights)
        if method == "gathered":
            return self._gathered(x, top_k_index, top_k_weights)
        if method == "grouped":
            glu = self.switch_glu
            gate_up = torch.cat([glu.gate_proj.dense(x.dtype), glu.up_proj.dense(x.dtype)], dim=1)
            return grouped_experts(x, gate_up, glu.down_proj.dense(x.dtype), top_k_index, top_k_weights,
                                   self._gated)
        return self._loop(x, top_k_index, top_k_weights)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
        return gated(self.act, gate_up)

    def _loop(self, x, top_k_index, top_k_weights):
        glu = self.switch_glu

        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            one = torch.tensor([expert], device=x.device)
            h = self.act(F.linear(rows, glu.gate_proj.dequantized(one, x.dtype)[0]))
            h = h * F.linear(rows, glu.up_proj.dequantized(one, x.dtype)[0])
            return F.linear(h, glu.down_proj.dequantized(one, x.dtype)[0])

        return loop_experts(x, top_k_index, top_k_weights, self.num_experts, expert_mlp)

    def _gathered(self, x, top_k_index, top_k_weights):
        glu = self.switch_glu
        t, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        rows = x.repeat_interleave(k, dim=0)[:, :, None]  # [P, H, 1]
        gate = torch.bmm(glu.gate_proj.dequantized(experts, x.dtype), rows)[..., 0]
        up = torch.bmm(glu.up_proj.dequantized(experts, x.dtype), rows)[..., 0]
        h = (self.act(gate) * up)[:, :, None]
        h = torch.bmm(glu.down_proj.dequantized(experts, x.dtype), h)[..., 0] * top_k_weights.reshape(-1, 1)
        return h.view(t, k, -1).sum(dim=1).to(x.dtype)

    def _gemv(self, x, top_k_index, top_k_weights):
        glu = self.switch_glu
        k = top_k_index.shape[1]
        experts = top_k_index.reshape(-1)  # pair p = token p // k, slot p % k
        h = self.act(glu.gate_proj.gemv(x, experts, k)) * glu.up_proj.gemv(x, experts, k)  # [P, I]
        return expert_gemv.combine(glu.down_proj.gemv(h, experts, 1), top_k_weights, x.dtype)  # one launch
