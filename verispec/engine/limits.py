"""What a request may ask of an engine: its prompt's token ids, the token ids its parameters name,
and how many new tokens fit. One
place for the checks, run by the Engine itself and, in the server's process, by the proxy of an
engine running in its own process (engine/process.py), before any response starts."""
from __future__ import annotations

from dataclasses import dataclass

from verispec.sampling.params import SamplingParams
from verispec.errors import InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int  # prompt + generated tokens
    vocab_size: int  # the model's (token ids must be below it)
    default_max_tokens: int  # new tokens when a request names no max_tokens (capped by the room left)

    def max_new_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The number of new tokens this request may produce; raises on a request that cannot fit (or
        whose logit_bias names a token outside the vocabulary: a bad index would fail a whole step)."""
        bad = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(f"'logit_bias' keys must be token ids in [0, {self.vocab_size}); got {bad[:5]}",
                                      param="logit_bias")
        if num_prompt_tokens < 1:
            raise InvalidRequestError("the prompt is empty: at least one token is needed", param="prompt")
        room = self.max_model_len - num_prompt_tokens
        if room < (0 if params.max_tokens == 0 else 1):  # 0 new tokens (a prompt's logprobs alone) need no room
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens, which leaves no room in this model's "
                f"context length of {self.max_model_len}", param="messages", code="context_length_exceeded")
        if params.max_tokens is None:
            return min(self.default_max_tokens, room)
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds this "
                f"model's context length of {self.max_model_len} (at most {room} new tokens fit)",
                param="max_tokens", code="context_length_exceeded")
        return params.max_tokens

    def check_prompt_ids(self, prompt_ids: list[int]) -> None:
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}",
                                      param="prompt")
