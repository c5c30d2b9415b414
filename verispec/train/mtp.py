"""Training a Qwen3.5 multi-token-prediction head for a target (also one that shipped without one).

The head is verispec's own `MtpHead` (what `load_mtp_head` runs): fc over [norm(embed(t_{p+1})),
norm(h_p)], one gated full-attention decoder layer, a final norm, the target's lm_head. It learns
the target's next-token distribution one position ahead; with `ttt_steps` > 1 it is also trained
on its own fed-back output for chained drafts (depth > 1), with the unroll of `attention.py`.
Saved as an `mtp.safetensors` sidecar in Hugging Face naming (`mtp.fc.weight`, ...; norms
zero-centred, applied as 1 + w, as HF checkpoints store them).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from verispec.errors import VerispecError
from verispec.models.base import CausalLM
from verispec.models.layers.rotary import apply_rotary
from verispec.models.qwen3_5 import LayerType
from verispec.spec.mtp import MTP_MODEL_TYPES, MtpHead, MtpHidden, MtpProposer, NormConvention, supports_mtp
from verispec.train.attention import distill_loss, unrolled_attention
from verispec.train.features import TargetBatch

SIDECAR = "mtp.safetensors"


class MtpTrainee:
    @staticmethod
    def check_target(target: CausalLM) -> None:
        if not supports_mtp(target):
            raise VerispecError(f"--method mtp trains a Qwen3.5-style MTP head, which needs a Qwen3.5-architecture "
                                f"target ({' / '.join(MTP_MODEL_TYPES)}); this target is "
                                f"'{target.config.get('model_type')}' (use --method eagle3)")

    def __init__(self, target: CausalLM, hidden: MtpHidden, num_real_tokens: int, seed: int):
        self.check_target(target)
        self.target = target
        self.hidden = hidden
        self.num_real_tokens = num_real_tokens
        device = next(target.parameters()).device
        torch.manual_seed(seed)
        head = MtpHead(target.settings, target)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if p.ndim == 2:
                    nn.init.normal_(p, 0.0, 0.02)
                elif "norm" in name:
                    p.zero_()  # zero-centred: applied as 1 + w
            # The decoder layer starts as a copy of the target's last full-attention layer (same shapes).
            full = [layer for layer in target.model.layers if layer.layer_type is LayerType.FULL_ATTENTION]
            if full:
                head.layers[0].load_state_dict(full[-1].state_dict())
        head.set_norm_convention(NormConvention.HF)
        self.head = head.to(device=device, dtype=torch.float32)

    capture: tuple[int, ...] = ()

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.head.parameters() if p.requires_grad]

    def state_dict(self) -> dict:
        return {k: v.detach().cpu() for k, v in self.head.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state)

    def _step(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """MtpHead.forward over all rows of one unroll step -> the head's output after mtp.norm [B, T, H]."""
        head = self.head
        e = self.target.input_embeddings()(token_ids).to(hidden.dtype)
        x = head.fc(torch.cat((head.pre_fc_norm_embedding(e), head.pre_fc_norm_hidden(hidden)), dim=-1))
        layer = head.layers[0]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        b, t, _ = h.shape
        q, gate = attn.q_proj(h).view(b, t, attn.num_heads, 2 * attn.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(b, t, attn.num_heads * attn.head_dim)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = head.rotary(positions, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys.append(k)
        values.append(v)
        out = unrolled_attention(q, keys, values, attn.scale)
        out = out.transpose(1, 2).reshape(b, t, attn.num_heads * attn.head_dim)
        x = x + attn.o_proj(out * torch.sigmoid(gate))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return head.norm(x)

    def unrolled_logits(self, batch: TargetBatch, num_steps: int) -> list[torch.Tensor]:
        """Head logits [B, T-1, V] per unroll step; row p of step j drafts the token after t[p+j+1]."""
        ids = batch.token_ids
        b, t = ids.shape
        n = t - 1
        feats = batch.hidden if self.hidden is MtpHidden.POST_NORM else batch.pre_norm
        hidden = feats[:, :n]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out = []
        for j in range(num_steps):
            tokens = torch.nn.functional.pad(ids[:, j + 1:], (0, j))
            positions = (torch.arange(n, device=ids.device) + j)[None].expand(b, -1)
            hidden = self._step(tokens, hidden, positions, keys, values)
            out.append(self.target.logits(hidden))
        return out

    def loss(self, batch: TargetBatch, num_steps: int, decay: float) -> tuple[torch.Tensor, dict]:
        b, t = batch.token_ids.shape
        n = t - 1
        total, weights, metrics = 0.0, 0.0, {}
        rows = torch.arange(n, device=batch.token_ids.device)
        for j, logits in enumerate(self.unrolled_logits(batch, num_steps)):
            valid = (rows < n - j)[None].expand(b, -1)
            labels = torch.nn.functional.pad(batch.logits[:, j + 1:], (0, 0, 0, j))
            loss_j = distill_loss(logits[..., :self.num_real_tokens], labels[..., :self.num_real_tokens], valid)
            w = decay ** j
            total = total + w * loss_j
            weights += w
            with torch.no_grad():
                chosen = logits[..., :self.num_real_tokens].argmax(-1)
                wanted = torch.nn.functional.pad(batch.argmax[:, j + 1:], (0, j))
                metrics[f"acc{j + 1}"] = float(((chosen == wanted) & valid).sum() / valid.sum().clamp(min=1))
        return total / weights, metrics

    def inference_head(self, dtype: torch.dtype) -> MtpHead:
        with torch.device("meta"):
            copy = MtpHead(self.target.settings, self.target)
        copy.to_empty(device=next(self.head.parameters()).device)
        copy.load_state_dict(self.head.state_dict())
        copy.to(dtype)
        copy.set_norm_convention(NormConvention.HF)
        return copy.eval().requires_grad_(False)

    def proposer(self, dtype: torch.dtype) -> MtpProposer:
        return MtpProposer(self.inference_head(dtype), self.hidden, num_real_tokens=self.num_real_tokens)

    def save(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """mtp.safetensors (HF names, zero-centred norms) into out_dir."""
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"mtp.{name}": p.detach().to(dtype).cpu().contiguous() for name, p in self.head.named_parameters()}
        path = out_dir / SIDECAR
        save_file(tensors, str(path), metadata={"format": "pt"})
        return [path]
