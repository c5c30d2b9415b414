"""The model runner: executes a step's plan on the device - the scheduler's cache operations, the
target's passes over the paged cache, and the proposer's drafting passes.

Two kinds of target pass: prompt chunks of one or several sequences ([B, T]: each row a sequence's next
n_b prompt tokens, T = max n_b), and a verify pass over every decoding sequence at once ([B, T]:
each row is a sequence's last token followed by its drafts, T = 1 without speculation). Rows
shorter than T are padded; padded tokens write into their own
sequence's blocks past its committed length (overwritten later) or into the scratch block, and
nothing reads them. On CUDA, verify passes replay CUDA graphs captured per (batch bucket, T).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.cache.paged import BatchCache, PagedPools, block_table_rows
from verispec.engine.deferred_rows import DeferredRows
from verispec.engine.scheduler import CacheOp, ClearState, CopyBlock, Released, RestoreState, ZeroBlocks
from verispec.engine.sequence import Sequence
from verispec.engine.tp_peers import CommittingCache, Peers
from verispec.models.base import CausalLM
from verispec.spec.proposer import Draft, Proposer, TargetCache, TargetStep


def chunk_rows(seqs: list[Sequence], starts: list[int], counts: list[int], width: int
               ) -> tuple[list[list[int]], list[list[int]]]:
    """A prompt pass's rows of `width` tokens: each sequence's counts[b] tokens from starts[b], padded
    with its last one (ids), and their positions (the padding's run on past the chunk)."""
    ids, positions = [], []
    for seq, start, n in zip(seqs, starts, counts):
        row = seq.token_ids[start:start + n]
        ids.append(row + [row[-1]] * (width - n))
        positions.append(list(range(start, start + width)))
    return ids, positions


def each_last_row(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] -> [B, 1, H]: row last[b] of each sequence b (last [B] on x's device)."""
    return x.gather(1, last[:, None, None].expand(-1, -1, x.shape[-1]))


@dataclass
class PassOutput:
    hidden: torch.Tensor  # [B, T, H] final-norm hidden states
    aux: list[torch.Tensor]  # each [B, T, H_t]: residual streams the proposer captures
    pre_norm: torch.Tensor | None  # [B, T, H]
    logits: torch.Tensor | None  # [B, T, V] float32 (float64 stays), padded vocabulary masked
    cache: BatchCache  # the pass's cache view: commit(rows per sequence) keeps what was accepted
    # a prompt pass's every_row: batch index -> that sequence's hidden states of all its rows [n_b, H]
    all_rows: dict[int, torch.Tensor] | None = None


class ModelRunner:
    def __init__(self, model: CausalLM, pools: PagedPools, num_real_tokens: int, use_kernel: bool,
                 proposer: Proposer | None = None, prompt_kernel: bool = False, peers: Peers | None = None):
        self.model = model
        # tensor parallelism: the other ranks, told each model call first (engine/tp_peers.py)
        self.peers = peers
        self.pools = pools
        self.num_real_tokens = num_real_tokens
        self.use_kernel = use_kernel  # split-K kernel over the block tables for short passes (CUDA)
        # prompt chunks attend with the kernel whose rows are the split-K kernel's bits (exact numerics)
        self.prompt_kernel = prompt_kernel
        p = next(model.parameters())
        self.device = p.device
        self.graphs = None  # BatchGraphs (CUDA), set by the engine at prewarm
        self.prompt_graphs = None  # PromptGraphs (CUDA, exact numerics), set with them
        self.proposer = proposer
        # rows of sequences that drafted nothing, observed when they next draft (engine/deferred_rows.py)
        self.deferred = DeferredRows(proposer is not None and proposer.needs_target_features)
        if proposer is not None:
            proposer.bind(TargetCache(pools, self.block_tables, use_kernel))

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose residual streams the proposer reads (captured in every pass)."""
        return self.proposer.capture_layers if self.proposer is not None else ()

    # ---- the scheduler's cache operations -------------------------------------------------------------
    def apply(self, ops: list[CacheOp]) -> None:
        """Make the device follow the scheduler's bookkeeping, in order (a drafter's own K/V pools,
        indexed by the same blocks, follow the target's)."""
        drafter_pools = self.proposer.pools if self.proposer is not None else None
        if self.peers is not None:
            self.peers.apply(ops)
        for op in ops:
            if isinstance(op, ZeroBlocks):
                self.pools.zero_blocks(op.blocks)
                if drafter_pools is not None:
                    drafter_pools.zero_blocks(op.blocks)
            elif isinstance(op, CopyBlock):
                self.pools.copy_block(op.src, op.dst)
                if drafter_pools is not None:
                    drafter_pools.copy_block(op.src, op.dst)
            elif isinstance(op, RestoreState):
                self.pools.copy_state(op.snapshot_slot, op.state_slot)
            elif isinstance(op, ClearState):
                self.pools.clear_state(op.state_slot)
            elif isinstance(op, Released):
                if self.proposer is not None:
                    self.deferred.drop(op.seq)
                    self.proposer.release(op.seq)
            else:  # pragma: no cover - a new op kind must be handled here
                raise TypeError(f"unknown cache operation {op!r}")

    # ---- drafting ----------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], counts: list[int]) -> list[Draft]:
        """Each sequence's drafts (counts[b] of them; 0 = none this round), drafted in one call for
        every sequence that gets some, after the drafter has seen their deferred rows."""
        drafts = [Draft([]) for _ in seqs]
        rows = [b for b, k in enumerate(counts) if k > 0]
        if rows:
            picked = [seqs[b] for b in rows]
            self.observe(self.deferred.take(picked))
            made = self.proposer.propose(picked, [counts[b] for b in rows], [s.params for s in picked],
                                         [s.generator for s in picked])
            for b, draft in zip(rows, made):
                drafts[b] = draft
        return drafts

    def propose_on_device(self, seqs: list[Sequence], counts: list[int]) -> torch.Tensor | None:
        """`propose`'s greedy drafts left on the device (Proposer.propose_on_device): [B, max(counts)],
        a row of zeros for a sequence given none; None when no sequence gets any."""
        rows = [b for b, k in enumerate(counts) if k > 0]
        if not rows:
            return None
        picked = [seqs[b] for b in rows]
        self.observe(self.deferred.take(picked))
        tokens = self.proposer.propose_on_device(picked, [counts[b] for b in rows])
        if len(rows) == len(seqs):
            return tokens
        full = tokens.new_zeros(len(seqs), tokens.shape[1])
        return full.index_copy_(0, torch.tensor(rows, device=tokens.device), tokens)

    def observe(self, rows: list[tuple[Sequence, TargetStep]]) -> None:
        if rows:
            self.proposer.observe(rows)

    def stop_drafting(self, seqs: list[Sequence]) -> None:
        """These sequences' drafter state goes, with the rows it had not seen: they decode plain from
        here (a prompt pass after a preemption starts their drafting again)."""
        for seq in seqs:
            if seq.drafting:
                self.deferred.drop(seq)
                self.proposer.release(seq)
                seq.drafting = False

    def defer(self, rows: list[tuple[Sequence, int, int, int]], out, owned: bool = False) -> None:
        """Committed rows the drafter sees later (DeferredRows.add); those that piled up to the
        limit are observed now."""
        self.observe(self.deferred.add(rows, out, owned))

    def block_tables(self, seqs: list[Sequence], num_columns: int | None = None) -> torch.Tensor:
        """[B, N] block ids, 0-padded (0 = scratch)."""
        width = num_columns or max(1, max(len(s.block_table) for s in seqs))
        return block_table_rows(seqs, width).to(self.device, non_blocking=True)

    def state_slots(self, seqs: list[Sequence]) -> torch.Tensor | None:
        if not self.pools.recurrent_layers:
            return None
        return torch.tensor([s.state_slot for s in seqs], dtype=torch.long, device=self.device)

    def batch_cache(self, seqs: list[Sequence], positions: torch.Tensor, num_keys: int,
                    row_starts: list[int] | None = None, row_lengths: list[int] | None = None) -> BatchCache:
        args = (self.pools, self.block_tables(seqs), positions, self.state_slots(seqs), num_keys, self.use_kernel)
        kwargs = dict(row_starts=row_starts, row_lengths=row_lengths, prompt_kernel=self.prompt_kernel)
        if self.peers is not None and self.pools.recurrent_layers:  # the workers keep their heads' states too
            return CommittingCache(self.peers, *args, **kwargs)
        return BatchCache(*args, **kwargs)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], counts: list[int], capture: tuple[int, ...],
                keep_all_rows: bool, every_row: list[int] = ()) -> PassOutput:
        """The next counts[b] uncached tokens of each sequence, in one pass, committed. Rows are
        padded at their ends to T = max(counts) (the padding writes past each sequence's chunk,
        where the next pass overwrites it, and is a no-op for recurrent layers). hidden/aux/pre_norm
        keep every row when `keep_all_rows` (a proposer observes them: row b's are [:counts[b]]),
        else each sequence's last; logits [B, 1, V] are those of each sequence's last token.
        every_row: batch indices whose hidden states of every row come back in `all_rows`
        (their prompt logprobs are wanted)."""
        t = max(counts)
        starts = [s.num_cached for s in seqs]
        graphed = self.prompt_graphs.get(len(seqs), t) if self.prompt_graphs is not None and not every_row else None
        if graphed is not None:
            return self._graphed_prefill(graphed, seqs, starts, counts, keep_all_rows)
        ids, positions = chunk_rows(seqs, starts, counts, t)
        packed = torch.tensor([i + p for i, p in zip(ids, positions)], dtype=torch.long).to(self.device)
        ids_t, positions_t = packed[:, :t], packed[:, t:]
        cache = self.batch_cache(seqs, positions_t, max(s + n for s, n in zip(starts, counts)),
                                 row_starts=starts, row_lengths=counts)
        out = self._forward(ids_t, cache, capture)
        cache.commit(counts)
        last = torch.tensor(counts, device=self.device) - 1
        last_hidden = each_last_row(out.hidden, last)
        if keep_all_rows:
            hidden, aux, pre_norm = out.hidden, out.aux, out.pre_norm
        else:
            hidden, aux = last_hidden, [each_last_row(a, last) for a in out.aux]
            pre_norm = each_last_row(out.pre_norm, last) if out.pre_norm is not None else None
        all_rows = {b: out.hidden[b, :counts[b]] for b in every_row} if every_row else None
        return PassOutput(hidden, aux, pre_norm, self.logits(last_hidden), cache, all_rows)

    def _graphed_prefill(self, graphed, seqs: list[Sequence], starts: list[int], counts: list[int],
                         keep_all_rows: bool) -> PassOutput:
        """`prefill` of the sequences' chunks by a captured graph (engine/prompt_graphs.py): the
        same bits, in tensors of its own (the graph's buffers are rewritten by the next replay)."""
        hidden, aux, pre_norm, logits = graphed(seqs, starts, counts)
        b, t = len(seqs), max(counts)
        if keep_all_rows:  # [B, T, H] as the eager pass gives them (row b's are [:counts[b]])
            def keep(x: torch.Tensor) -> torch.Tensor:
                return x[:b, :t].clone()
        else:  # each sequence's last row
            last = torch.tensor(counts, device=self.device) - 1

            def keep(x: torch.Tensor) -> torch.Tensor:
                return each_last_row(x[:b], last)
        return PassOutput(keep(hidden), [keep(a) for a in aux], keep(pre_norm) if pre_norm is not None else None,
                          logits[:b].clone(), graphed.cache)

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
        out = self._forward(ids, cache, capture)
        return PassOutput(out.hidden, out.aux, out.pre_norm, self.logits(out.hidden), cache)

    def _forward(self, input_ids: torch.Tensor, cache: BatchCache, capture: tuple[int, ...]):
        """The target's pass (input_ids [B, T] at cache.positions), on every rank of a tensor-parallel group."""
        if self.peers is None:
            return self.model(input_ids, cache.positions, cache, capture)
        with self.peers.collective():
            self.peers.forward(input_ids, cache, capture)
            return self.model(input_ids, cache.positions, cache, capture)

    @property
    def tensor_group(self):
        """The process group of a tensor-parallel model's collectives (None for a whole model)."""
        return self.peers.group.shard.group if self.peers is not None else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] in float32 (float64 stays float64), padding rows masked."""
        if self.peers is None:
            return self.head(hidden)
        with self.peers.collective():
            self.peers.logits(hidden)
            return self.head(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits on this rank, whose peers (if any) already make the same call (a CUDA graph's)."""
        logits = self.model.logits(hidden)
        if logits.dtype != torch.float64:
            logits = logits.float()
        if self.num_real_tokens < logits.shape[-1]:
            logits[..., self.num_real_tokens:] = float("-inf")
        return logits
