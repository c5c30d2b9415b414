"""The Gemma 4 "assistant" MTP drafter (model_type `gemma4_assistant`) and the proposer that runs it.

A small separate checkpoint trained with one backbone (see shared/reference/gemma4.md; the oracle is
transformers' `Gemma4AssistantForCausalLM` driven by `SinglePositionMultiTokenCandidateGenerator`).
It has no K/V of its own: every layer is query-only attention over the *target's* cached K/V of
the last target layer of the same type (already normed and roped). One draft step:

    x    = pre_projection(cat(target.embed(tok) * sqrt(H_target), h))     # embedding first
    x    = layers(x)      # Gemma 4 decoder layers; q RoPE at one constant position per round
    hn   = norm(x);   logits = lm_head(hn)   (tied to its own embed_tokens; or centroid-masked)
    h    = post_projection(hn)                                              # fed to the next step
    tok  = argmax(logits)  (or a sample from the processed distribution)

Seed of a round: h = the target's post-final-norm hidden at the last committed position P-1 and
tok = the target's token for position P (the bonus token). Within a round the target's cache is
fixed, so the drafts never see each other's K/V; they chain only through h and tok.

Positions, as transformers defines them: the query RoPE position is P (`input_ids.shape[1] - 1`
in the candidate generator: the position of the token being embedded) for every step of the
round. The keys are the committed rows 0..P-1 only: attention is bounded by the *last committed
row* P-1, never by P, because row P onward of the target's cache holds rejected K/V from the last
verify pass (the engine's commit(n) keeps them out of cache.length but not out of the buffer).
Full layers see every committed row; sliding layers see the last sliding_window + 1 rows
(transformers' bidirectional sliding mask is inclusive: |q - k| <= window, flipped to the past).
`--assistant-window W` caps every layer to the last W rows (SwiftLM PR #109's cap of 16 for long
contexts): the drafts change, the output does not (verification is unchanged).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from verispec import log
from verispec.cache.kv import KVCache
from verispec.cache.paged import BatchCache
from verispec.config import EngineConfig
from verispec.sampling.params import SamplingParams
from verispec.errors import ModelNotFoundError, VerispecError
from verispec.loading.resolve import HUB_ID, resolve_model
from verispec.loading.weights import checkpoint_files, iter_tensors
from verispec.models.base import CausalLM
from verispec.models.gemma4 import Gemma4ForCausalLM, Gemma4Settings, Gemma4TextModel, LayerType
from verispec.models.layers.attention import AttentionInputs
from verispec.models.layers.rotary import RotaryEmbedding
from verispec.spec.drafting import choose_draft
from verispec.spec.proposer import Draft, Proposer, TargetCache, drafts_per_row

ASSISTANT_MODEL_TYPE = "gemma4_assistant"
DEFAULT_NUM_MTP_TOKENS = 2  # drafts per round: SwiftLM's default (depth 4 measured worse there)
SIBLING_SUFFIX = "-assistant"  # google/gemma-4-31B-it -> google/gemma-4-31B-it-assistant


class AssistantConfig:
    """The fields of a `gemma4_assistant` config.json, checked against the target it will read."""

    def __init__(self, raw: dict, target: Gemma4ForCausalLM, where: Path):
        if raw.get("model_type") != ASSISTANT_MODEL_TYPE:
            raise VerispecError(f"{where} is not a Gemma 4 assistant checkpoint: its config.json has model_type "
                                f"{raw.get('model_type')!r}, expected '{ASSISTANT_MODEL_TYPE}'")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise VerispecError(f"{where}/config.json has no text_config object (the assistant's decoder layers)")
        for key, off in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False),
                         ("use_double_wide_mlp", False)):
            if text.get(key, off) not in (off, None):
                raise VerispecError(f"Gemma 4 assistant at {where}: text_config.{key} must be {off!r} "
                                    f"(as transformers requires), got {text[key]!r}")
        num_layers = int(text.get("num_hidden_layers", 30))  # Gemma4TextConfig's default
        num_shared = int(text.get("num_kv_shared_layers") or num_layers)  # transformers: 0/None -> all
        if num_shared != num_layers:
            raise VerispecError(f"Gemma 4 assistant at {where}: all {num_layers} layers must read the target's "
                                f"K/V (num_kv_shared_layers {num_shared})")
        text = dict(text, hidden_size_per_layer_input=0)
        tie = bool(raw.get("tie_word_embeddings", True))
        types = Gemma4Settings(text, tie, kv_sources=[None] * num_layers).layer_types
        sources = [target.kv_owner_layer(t) for t in types]
        self.settings = s = Gemma4Settings(text, tie, kv_sources=sources)
        self.backbone_hidden_size = int(raw.get("backbone_hidden_size", 1536))
        self.use_ordered_embeddings = bool(raw.get("use_ordered_embeddings", False))
        self.num_centroids = int(raw.get("num_centroids", 2048))
        self.centroid_top_k = int(raw.get("centroid_intermediate_top_k", 32))
        ts = target.settings
        if self.backbone_hidden_size != target.hidden_size:
            raise VerispecError(f"Gemma 4 assistant at {where} was trained for a backbone of hidden size "
                                f"{self.backbone_hidden_size}; the target has hidden size {target.hidden_size}")
        if s.vocab_size != target.vocab_size:
            raise VerispecError(f"Gemma 4 assistant at {where} has a vocabulary of {s.vocab_size} tokens; the "
                                f"target has {target.vocab_size}")
        for i, (t, src) in enumerate(zip(s.layer_types, sources)):
            if s.head_dims[i] != ts.head_dims[src] or s.num_heads % ts.num_kv_heads[src]:
                raise VerispecError(f"Gemma 4 assistant at {where}: layer {i} ({t.value}) has {s.num_heads} heads "
                                    f"of dim {s.head_dims[i]}, but it reads target layer {src} with "
                                    f"{ts.num_kv_heads[src]} kv heads of dim {ts.head_dims[src]}")
        if self.use_ordered_embeddings and (self.num_centroids < 1 or s.vocab_size % self.num_centroids
                                            or not 0 < self.centroid_top_k <= self.num_centroids):
            raise VerispecError(f"Gemma 4 assistant at {where}: {self.num_centroids} centroids with top-k "
                                f"{self.centroid_top_k} do not split a vocabulary of {s.vocab_size}")


class MaskedEmbedder(nn.Module):
    """Centroid-masked logits (`use_ordered_embeddings`, the small E-series assistants): score the
    centroids, keep the top-k clusters' tokens, and give every other token the smallest kept
    logit minus 1, as transformers' Gemma4AssistantMaskedEmbedder does."""

    def __init__(self, c: AssistantConfig):
        super().__init__()
        s = c.settings
        self.top_k = c.centroid_top_k
        self.num_centroids = c.num_centroids
        self.vocab_size = s.vocab_size
        self.centroids = nn.Linear(s.hidden_size, c.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(s.vocab_size, dtype=torch.long))

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H], lm_head_weight [V, H] -> logits [B, T, V]."""
        b, t, h = hidden.shape
        top = torch.topk(self.centroids(hidden), k=self.top_k, dim=-1).indices  # [B, T, k]
        clusters = self.token_ordering.view(self.num_centroids, -1)  # [C, V / C] token ids
        selected = clusters[top].reshape(b, t, -1)  # [B, T, k * V / C]
        embeddings = lm_head_weight[selected.reshape(-1)].view(b, t, -1, h)
        selected_logits = (hidden.unsqueeze(-2) @ embeddings.transpose(-1, -2)).squeeze(-2)
        out = hidden.new_empty((b, t, self.vocab_size))
        out.fill_(selected_logits.min() - 1.0)  # a device value, not .item(): no sync per step
        return out.scatter_(-1, selected, selected_logits)


class Gemma4AssistantDrafter(nn.Module):
    """The assistant's weights under the checkpoint's names (model.*, pre/post_projection,
    lm_head, masked_embedding.*). Its decoder layers are verispec's Gemma 4 layers built with
    kv_sources = the target layers they read (so they have no k/v projections)."""

    def __init__(self, c: AssistantConfig):
        super().__init__()
        s = c.settings
        self.cfg = c
        self.model = Gemma4TextModel(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.pre_projection = nn.Linear(2 * c.backbone_hidden_size, s.hidden_size, bias=False)
        self.post_projection = nn.Linear(s.hidden_size, c.backbone_hidden_size, bias=False)
        self.masked_embedding = MaskedEmbedder(c) if c.use_ordered_embeddings else None
        self.rotary = nn.ModuleDict({t.value: RotaryEmbedding(s.rope[t], s.head_dim_of(t)) for t in s.rope})
        # transformers' inclusive bidirectional sliding mask: window + 1 rows in our convention
        self.base_windows = [s.sliding_window + 1 if t is LayerType.SLIDING else None for t in s.layer_types]

    def tie_weights(self) -> None:
        if self.cfg.settings.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def logits(self, hn: torch.Tensor) -> torch.Tensor:
        """hn [B, T, H] (after the final norm) -> [B, T, V]. No softcapping, as in transformers."""
        if self.masked_embedding is not None:
            return self.masked_embedding(hn, self.lm_head.weight)
        return self.lm_head(hn)

    def forward(self, inputs: torch.Tensor, rope_positions: torch.Tensor, last_rows: torch.Tensor,
                num_rows: int, target_cache: KVCache, max_window: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [B, T, 2 * H_target] = cat(scaled target embedding, target-sized hidden);
        rope_positions [B, T]: the queries' RoPE position; last_rows [B, T]: the last cache row each
        may see (num_rows: the largest last row + 1, as a host int). Reads `target_cache`, writes nothing.
        Returns (post_projection(hn) [B, T, H_target], logits [B, T, V])."""
        x = self.pre_projection(inputs)
        rope = {t: self.rotary[t](rope_positions, x.dtype) for t in self.rotary}
        attn_inputs = AttentionInputs(last_rows, target_cache)
        # AttentionInputs counts this pass's T rows as keys; the assistant adds none, and the rows
        # past the committed ones hold the last verify pass's rejected K/V
        attn_inputs.num_keys = num_rows
        for layer, window in zip(self.model.layers, self.base_windows):
            if max_window is not None:
                window = max_window if window is None else min(window, max_window)
            layer.self_attn.window = window
            cos, sin = rope[layer.self_attn.layer_type.value]
            x = layer(x, None, cos, sin, attn_inputs)
        hn = self.model.norm(x)
        return self.post_projection(hn), self.logits(hn)


