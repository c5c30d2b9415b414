"""One request's state inside the engine: nothing else holds per-request state.

A sequence's tokens are its prompt followed by what it generated. `num_cached` counts the
positions whose K/V (and recurrent state) are committed in the paged cache. While decoding, every
token but the last is cached (the last chosen token is fed by the next step); after a preemption
`num_cached` is 0 and the sequence is prefilled again over all its tokens but the last.
"""
from __future__ import annotations

import itertools
import threading
import time
from enum import Enum
from typing import Callable

from verispec.cache.prefix import chain_hashes, root_hash
from verispec.engine.output import OutputBuilder
from verispec.sampling.params import SamplingParams
from verispec.engine.types import GenerationChunk, GenerationStats

_ids = itertools.count(1)


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class EndsOnce:
    """A request's sink that passes on items until one ends the request (an exception, or a chunk
    with a finish reason), and drops whatever comes after it, from any thread. `on_end` is called
    once it has ended."""

    def __init__(self, sink: Callable[[object], None]):
        self._sink = sink
        self._lock = threading.Lock()
        self.ended = False
        self.on_end: Callable[[], None] | None = None

    def __call__(self, item) -> None:
        with self._lock:
            if self.ended:
                return
            ending = isinstance(item, BaseException) or getattr(item, "finish_reason", None) is not None
            self.ended = ending
            self._sink(item)
        if ending and self.on_end is not None:
            self.on_end()


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int, out: OutputBuilder,
                 generator, method: str, sink: Callable[[object], None], cancel: threading.Event | None = None,
                 block_size: int = 16, seed: int | None = None):
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.out = out
        self.history = out.history
        self.generator = generator  # unseeded sampling, and drafters' own draws
        # the request's seed (or the server's): its samples are fixed per position (sampling/seeded.py)
        self.seed = seed
        self.stats = GenerationStats(method=method, prompt_tokens=len(prompt_ids))
        # receives GenerationChunk objects, or an exception that ended the request; once ended, nothing
        # more (a lost tensor-parallel rank fails a request from another thread: engine.py)
        self.sink = EndsOnce(sink)
        self.cancel = cancel or threading.Event()
        self.status = SequenceStatus.WAITING
        self.block_size = block_size  # the paged cache's (block hashes are per block)
        self.block_table: list[int] = []
        self.table_row = None  # (table length, host tensor row) cached for graph inputs (cache.paged.block_table_rows)
        self.state_slot: int | None = None  # recurrent-state slot (hybrid models)
        self.num_cached = 0
        # prefix cache (verispec/cache/prefix.py): hashes of full blocks of token_ids (grown on
        # demand: tokens only ever append), blocks of the table registered so far, the hit this
        # admission took (consumed by the first prefill chunk), the latest decode-time snapshot
        self._block_hashes: list[bytes] = []
        self._root_hash = root_hash(params.cache_salt)
        self.num_registered = 0
        self.prefix_hit = None
        self.decode_snapshot: bytes | None = None
        self.drafting = False  # the engine's proposer holds state for it (started, not yet released)
        self.plain_only = False  # started where the draft gate had speculation shut: it never drafts
        # the adaptive draft choice's view of it (engine/draft_policy.py): its running acceptance
        # (engine/acceptance.AcceptanceEstimate, made at its first round) and rounds since it last drafted
        self.acceptance = None
        self.rounds_without_drafts = 0
        self.constraint = None  # its grammar's matcher (grammar/constraint.py), when constrained
        self.num_preemptions = 0
        self.arrival = time.perf_counter()
        self.first_scheduled: float | None = None
        self.first_token_at: float | None = None

    # ---- tokens ------------------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.out.token_ids

    @property
    def last_token(self) -> int:
        return self.out.token_ids[-1] if self.out.token_ids else self.prompt_ids[-1]

    def seeded_at(self, position: int) -> tuple[int, int] | None:
        """(seed, position) for sampling the token at absolute `position`; None when unseeded."""
        return None if self.seed is None else (self.seed, position)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.out.token_ids)

    def full_block_hashes(self, count: int) -> list[bytes]:
        """Chained hashes of the first `count` full blocks of token_ids (count * block_size <= num_tokens)."""
        have = len(self._block_hashes)
        if count > have:
            size = self.block_size
            parent = self._block_hashes[-1] if have else self._root_hash
            self._block_hashes += chain_hashes(self.token_ids[have * size:count * size], size, parent)
        return self._block_hashes[:count]

    @property
    def prefill_target(self) -> int:
        """Positions to cache before the next decode step: the whole prompt before the first
        token; after a preemption, every token but the last (which the next step feeds)."""
        return self.num_tokens - 1 if self.out.token_ids else len(self.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prefill_target

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs are asked for and not all computed yet: its prompt passes keep every row
        (engine/prompt_logprobs.py), and it takes no prefix-cache hit, whose rows no pass computes."""
        return self.params.prompt_logprobs is not None and len(self.out.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.out.token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # ---- output ------------------------------------------------------------------------------------
    def emit(self, chunk: GenerationChunk) -> None:
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if chunk.finish_reason is not None:
            self._fill_stats()
            chunk.stats = self.stats
        self.sink(chunk)

    def _fill_stats(self) -> None:
        now = time.perf_counter()
        stats = self.stats
        stats.generated_tokens = len(self.out.token_ids)
        if self.first_token_at is not None:
            stats.ttft_ms = (self.first_token_at - self.arrival) * 1000
            stats.prefill_ms = (self.first_token_at - (self.first_scheduled or self.arrival)) * 1000
            stats.decode_ms = (now - self.first_token_at) * 1000
