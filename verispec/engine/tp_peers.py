"""Rank 0's side of tensor parallelism: it tells the other ranks what to run, step by step.

Only rank 0 schedules. Each time its runner touches the model it first sends the same call as a
message (engine/tp_channel.py, CPU tensors), so every rank makes the same collectives in the same order:
- `Pools`: allocate the paged KV cache (each rank holds its own heads' blocks, same block ids);
- `CacheOps`: the scheduler's block zeroes and copies;
- `Forward`: one pass (token ids, positions, block tables and the pass's cache view);
- `Logits`: the head over hidden states that follow on the tensor group (rank 0 gathers them);
- `Commit`: the rows of the last pass each sequence keeps (recurrent layers' states, which each
  rank holds for its own heads);
- `CaptureGraphs`, `Replay`: on CUDA, capture the same verify-pass graphs as rank 0
  (engine/cuda_graphs.py), replay one (its inputs come from rank 0 inside the graph);
- `Stop`.
A worker that dies is seen by a watch thread (its process exits, or its connection closes), or
makes the next collective fail; either way the group is marked failed, the step's requests fail with a
`TensorParallelError` naming the rank, and every later call fails at once, never blocking.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from verispec import log
from verispec.cache.paged import BatchCache
from verispec.engine import tp_group
from verispec.engine.scheduler import CacheOp, ClearState, CopyBlock, RestoreState, ZeroBlocks
from verispec.errors import EngineUnavailableError

EXIT_NOTICE_S = 1.0  # after a collective fails, how long to wait for the watch thread to name the rank
ABORT_WAIT_S = 5.0  # how long a lost group's abort is waited on before it is left to itself


class TensorParallelError(EngineUnavailableError):
    """A rank of the tensor-parallel group is gone: the engine cannot run requests any more."""


@dataclass(frozen=True)
class Pools:
    num_blocks: int
    block_size: int
    num_state_slots: int
    kv_cache_dtype: str = "auto"  # what every rank's pools store, as rank 0's


@dataclass(frozen=True)
class CacheOps:
    ops: list  # ZeroBlocks / CopyBlock / RestoreState / ClearState, in order


@dataclass(frozen=True)
class Forward:
    input_ids: torch.Tensor  # [B, T] (CPU)
    positions: torch.Tensor  # [B, T]
    block_tables: torch.Tensor  # [B, N]
    state_slots: torch.Tensor | None  # [B]
    num_keys: int
    use_kernel: bool
    row_starts: list[int] | None
    row_lengths: list[int] | None
    prompt_kernel: bool
    capture: tuple[int, ...]


@dataclass(frozen=True)
class Logits:
    shape: tuple[int, ...]  # the hidden states' [..., H], sent next on the tensor group
    dtype: torch.dtype


@dataclass(frozen=True)
class Commit:
    num_rows: list[int]  # BatchCache.commit's argument, for the workers' last pass


@dataclass(frozen=True)
class CaptureGraphs:
    """BatchGraphs' arguments, so that every rank captures the same graphs in the same order."""

    max_tokens: int
    max_batch: int
    capture: tuple[int, ...]
    table_width: int


@dataclass(frozen=True)
class Replay:
    batch: int  # the graph's batch bucket
    num_tokens: int


@dataclass(frozen=True)
class CopyState:
    """A recurrent state copied from slot to slot outside the scheduler's ops (a prefix-cache snapshot)."""

    src: int
    dst: int


@dataclass(frozen=True)
class Stop:
    pass


DEVICE_OPS = (ZeroBlocks, CopyBlock, RestoreState, ClearState)


