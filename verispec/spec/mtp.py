"""MTP self-speculation: the multi-token-prediction head of Qwen3.5 / Qwen3.6, and its proposer.

The head (see shared/reference/qwen3_5-mtp.md) is one gated full-attention decoder layer with its
own 1-layer KV cache, sharing the target's embed_tokens and lm_head; an MoE target's head layer
has the target's sparse MoE MLP (experts stacked or one linear each, as the target's may be). For the row at position i,
with the target's hidden h_i and the token t_{i+1} that follows it:
    x = fc(cat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)))   # embedding first
    x = layers.0(x, position i);   out = norm(x);   logits = lm_head(out)        # predicts t_{i+2}
Deeper drafts feed `out` (after mtp.norm) back as the next row's hidden, as vLLM
(qwen3_5_mtp.py / qwen3_next_mtp.py: the head returns norm(x), and the proposer feeds back the
tensor it computed logits from) and SGLang (Qwen3NextForCausalLMMTP) do.

Weights: `mtp.*` inside the checkpoint's shards (the original Qwen releases; also accepted under a
`model.` / `model.language_model.` / `language_model.` wrapper), or a sidecar: the file named by
config.json `mlx_lm_extra_tensors.mtp_file`, `mtp.safetensors`, `mtp/weights.safetensors`,
`model-mtp.safetensors`. Norm convention, decided by the format and never by the values: HF
weights are zero-centred and applied as (1 + w); MLX conversions store 1 + w. A file whose
safetensors metadata says {"format": "mlx"}, or a config declaring `mlx_lm_extra_tensors`, is
MLX; anything else is HF. Every RMSNorm of the head (q/k norms included) follows it. A head whose
linears are MLX-affine quantized (`.scales` / `.biases` beside packed words) gets quantized
layers, configured by the checkpoint's `quantization` section as the target's are.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from verispec import log
from verispec.cache.kv import KVCache, LayerCacheSpec
from verispec.sampling.params import SamplingParams
from verispec.errors import VerispecError
from verispec.loading.model_loader import as_stored
from verispec.loading.parts import stack_parts
from verispec.loading.weights import checkpoint_files
from verispec.models.base import CausalLM, renamed
from verispec.models.layers.attention import AttentionInputs
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.rotary import RotaryEmbedding
from verispec.models.qwen3_5 import LayerType, Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, Qwen3_5Settings
from verispec.quant import loading as quant_loading
from verispec.spec.chained import ChainedDrafter
from verispec.spec.drafting import choose_draft
from verispec.spec.proposer import TargetStep

SIDECAR_NAMES = ("mtp.safetensors", "mtp/weights.safetensors", "model-mtp.safetensors")
# Where a checkpoint may keep the head: top level (Qwen/Qwen3.5-*), or under a wrapper prefix.
WRAPPER_PREFIXES = ("", "model.", "model.language_model.", "language_model.", "language_model.model.")
MTP_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


class MtpHidden(str, Enum):
    """Which target hidden state feeds the head: after the final norm (vLLM and most ports;
    higher acceptance) or before it (mlx-lm PR #990)."""

    POST_NORM = "post-norm"
    PRE_NORM = "pre-norm"

    @classmethod
    def parse(cls, value: str) -> "MtpHidden":
        try:
            return cls(value)
        except ValueError:
            raise VerispecError(f"--mtp-hidden '{value}' is not supported "
                                f"(accepted: {', '.join(h.value for h in cls)})") from None


class NormConvention(str, Enum):
    HF = "hf"  # zero-centred weights, applied as (1 + w)
    MLX = "mlx"  # 1 + w stored, applied as is


class MtpHead(nn.Module):
    """The head's own weights (HF names without the `mtp.` prefix); embedding and lm_head are
    the target's, reached through it (never copied)."""

    def __init__(self, s: Qwen3_5Settings, target: CausalLM):
        super().__init__()
        h = s.hidden_size
        self.settings = s
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, s.rms_norm_eps, unit_offset=True)
        self.pre_fc_norm_hidden = RMSNorm(h, s.rms_norm_eps, unit_offset=True)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(s, 0, LayerType.FULL_ATTENTION)])
        self.norm = RMSNorm(h, s.rms_norm_eps, unit_offset=True)
        self.rotary = RotaryEmbedding(s.rope, s.rotary_dim)
        self.norm_convention = NormConvention.HF
        self.__dict__["target"] = target  # not a submodule: its weights are the target's

    def set_norm_convention(self, convention: NormConvention) -> None:
        self.norm_convention = convention
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.unit_offset = convention is NormConvention.HF

    def cache_specs(self) -> list[LayerCacheSpec]:
        return [self.layers[0].cache_spec()]

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """token_ids, positions [1, T]; hidden [1, T, H] -> head output after mtp.norm [1, T, H]
        (what lm_head reads, and what a chained draft feeds back). Writes T pending cache rows."""
        e = self.target.input_embeddings()(token_ids).to(hidden.dtype)  # Qwen3.5: not scaled
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)), dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        # head cache rows sit at their positions (row i = position i), as in the target
        x, update = self.layers[0](x, None, cos, sin, AttentionInputs(positions, cache))
        return self.norm(x + update)

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        return self.target.logits(out)


