"""A worker rank of a tensor-parallel group: loads its share of the model, then runs what rank 0
tells it (engine/tp_peers.py), until told to stop or rank 0 is gone.

Started by engine/tp_group.py as `python -m verispec.engine.tp_worker`, with (config, rank,
model directory, or a shape's `RandomWeights`) pickled on stdin. It keeps no request state: the paged KV cache of its heads,
indexed by the block ids rank 0's scheduler hands out.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import signal
import sys

from dataclasses import dataclass

import torch
import torch.distributed as dist

from verispec import log
from verispec.cache.paged import BatchCache, PagedPools
from verispec.config import EngineConfig
from verispec.engine import tp_group
from verispec.engine.cuda_graphs import BatchGraphs
from verispec.engine.tp_channel import Line, RankGone
from verispec.engine.tp_peers import CacheOps, CaptureGraphs, Commit, CopyState, Forward, Logits, Pools, Replay, Stop
from verispec.engine.scheduler import ClearState, CopyBlock, RestoreState, ZeroBlocks
from verispec.engine.loading import load_rank_share
from verispec.loading.device import parse_dtype
from verispec.loading.model_loader import prepare_for_device, resolve_numerics


def run(config: EngineConfig, rank: int, source) -> None:
    group = tp_group.join(config, rank)
    line = Line.connect(rank)
    if group.device.type == "cpu":  # the ranks of one machine share its cores
        per_node = config.tensor_parallel_size // config.nnodes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    model = load_rank_share(source, parse_dtype(config.dtype, group.device), group)
    numerics, _ = resolve_numerics(model, config.numerics)
    prepare_for_device(model, config.fuse_small_ops, numerics)  # the rewrites rank 0 makes, in the same order
    dtype = next(model.parameters()).dtype
    pools: PagedPools | None = None
    last: BatchCache | None = None  # the last pass's cache view, which a Commit refers to
    graphs = None  # BatchGraphs (CUDA), captured when rank 0 captures its own
    while True:
        try:
            message = line.receive()
        except (RankGone, OSError) as exc:
            log.info("tensor-parallel rank %d: rank 0 is gone (%s); exiting", rank, exc)
            return
        with torch.inference_mode():
            if isinstance(message, Forward):
                last = _cache(pools, message, group.device)
                model(message.input_ids.to(group.device), message.positions.to(group.device), last, message.capture)
            elif isinstance(message, Commit):
                last.commit(message.num_rows)
            elif isinstance(message, Logits):
                hidden = torch.empty(message.shape, dtype=message.dtype, device=group.device)
                dist.broadcast(hidden, src=0, group=group.shard.group)
                model.logits(hidden)
            elif isinstance(message, CacheOps):
                _apply(pools, message.ops)
            elif isinstance(message, Replay):
                graphs.passes[(message.batch, message.num_tokens)].replay_as_worker()
            elif isinstance(message, CaptureGraphs):
                if graphs is not None:  # rank 0 built another engine over the same ranks
                    graphs.release()
                target = GraphTarget(model, pools, group.device, group.shard.group)
                graphs = BatchGraphs(target, message.max_tokens, message.max_batch, message.capture,
                                     message.table_width)
            elif isinstance(message, Pools):
                pools = PagedPools(model.cache_specs(), message.num_blocks, message.block_size,
                                   message.num_state_slots, dtype, group.device, message.kv_cache_dtype)
            elif isinstance(message, Stop):
                if graphs is not None:  # their captured collectives hold the group
                    graphs.release()
                _leave(group.device)
                return
            else:  # pragma: no cover - a new message kind must be handled here
                raise TypeError(f"unknown message {message!r}")


def _leave(device: torch.device) -> None:
    """Leave the group with rank 0 (it destroys its side at the same time)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
    dist.destroy_process_group()


@dataclass
class GraphTarget:
    """What a worker's CUDA graphs run (engine/cuda_graphs.py): its share of the model, its pools."""

    model: torch.nn.Module
    pools: PagedPools
    device: torch.device
    tensor_group: object
    peers = None  # a worker tells no one

    def head(self, hidden: torch.Tensor) -> None:
        return self.model.logits(hidden)  # this rank's part of the logits, gathered on rank 0


def _cache(pools: PagedPools, m: Forward, device: torch.device) -> BatchCache:
    slots = m.state_slots.to(device) if m.state_slots is not None else None
    return BatchCache(pools, m.block_tables.to(device), m.positions.to(device), slots, m.num_keys, m.use_kernel,
                      row_starts=m.row_starts, row_lengths=m.row_lengths, prompt_kernel=m.prompt_kernel)


def _apply(pools: PagedPools, ops: list) -> None:
    for op in ops:
        if isinstance(op, ZeroBlocks):
            pools.zero_blocks(op.blocks)
        elif isinstance(op, CopyBlock):
            pools.copy_block(op.src, op.dst)
        elif isinstance(op, RestoreState):
            pools.copy_state(op.snapshot_slot, op.state_slot)
        elif isinstance(op, ClearState):
            pools.clear_state(op.state_slot)
        elif isinstance(op, CopyState):
            pools.copy_state(op.src, op.dst)


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` shows where a worker waits
    config, rank, source = pickle.load(sys.stdin.buffer)
    run(config, rank, source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
