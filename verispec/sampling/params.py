"""SamplingParams: what one request asks of the engine, validated once at the edge."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from verispec.errors import InvalidRequestError

if TYPE_CHECKING:
    from verispec.grammar.spec import GrammarSpec

MAX_TOP_LOGPROBS = 20
# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): logits / 1e-45 overflows float32
# to inf, and softmax of inf - inf is NaN, which torch.multinomial rejects.
GREEDY_TEMPERATURE = 1e-5
# repetition_penalty divides (or multiplies) logits: far from 1 it overflows float32 to inf, which
# would fail the engine step of every sequence in the batch. Useful values are about 1 to 2.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# torch.Generator.manual_seed takes exactly this range (anything else is an OverflowError in a step).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# logit_bias values, as OpenAI's: -100 bans a token in practice, +100 all but forces it.
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: up to the engine's default / the context's end
    temperature: float = 1.0  # 0 (or anything below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + generated tokens (HF/vLLM convention)
    presence_penalty: float = 0.0  # over generated tokens (OpenAI convention)
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # each prompt token's logprob under the model (the first token has none), with this many
    # alternatives; None: not computed. The prompt's passes then keep every row's logits.
    prompt_logprobs: int | None = None
    # token id -> added to its logit after penalties, before temperature and filters; verification
    # uses the biased logits too, so with speculation on the biased distribution is the target's
    logit_bias: dict[int, float] = field(default_factory=dict)
    # constrained decoding: output must match this grammar (verispec.grammar.spec builds one from a
    # JSON schema, "any JSON object" or a tool-call syntax); EOS is allowed only where it is complete
    grammar: GrammarSpec | None = None
    # Not a sampling setting, but per request: prefix-cache blocks are shared only between requests
    # with the same salt (None: the unsalted cache). The server salts by API key and `cache_salt`.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"'{param}' {msg}", param=param)

        # 0 new tokens is a request for the prompt's logprobs alone (scoring a text)
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < least):
            raise bad("max_tokens", f"must be an integer >= 1 (0 only with prompt_logprobs), got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", f"must be between 0 and 2, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"must be between {low} and {high}, got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise bad("seed", f"must be an integer between {MIN_SEED} and {MAX_SEED}, got {self.seed!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be between -2 and 2, got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be between -2 and 2, got {self.frequency_penalty!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise bad("prompt_logprobs", f"must be None or an integer between 0 and {MAX_TOP_LOGPROBS}, "
                      f"got {self.prompt_logprobs!r}")
        low, high = LOGIT_BIAS_RANGE
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {token_id!r}")
            if (isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias)
                    or not low <= bias <= high):
                raise bad("logit_bias", f"values must be numbers between {low:g} and {high:g}, got {bias!r} "
                          f"for token {token_id}")
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias change the target's logits (sampler.apply_penalties)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))