# ---- finding and loading the head ----------------------------------------------------------------
def head_tensor_name(name: str, sidecar: bool) -> str | None:
    """Checkpoint tensor name -> the head's name, or None when it is not part of the head.
    A sidecar holds only the head, so there its names may also come without the `mtp.` prefix."""
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix + "mtp."):
            return name[len(prefix) + len("mtp."):]
    return name if sidecar else None


@dataclass
class MtpSource:
    files: list[Path]
    sidecar: bool
    convention: NormConvention
    why: str  # how the convention was decided, for the debug line


def _extra_tensors(config: dict) -> dict | None:
    for c in (config, config.get("text_config") or {}):
        extra = c.get("mlx_lm_extra_tensors")
        if isinstance(extra, dict):
            return extra
    return None


def _file_format(path: Path) -> str | None:
    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("format")


def _has_head(path: Path, sidecar: bool) -> bool:
    with safe_open(str(path), framework="pt") as f:
        return any(head_tensor_name(n, sidecar) is not None for n in f.keys())


def find_mtp_source(model_dir: Path, config: dict) -> tuple[MtpSource | None, list[str]]:
    """Where the head's weights are: (source or None, the places looked, for the log line).
    Order: the sidecar a config declares, then the checkpoint's shards, then the usual sidecar names."""
    extra = _extra_tensors(config)
    declared = extra.get("mtp_file") if extra else None
    candidates: list[tuple[list[Path], bool]] = []
    if declared:
        candidates.append(([model_dir / str(declared)], True))
    candidates.append((checkpoint_files(model_dir), False))
    candidates += [([model_dir / name], True) for name in SIDECAR_NAMES if name != declared]
    looked: list[str] = []
    for files, sidecar in candidates:
        present = [f for f in files if f.is_file()]
        looked.append(", ".join(str(f.relative_to(model_dir)) for f in files) +
                      ("" if sidecar else " (mtp.* tensors)"))
        with_head = [f for f in present if _has_head(f, sidecar)]
        if not with_head:
            continue
        formats = {f.name: _file_format(f) for f in with_head}
        mlx_files = sorted(n for n, fmt in formats.items() if fmt == "mlx")
        if extra is not None:
            convention, why = NormConvention.MLX, "config.json declares mlx_lm_extra_tensors"
        elif mlx_files and len(mlx_files) < len(with_head):
            raise VerispecError(f"the MTP head in {model_dir} is split over files of two formats "
                                f"(MLX: {', '.join(mlx_files)}; others: "
                                f"{', '.join(sorted(set(formats) - set(mlx_files)))}), so its norm "
                                "convention is ambiguous")
        elif mlx_files:
            convention, why = NormConvention.MLX, f"safetensors metadata format=mlx in {mlx_files[0]}"
        else:
            convention, why = NormConvention.HF, "Hugging Face format (no MLX markers)"
        return MtpSource(with_head, sidecar, convention, why), looked
    return None, looked


def supports_mtp(model: CausalLM) -> bool:
    return isinstance(model, Qwen3_5ForCausalLM)