def read_assistant_config(where: Path) -> dict:
    path = where / "config.json"
    if not path.is_file():
        raise VerispecError(f"{where} is not a Gemma 4 assistant checkpoint: it has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise VerispecError(f"{path} is not valid JSON: {exc}") from exc


def load_assistant(assistant_dir: str | Path, target: Gemma4ForCausalLM) -> Gemma4AssistantDrafter:
    """A `gemma4_assistant` checkpoint directory (config.json + safetensors) on the target's
    device and dtype; refused with one line when it does not fit the target."""
    where = Path(assistant_dir).expanduser()
    c = AssistantConfig(read_assistant_config(where), target, where)
    param = next(target.parameters())
    with torch.device("meta"):
        drafter = Gemma4AssistantDrafter(c)
    drafter.to_empty(device=param.device)
    drafter.to(param.dtype)
    expected = dict(drafter.named_parameters())
    expected.update(drafter.named_buffers())
    loaded, ignored = set(), []
    for name, tensor in iter_tensors(checkpoint_files(where)):
        if name not in expected:
            ignored.append(name)  # e.g. k/v projections of shared layers, which transformers drops too
            continue
        target_tensor = expected[name]
        if tuple(tensor.shape) != tuple(target_tensor.shape):
            raise VerispecError(f"Gemma 4 assistant tensor '{name}' in {where} has shape {tuple(tensor.shape)}; "
                                f"its config and the target imply {tuple(target_tensor.shape)}")
        with torch.no_grad():
            target_tensor.copy_(tensor.to(target_tensor.dtype))
        loaded.add(name)
    tied = {"lm_head.weight"} if c.settings.tie_word_embeddings else set()
    missing = sorted(set(expected) - loaded - tied)
    if missing:
        shown = ", ".join(missing[:6]) + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else "")
        raise VerispecError(f"Gemma 4 assistant at {where} is missing tensors: {shown}")
    if drafter.masked_embedding is not None:
        ordering = drafter.masked_embedding.token_ordering
        if int(ordering.min()) < 0 or int(ordering.max()) >= c.settings.vocab_size:
            raise VerispecError(f"Gemma 4 assistant at {where}: token_ordering has ids outside the vocabulary "
                                f"of {c.settings.vocab_size}")
    drafter.tie_weights()
    drafter.eval().requires_grad_(False)
    if ignored:
        log.debug("Gemma 4 assistant: ignored %d tensors (e.g. %s)", len(ignored), ", ".join(ignored[:3]))
    return drafter


