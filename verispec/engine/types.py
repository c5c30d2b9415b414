"""What the engine hands back: token chunks with text, logprobs and, at the end, stats."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from verispec.sampling.sampler import TokenLogprob  # noqa: F401 - part of a chunk


class FinishReason(str, Enum):
    STOP = "stop"  # eos token, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context's end
    CANCELLED = "cancelled"  # the client went away


@dataclass
class GenerationStats:
    method: str = "ar"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    generated_tokens: int = 0
    rounds: int = 0  # target forward passes after prefill
    drafted: int = 0
    accepted: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "cached_tokens": self.cached_tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms": round(self.decode_ms, 3),
            "ttft_ms": round(self.ttft_ms, 3),
        }

    @property
    def prefill_tok_per_s(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1000) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tok_per_s(self) -> float:
        # the first token comes from prefill; decode rate counts the rest
        n = max(self.generated_tokens - 1, 0)
        return n / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0


@dataclass
class GenerationChunk:
    """One step of output: tokens committed this round and the text now safe to show.

    `text` may lag `token_ids` (held back while it could still be the start of a stop string
    or an incomplete UTF-8 sequence); the final chunk flushes whatever remains.
    """

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None  # set on the final chunk only
    # how many of token_ids were drafts the target accepted (in a single round's chunk, the first
    # ones); the rest are the target's own choices (the bonus token, or a plain step's token)
    num_drafted: int = 0
    num_rounds: int = 0  # target passes after prefill that produced these tokens (merged chunks add up)
    # SamplingParams.prompt_logprobs: on a sequence's first chunk, one entry per prompt token after
    # the first (the first token has nothing before it to be predicted from); None on every other
    prompt_logprobs: list[TokenLogprob] | None = None


def merge_chunks(first: GenerationChunk, second: GenerationChunk) -> GenerationChunk:
    """One chunk saying what two consecutive chunks of a generation say."""
    logprobs = None if first.logprobs is None and second.logprobs is None else \
        (first.logprobs or []) + (second.logprobs or [])
    return GenerationChunk(first.token_ids + second.token_ids, first.text + second.text, logprobs,
                           second.finish_reason, second.stats, first.num_drafted + second.num_drafted,
                           first.num_rounds + second.num_rounds,
                           first.prompt_logprobs if first.prompt_logprobs is not None else second.prompt_logprobs)


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens after the first (GenerationChunk's)

    def as_json(self) -> dict:
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason.value,
            "stats": self.stats.as_dict(),
        }
