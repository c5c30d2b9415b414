"""Logits -> next token: penalties, temperature, top-k, top-p, min-p, seeded sampling, logprobs.

Processing order (the same as vLLM): penalties on raw logits, then temperature, then top-k,
top-p and min-p as filters. `processed_probs` returns the final distribution, which speculative
sampling compares between drafter and target. A seeded request's sample is fixed by its seed and
the token's position (sampling/seeded.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from verispec.sampling.params import SamplingParams
from verispec.sampling.seeded import seeded_sample


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # [(token_id, logprob)], best first


class TokenHistory:
    """Counts of prompt and generated tokens, for penalties, and the request's logit bias as a tensor. Counts are kept on the host and the
    device tensors built only when a penalty reads them: most requests have no penalties, and a
    device update per token per sequence would cost a kernel launch each in a batched step."""

    def __init__(self, vocab_size: int, prompt_ids: list[int], device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.prompt_ids = prompt_ids
        self.counts: Counter[int] = Counter()
        self._in_prompt: torch.Tensor | None = None
        self._output_counts: torch.Tensor | None = None  # built from `counts`, dropped when they change
        self._bias: torch.Tensor | None = None

    def add(self, token_ids: list[int]) -> None:
        if token_ids:
            self.counts.update(token_ids)
            self._output_counts = None

    def remove(self, token_ids: list[int]) -> None:
        """Undo `add` (verification scores drafts provisionally)."""
        if token_ids:
            self.counts.subtract(token_ids)
            self._output_counts = None

    @property
    def in_prompt(self) -> torch.Tensor:  # [V] bool
        if self._in_prompt is None:
            self._in_prompt = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            ids = [i for i in self.prompt_ids if 0 <= i < self.vocab_size]
            if ids:
                self._in_prompt[torch.tensor(ids, dtype=torch.long, device=self.device)] = True
        return self._in_prompt

    def bias(self, logit_bias: dict[int, float]) -> torch.Tensor:  # [V] float32
        """The request's logit_bias (fixed for its life) as a dense row, built once."""
        if self._bias is None:
            bias = torch.zeros(self.vocab_size, dtype=torch.float32)
            for token_id, value in logit_bias.items():
                if 0 <= token_id < self.vocab_size:
                    bias[token_id] = float(value)
            self._bias = bias.to(self.device)
        return self._bias

    @property
    def output_counts(self) -> torch.Tensor:  # [V] int32
        if self._output_counts is None:
            counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
            present = [(t, c) for t, c in self.counts.items() if c and 0 <= t < self.vocab_size]
            if present:
                ids, values = zip(*present)
                counts[torch.tensor(ids, dtype=torch.long, device=self.device)] = torch.tensor(
                    values, dtype=torch.int32, device=self.device)
            self._output_counts = counts
        return self._output_counts


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """logits [V] (float32) -> penalised and biased logits [V]."""
    if not params.adjusts_logits:
        return logits
    logits = _penalised(logits, params, history)
    if params.logit_bias:
        logits = logits + history.bias(params.logit_bias).to(logits.dtype)
    return logits


def _penalised(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    if not (params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty):
        return logits
    counts = history.output_counts
    seen_output = counts > 0
    if params.repetition_penalty != 1.0:
        seen = seen_output | history.in_prompt
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts.to(logits.dtype)
    if params.presence_penalty:
        logits = logits - params.presence_penalty * seen_output.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [..., V] with top-k / top-p / min-p filtered out as -inf."""
    logits = logits / params.temperature
    neg_inf = torch.finfo(logits.dtype).min
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, neg_inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token if the mass strictly before it is < top_p (the first token always stays)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        threshold = params.min_p * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, neg_inf)
    return logits


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Penalised logits [..., V] -> the sampling distribution [..., V] (float32)."""
    return filter_logits(logits.float(), params).softmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           seeded_at: tuple[int, int] | None = None) -> int:
    """Penalised logits [V] -> one token id (argmax when greedy). seeded_at: (seed, absolute
    position) of a seeded request, whose sample is fixed by them (sampling/seeded.py); else the
    generator draws."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = processed_probs(logits, params)
    if seeded_at is not None:
        return seeded_sample(probs, *seeded_at)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(raw_logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """The model's own log-probabilities (before penalties and filters) for the chosen token."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = torch.topk(logprobs, top_n)
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


def rows_token_logprobs(raw_logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """token_logprobs for many rows at once: raw_logits [R, V], row r scoring token_ids[r]. One
    transfer to the host for all rows (prompt logprobs score every prompt token)."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logprobs.device)[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if top_n:
        values, ids = torch.topk(logprobs, top_n, dim=-1)
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, v, top) for t, v, top in zip(token_ids, chosen, tops)]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
