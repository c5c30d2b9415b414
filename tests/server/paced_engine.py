"""An engine double for the chat page: scripted pieces at a chosen pace, each with how many of its
tokens were accepted drafts, that notices cancellation the way the real engine does."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from verispec.engine.types import FinishReason, GenerationChunk, GenerationStats
from server_helpers import ScriptedEngine


@dataclass
class Piece:
    text: str
    num_tokens: int = 1
    num_drafted: int = 0  # of num_tokens, from the start, accepted drafts


class FakeProposer:
    def __init__(self, method: str):
        self.method = method


class PacedEngine(ScriptedEngine):
    """Plays `script` (a list of Piece) one chunk every `delay_s`, speculating as `method` claims."""

    def __init__(self, tokenizer, method: str = "eagle3", num_drafts: int = 3):
        super().__init__(tokenizer)
        self.script: list[Piece] = [Piece("hello")]
        self.delay_s = 0.0
        self.proposer = FakeProposer(method) if method != "ar" else None
        self.method = method  # what describe() reports (EngineDouble)
        self.num_drafts = num_drafts if method != "ar" else 0
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.cancelled = threading.Event()  # set when a generation ended because its client left
        self.finished = threading.Event()
        self.last_prompt_ids: list[int] = []
        self.last_params = None

    def generate(self, prompt_ids, params, cancel=None):
        self.last_prompt_ids, self.last_params = list(prompt_ids), params
        self.cancelled.clear()
        self.finished.clear()
        stats = GenerationStats(method=self.proposer.method if self.proposer else "ar",
                                prompt_tokens=len(prompt_ids))
        for i, piece in enumerate(self.script):
            if cancel is not None and cancel.is_set():
                self.cancelled.set()
                yield GenerationChunk([], "", None, FinishReason.CANCELLED, stats)
                return
            last = i == len(self.script) - 1
            stats.generated_tokens += piece.num_tokens
            if i:  # the first piece stands for prefill's token; every later one is a round
                stats.rounds += 1
                stats.drafted += self.num_drafts
                stats.accepted += piece.num_drafted
            stats.decode_ms = max(stats.decode_ms, 1.0) + self.delay_s * 1000
            yield GenerationChunk([1] * piece.num_tokens, piece.text, None,
                                  FinishReason.STOP if last else None, stats if last else None,
                                  num_drafted=piece.num_drafted, num_rounds=1 if i else 0)
            if not last:
                time.sleep(self.delay_s)
        self.finished.set()


def rounds_of(text: str, pattern: list[int], num_drafts: int = 3) -> list[Piece]:
    """Splits text into word-ish rounds; the i-th round accepts pattern[i % len] drafts of num_drafts
    (so it carries that many + 1 tokens): a plausible speculative reply for the screenshot and tests."""
    words = text.split(" ")
    pieces, i, at = [Piece(words[0], 1, 0)], 0, 1
    while at < len(words):
        accepted = min(pattern[i % len(pattern)], num_drafts)
        take = accepted + 1
        pieces.append(Piece(" " + " ".join(words[at:at + take]), take, accepted))
        at += take
        i += 1
    return pieces