def load_mtp_head(model_dir: str | Path, target: CausalLM,
                  tables: Callable[[], CausalLM] | None = None) -> MtpHead | None:
    """The target's MTP head, or None (with one log line saying why) when it has none. `tables`:
    what gives the embedding and head it shares (the target; under tensor parallelism their whole
    copy: models/drafter_tables.py)."""
    model_dir = Path(model_dir)
    if not supports_mtp(target):  # checked first: a GGUF target has no config.json to read
        log.warning("--mtp: model type '%s' has no MTP head (MTP self-speculation is for %s); "
                    "decoding without speculation", target.config.get("model_type"), " / ".join(MTP_MODEL_TYPES))
        return None
    config = json.loads((model_dir / "config.json").read_text())
    source, looked = find_mtp_source(model_dir, config)
    if source is None:
        log.warning("--mtp: no MTP head in %s (looked in %s); decoding without speculation",
                    model_dir, "; ".join(looked))
        return None
    tensors: dict[str, torch.Tensor] = {}
    for path in source.files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                head_name = head_tensor_name(name, source.sidecar)
                if head_name is not None:
                    tensors[renamed(head_name, target.checkpoint_renames)] = f.get_tensor(name)
    param = next(p for p in target.parameters() if p.is_floating_point())
    where = ", ".join(str(p) for p in source.files)
    quantized = any(name.endswith(".scales") for name in tensors)
    shared = tables() if tables is not None else target
    with torch.device("meta"):  # allocated once, on the target's device and dtype
        head = MtpHead(target.settings, shared)
        if quantized:
            _quantized_layers(head, config, tensors, where)
    tensors = stack_parts(head, tensors)  # an MoE head's experts one linear each -> the stacks
    head.to_empty(device=param.device)
    head.to(param.dtype)
    expected = dict(head.named_parameters())
    if quantized:
        expected.update(quant_loading.loadable_tensors(head))  # the quantized layers' packed words
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        shown = ", ".join(unexpected[:4]) + (f" (+{len(unexpected) - 4} more)" if len(unexpected) > 4 else "")
        raise VerispecError(f"MTP head in {where} has tensors that are not part of a one-layer Qwen3.5 MTP "
                            f"head: mtp.{shown} (multi-layer heads are not supported)")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shown = ", ".join(missing[:4]) + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "")
        raise VerispecError(f"MTP head in {where} is missing tensors: mtp.{shown}")
    for name, p in expected.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise VerispecError(f"MTP tensor 'mtp.{name}' in {where} has shape {tuple(tensors[name].shape)}; "
                                f"the target (hidden {target.hidden_size}) implies {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(as_stored(f"mtp.{name}", tensors[name], p, param.dtype))
    if quantized:
        quant_loading.finish_loading(head)
    head.set_norm_convention(source.convention)
    head.eval().requires_grad_(False)
    log.debug("MTP head from %s (%s norm convention: %s)", where, source.convention.value, source.why)
    return head


def _quantized_layers(head: MtpHead, config: dict, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Swap the head's linears whose tensors are MLX affine quantized (`.scales` / `.biases` beside
    packed `.weight` words) for quantized layers, as the target's loader does: the checkpoint's
    `quantization` section says how (bits, group size, per-layer overrides under `mtp.*` names)."""
    quantization = config.get("quantization") or (config.get("text_config") or {}).get("quantization")
    if not isinstance(quantization, dict):
        raise VerispecError(f"the MTP head in {where} is quantized (it has .scales tensors), but config.json "
                            "has no MLX `quantization` section saying how (bits, group_size)")
    named = {name: quant_loading.CheckpointTensor(f"mtp.{name}", tuple(t.shape)) for name, t in tensors.items()}
    quant_loading.prepare_model(head, {"quantization": quantization}, named)


# ---- the proposer ----------------------------------------------------------------------------------
class MtpProposer(ChainedDrafter):
    """Drafts with the target's own MTP head.

    Its 1-layer cache keeps one committed row per target position (h_i paired with t_{i+1});
    rows written while chaining drafts (depth > 1) are dropped at the next observe.
    """

    method = "mtp"

    def __init__(self, head: MtpHead, hidden: MtpHidden = MtpHidden.POST_NORM, num_real_tokens: int | None = None):
        super().__init__(head, head.cache_specs(), head.settings.hidden_size)
        self.head = head
        self.hidden = MtpHidden(hidden)
        self.num_real_tokens = num_real_tokens  # vocabulary rows past this are padding, never drafted

    def _rows(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache, last: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: ids, positions [B, T], hidden [B, T, H], last [B] ->
        each row's output after mtp.norm at index last [B, 1, H] and its logits [B, V]."""
        out = self.head(ids, hidden, positions, cache)
        rows = torch.arange(ids.shape[0], device=ids.device)
        picked = out[rows, last]
        return picked[:, None], self.head.logits(picked)

    def _greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] -> the greedy drafts [B], never a padded vocabulary row."""
        if self.num_real_tokens is not None and self.num_real_tokens < logits.shape[-1]:
            logits = logits[:, :self.num_real_tokens]
        return logits.argmax(-1)

    def _batch_features(self, out, n_max: int) -> torch.Tensor | None:
        source = out.hidden if self.hidden is MtpHidden.POST_NORM else out.pre_norm
        if source is None:
            return None  # the per-step path raises the error that names what is missing
        return source[:, :n_max]

    def _features(self, step: TargetStep) -> torch.Tensor:
        if self.hidden is MtpHidden.POST_NORM:
            return step.hidden
        if step.pre_norm is None:
            raise VerispecError("--mtp-hidden pre-norm needs the target's pre-norm hidden states, "
                                "which this model does not provide")
        return step.pre_norm

    def _choose(self, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
        """Head logits [V] -> (token id, the distribution it was sampled from [V], or None when greedy)."""
        token, q = choose_draft(logits, params, generator, self.num_real_tokens)
        return int(token), q
