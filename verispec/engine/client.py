"""What the server uses of an engine: the `EngineClient` protocol.

The server (verispec/server) types against this protocol and uses nothing else of the engine it is
given. Two engines implement it: `Engine` (engine/engine.py, in the server's process) and
`EngineProcess` (engine/process.py, a proxy for an Engine in a process of its own); the server tests'
doubles implement it too (tests/server/server_helpers.py), and tests/server/test_engine_client.py
checks all of them against it.

`ServedEngine` holds the members both real engines derive from their public attributes (the
description for the chat page and the startup log, the default seed, close), so neither engine
repeats them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import torch


if TYPE_CHECKING:
    from verispec.sampling.params import SamplingParams
    from verispec.engine.types import GenerationChunk
    from verispec.grammar.spec import GrammarSpec
    from verispec.loading.tokenizer import Tokenizer

# What a request's sink receives: each chunk (the last carries finish_reason and stats), or the
# exception that ended the request.
Sink = Callable[["GenerationChunk | BaseException"], None]


class GrammarChecker(Protocol):
    """The part of the grammar library the server uses: checking a grammar before a request starts."""

    def check(self, spec: GrammarSpec) -> None:
        """Raise InvalidRequestError naming what `spec` uses that the grammar library does not support."""


@dataclass(frozen=True)
class EngineDescription:
    """What the chat page's header (GET /v1/verispec/info) and the startup log say about an engine."""

    method: str  # the speculation method: "ar" (none), "eagle3", "mtp", "assistant"
    num_drafts: int  # drafts per round at batch size 1 (0 without speculation)
    device: str  # "cuda:0", "cpu"
    device_name: str | None  # the GPU's name (None on a CPU)
    dtype: str | None  # "bfloat16", "float32" (None: not known)
    cache: str | None = None  # the KV cache and batch in one line for the startup log (None: no paged cache)
    # "exact" where a token's result does not depend on its pass (--numerics exact on CUDA, or on a CPU
    # in float16/bfloat16), else "fast"
    numerics: str = "fast"
    kv_cache_dtype: str = "auto"  # what the KV cache stores: the model's dtype ("bfloat16", ...), "fp8", "tq4", "tq3"


@runtime_checkable
class EngineClient(Protocol):
    """Everything the server uses of an engine. isinstance() checks only that the names exist."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer: chat templates, encode/decode, special tokens."""

    @property
    def model_name(self) -> str:
        """The model as the engine was given it (the served name unless --served-model-name)."""

    @property
    def max_model_len(self) -> int:
        """The context length: prompt plus generated tokens."""

    @property
    def vocab_size(self) -> int:
        """Token ids must be below this (stop_token_ids are checked against it)."""

    @property
    def grammars(self) -> GrammarChecker:
        """Checks a response_format / forced tool call grammar before the request starts."""

    @property
    def default_seed(self) -> int | None:
        """The server's --seed, used by requests without one (None: unseeded)."""

    def describe(self) -> EngineDescription:
        """Method, device, dtype and cache, for the chat page and the startup log."""

    def check_prompt_ids(self, prompt_ids: list[int]) -> None:
        """Raise InvalidRequestError if the prompt is empty, too long or holds ids outside the vocabulary."""

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The number of new tokens the request may produce; raise InvalidRequestError if it cannot fit."""

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink,
               cancel: threading.Event | None = None) -> object:
        """Start a request (a bad one raises here); chunks reach `sink` from another thread; `cancel` stops it."""

    def load_stats(self) -> dict:
        """Scheduler and cache load for /metrics (running, waiting, kv_blocks_used/total, preemptions, ...).
        May block (an engine process answers over its pipe): the server calls it off the event loop."""

    def failure(self) -> str | None:
        """Why the engine can no longer run requests (its process died), or None while it can. Never blocks."""

    def prewarm(self) -> float:
        """Warm up (kernels, graphs) so the first request pays nothing extra; returns the seconds taken."""

    def shutdown(self) -> None:
        """Cancel every request (the server is stopping); the engine stays usable."""

    def close(self) -> None:
        """Release what the engine holds beyond requests (an engine process: the process itself)."""


class ServedEngine:
    """The EngineClient members that Engine and EngineProcess derive from their public attributes:
    config, budget (cache.paged.CacheBudget), draft_policy (or describe_drafts()), method, num_drafts, device, dtype,
    max_model_len. A subclass that knows its GPU's name without asking CUDA overrides gpu_name()."""

    @property
    def default_seed(self) -> int | None:
        return self.config.seed

    def describe(self) -> EngineDescription:
        return EngineDescription(method=self.method, num_drafts=int(self.num_drafts), device=str(self.device),
                                 device_name=self.gpu_name(), dtype=str(self.dtype).removeprefix("torch."),
                                 cache=self._describe_cache(), numerics=self.numerics,
                                 kv_cache_dtype=self.kv_cache_dtype)

    @property
    def numerics(self) -> str:
        """The numerics that run, "exact" or "fast" (the engine resolved --numerics at load:
        models/layers/numerics.py `resolve`; docs/serving.md)."""
        return self.config.numerics

    @property
    def kv_cache_dtype(self) -> str:
        """What the KV cache stores: --kv-cache-dtype, with auto named as the model's dtype."""
        chosen = self.config.kv_cache_dtype
        return str(self.dtype).removeprefix("torch.") if chosen == "auto" else chosen

    def gpu_name(self) -> str | None:
        """The GPU's name (None on a CPU)."""
        device = torch.device(self.device)
        return torch.cuda.get_device_name(device) if device.type == "cuda" else None

    def failure(self) -> str | None:
        """An engine in this process fails only with the process itself."""
        return None

    def close(self) -> None:
        """An engine in this process holds nothing beyond its requests: as shutdown()."""
        self.shutdown()

    def describe_drafts(self) -> str:
        """How drafts are chosen, as of now (measured costs replace the analytic ones after start)."""
        return self.draft_policy.describe()

    def _describe_cache(self) -> str:
        budget = self.budget
        drafts = f"; {self.describe_drafts()}" if self.num_drafts else ""
        return (f"{budget.num_tokens} tokens ({self.kv_cache_dtype}) in {budget.num_blocks - 1} blocks of "
                f"{budget.block_size} "
                f"({budget.bytes_total / 2**30:.2f} GiB); up to {self.config.max_num_seqs} sequences at once, "
                f"context {self.max_model_len} tokens{drafts}")