# ---- where the assistant is ------------------------------------------------------------------------
def _snapshot_hub_id(model_dir: Path) -> str | None:
    """org/name for a hub-cache snapshot directory (.../models--org--name/snapshots/<hash>)."""
    repo = model_dir.parent.parent
    if model_dir.parent.name == "snapshots" and repo.name.startswith("models--"):
        parts = repo.name[len("models--"):].split("--")
        if len(parts) == 2:
            return "/".join(parts)
    return None


def find_assistant(model_arg: str, model_dir: Path, explicit: str | None) -> Path | None:
    """The assistant checkpoint for a target: `explicit` (--mtp-model; resolved like -m, errors
    raised), else a sibling directory `<name>-assistant` next to the target's directory, else the
    hub id `<org>/<name>-assistant` in the model caches (no download). None (with one log line
    naming where it looked) when there is none."""
    if explicit:
        try:
            return resolve_model(explicit)
        except ModelNotFoundError as exc:
            raise VerispecError(f"--mtp-model: {exc.message}") from None
    looked: list[str] = []
    hub_id = model_arg if HUB_ID.match(model_arg) and not Path(model_arg).expanduser().exists() else None
    for d in dict.fromkeys(p for p in (Path(model_arg).expanduser(), model_dir) if p.is_dir()):
        snapshot_of = _snapshot_hub_id(d)
        if snapshot_of is not None:  # a snapshot's siblings are other revisions: look up the hub id
            hub_id = hub_id or snapshot_of
            continue
        sibling = d.parent / (d.name + SIBLING_SUFFIX)
        if (sibling / "config.json").is_file():
            return sibling
        looked.append(str(sibling))
    if hub_id is not None:
        try:
            return resolve_model(hub_id + SIBLING_SUFFIX, allow_download=False)
        except ModelNotFoundError:
            looked.append(f"{hub_id}{SIBLING_SUFFIX} in the model caches")
    log.warning("--mtp: no Gemma 4 assistant checkpoint for %s (looked for %s; name one with --mtp-model DIR); "
                "decoding without speculation", model_arg, ", ".join(looked) or "nothing to derive a name from")
    return None


