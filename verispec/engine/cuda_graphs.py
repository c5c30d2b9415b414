"""Decode and verify steps as captured CUDA graphs.

BatchGraphs (the engine's): one graph per (batch-size bucket, T) over the paged cache; the
inputs (token ids, positions, block tables, state slots) go through static buffers, padded rows
point at the scratch block, so one graph serves any sequences of up to its bucket's size.

A step is the target's forward over T tokens (T = 1 for plain decoding, k + 1 for a verify
pass) plus its logits, at whatever position: inputs go through static buffers, the KV cache is
written at device-side positions and read by the split-K kernel, so one graph per T serves every
position. Capture happens once, before serving (prewarm), into rows at the very end of the
cache, which no sequence reaches before they are overwritten.

Under tensor parallelism every rank captures the same graphs, collectives included (NCCL in
CUDA graphs); rank 0 tells the others which graph to replay (engine/tp_peers.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from verispec.cache.paged import block_table_rows
from verispec.kernels.cuda_graph import GraphedCall


BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class _CapturedBatchPass:
    """One (bucket, T) graph: the target's forward + logits over a BatchCache of static tensors.

    `target` is rank 0's ModelRunner, or a tensor-parallel worker's GraphTarget: anything with
    `device`, `pools`, `model`, `head(hidden)` (the logits, without messages to other ranks),
    `tensor_group` (None without tensor parallelism) and `peers` (rank 0's, else None). Under
    tensor parallelism every rank captures the same graphs in the same order; the graph begins by
    broadcasting rank 0's inputs, so a worker replays on being told which graph, nothing more."""

    def __init__(self, target, batch: int, num_tokens: int, table_width: int, capture: tuple[int, ...], pool):
        from verispec.cache.paged import BatchCache

        device = target.device
        pools = target.pools
        has_state = bool(pools.recurrent_layers)
        self.batch, self.num_tokens, self.peers = batch, num_tokens, target.peers
        self.cache_box: list = []
        group = target.tensor_group

        def step(input_ids, positions, block_tables, state_slots):
            if group is not None:
                input_ids, positions, block_tables, state_slots = _from_rank_0(
                    group, input_ids, positions, block_tables, state_slots)
            cache = BatchCache(pools, block_tables, positions, state_slots if has_state else None, 0, use_kernel=True)
            self.cache_box[:] = [cache]
            out = target.model(input_ids, positions, cache, capture)
            return out.hidden, out.aux, out.pre_norm, target.head(out.hidden)

        example = [torch.zeros((batch, num_tokens), dtype=torch.long, device=device),
                   torch.arange(num_tokens, device=device)[None].repeat(batch, 1),
                   torch.zeros((batch, table_width), dtype=torch.long, device=device),
                   torch.zeros((batch,), dtype=torch.long, device=device)]
        self.call = GraphedCall(step, example, pool)
        self.cache = self.cache_box[0]  # the captured forward's cache: its pending states are static
        self.pending_recurrent = self.cache.pending_recurrent_snapshot()
        # hybrid models: the per-row commit of recurrent states (a few small ops per layer) as one
        # graph too, fed the accepted row counts; padded rows point at the scratch slot
        self.commit_graph = None
        if has_state:
            self.counts = torch.ones(batch, dtype=torch.long, device=device)

            def commit(counts):  # counts [bucket]: rows each sequence keeps (the graph's static input)
                self.cache.restore_pending_recurrent(self.pending_recurrent)
                self.cache.commit_on_device(counts)
                return ()

            self.commit_graph = GraphedCall(commit, [torch.ones(batch, dtype=torch.long, device=device)],
                                            self.call.pool())

    def __call__(self, seqs, inputs: list[list[int]] | torch.Tensor, starts: list[int]):
        """inputs: host lists, or a device tensor [B, T] (overlapped decoding feeds the previous
        step's tokens without a round trip to the host)."""
        from verispec.engine.runner import PassOutput

        b, t = len(seqs), self.num_tokens
        width = self.call.inputs[2].shape[1]
        pad = self.batch - b
        if isinstance(inputs, torch.Tensor):
            ids = torch.cat([inputs, inputs.new_zeros(pad, t)]) if pad else inputs
        else:
            ids = torch.tensor(inputs + [[0] * t] * pad, dtype=torch.long)
        positions = torch.tensor([[p + j for j in range(t)] for p in starts] + [list(range(t))] * pad)
        tables = block_table_rows(seqs, width, pad)
        slots = torch.tensor([s.state_slot or 0 for s in seqs] + [0] * pad)
        if self.peers is None:
            hidden, aux, pre_norm, logits = self.call(ids, positions, tables, slots)
        else:
            with self.peers.collective():
                self.peers.replay(self.batch, t)
                hidden, aux, pre_norm, logits = self.call(ids, positions, tables, slots)
        self.cache.restore_pending_recurrent(self.pending_recurrent)
        return PassOutput(hidden[:b], [a[:b] for a in aux], pre_norm[:b] if pre_norm is not None else None,
                          logits[:b], _PaddedCommit(self, self.batch))

    def replay_as_worker(self) -> None:
        """A tensor-parallel worker's replay: its inputs come from rank 0 inside the graph."""
        self.call.graph.replay()
        self.cache.restore_pending_recurrent(self.pending_recurrent)


def _from_rank_0(group, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Rank 0's copies of the pass's integer inputs on every rank, as one broadcast (captured in the
    graph, so a worker's own input buffers are never read)."""
    packed = torch.cat([x.reshape(-1) for x in inputs])
    dist.broadcast(packed, src=0, group=group)
    return [part.view(x.shape) for part, x in zip(packed.split([x.numel() for x in inputs]), inputs)]


class _PaddedCommit:
    """commit(rows per real sequence) on a graph's cache: the captured commit graph when there is
    one (padded rows count 1 and write the scratch slot), else the cache's own commit. (A model
    split over tensor-parallel ranks has no recurrent layers here: a split hybrid runs eagerly.)"""

    def __init__(self, graphed: _CapturedBatchPass, batch: int):
        self.graphed, self.batch = graphed, batch

    def commit(self, num_rows: list[int]) -> None:
        graphed = self.graphed
        if graphed.commit_graph is not None and min(num_rows) >= 1:
            graphed.commit_graph(torch.tensor(list(num_rows) + [1] * (self.batch - len(num_rows))))
            return
        graphed.cache.restore_pending_recurrent(graphed.pending_recurrent)
        graphed.cache.commit(list(num_rows) + [0] * (self.batch - len(num_rows)))


class BatchGraphs:
    """Verify passes captured for batch buckets up to `max_batch` x T = 1..max_tokens, one memory pool."""

    def __init__(self, target, max_tokens: int, max_batch: int, capture: tuple[int, ...], table_width: int):
        self.batch_sizes = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.passes: dict[tuple[int, int], _CapturedBatchPass] = {}
        pool = None
        for b in sorted(self.batch_sizes, reverse=True):  # largest first, so the shared pool fits the rest
            for t in range(max_tokens, 0, -1):
                graph = _CapturedBatchPass(target, b, t, table_width, capture, pool)
                pool = graph.call.pool()
                self.passes[(b, t)] = graph
        self.pool = pool  # the memory pool the graphs share (later captures may share it too)

    def release(self) -> None:
        """Free every graph now: a tensor-parallel group cannot be torn down while graphs holding
        its collectives live (NCCL waits for them)."""
        for graphed in self.passes.values():
            graphed.call.graph.reset()
            if graphed.commit_graph is not None:
                graphed.commit_graph.graph.reset()

    def get(self, batch: int, num_tokens: int) -> _CapturedBatchPass | None:
        for b in self.batch_sizes:
            if b >= batch:
                return self.passes.get((b, num_tokens))
        return None
