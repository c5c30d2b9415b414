"""Training an EAGLE3 drafter (speculators format) for a target.

The drafter is verispec's own `Eagle3Drafter` (so what is trained is exactly what
`load_eagle3` runs): one decoder layer over [embedding, hidden], `fc` from the concatenated aux
streams. The forward here runs the same modules over all positions at once, with the unroll of
`attention.py` for drafts 2..k (each step feeds back the drafter's own hidden, as at inference).
The draft vocabulary is the `draft_vocab_size` target ids the target itself predicts most often
on the training data (`d2t`/`t2d`); the loss is the cross-entropy against the target's
distribution restricted to that vocabulary.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from verispec.models.base import CausalLM
from verispec.models.layers.rotary import apply_rotary, rope_parameters
from verispec.spec.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Proposer
from verispec.train.attention import distill_loss, unrolled_attention
from verispec.train.features import TargetBatch

DEFAULT_MAX_DRAFT_VOCAB = 32000  # the common speculators choice


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def default_aux_layers(num_layers: int) -> list[int]:
    """The speculators default [2, N // 2, N - 3], kept inside small targets' layer range."""
    return [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


def drafter_config(target: CausalLM, aux_layers: list[int], draft_vocab_size: int, layer_type: str,
                   num_speculative_tokens: int, verifier: str) -> dict:
    """A speculators config.json for a drafter shaped after the target's attention and MLP sizes."""
    c = text_config(target.config)
    h = target.hidden_size
    heads = int(c.get("num_attention_heads") or max(1, h // 64))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or h // heads)
    rope = rope_parameters(c)
    layer = {
        "model_type": layer_type, "hidden_size": h, "intermediate_size": int(c.get("intermediate_size") or 4 * h),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6)), "vocab_size": target.vocab_size,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(target.max_position_embeddings), "hidden_act": "silu",
        "num_hidden_layers": 1, "tie_word_embeddings": False,
    }
    return {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer, "draft_vocab_size": draft_vocab_size, "target_hidden_size": h,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": target.config.get("architectures") or []},
        },
    }


def choose_draft_vocab(target_counts: torch.Tensor, text_counts: torch.Tensor, size: int,
                       num_real_tokens: int) -> torch.Tensor:
    """The `size` target ids the target predicts most often (ties and the never-predicted
    remainder by frequency in the text, then by id), sorted ascending. Counts [V] int64."""
    score = target_counts.double() * (float(text_counts.sum()) + 1.0) + text_counts.double()
    score[num_real_tokens:] = -1.0  # padding rows of the vocabulary are never drafted
    size = min(size, num_real_tokens)
    # stable: equal scores keep id order
    order = torch.sort(-score, stable=True).indices[:size]
    return torch.sort(order).values


class Eagle3Trainee:
    """The drafter being trained, its forward with the unroll, and saving it."""

    def __init__(self, target: CausalLM, config: dict, draft_ids: torch.Tensor, copy_embedding: bool,
                 out_dir: Path, seed: int):
        self.target = target
        self.config = config
        param = next(target.parameters())
        device = param.device
        cfg = Eagle3Config(config, target, out_dir)
        torch.manual_seed(seed)
        drafter = Eagle3Drafter(cfg, has_embedding=copy_embedding, fc_bias=False)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if p.ndim == 2:
                    nn.init.normal_(p, 0.0, 0.02)
            # Start from the target's own output rows of the draft vocabulary.
            head = getattr(target, "lm_head", None)
            if head is not None and head.weight.shape[1] == cfg.hidden_size:
                drafter.lm_head.weight.copy_(head.weight[draft_ids.to(head.weight.device)].float())
            if copy_embedding:
                drafter.embed_tokens.weight.copy_(target.input_embeddings().weight.float())
        drafter.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        drafter.to(device=device, dtype=torch.float32)
        if drafter.embed_tokens is None:
            drafter.__dict__["shared_embedding"] = target.input_embeddings()
        else:
            drafter.embed_tokens.requires_grad_(False)  # the target's embedding, frozen as in EAGLE-3
        drafter.d2t.data = drafter.d2t.data.to(device)
        self.drafter = drafter
        self.draft_ids = draft_ids.to(device)

    @property
    def capture(self) -> tuple[int, ...]:
        return self.drafter.cfg.aux_layer_ids

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.drafter.parameters() if p.requires_grad]

    def state_dict(self) -> dict:
        return {k: v.detach().cpu() for k, v in self.drafter.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict(state)

    def _step(self, token_ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
              keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Eagle3Drafter.forward over all rows of one unroll step: token_ids [B, T], g [B, T, H],
        positions [B, T] -> (fed-back hidden [B, T, H], draft logits [B, T, Vd])."""
        d = self.drafter
        layer = d.layers[0]
        attn = layer.self_attn
        e = layer.input_layernorm(d.embed(token_ids).to(g.dtype))
        gn = layer.hidden_norm(g)
        residual = gn if d.cfg.norm_before_residual else g
        x_in = torch.cat((e, gn), dim=-1)
        b, t, _ = x_in.shape
        q = attn.q_proj(x_in).view(b, t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x_in).view(b, t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(x_in).view(b, t, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = d.rotary(positions, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys.append(k)
        values.append(v)
        out = unrolled_attention(q, keys, values, attn.scale)
        x = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        pre = x + layer.mlp(layer.post_attention_layernorm(x))
        normed = d.norm(pre)
        return (normed if d.cfg.norm_output else pre), d.lm_head(normed)

    def unrolled_logits(self, batch: TargetBatch, num_steps: int) -> list[torch.Tensor]:
        """Draft logits [B, T-1, Vd] per unroll step; row p of step j drafts the token after
        t[p+j+1] (the target's choice at position p+j+1)."""
        ids = batch.token_ids
        b, t = ids.shape
        n = t - 1
        g = self.drafter.project([a[:, :n] for a in batch.aux])
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out = []
        for j in range(num_steps):
            # rows past the window's end get a stand-in token: they are masked out of the loss
            tokens = torch.nn.functional.pad(ids[:, j + 1:], (0, j))
            positions = (torch.arange(n, device=ids.device) + j)[None].expand(b, -1)
            g, logits = self._step(tokens, g, positions, keys, values)
            out.append(logits)
        return out

    def loss(self, batch: TargetBatch, num_steps: int, decay: float) -> tuple[torch.Tensor, dict]:
        b, t = batch.token_ids.shape
        n = t - 1
        total, weights, metrics = 0.0, 0.0, {}
        rows = torch.arange(n, device=batch.token_ids.device)
        for j, logits in enumerate(self.unrolled_logits(batch, num_steps)):
            valid = (rows < n - j)[None].expand(b, -1)
            labels = torch.nn.functional.pad(batch.logits[:, j + 1:], (0, 0, 0, j))
            loss_j = distill_loss(logits, labels, valid)
            w = decay ** j
            total = total + w * loss_j
            weights += w
            with torch.no_grad():
                chosen = self.draft_ids[logits.argmax(-1)]
                wanted = torch.nn.functional.pad(batch.argmax[:, j + 1:], (0, j))
                metrics[f"acc{j + 1}"] = float(((chosen == wanted) & valid).sum() / valid.sum().clamp(min=1))
        return total / weights, metrics

    def inference_drafter(self, dtype: torch.dtype) -> Eagle3Drafter:
        """A copy in the target's dtype, eval mode, for the engine (the trained one stays float32)."""
        d = self.drafter
        copy = Eagle3Drafter(d.cfg, has_embedding=d.embed_tokens is not None, fc_bias=d.fc.bias is not None)
        copy.load_state_dict(d.state_dict())
        copy.to(device=d.d2t.device, dtype=dtype)
        copy.d2t.data = d.d2t.data.clone()
        copy.__dict__["shared_embedding"] = d.shared_embedding
        return copy.eval().requires_grad_(False)

    def proposer(self, dtype: torch.dtype) -> Eagle3Proposer:
        return Eagle3Proposer(self.inference_drafter(dtype), self.target.vocab_size)

    def save(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """config.json + model.safetensors (speculators format) into out_dir."""
        out_dir.mkdir(parents=True, exist_ok=True)
        d = self.drafter
        tensors = {name: p.detach().to(dtype).cpu().contiguous() for name, p in d.named_parameters()}
        tensors["d2t"] = d.d2t.detach().cpu().to(torch.long)
        t2d = torch.zeros(self.target.vocab_size, dtype=torch.bool)
        t2d[self.draft_ids.cpu()] = True
        tensors["t2d"] = t2d
        config = dict(self.config, torch_dtype=str(dtype).removeprefix("torch."))
        weights = out_dir / "model.safetensors"
        save_file(tensors, str(weights), metadata={"format": "pt"})
        path = out_dir / "config.json"
        path.write_text(json.dumps(config, indent=2) + "\n")
        return [path, weights]
