"""The engine: prompt ids + SamplingParams -> an iterator of token chunks, with stats.

The server only ever talks to this. One generation runs at a time on an engine instance
(the server serialises requests); the KV cache is allocated once and grown when needed.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from verispec import log
from verispec.cache.kv import KVCache, RecurrentLayerSpec
from verispec.engine.cuda_graphs import StepGraphs
from verispec.kernels import decode_attention as split_k
from verispec.config import EngineConfig, env
from verispec.engine.output import OutputBuilder
from verispec.engine.params import SamplingParams
from verispec.engine.sampler import TokenHistory, apply_penalties, make_generator, processed_probs, sample
from verispec.engine.types import GenerationChunk, GenerationResult, GenerationStats
from verispec.errors import InvalidRequestError, VerispecError
from verispec.loading.model_loader import load_model, parse_device, parse_dtype
from verispec.loading.resolve import resolve_model
from verispec.loading.tokenizer import Tokenizer
from verispec.models.base import CausalLM
from verispec.spec.proposer import Draft, Proposer, TargetStep
from verispec.spec.verify import verify_greedy, verify_sampling


DEFAULT_EAGLE3_BLOCK = 2  # drafts per round: the seed system's measured sweet spot


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig,
                 model_dir: Path | None = None, proposer: Proposer | None = None, num_drafts: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = config.model
        self.model_dir = model_dir
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        limit = model.max_position_embeddings
        self.max_model_len = min(config.max_model_len, limit) if config.max_model_len else limit
        if config.prefill_step_size < 1:
            raise VerispecError(f"--prefill-step-size must be >= 1, got {config.prefill_step_size}")
        self.eos_token_ids = tokenizer.eos_token_ids
        # Model vocabularies are often padded past the tokenizer's; those rows are never sampled.
        self.num_real_tokens = min(tokenizer.vocab_size, model.vocab_size)
        self._cache: KVCache | None = None
        self.proposer = proposer
        self.num_drafts = num_drafts if proposer is not None else 0
        if proposer is not None and num_drafts < 1:
            raise VerispecError(f"the number of drafts per round must be >= 1, got {num_drafts}")
        self._graphs: StepGraphs | None = None
        self.use_graphs = self._graphs_possible()
        if self.device.type == "cuda" and config.fuse_small_ops and hasattr(model, "fuse_small_ops"):
            if split_k.triton is None:
                log.debug("small-op fusion off: Triton is not installed")
            else:
                model.fuse_small_ops()  # compiled on first use: prewarm pays for it
        self._lock = threading.Lock()

    @classmethod
    def load(cls, config: EngineConfig) -> "Engine":
        if config.mtp:
            from verispec.spec.mtp import MtpHidden

            if config.eagle3:
                raise VerispecError("--mtp and --eagle3 are two proposers; use one of them")
            if config.mtp_depth < 1:
                raise VerispecError(f"--mtp-depth must be >= 1, got {config.mtp_depth}")
            MtpHidden.parse(config.mtp_hidden)
            from verispec.spec.gemma4_assistant import check_assistant_options

            check_assistant_options(config.num_mtp_tokens, config.assistant_window)
        device = parse_device(config.device)
        dtype = parse_dtype(config.dtype, device)
        model_dir = resolve_model(config.model)
        t0 = time.perf_counter()
        model = load_model(model_dir, dtype, device)
        tokenizer = Tokenizer.from_dir(model_dir)
        log.debug("loaded %s (%s, %s, %s) in %.2fs", model_dir, type(model).__name__, dtype, device,
                  time.perf_counter() - t0)
        proposer, num_drafts = None, 0
        if config.eagle3:
            from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3

            drafter = load_eagle3(config.eagle3, model)
            proposer = Eagle3Proposer(drafter, model.vocab_size)
            num_drafts = config.draft_block or env().eagle3_block or DEFAULT_EAGLE3_BLOCK
            log.debug("EAGLE3 drafter %s: aux layers %s, draft vocab %d, %d drafts per round",
                      config.eagle3, list(drafter.cfg.aux_layer_ids), drafter.cfg.draft_vocab_size, num_drafts)
        elif config.mtp and _is_gemma4(model):
            from verispec.spec.gemma4_assistant import assistant_proposer

            # None (logged) when no assistant checkpoint is found
            proposer, num_drafts = assistant_proposer(config, model, model_dir,
                                                      min(tokenizer.vocab_size, model.vocab_size))
        elif config.mtp:
            from verispec.spec.gemma4_assistant import refuse_assistant_options
            from verispec.spec.mtp import MtpHidden, MtpProposer, load_mtp_head

            refuse_assistant_options(config, model)
            head = load_mtp_head(model_dir, model)  # None (logged) when the model has no head
            if head is not None:
                proposer = MtpProposer(head, MtpHidden.parse(config.mtp_hidden),
                                       num_real_tokens=min(tokenizer.vocab_size, model.vocab_size))
                num_drafts = config.num_mtp_tokens or config.mtp_depth
                log.debug("MTP head: %d drafts per round, %s hidden", num_drafts, config.mtp_hidden)
        return cls(model, tokenizer, config, model_dir, proposer=proposer, num_drafts=num_drafts)

    # ---- request checks -------------------------------------------------------------------
    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The number of new tokens this request may produce; raises on a request that cannot fit."""
        if num_prompt_tokens < 1:
            raise InvalidRequestError("the prompt is empty: at least one token is needed", param="prompt")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens, which leaves no room in this model's "
                f"context length of {self.max_model_len}", param="messages", code="context_length_exceeded")
        if params.max_tokens is None:
            return min(self.config.default_max_tokens, room)
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds this "
                f"model's context length of {self.max_model_len} (at most {room} new tokens fit)",
                param="max_tokens", code="context_length_exceeded")
        return params.max_tokens

    def check_prompt_ids(self, prompt_ids: list[int]) -> None:
        bad = [t for t in prompt_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.model.vocab_size}); got {bad[:5]}", param="prompt")

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[GenerationChunk]:
        """Yield one chunk per target forward pass; the last chunk has finish_reason and stats."""
        self.check_prompt_ids(prompt_ids)
        max_new = self.resolve_max_tokens(len(prompt_ids), params)
        with self._lock:
            yield from self._generate(prompt_ids, params, max_new, cancel)

    def _generate(self, prompt_ids, params, max_new, cancel) -> Iterator[GenerationChunk]:
        proposer = self.proposer
        stats = GenerationStats(method=proposer.method if proposer else "ar", prompt_tokens=len(prompt_ids))
        cache = self._cache_for(len(prompt_ids) + max_new + self.num_drafts + 1)
        generator = make_generator(params.seed if params.seed is not None else self.config.seed, self.device)
        history = TokenHistory(self.model.vocab_size, prompt_ids, self.device)
        out = OutputBuilder(self.tokenizer, params, max_new, history, self.eos_token_ids)
        capture = proposer.capture_layers if proposer else ()

        if cancel is not None and cancel.is_set():  # the client left while queued
            chunk = out.cancel()
            chunk.stats = stats
            yield chunk
            return
        t0 = time.perf_counter()
        if proposer is not None:
            proposer.reset(prompt_ids)
        hidden, aux, last_start, pre_norm = self._prefill(prompt_ids, cache, capture)
        logits = self._logits(hidden[-1:])
        token = self._choose(logits[0], params, history, generator)
        if proposer is not None:
            proposer.observe(TargetStep(prompt_ids[last_start:], last_start, hidden, aux, token, pre_norm))
        _sync(self.device)
        stats.prefill_ms = stats.ttft_ms = (time.perf_counter() - t0) * 1000
        chunk = out.push([token], logits)
        profile = proposer is not None and env().eagle3_profile
        t_decode = time.perf_counter()
        while not out.done:
            if cancel is not None and cancel.is_set():
                chunk = out.cancel()
                break
            yield chunk
            remaining = max_new - len(out.token_ids)
            num_drafts = min(self.num_drafts, remaining - 1) if proposer is not None else 0
            t_round = time.perf_counter()
            draft = proposer.propose(num_drafts, params, generator) if num_drafts > 0 else Draft([])
            if profile:
                _sync(self.device)
                t_drafted = time.perf_counter()
            position = len(prompt_ids) + len(out.token_ids) - 1
            inputs = [token] + draft.token_ids
            hidden, aux, logits, pre_norm = self._verify_pass(inputs, position, cache, capture)
            accepted, token = self._verify(draft, logits, params, history, generator)
            if profile:
                _sync(self.device)
                log.info("[%s] round %d: draft %.2f ms (k=%d), verify %.2f ms, accepted %d", stats.method,
                         stats.rounds + 1, (t_drafted - t_round) * 1000, len(draft.token_ids),
                         (time.perf_counter() - t_drafted) * 1000, accepted)
            cache.commit(accepted + 1)
            stats.rounds += 1
            stats.drafted += len(draft.token_ids)
            stats.accepted += accepted
            if proposer is not None:
                proposer.observe(TargetStep(inputs[:accepted + 1], position, hidden[:accepted + 1],
                                            [a[:accepted + 1] for a in aux], token, _rows(pre_norm, accepted + 1)))
            chunk = out.push(draft.token_ids[:accepted] + [token], logits[:accepted + 1])
        _sync(self.device)
        stats.decode_ms = (time.perf_counter() - t_decode) * 1000
        stats.generated_tokens = len(out.token_ids)
        chunk.stats = stats
        self._log_request(stats, out)
        yield chunk

    def _verify(self, draft: Draft, logits: torch.Tensor, params: SamplingParams, history: TokenHistory,
                generator: torch.Generator) -> tuple[int, int]:
        """logits [k+1, V] from one target pass over [last token] + k drafts -> (accepted, next token).

        Penalties for position i are computed on the committed sequence plus drafts[:i].
        """
        drafts = draft.token_ids

        def penalised(i: int) -> torch.Tensor:
            if not params.has_penalties or i == 0:
                return apply_penalties(logits[i], params, history)
            history.add(drafts[:i])
            try:
                return apply_penalties(logits[i], params, history)
            finally:
                history.remove(drafts[:i])

        if params.greedy and not params.has_penalties:
            choices = logits.argmax(-1).tolist()  # one device sync for the whole round
            return verify_greedy(drafts, lambda i: choices[i])
        if params.greedy:
            return verify_greedy(drafts, lambda i: int(torch.argmax(penalised(i))))
        return verify_sampling(drafts, draft.probs, lambda i: processed_probs(penalised(i), params), generator)

    def generate_all(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        chunks = list(self.generate(prompt_ids, params))
        last = chunks[-1]
        token_ids = [t for c in chunks for t in c.token_ids]
        logprobs = [lp for c in chunks for lp in (c.logprobs or [])] if params.logprobs else None
        return GenerationResult(list(prompt_ids), token_ids, "".join(c.text for c in chunks),
                                last.finish_reason, last.stats, logprobs)

    def prewarm(self) -> float:
        """Capture CUDA graphs, then one short generation, so the first request pays no
        warm-up. Returns seconds taken."""
        t0 = time.perf_counter()
        self.capture_graphs()
        # a prompt of ~100 tokens and a few speculative rounds: the compiled small ops specialise
        # on one-token shapes, so a one-token warm-up would leave the first real prefill to
        # compile its multi-token variants (measured: ~1.8 s added to the first request's TTFT)
        ids = (self.tokenizer.encode("def hello(world):\n    return world + 1\n\n" * 12) or [0])[:PREWARM_PROMPT_TOKENS]
        self.generate_all(ids, SamplingParams(max_tokens=2 * (self.num_drafts + 1) + 1, temperature=0.0,
                                              ignore_eos=True))
        return time.perf_counter() - t0

    # ---- steps ----------------------------------------------------------------------------
    def _graphs_possible(self) -> bool:
        if self.device.type != "cuda":
            return False
        reason = None
        if not self.config.cuda_graphs:
            reason = "disabled (--no-cuda-graphs)"
        elif not split_k.available(self.device):
            reason = "Triton is not installed, so attention cannot read the cache in place"
        if reason:
            log.debug("CUDA graphs off: %s; decode steps run eagerly", reason)
            return False
        return True

    def _cache_for(self, num_rows: int) -> KVCache:
        if self._cache is None:
            if self.use_graphs:
                # graphs hold pointers into the cache: allocate it once, for the whole context
                self._cache = self.model.make_cache(self._graph_cache_rows())
                self._cache.use_decode_kernel = True
            else:
                self._cache = self.model.make_cache(num_rows)
                self._cache.use_decode_kernel = split_k.available(self.device)
        self._cache.reset()
        self._cache.ensure_capacity(num_rows)
        if isinstance(self.proposer, Proposer):
            self.proposer.attach_target_cache(self._cache)
        return self._cache

    def _graph_cache_rows(self) -> int:
        """Rows for the one cache graphs use: the whole context, unless its K/V would take more
        than half the free GPU memory — then the context is capped to what fits, and said so."""
        margin = self.num_drafts + 1
        rows = self.max_model_len + margin
        item = torch.empty((), dtype=self.dtype).element_size()
        row_bytes = sum(2 * s.num_kv_heads * s.head_dim * item for s in self.model.cache_specs()
                        if not isinstance(s, RecurrentLayerSpec))
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = free // 2
        if row_bytes and rows * row_bytes > budget:
            fit = budget // row_bytes
            log.info("the KV cache for the full %d-token context needs %.1f GiB, more than half the free GPU "
                     "memory; serving a context of %d tokens (set --max-model-len to choose)",
                     self.max_model_len, rows * row_bytes / 2**30, fit - margin)
            self.max_model_len = fit - margin
            rows = fit
        return rows

    def capture_graphs(self) -> float:
        """Capture decode/verify steps (T = 1..k+1) as CUDA graphs. Returns seconds taken."""
        if not self.use_graphs or self._graphs is not None:
            return 0.0
        t0 = time.perf_counter()
        cache = self._cache_for(1)
        capture = self.proposer.capture_layers if self.proposer else ()
        self._graphs = StepGraphs(self.model, cache, self.num_drafts + 1, capture, self._logits)
        cache.reset()
        if isinstance(self.proposer, Proposer):
            self.proposer.capture_graphs(self.num_drafts + 1, cache.capacity)
        seconds = time.perf_counter() - t0
        log.debug("captured %d CUDA graphs (steps of 1..%d tokens) in %.2fs", self.num_drafts + 1,
                  self.num_drafts + 1, seconds)
        return seconds

    @torch.inference_mode()
    def _prefill(self, prompt_ids: list[int], cache: KVCache, capture: tuple[int, ...]
                 ) -> tuple[torch.Tensor, list[torch.Tensor], int, torch.Tensor | None]:
        """Chunked prefill. The proposer observes each chunk but the last as it goes (so the
        prompt's features never all sit in memory at once); the last chunk's hidden [n, H] and
        aux [n, H_t] each are returned with its start position, to be observed once the first
        token is chosen. Without a proposer only the last row's hidden is kept."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        step = self.config.prefill_step_size
        proposer = self.proposer
        for start in range(0, ids.shape[1], step):
            chunk = ids[:, start:start + step]
            end = start + chunk.shape[1]
            positions = torch.arange(start, end, device=self.device)[None]
            out = self.model(chunk, positions, cache, capture)
            cache.commit(chunk.shape[1])
            if end < len(prompt_ids) and proposer is not None:
                proposer.observe(TargetStep(prompt_ids[start:end], start, out.hidden[0],
                                            [a[0] for a in out.aux], prompt_ids[end], _rows(out.pre_norm, None, 0)))
        hidden = out.hidden[0] if proposer is not None else out.hidden[0, -1:]
        return hidden, [a[0] for a in out.aux], start, _rows(out.pre_norm, None, 0)

    @torch.inference_mode()
    def _verify_pass(self, token_ids: list[int], position: int, cache: KVCache, capture: tuple[int, ...]
                     ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """One target pass over T = k+1 tokens (T = 1 is a plain decode step), nothing committed.
        Returns hidden [T, H], aux [T, H_t] each, logits [T, V], pre-norm hidden [T, H] or None."""
        step = self._graphs.get(len(token_ids)) if self._graphs is not None else None
        if step is not None:
            return step(token_ids, position)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(position, position + len(token_ids), device=self.device)[None]
        out = self.model(ids, positions, cache, capture)
        hidden = out.hidden[0]
        return hidden, [a[0] for a in out.aux], self._logits(hidden), _rows(out.pre_norm, None, 0)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> logits [B, V] in float32 (float64 stays float64), padding rows masked."""
        logits = self.model.logits(hidden)
        if logits.dtype != torch.float64:
            logits = logits.float()
        if self.num_real_tokens < logits.shape[-1]:
            logits[..., self.num_real_tokens:] = float("-inf")
        return logits

    @torch.inference_mode()
    def _choose(self, logits: torch.Tensor, params: SamplingParams, history: TokenHistory,
                generator: torch.Generator) -> int:
        return sample(apply_penalties(logits, params, history), params, generator)

    def _log_request(self, stats: GenerationStats, out: OutputBuilder) -> None:
        spec = ""
        if stats.drafted:
            spec = (f", {stats.method}: accepted {stats.accepted}/{stats.drafted} "
                    f"({100 * stats.accepted / stats.drafted:.0f}%), "
                    f"{(stats.generated_tokens - 1) / max(stats.rounds, 1):.2f} tokens/round")
        log.debug("request: prompt=%d tokens, generated=%d, ttft=%.1fms, prefill=%.1f tok/s, "
                  "decode=%.1f tok/s, finish=%s%s", stats.prompt_tokens, stats.generated_tokens,
                  stats.ttft_ms, stats.prefill_tok_per_s, stats.decode_tok_per_s,
                  out.finish_reason.value if out.finish_reason else None, spec)


PREWARM_PROMPT_TOKENS = 100


def _is_gemma4(model: CausalLM) -> bool:
    """--mtp on Gemma 4 means its assistant drafter (imported here only: model modules load on demand)."""
    from verispec.models.gemma4 import Gemma4ForCausalLM

    return isinstance(model, Gemma4ForCausalLM)


def _rows(t: torch.Tensor | None, count: int | None, batch_index: int | None = None) -> torch.Tensor | None:
    """Optional tensor helper: select a batch row and/or the first `count` rows."""
    if t is None:
        return None
    if batch_index is not None:
        t = t[batch_index]
    return t if count is None else t[:count]


def load_engine(model: str, **kwargs) -> Engine:
    return Engine.load(replace(EngineConfig(model=model), **kwargs))
