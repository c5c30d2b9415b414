"""Prompt chunks as captured CUDA graphs, under exact numerics: one sequence's, or several's in one pass.

A short prompt pass is bound by the host: on the H200 a 512-token pass of the Qwen3-8B shape keeps
the GPU busy ~16 ms while Python and the kernel launches take several times that. Exact numerics
make a replay free of numeric cost: a row's bits do not depend on the rows beside it, so a chunk of
n tokens padded to a bucket of T >= n gives its n rows the bits the eager pass gives them (the
padding writes past the chunk, as an eager batched pass's padding does, where the next pass
overwrites it, or into the scratch block). One graph per bucket serves every position: the inputs
(token ids, positions, the block table, the real row count) go through static buffers and the
attention kernels bound their reads on the device.

Several sequences' chunks arriving together (eight clients' first prompts) run as one pass of a
batch bucket: padded sequences get one row, the scratch block's table and no logits anyone reads.
Without these graphs such a pass ran eagerly and the eighth client's first token waited several
times as long as one client's.

Only where every layer is capturable and rows are independent: attention-only models (a
recurrent layer's state update is per chunk), no tensor parallelism.
"""
from __future__ import annotations

import torch

from verispec import log
from verispec.cache.paged import BatchCache, block_table_rows
from verispec.engine.runner import chunk_rows
from verispec.kernels.cuda_graph import GraphedCall, failure_line

# chunk lengths captured; a chunk runs in the smallest that holds it (at most twice its work below
# 256 tokens, where the pass costs its launches, not its arithmetic)
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
# sequences a pass of several holds (up to the engine's max_num_seqs), and the longest chunk and
# most rows such a pass replays: longer passes are bound by their arithmetic and run eagerly
BATCH_BUCKETS = (1, 2, 4, 8)
MAX_BATCHED_CHUNK = 512
MAX_BATCHED_ROWS = 4096


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
    """One (batch bucket B, chunk bucket T) graph: the target's forward over B sequences' T rows,
    and the logits of each one's last real row."""

    def __init__(self, runner, num_seqs: int, num_tokens: int, table_width: int, capture: tuple[int, ...], pool):
        device = runner.device
        pools = runner.pools
        self.num_seqs, self.num_tokens = num_seqs, num_tokens
        cache_box: list[BatchCache] = []

        def step(input_ids, positions, block_tables, lengths):
            cache = BatchCache(pools, block_tables, positions, None, 0, use_kernel=runner.use_kernel,
                               prompt_kernel=True, row_lengths_on_device=lengths)
            cache_box[:] = [cache]
            out = runner.model(input_ids, positions, cache, capture)
            last = (lengths - 1).view(-1, 1, 1)
            logits = runner.head(out.hidden.gather(1, last.expand(-1, -1, out.hidden.shape[-1])))
            return out.hidden, out.aux, out.pre_norm, logits

        example = [torch.zeros((num_seqs, num_tokens), dtype=torch.long, device=device),
                   torch.arange(num_tokens, device=device)[None].repeat(num_seqs, 1),
                   torch.zeros((num_seqs, table_width), dtype=torch.long, device=device),
                   # one real row a sequence: the others' positions may lie past the table (a
                   # bucket longer than the context), and a real row reads its keys' block ids from it
                   torch.ones((num_seqs,), dtype=torch.long, device=device)]
        self.call = GraphedCall(step, example, pool)
        self.cache = cache_box[0]  # the captured pass's cache (its commit has nothing to keep)

    def __call__(self, seqs, starts: list[int], counts: list[int]):
        """The graph's (hidden [B, T, H], aux, pre_norm, logits [B, 1, V]) for each seqs[b]'s
        counts[b] tokens from starts[b] (rows past len(seqs) are padding): its own buffers, valid
        until the next replay. A padded sequence has one real row at position 0 of the scratch
        block, which no sequence reads."""
        t, pad = self.num_tokens, self.num_seqs - len(seqs)
        ids, positions = chunk_rows(seqs, starts, counts, t)
        ids += [[0] * t] * pad
        positions += [list(range(t))] * pad
        tables = block_table_rows(seqs, self.call.inputs[2].shape[1], pad)
        lengths = torch.tensor(list(counts) + [1] * pad)
        return self.call(torch.tensor(ids, dtype=torch.long), torch.tensor(positions), tables, lengths)


class PromptGraphs:
    """Prompt passes captured for chunks up to `max_tokens` tokens of one sequence, and for passes
    of up to `max_seqs` sequences' chunks of up to MAX_BATCHED_CHUNK tokens (MAX_BATCHED_ROWS rows)."""

    def __init__(self, runner, max_tokens: int, max_seqs: int, table_width: int, capture: tuple[int, ...],
                 pool=None):
        self.buckets = [t for t in PROMPT_BUCKETS if t <= max_tokens]
        self.batch_sizes = [b for b in BATCH_BUCKETS if b <= max_seqs]
        self.passes: dict[tuple[int, int], _CapturedPrompt] = {}
        shapes = [(b, t) for b in self.batch_sizes for t in self.buckets
                  if b == 1 or (t <= MAX_BATCHED_CHUNK and b * t <= MAX_BATCHED_ROWS)]
        for b, t in sorted(shapes, key=lambda shape: -shape[0] * shape[1]):  # largest first: the shared pool fits the rest
            graph = _CapturedPrompt(runner, b, t, table_width, capture, pool)
            pool = graph.call.pool()
            self.passes[(b, t)] = graph

    @property
    def longest_batched(self) -> int:
        """The longest chunk a pass of several sequences replays (0: none does)."""
        return max((t for b, t in self.passes if b > 1), default=0)

    def get(self, num_seqs: int, num_tokens: int) -> _CapturedPrompt | None:
        """The graph for a pass of num_seqs sequences' chunks of at most num_tokens tokens (None: none holds it)."""
        bucket = bucket_for(num_tokens, self.buckets)
        seqs = bucket_for(num_seqs, self.batch_sizes)
        return self.passes.get((seqs, bucket)) if bucket is not None and seqs is not None else None


def bucket_for(size: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `size` (None: none does)."""
    return next((t for t in buckets if t >= size), None)


def capture_prompt_graphs(runner, max_tokens: int, max_seqs: int, table_width: int, capture: tuple[int, ...],
                          pool=None) -> PromptGraphs | None:
    """The runner's prompt graphs, or None (logged with the reason) where its passes cannot replay
    them or a capture fails; prompt passes then run eagerly, with the same bits."""
    reason = prompt_graph_reason(runner, max_tokens)
    if reason is not None:
        log.debug("prompt passes run eagerly: %s", reason)
        return None
    try:
        return PromptGraphs(runner, max_tokens, max_seqs, table_width, capture, pool)
    except RuntimeError as exc:
        log.warning("prompt passes run eagerly (capture failed: %s)", failure_line(exc))
        return None
