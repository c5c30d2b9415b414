"""The model runner: turns a step's sequences into tensors and runs the target over the paged cache.

Two kinds of pass: prompt chunks of one or several sequences ([B, T]: each row a sequence's next
n_b prompt tokens, T = max n_b), and a verify pass over every decoding sequence at once ([B, T]:
each row is a sequence's last token followed by its drafts, T = 1 without speculation). Rows
shorter than T are padded; padded tokens write into their own
sequence's blocks past its committed length (overwritten later) or into the scratch block, and
nothing reads them. On CUDA, verify passes replay CUDA graphs captured per (batch bucket, T).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.cache.paged import BatchCache, PagedPools
from verispec.engine.sequence import Sequence
from verispec.models.base import CausalLM


@dataclass
class PassOutput:
    hidden: torch.Tensor  # [B, T, H] final-norm hidden states
    aux: list[torch.Tensor]  # each [B, T, H_t]: residual streams the proposer captures
    pre_norm: torch.Tensor | None  # [B, T, H]
    logits: torch.Tensor | None  # [B, T, V] float32 (float64 stays), padded vocabulary masked
    cache: BatchCache  # the pass's cache view: commit(rows per sequence) keeps what was accepted


class ModelRunner:
    def __init__(self, model: CausalLM, pools: PagedPools, num_real_tokens: int, use_kernel: bool):
        self.model = model
        self.pools = pools
        self.num_real_tokens = num_real_tokens
        self.use_kernel = use_kernel  # split-K kernel over the block tables for short passes (CUDA)
        p = next(model.parameters())
        self.device = p.device
        self.graphs = None  # BatchGraphs (CUDA), set by the engine at prewarm

    def block_tables(self, seqs: list[Sequence], num_columns: int | None = None) -> torch.Tensor:
        """[B, N] block ids, 0-padded (0 = scratch)."""
        width = num_columns or max(1, max(len(s.block_table) for s in seqs))
        return self.table_rows(seqs, width).to(self.device, non_blocking=True)

    @staticmethod
    def table_rows(seqs: list[Sequence], width: int, pad_rows: int = 0) -> torch.Tensor:
        """Host [B + pad_rows, width] block tables for a captured graph's static buffer. Each
        sequence keeps its row as a tensor, rebuilt only when its table grew (every block_size
        tokens), so a step costs one stack, not B x width Python ints."""
        rows = []
        for s in seqs:
            cached = s.table_row
            if cached is None or cached[0] != len(s.block_table) or cached[1].shape[0] != width:
                row = torch.zeros(width, dtype=torch.long)
                row[:len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
                cached = s.table_row = (len(s.block_table), row)
            rows.append(cached[1])
        if pad_rows:
            rows.extend([torch.zeros(width, dtype=torch.long)] * pad_rows)
        return torch.stack(rows)

    def state_slots(self, seqs: list[Sequence]) -> torch.Tensor | None:
        if not self.pools.recurrent_layers:
            return None
        return torch.tensor([s.state_slot for s in seqs], dtype=torch.long, device=self.device)

    def batch_cache(self, seqs: list[Sequence], positions: torch.Tensor, num_keys: int,
                    row_starts: list[int] | None = None, row_lengths: list[int] | None = None) -> BatchCache:
        return BatchCache(self.pools, self.block_tables(seqs), positions, self.state_slots(seqs), num_keys,
                          self.use_kernel, row_starts=row_starts, row_lengths=row_lengths)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], counts: list[int], capture: tuple[int, ...],
                keep_all_rows: bool) -> PassOutput:
        """The next counts[b] uncached tokens of each sequence, in one pass, committed. Rows are
        padded at their ends to T = max(counts) (the padding writes past each sequence's chunk,
        where the next pass overwrites it, and is a no-op for recurrent layers). hidden/aux/pre_norm
        keep every row when `keep_all_rows` (a proposer observes them: row b's are [:counts[b]]),
        else each sequence's last; logits [B, 1, V] are those of each sequence's last token."""
        t = max(counts)
        starts = [s.num_cached for s in seqs]
        ids, positions = [], []
        for seq, start, n in zip(seqs, starts, counts):
            row = seq.token_ids[start:start + n]
            ids.append(row + [row[-1]] * (t - n))
            positions.append(list(range(start, start + t)))
        packed = torch.tensor([i + p for i, p in zip(ids, positions)], dtype=torch.long).to(self.device)
        ids_t, positions_t = packed[:, :t], packed[:, t:]
        cache = self.batch_cache(seqs, positions_t, max(s + n for s, n in zip(starts, counts)),
                                 row_starts=starts, row_lengths=counts)
        out = self.model(ids_t, positions_t, cache, capture)
        cache.commit(counts)
        last = torch.tensor(counts, device=self.device)[:, None] - 1  # [B, 1]

        def last_rows(x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, 1, H]: each sequence's last token
            return x.gather(1, last[..., None].expand(-1, -1, x.shape[-1]))

        last_hidden = last_rows(out.hidden)
        if keep_all_rows:
            hidden, aux, pre_norm = out.hidden, out.aux, out.pre_norm
        else:
            hidden, aux = last_hidden, [last_rows(a) for a in out.aux]
            pre_norm = last_rows(out.pre_norm) if out.pre_norm is not None else None
        return PassOutput(hidden, aux, pre_norm, self.logits(last_hidden), cache)

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], inputs: list[list[int]] | torch.Tensor, capture: tuple[int, ...],
               ahead: int = 0) -> PassOutput:
        """One pass over every sequence's inputs (each of length T, drafts padded; or a device
        tensor [B, T]) at positions num_cached + ahead..; nothing committed (the caller commits
        the accepted rows per sequence). ahead > 0: steps queued before this one are not yet
        counted in num_cached (overlapped decoding, engine/overlap.py)."""
        t = len(inputs[0])
        starts = [s.num_cached + ahead for s in seqs]
        step = self.graphs.get(len(seqs), t) if self.graphs is not None else None
        if step is not None:
            return step(seqs, inputs, starts)
        ids = inputs if isinstance(inputs, torch.Tensor) else torch.tensor(inputs, dtype=torch.long, device=self.device)
        positions = torch.tensor([[p + j for j in range(t)] for p in starts], device=self.device)
        cache = self.batch_cache(seqs, positions, max(starts) + t)
        out = self.model(ids, positions, cache, capture)
        return PassOutput(out.hidden, out.aux, out.pre_norm, self.logits(out.hidden), cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] in float32 (float64 stays float64), padding rows masked."""
        logits = self.model.logits(hidden)
        if logits.dtype != torch.float64:
            logits = logits.float()
        if self.num_real_tokens < logits.shape[-1]:
            logits[..., self.num_real_tokens:] = float("-inf")
        return logits


class TargetView:
    """One sequence's rows in the target's paged cache, for drafters that read the target's K/V
    (the Gemma 4 assistant): `length` is the committed row count (rows past it hold the last verify
    pass's rejected K/V), `batch_cache` a one-sequence cache view for a read-only pass."""

    def __init__(self, runner: ModelRunner, seq: Sequence):
        self.runner = runner
        self.seq = seq

    @property
    def length(self) -> int:
        return self.seq.num_cached

    @property
    def pools(self) -> PagedPools:
        return self.runner.pools

    def rows_from(self, position: int) -> torch.Tensor:
        """Pool rows of this sequence's positions from `position` to the end of its blocks."""
        size = self.runner.pools.block_size
        positions = range(position, len(self.seq.block_table) * size)
        return torch.tensor([self.seq.block_table[p // size] * size + p % size for p in positions],
                            dtype=torch.long, device=self.runner.device)

    def batch_cache(self, positions: torch.Tensor, num_keys: int) -> BatchCache:
        """positions [1, T] of the queries; keys 0..num_keys-1."""
        return self.runner.batch_cache([self.seq], positions, num_keys)
