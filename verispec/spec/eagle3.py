"""EAGLE3 drafters in the speculators checkpoint format, and the proposer that runs them.

Draft forward (see shared/reference/eagle3.md):
    g   = fc(cat(aux_0, aux_1, aux_2))       when g comes from the target (not for fed-back g)
    x   = residual + o_proj(attn(cat(input_layernorm(embed(token)), hidden_norm(g))))
    pre = x + mlp(post_attention_layernorm(x));   logits_draft = lm_head(norm(pre))
with residual = hidden_norm(g) if norm_before_residual else g, and `pre` (or norm(pre) when
norm_output) fed back as the next g. Aux id k is the residual stream *entering* target layer k.
Draft ids map to target ids by offset: target_id = draft_id + d2t[draft_id].
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from verispec.cache.kv import KVCache, LayerCacheSpec
from verispec.sampling.params import SamplingParams
from verispec.errors import VerispecError
from verispec.loading.weights import iter_tensors, tensor_shapes
from verispec.models.base import CausalLM
from verispec.models.layers.attention import AttentionInputs, attend
from verispec.models.layers.meta import materialize, on_meta
from verispec.models.layers.mlp import GatedMLP
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.rotary import RotaryEmbedding
from verispec.models.llama import Attention, DecoderSettings
from verispec.spec.chained import ChainedDrafter
from verispec.spec.drafting import choose_draft
from verispec.spec.eagle3_files import eagle3_config_path
from verispec.spec.proposer import TargetStep

SUPPORTED_LAYER_TYPES = ("llama", "qwen3")


class Eagle3Config:
    def __init__(self, raw: dict, target: CausalLM, where: Path):
        if raw.get("speculators_model_type") != "eagle3":
            raise VerispecError(f"{where}/config.json is not an EAGLE3 speculator "
                                f"(speculators_model_type={raw.get('speculators_model_type')!r}, expected 'eagle3')")
        layer = dict(raw.get("transformer_layer_config") or {})
        if not layer:
            raise VerispecError(f"{where}/config.json has no transformer_layer_config")
        layer.setdefault("model_type", "llama")
        if layer["model_type"] not in SUPPORTED_LAYER_TYPES:
            raise VerispecError(f"EAGLE3 decoder layer type '{layer['model_type']}' is not supported "
                                f"(supported: {', '.join(SUPPORTED_LAYER_TYPES)})")
        layer["num_hidden_layers"] = 1
        layer.setdefault("vocab_size", target.vocab_size)
        if int(layer["vocab_size"]) != target.vocab_size:
            raise VerispecError(f"EAGLE3 drafter at {where} was built for a vocabulary of {layer['vocab_size']} "
                                f"tokens, but the target model has {target.vocab_size}")
        self.layer = DecoderSettings(layer)
        self.hidden_size = self.layer.hidden_size
        self.draft_vocab_size = int(raw.get("draft_vocab_size") or layer.get("vocab_size"))
        self.target_hidden_size = int(raw.get("target_hidden_size") or self.hidden_size)
        n = target.num_layers
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
        self.aux_layer_ids = tuple(int(i) for i in ids)
        self.norm_before_residual = bool(raw.get("norm_before_residual", False))
        self.norm_output = bool(raw.get("norm_output", False))
        # Optional normalisation of the target features before `fc`: one RMSNorm over the
        # concatenation (norm_before_fc, weight `input_norm`) and/or one per aux layer (fc_norm).
        self.norm_before_fc = bool(raw.get("norm_before_fc") or False)
        self.fc_norm = bool(raw.get("fc_norm") or False)
        if self.target_hidden_size != target.hidden_size:
            raise VerispecError(f"EAGLE3 drafter at {where} expects target hidden size {self.target_hidden_size}, "
                                f"but the target model has hidden size {target.hidden_size}")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < n]
        if bad or not self.aux_layer_ids:
            raise VerispecError(f"EAGLE3 aux layer ids {list(self.aux_layer_ids)} must be layers of the "
                                f"target's {n} (0..{n - 1})")


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        s = c.layer
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, 0, input_size=2 * s.hidden_size)
        self.mlp = GatedMLP(s.hidden_size, s.intermediate_size, s.hidden_act, s.mlp_bias)


class Eagle3Drafter(nn.Module):
    def __init__(self, c: Eagle3Config, has_embedding: bool, fc_bias: bool):
        super().__init__()
        self.cfg = c
        s = c.layer
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size) if has_embedding else None
        num_aux = len(c.aux_layer_ids)
        self.fc = nn.Linear(num_aux * c.target_hidden_size, s.hidden_size, bias=fc_bias)
        self.input_norm = RMSNorm(num_aux * c.target_hidden_size, s.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(c.target_hidden_size, s.rms_norm_eps) for _ in range(num_aux))
                        if c.fc_norm else None)
        self.layers = nn.ModuleList([Eagle3Layer(c)])
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.rotary = RotaryEmbedding(s.rope, s.head_dim)
        # The target's embedding when the checkpoint has none: kept out of this module's
        # parameters (it belongs to the target and is neither loaded nor moved here).
        self.__dict__["shared_embedding"] = None

    def project(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """Target features, each [..., H_t] -> g [..., H] (fc of their concatenation)."""
        if self.fc_norm is not None:
            aux = [norm(a) for norm, a in zip(self.fc_norm, aux)]
        x = torch.cat(aux, dim=-1)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # EAGLE3 embeddings are never scaled (not even for Gemma targets).
        table = self.embed_tokens if self.embed_tokens is not None else self.shared_embedding
        return table(token_ids)

    def forward(self, token_ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
                cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids, positions [1, T]; g [1, T, H] -> (fed-back hidden [1, T, H], draft logits [1, T, Vd])."""
        layer = self.layers[0]
        e = layer.input_layernorm(self.embed(token_ids).to(g.dtype))
        gn = layer.hidden_norm(g)
        residual = gn if self.cfg.norm_before_residual else g
        attn = layer.self_attn
        x_in = torch.cat((e, gn), dim=-1)
        b, t, _ = x_in.shape
        if attn.qkv_proj is not None:  # merged by CapturedPasses.capture_graphs (CUDA)
            kv_size = attn.num_kv_heads * attn.head_dim
            q, k, v = attn.qkv_proj(x_in).split([attn.num_heads * attn.head_dim, kv_size, kv_size], dim=-1)
        else:
            q, k, v = attn.q_proj(x_in), attn.k_proj(x_in), attn.v_proj(x_in)
        q = q.view(b, t, attn.num_heads, attn.head_dim)
        k = k.view(b, t, attn.num_kv_heads, attn.head_dim)
        v = v.view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self.rotary(positions, x_in.dtype)
        has_norm = attn.q_norm is not None
        q, k = attn.prepare_qk(q, k, cos, sin, attn.q_norm.weight if has_norm else None,
                               attn.k_norm.weight if has_norm else None, attn.eps, False)
        # drafter cache rows sit at their positions (row i = position i), as in the target
        out = attend(q, k, v, AttentionInputs(positions, cache), 0, None, attn.scale)
        x = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        pre = x + layer.mlp(layer.post_attention_layernorm(x))
        normed = self.norm(pre)
        return (normed if self.cfg.norm_output else pre), self.lm_head(normed)

    def cache_specs(self) -> list[LayerCacheSpec]:
        s = self.cfg.layer
        return [LayerCacheSpec(s.num_kv_heads, s.head_dim)]