class CommittingCache(BatchCache):
    """Rank 0's view of a pass of a model with recurrent layers: committing it commits the
    workers' view of the same pass too (told before rank 0's own, as every model call is)."""

    def __init__(self, peers: "Peers", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.peers = peers

    def commit(self, num_rows: list[int]) -> None:
        if self._pending_recurrent:
            with self.peers.collective():
                self.peers.send(Commit(list(num_rows)))
        super().commit(num_rows)


class MirroredPools:
    """The pools as the prefix cache sees them: a recurrent-state snapshot it takes in rank 0's
    pools is taken in every worker's too."""

    def __init__(self, pools, peers: "Peers"):
        self.pools, self.peers = pools, peers
        self.recurrent_layers = pools.recurrent_layers

    def copy_state(self, src: int, dst: int) -> None:
        with self.peers.collective():
            self.peers.send(CacheOps([CopyState(src, dst)]))
        self.pools.copy_state(src, dst)


def _abort_collectives() -> None:
    """NCCL does not notice a dead peer (gloo's closed connection does): abort the group so that a
    collective rank 0 is blocked in raises instead of waiting for its timeout."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception as exc:  # noqa: BLE001 - the failure is already recorded; this only unblocks
            log.debug("tensor parallel: aborting the process group failed (%s)", exc)


class BoundedOnce:
    """Runs `work` once, in a thread of its own, and waits for it at most `wait_s` seconds over all
    calls: aborting a group can block for good where a kernel on this GPU waits on the lost rank
    (an NVLink all-reduce spinning on a signal that will not come), and neither the thread that
    noticed the loss nor `stop()` may hang on it."""

    def __init__(self, work, wait_s: float, what: str):
        self.work, self.wait_s, self.what = work, wait_s, what
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._deadline = 0.0
        self._warned = False

    def run(self) -> bool:
        """True once the work has returned; False while it is still blocked (logged once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self.work, name=self.what, daemon=True)
                self._deadline = time.monotonic() + self.wait_s
                self._thread.start()
        self._thread.join(timeout=max(0.0, self._deadline - time.monotonic()))
        if not self._thread.is_alive():
            return True
        with self._lock:
            if not self._warned:
                self._warned = True
                log.warning("%s did not return within %.0f s: a kernel on this GPU may be waiting on the lost rank; "
                            "the process cannot finish its GPU work and should be restarted", self.what, self.wait_s)
        return False


class Peers:
    """What rank 0's runner calls so the other ranks run the same step."""

    def __init__(self, group: tp_group.Group):
        self.group = group
        self._lock = threading.RLock()  # one step's messages and collectives at a time (and stop after them)
        self._failure: str | None = None
        self._stopping = False
        self._graphs: list[weakref.ref] = []  # rank 0's BatchGraphs, released before the group goes
        self._abort = BoundedOnce(_abort_collectives, ABORT_WAIT_S, "aborting the tensor-parallel group")
        # told the failure once the group is lost (the engine fails its open requests: its own
        # thread may be blocked for good in a step waiting on the lost rank)
        self.on_lost: Callable[[str], None] | None = None
        tp_group.watch(group.workers, self._exited)
        group.hub.watch(self._disconnected)

    @property
    def world_size(self) -> int:
        return self.group.shard.world_size

    def failure(self) -> str | None:
        """Why the group can no longer run (None while it can)."""
        return self._failure

    def _exited(self, rank: int, code: int) -> None:
        self._lost(f"tensor-parallel rank {rank} exited (exit code {code})")

    def _disconnected(self, rank: int) -> None:
        if rank not in {w.rank for w in self.group.workers}:  # a local one's exit is named with its code
            self._lost(f"tensor-parallel rank {rank}'s connection closed")

    def _lost(self, failure: str) -> None:
        if not self._stopping and self._failure is None:
            self._failure = failure
            log.warning("%s; open requests fail and new ones are refused", self._failure)
            if self.on_lost is not None:
                self.on_lost(self._failure)
            if self.group.device.type == "cuda":
                self._abort.run()

    # ---- calls ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def collective(self):
        """Around one model call on every rank: refused at once once the group failed; a failing
        collective marks it failed and raises TensorParallelError."""
        with self._lock:
            if self._failure is not None:
                raise TensorParallelError(self._failure)
            try:
                yield
            except Exception as exc:
                raise TensorParallelError(self._fail(exc)) from exc

    def _fail(self, exc: Exception) -> str:
        deadline = time.monotonic() + EXIT_NOTICE_S
        while self._failure is None and time.monotonic() < deadline and self.group.workers:
            time.sleep(0.02)  # a dead local worker: let the watch thread name it
        if self._failure is None:
            self._failure = f"the tensor-parallel group failed: {exc}"
        return self._failure

    def send(self, message) -> None:
        """One message to every worker (inside `collective()`)."""
        self.group.hub.send(message)

    def make_pools(self, num_blocks: int, block_size: int, num_state_slots: int, kv_cache_dtype: str = "auto") -> None:
        with self.collective():
            self.send(Pools(num_blocks, block_size, num_state_slots, kv_cache_dtype))

    def apply(self, ops: list[CacheOp]) -> None:
        device_ops = [op for op in ops if isinstance(op, DEVICE_OPS)]
        if device_ops:
            with self.collective():
                self.send(CacheOps(device_ops))

    def forward(self, input_ids: torch.Tensor, cache: BatchCache, capture: tuple[int, ...]) -> None:
        """Tell the workers to run the pass rank 0 is about to run (inside `collective()`)."""
        slots = cache.state_slots.cpu() if cache.state_slots is not None else None
        self.send(Forward(input_ids.cpu(), cache.positions.cpu(), cache.block_tables.cpu(), slots, cache.num_keys,
                           cache.use_kernel, cache.row_starts, cache.row_lengths, cache.prompt_kernel, tuple(capture)))

    def logits(self, hidden: torch.Tensor) -> None:
        """Give the workers the hidden states rank 0 is about to project (inside `collective()`)."""
        hidden = hidden.contiguous()
        self.send(Logits(tuple(hidden.shape), hidden.dtype))
        dist.broadcast(hidden, src=0, group=self.group.shard.group)

    def capture_graphs(self, max_tokens: int, max_batch: int, capture: tuple[int, ...], table_width: int) -> None:
        """Tell the workers to capture the graphs rank 0 is about to (inside `collective()`)."""
        self.send(CaptureGraphs(max_tokens, max_batch, tuple(capture), table_width))

    def replay(self, batch: int, num_tokens: int) -> None:
        """Tell the workers to replay the graph rank 0 is about to (inside `collective()`)."""
        self.send(Replay(batch, num_tokens))

    def keep_graphs(self, graphs) -> None:
        self._graphs.append(weakref.ref(graphs))

    def stop(self) -> None:
        """Tell the workers to exit and wait for them (after any step in flight). After a lost rank
        a step in flight may never end (its kernel waits on that rank): stop then waits for it at
        most ABORT_WAIT_S, and leaves the CUDA graphs as they are (freeing them would wait on that
        kernel; the process is to be restarted, as the loss's warning says)."""
        locked = self._lock.acquire(timeout=-1 if self._failure is None else ABORT_WAIT_S)
        if not locked:
            log.warning("tensor parallel: a step is still waiting on the lost rank; stopping without it")
        try:
            self._stop()
        finally:
            if locked:
                self._lock.release()

    def _stop(self) -> None:
        self._stopping = True
        if self._failure is None:
            for ref in self._graphs:  # their captured collectives hold the NCCL group
                if (graphs := ref()) is not None:
                    graphs.release()
        told = False
        if self._failure is None:
            try:
                self.send(Stop())
                told = True
            except Exception as exc:  # noqa: BLE001 - a worker already gone: nothing to tell
                log.debug("tensor parallel: stop not delivered (%s)", exc)
        if dist.is_initialized():
            if told:  # every rank leaves the group together (NCCL's teardown waits for its peers)
                if self.group.device.type == "cuda":
                    torch.cuda.synchronize(self.group.device)
                dist.destroy_process_group()
            else:  # a rank is gone: tearing down would wait for it
                self._abort.run()
        tp_group.stop_workers(self.group.workers)
        self.group.hub.close()