# ---- the proposer ----------------------------------------------------------------------------------
class AssistantProposer(Proposer):
    """Drafts with a Gemma 4 assistant reading the target's KV cache: one assistant pass per
    chained step for every sequence, each row reading its own sequence's committed target rows
    (the last verify pass's rejected K/V sit past them). It keeps no K/V of its own."""

    method = "assistant"

    def __init__(self, drafter: Gemma4AssistantDrafter, target: Gemma4ForCausalLM,
                 num_real_tokens: int | None = None, window: int | None = None):
        self.drafter = drafter
        self.target = target
        self.window = window  # attend to at most the last `window` target positions (None: all)
        self.num_real_tokens = num_real_tokens  # vocabulary rows past this are padding, never drafted
        self.device = next(drafter.parameters()).device
        self._target: TargetCache | None = None
        self._states: dict[int, _AssistantRow] = {}

    def bind(self, target: TargetCache) -> None:
        self._target = target
        self._states = {}

    def capture_graphs(self, batch_sizes: list[int], max_tokens: int, table_width: int) -> None:
        """Not captured: its passes read the target's rows up to a per-row bound and run eagerly."""
        log.debug("Gemma 4 assistant: drafting runs eagerly (no CUDA graphs)")

    def start(self, seq) -> None:
        self._states.pop(seq.id, None)

    def release(self, seq) -> None:
        self._states.pop(seq.id, None)

    def observe(self, rows: list) -> None:
        for seq, step in rows:
            # a copy: a CUDA-graph output view is overwritten by the next replay
            self._states[seq.id] = _AssistantRow(step.hidden[-1:].clone(), step.next_token,
                                                 step.start_position + len(step.token_ids))

    @torch.inference_mode()
    def propose(self, seqs, num_drafts: list[int], params: list, generators: list) -> list[Draft]:
        device, k = self.device, max(num_drafts)
        states = [self._states[s.id] for s in seqs]
        last = self._last_rows(seqs)
        rope_positions = torch.tensor([[st.next_position] for st in states], device=device)
        last_rows = torch.tensor([[row] for row in last], device=device)
        num_keys = max(last) + 1
        target_rows = BatchCache(self._target.pools, self._target.tables(seqs), last_rows, None, num_keys,
                                 self._target.use_kernel)
        token = torch.tensor([[st.next_token] for st in states], dtype=torch.long, device=device)
        hidden = torch.stack([st.hidden for st in states])  # [B, 1, H_target]
        chosen, probs = [], []
        for i in range(k):
            inputs = torch.cat((self.target.embed(token), hidden), dim=-1)
            hidden, logits = self.drafter(inputs, rope_positions, last_rows, num_keys, target_rows, self.window)
            row_logits = logits[:, -1]
            if self.num_real_tokens is not None and self.num_real_tokens < row_logits.shape[-1]:
                row_logits = row_logits[:, :self.num_real_tokens]
            tokens = row_logits.argmax(-1)
            step_probs: list[torch.Tensor | None] = [None] * len(seqs)
            for b, p in enumerate(params):
                if not p.greedy and i < num_drafts[b]:  # a row past its count draws nothing
                    drawn, step_probs[b] = self._choose(logits[b, -1], p, generators[b])
                    tokens[b] = drawn[0]
            chosen.append(tokens)
            probs.append(step_probs)
            token = tokens[:, None]
        return drafts_per_row(chosen, probs, num_drafts)

    def _last_rows(self, seqs) -> list[int]:
        """Each sequence's last committed row: the last verify pass's rejected K/V sit at num_cached on."""
        return [min(seq.num_cached, self._states[seq.id].next_position) - 1 for seq in seqs]

    def _choose(self, logits: torch.Tensor, params: SamplingParams, generator
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [V] -> (token id [1] on the device, the distribution it was sampled from [V] or
        None when greedy)."""
        return choose_draft(logits, params, generator, self.num_real_tokens)


@dataclass
class _AssistantRow:
    hidden: torch.Tensor  # [1, H_target] post-norm hidden at the sequence's last committed row
    next_token: int
    next_position: int  # the position of next_token: the round's RoPE position


# ---- engine wiring --------------------------------------------------------------------------------
def check_assistant_options(assistant_window: int | None) -> None:
    if assistant_window is not None and assistant_window < 1:
        raise VerispecError(f"--assistant-window must be >= 1, got {assistant_window}")


def refuse_assistant_options(config: EngineConfig, target: CausalLM) -> None:
    """--mtp on a target that is not Gemma 4 (its MTP head, if any, is in its own checkpoint)."""
    for flag, value in (("--mtp-model", config.mtp_model), ("--assistant-window", config.assistant_window)):
        if value is not None:
            raise VerispecError(f"{flag} is for a Gemma 4 assistant drafter, but the target is a "
                                f"{target.config.get('model_type')!r} model (not gemma4 / gemma4_text)")


def assistant_proposer(config: EngineConfig, target: Gemma4ForCausalLM, model_dir: Path,
                       num_real_tokens: int) -> tuple[AssistantProposer | None, int]:
    """--mtp on a Gemma 4 target: (the assistant proposer, drafts per round), or (None, 0) with
    one log line when no assistant checkpoint is found."""
    where = find_assistant(config.model, model_dir, config.mtp_model)
    if where is None:
        return None, 0
    drafter = load_assistant(where, target)
    num_drafts = config.num_draft_tokens or DEFAULT_NUM_MTP_TOKENS
    log.debug("Gemma 4 assistant %s: %d layers reading target layers %s, %s per round, window %s",
              where, len(drafter.model.layers), drafter.cfg.settings.kv_sources, log.count(num_drafts, "draft"),
              config.assistant_window or "all")
    return AssistantProposer(drafter, target, num_real_tokens, config.assistant_window), num_drafts