def load_eagle3(drafter_dir: str | Path, target: CausalLM,
                tables: Callable[[], CausalLM] | None = None) -> Eagle3Drafter:
    """`tables`: what gives the embedding a drafter without its own shares (the target; under
    tensor parallelism its whole copy, called only when needed: models/drafter_tables.py)."""
    cfg_path = eagle3_config_path(drafter_dir)
    where = cfg_path.parent
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise VerispecError(f"{cfg_path} is not valid JSON: {exc}") from exc
    c = Eagle3Config(raw, target, where)
    files = sorted(where.glob("*.safetensors"))
    if not files:
        raise VerispecError(f"--eagle3 {where}: no .safetensors weights")
    # checked against the files' headers, then read a tensor at a time into the parameters: neither
    # a float32 module nor the whole checkpoint beside the drafter (a CPU start's peak)
    shapes = {_our_name(name): shape for name, shape in tensor_shapes(files).items()}
    param = next(target.parameters())
    with on_meta():
        drafter = Eagle3Drafter(c, has_embedding="embed_tokens.weight" in shapes, fc_bias="fc.bias" in shapes)
        drafter.to(dtype=param.dtype)
    materialize(drafter, param.device)
    if drafter.embed_tokens is None:
        if c.hidden_size != target.hidden_size:
            raise VerispecError(f"EAGLE3 drafter at {where} has no embed_tokens and hidden size {c.hidden_size}; "
                                f"sharing the target's needs hidden size {target.hidden_size}")
        drafter.__dict__["shared_embedding"] = (tables() if tables is not None else target).input_embeddings()
    expected = dict(drafter.named_parameters())
    expected["d2t"] = drafter.d2t
    for name, p in expected.items():
        if name not in shapes:
            raise VerispecError(f"EAGLE3 drafter at {where} is missing tensor '{name}'")
        if tuple(shapes[name]) != tuple(p.shape):
            raise VerispecError(f"EAGLE3 tensor '{name}' has shape {tuple(shapes[name])}; the drafter "
                                f"config and target (hidden {target.hidden_size}, vocab {target.vocab_size}) "
                                f"imply {tuple(p.shape)}")
    if "t2d" in shapes and shapes["t2d"][0] != target.vocab_size:
        raise VerispecError(f"EAGLE3 t2d covers {shapes['t2d'][0]} target ids, the target vocabulary "
                            f"has {target.vocab_size}")
    with torch.no_grad():
        for name, t in iter_tensors(files, only=lambda name: _our_name(name) in expected, reopen=True):
            expected[_our_name(name)].copy_(t)
    target_ids = torch.arange(c.draft_vocab_size, device=drafter.d2t.device) + drafter.d2t
    if int(target_ids.max()) >= target.vocab_size or int(target_ids.min()) < 0:
        raise VerispecError(f"EAGLE3 d2t maps draft ids outside the target vocabulary of {target.vocab_size}")
    drafter.eval().requires_grad_(False)
    return drafter


