"""One sequence's prompt chunks as captured CUDA graphs, under exact numerics.

A short prompt pass is bound by the host: on the H200 a 512-token pass of the Qwen3-8B shape keeps
the GPU busy ~16 ms while Python and the kernel launches take several times that. Exact numerics
make a replay free of numeric cost: a row's bits do not depend on the rows beside it, so a chunk of
n tokens padded to a bucket of T >= n gives its n rows the bits the eager pass gives them (the
padding writes past the chunk, as an eager batched pass's padding does, where the next pass
overwrites it, or into the scratch block). One graph per bucket serves every position: the inputs
(token ids, positions, the block table, the real row count) go through static buffers and the
attention kernels bound their reads on the device.

Only where every layer is capturable and rows are independent: attention-only models (a
recurrent layer's state update is per chunk), one sequence a pass, no tensor parallelism.
"""
from __future__ import annotations

import torch

from verispec import log
from verispec.cache.paged import BatchCache, block_table_rows
from verispec.kernels.cuda_graph import GraphedCall, failure_line

# chunk lengths captured; a chunk runs in the smallest that holds it (at most twice its work below
# 256 tokens, where the pass costs its launches, not its arithmetic)
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024)


def prompt_graph_reason(runner, max_tokens: int) -> str | None:
    """Why this runner's prompt chunks of up to max_tokens tokens cannot replay graphs (None: they can)."""
    if not runner.prompt_kernel:
        return "prompt rows depend on their pass (fast numerics)"
    if runner.pools.recurrent_layers:
        return "recurrent layers update their state per chunk"
    if runner.peers is not None:
        return "tensor parallelism"
    if max_tokens < PROMPT_BUCKETS[0]:
        return f"prompt chunks of at most {max_tokens} tokens (the smallest graph is {PROMPT_BUCKETS[0]})"
    return None


class _CapturedPrompt:
    """One bucket's graph: the target's forward over T rows of one sequence, and the logits of its
    last real row."""

    def __init__(self, runner, num_tokens: int, table_width: int, capture: tuple[int, ...], pool):
        device = runner.device
        pools = runner.pools
        self.num_tokens = num_tokens
        cache_box: list[BatchCache] = []

        def step(input_ids, positions, block_tables, lengths):
            cache = BatchCache(pools, block_tables, positions, None, 0, use_kernel=runner.use_kernel,
                               prompt_kernel=True, row_lengths_on_device=lengths)
            cache_box[:] = [cache]
            out = runner.model(input_ids, positions, cache, capture)
            last = (lengths - 1).view(1, 1, 1)
            logits = runner.head(out.hidden.gather(1, last.expand(-1, -1, out.hidden.shape[-1])))
            return out.hidden, out.aux, out.pre_norm, logits

        example = [torch.zeros((1, num_tokens), dtype=torch.long, device=device),
                   torch.arange(num_tokens, device=device)[None],
                   torch.zeros((1, table_width), dtype=torch.long, device=device),
                   # one real row: the others' positions may lie past the table (a bucket longer
                   # than the context), and a real row reads its keys' block ids from it
                   torch.ones((1,), dtype=torch.long, device=device)]
        self.call = GraphedCall(step, example, pool)
        self.cache = cache_box[0]  # the captured pass's cache (its commit has nothing to keep)

    def __call__(self, seq, start: int, count: int):
        """The graph's (hidden [1, T, H], aux, pre_norm, logits [1, 1, V]) for seq's `count` tokens
        from `start`: its own buffers, valid until the next replay."""
        t = self.num_tokens
        row = seq.token_ids[start:start + count]
        ids = torch.tensor([row + [row[-1]] * (t - count)], dtype=torch.long)
        positions = torch.arange(start, start + t)[None]
        tables = block_table_rows([seq], self.call.inputs[2].shape[1])
        return self.call(ids, positions, tables, torch.tensor([count]))


class PromptGraphs:
    """Prompt passes of one sequence, captured for the buckets up to `max_tokens` tokens."""

    def __init__(self, runner, max_tokens: int, table_width: int, capture: tuple[int, ...], pool=None):
        self.buckets = [t for t in PROMPT_BUCKETS if t <= max_tokens]
        self.passes: dict[int, _CapturedPrompt] = {}
        for t in sorted(self.buckets, reverse=True):  # largest first, so the shared pool fits the rest
            graph = _CapturedPrompt(runner, t, table_width, capture, pool)
            pool = graph.call.pool()
            self.passes[t] = graph

    def get(self, num_tokens: int) -> _CapturedPrompt | None:
        bucket = bucket_for(num_tokens, self.buckets)
        return self.passes[bucket] if bucket is not None else None


def bucket_for(num_tokens: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds a chunk of num_tokens (None: none does)."""
    return next((t for t in buckets if t >= num_tokens), None)


def capture_prompt_graphs(runner, max_tokens: int, table_width: int, capture: tuple[int, ...],
                          pool=None) -> PromptGraphs | None:
    """The runner's prompt graphs, or None (logged with the reason) where its passes cannot replay
    them or a capture fails; prompt passes then run eagerly, with the same bits."""
    reason = prompt_graph_reason(runner, max_tokens)
    if reason is not None:
        log.debug("prompt passes run eagerly: %s", reason)
        return None
    try:
        return PromptGraphs(runner, max_tokens, table_width, capture, pool)
    except RuntimeError as exc:
        log.warning("prompt passes run eagerly (capture failed: %s)", failure_line(exc))
        return None
