"""Turns accepted tokens into output, one token at a time, deciding when generation ends.

Every decoding method (plain, and each speculative one) hands its accepted tokens here, so
eos, stop ids, stop strings and max_tokens are checked after every token, including between
accepted drafts and the bonus token.
"""
from __future__ import annotations

import torch

from verispec.engine.detok import IncrementalDetokenizer, StopMatcher
from verispec.sampling.params import SamplingParams
from verispec.sampling.sampler import TokenHistory, token_logprobs
from verispec.engine.types import FinishReason, GenerationChunk, TokenLogprob
from verispec.loading.tokenizer import Tokenizer


class OutputBuilder:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, max_new_tokens: int,
                 history: TokenHistory, eos_token_ids: list[int]):
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.history = history
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(params.stop)
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_token_ids)
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        # filled by the prompt's passes (engine/prompt_logprobs.py), sent once, on the first chunk
        self.prompt_logprobs: list[TokenLogprob] | None = [] if params.prompt_logprobs is not None else None
        self._prompt_logprobs_sent = False
        self.finish_reason: FinishReason | None = None
        self.stopped_by_string = False  # the matcher already cut the text: nothing to flush

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token_ids: list[int], raw_logits: torch.Tensor | None = None,
             grammar_done: bool = False) -> GenerationChunk:
        """Emit tokens in order until one finishes the generation; the rest are dropped.

        raw_logits [len(token_ids), V]: the target's logits each token was chosen from (for logprobs).
        grammar_done: the request's grammar admits nothing after these tokens, which ends it (stop).
        Returns the chunk for this round (its token_ids are the ones actually emitted).
        """
        emitted: list[int] = []
        text = ""
        round_logprobs: list[TokenLogprob] = []
        # without stop strings nothing depends on the text between tokens: the round's tokens are
        # detokenized in one go (two decodes per round, not two per token)
        whole_round = not self.stops.stops
        to_text: list[int] = []
        for i, tok in enumerate(token_ids):
            if self.done:
                break
            emitted.append(tok)
            self.token_ids.append(tok)
            if tok in self.stop_ids:
                # an end token has no text, so it gets no logprob either: the logprob tokens join
                # to the text, as OpenAI returns them
                self.finish_reason = FinishReason.STOP
                continue
            if self.params.logprobs and raw_logits is not None:
                round_logprobs.append(token_logprobs(raw_logits[i], tok, self.params.top_logprobs))
            if whole_round:
                to_text.append(tok)
            else:
                released, stopped = self.stops.feed(self.detok.add([tok]))
                text += released
                if stopped:
                    self.finish_reason = FinishReason.STOP
                    self.stopped_by_string = True
            if not self.done and len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = FinishReason.LENGTH
        self.history.add(emitted)
        if to_text:
            text += self.detok.add(to_text)
        # a grammar completed by the last token ends the generation, even if max_tokens ran out there too
        if grammar_done and (not self.done or (self.finish_reason is FinishReason.LENGTH
                                               and len(emitted) == len(token_ids))):
            self.finish_reason = FinishReason.STOP
        if self.done and not self.stopped_by_string:
            text += self._flush()
        self.logprobs.extend(round_logprobs)
        self.text_parts.append(text)
        return GenerationChunk(emitted, text, round_logprobs if self.params.logprobs else None,
                               self.finish_reason, prompt_logprobs=self._first_prompt_logprobs())

    def prompt_only(self) -> GenerationChunk:
        """The only chunk of a request for no new tokens (max_tokens 0: its prompt's logprobs)."""
        self.finish_reason = FinishReason.LENGTH
        return GenerationChunk([], "", [] if self.params.logprobs else None, self.finish_reason,
                               prompt_logprobs=self._first_prompt_logprobs())

    def _first_prompt_logprobs(self) -> list[TokenLogprob] | None:
        if self.prompt_logprobs is None or self._prompt_logprobs_sent:
            return None
        self._prompt_logprobs_sent = True
        return self.prompt_logprobs

    def cancel(self) -> GenerationChunk:
        self.finish_reason = FinishReason.CANCELLED
        text = self._flush()
        self.text_parts.append(text)
        return GenerationChunk([], text, [] if self.params.logprobs else None, self.finish_reason)

    def _flush(self) -> str:
        """Release held-back text at the end (not after a stop string: that text is cut)."""
        released, stopped = self.stops.feed(self.detok.flush())
        return released + ("" if stopped else self.stops.flush())

    @property
    def text(self) -> str:
        return "".join(self.text_parts)