def _our_name(name: str) -> str:
    """A speculators checkpoint's tensor name as the drafter module names it."""
    name = name.removeprefix("model.")
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


class Eagle3Proposer(ChainedDrafter):
    method = "eagle3"

    def __init__(self, drafter: Eagle3Drafter, target_vocab_size: int):
        super().__init__(drafter, drafter.cache_specs(), drafter.cfg.hidden_size)
        self.capture_layers = drafter.cfg.aux_layer_ids
        self.target_vocab_size = target_vocab_size
        self.draft_to_target = torch.arange(drafter.cfg.draft_vocab_size, device=self.device) + drafter.d2t

    def _rows(self, ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, cache, last: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: ids, positions [B, T], g [B, T, H], last [B] -> each
        row's fed-back hidden at index last [B, 1, H] and draft logits there [B, Vd]."""
        fed_back, logits = self.drafter(ids, g, positions, cache)
        rows = torch.arange(ids.shape[0], device=ids.device)
        return fed_back[rows, last][:, None], logits[rows, last]

    def _greedy_tokens(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[B, Vd] -> the greedy drafts as target ids [B]."""
        return self.draft_to_target[draft_logits.argmax(-1)]

    def _batch_features(self, out, n_max: int) -> torch.Tensor:
        """g [B, n_max, H]: every pass row's projection."""
        return self.drafter.project([a[:, :n_max] for a in out.aux])

    def _features(self, step: TargetStep) -> torch.Tensor:
        """g [T, H]: the fc projection of the captured target layers' streams."""
        return self.drafter.project(step.aux)

    def _choose(self, draft_logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
        """draft_logits [Vd] -> (target token id, q over the target vocabulary [V] or None)."""
        if params.greedy:
            return int(self.draft_to_target[int(torch.argmax(draft_logits))]), None
        full = torch.full((self.target_vocab_size,), float("-inf"), dtype=torch.float32, device=draft_logits.device)
        full[self.draft_to_target] = draft_logits.float()
        token, q = choose_draft(full, params, generator)
        return int(token), q
