"""Decode and verify steps as captured CUDA graphs.

BatchGraphs (the engine's): one graph per (batch-size bucket, T) over the paged cache; the
inputs (token ids, positions, block tables, state slots) go through static buffers, padded rows
point at the scratch block, so one graph serves any sequences of up to its bucket's size.
GraphedStep/StepGraphs (below) are the single-sequence form over a contiguous KVCache.


A step is the target's forward over T tokens (T = 1 for plain decoding, k + 1 for a verify
pass) plus its logits, at whatever position: inputs go through static buffers, the KV cache is
written at device-side positions and read by the split-K kernel, so one graph per T serves every
position. Capture happens once, before serving (prewarm), into rows at the very end of the
cache, which no sequence reaches before they are overwritten.
"""
from __future__ import annotations

import contextlib
import gc

import torch

from verispec import log
from verispec.cache.kv import KVCache
from verispec.kernels import launch
from verispec.models.base import CausalLM


def _capture_once(fn, inputs: list[torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, tuple]:
    graph = torch.cuda.CUDAGraph()
    # thread_local: only this thread's unsafe calls can spoil the capture. In the default
    # ("global") mode a sync or cudaMalloc from any other thread invalidates it - e.g. another
    # engine's worker finishing its last step while this one captures (a long
    # scripts/gpu_spec_identity.py run failed so, cudaErrorStreamCaptureInvalidated)
    try:
        with _no_garbage_collection(), torch.inference_mode(), \
                torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = fn(*inputs)
    except BaseException:
        _stop_recording_to_pool(graph)
        raise
    return graph, outputs


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's cycle collector off for the capture. A collection that runs inside it (any
    allocation can start one) frees whatever unreachable cycles hold, e.g. an engine dropped
    earlier with its CUDA graphs, and destroying a graph is not permitted while this thread
    captures: the capture is invalidated ("operation failed due to a previous error during
    capture", after torch's "operation not permitted when stream is capturing (function reset)"
    warnings). torch stopped collecting before captures (torch.compiler.config.force_cudagraph_gc),
    so the engines of scripts/gpu_spec_identity.py met it now and then. Collection resumes after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _stop_recording_to_pool(graph: torch.cuda.CUDAGraph) -> None:
    """After a failed capture: torch ends the capture but, when ending it fails, may leave the
    caching allocator recording into the graph's pool; the next capture into that pool then fails
    with "beginAllocateToPool: already recording". Ends that recording if it is still open."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), graph.pool())
    except Exception as exc:  # already ended (the usual case) or the capture never began
        log.debug("after a failed capture, the pool's recording was already closed (%s)", exc)


def capture(fn, inputs: list[torch.Tensor], pool=None) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """`fn(*inputs)` captured as a CUDA graph -> (graph, its outputs). A capture that fails is made
    once more, into a memory pool of its own (the shared one may still be marked as recording) and
    without programmatic dependent launch (suspected once, before the collector was found out),
    and says so; a second failure raises."""
    try:
        return _capture_once(fn, inputs, pool)
    except RuntimeError as exc:
        log.warning("CUDA graph capture failed (%s); capturing once more, into a pool of its own and without "
                    "programmatic dependent launch", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    with launch.launches_without_pdl():
        return _capture_once(fn, inputs, None)


class GraphedCall:
    """`fn(*inputs)` (tensors in, a tuple of tensors out) captured once with static input buffers
    shaped like `example_inputs`; calling it copies the new inputs in (host tensors: without a
    sync) and replays. Outputs are the graph's own buffers: valid until the next replay. Target
    steps (GraphedStep) and drafter passes (Proposer.capture_graphs) are built on it."""

    def __init__(self, fn, example_inputs: list[torch.Tensor], pool=None):
        device = example_inputs[0].device
        self.inputs = [x.clone() for x in example_inputs]
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up runs compile/autotune kernels outside the capture
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph, self.outputs = capture(fn, self.inputs, pool)

    def pool(self):
        return self.graph.pool()

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        for buffer, x in zip(self.inputs, inputs):
            buffer.copy_(x, non_blocking=True)
        self.graph.replay()
        return self.outputs


class GraphedStep:
    def __init__(self, model: CausalLM, cache: KVCache, num_tokens: int, capture: tuple[int, ...],
                 logits_fn, pool=None):
        device = cache.device
        self.num_tokens = num_tokens
        self.cache = cache

        def step(input_ids, positions):
            out = model(input_ids, positions, cache, capture)
            hidden = out.hidden[0]
            pre_norm = out.pre_norm[0] if out.pre_norm is not None else None
            return hidden, [a[0] for a in out.aux], logits_fn(hidden), pre_norm

        # capture (and warm up) writing the last rows of the cache: never live data at capture time
        example = [torch.zeros((1, num_tokens), dtype=torch.long, device=device),
                   torch.arange(cache.capacity - num_tokens, cache.capacity, device=device)[None]]
        self.call = GraphedCall(step, example, pool)
        # recurrent layers recorded their (static, graph-owned) per-position states for commit
        self.pending_recurrent = cache.pending_recurrent_snapshot()
        cache.pending = 0
        cache.restore_pending_recurrent({})

    def pool(self):
        return self.call.pool()

    def __call__(self, token_ids: list[int], position: int):
        """Replay at `position`; returns static hidden [T, H], aux [T, H_t] each, logits [T, V],
        pre-norm hidden [T, H] (or None)."""
        t = self.num_tokens
        out = self.call(torch.tensor([token_ids], dtype=torch.long), torch.arange(position, position + t)[None])
        self.cache.pending = t  # the replayed forward wrote t pending rows
        self.cache.restore_pending_recurrent(self.pending_recurrent)
        return out


class StepGraphs:
    """One captured graph per step size T in 1..max_tokens, sharing one memory pool."""

    def __init__(self, model: CausalLM, cache: KVCache, max_tokens: int, capture: tuple[int, ...], logits_fn):
        self.steps: dict[int, GraphedStep] = {}
        pool = None
        for t in range(max_tokens, 0, -1):  # largest first, so the shared pool fits the rest
            step = GraphedStep(model, cache, t, capture, logits_fn, pool)
            pool = step.pool()
            self.steps[t] = step

    def get(self, num_tokens: int) -> GraphedStep | None:
        return self.steps.get(num_tokens)


BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class _CapturedBatchPass:
    """One (bucket, T) graph: the target's forward + logits over a BatchCache of static tensors."""

    def __init__(self, runner, batch: int, num_tokens: int, table_width: int, capture: tuple[int, ...], pool):
        from verispec.cache.paged import BatchCache

        device = runner.device
        pools = runner.pools
        has_state = bool(pools.recurrent_layers)
        self.batch, self.num_tokens, self.runner = batch, num_tokens, runner
        self.cache_box: list = []

        def step(input_ids, positions, block_tables, state_slots):
            cache = BatchCache(pools, block_tables, positions, state_slots if has_state else None, 0, use_kernel=True)
            self.cache_box[:] = [cache]
            out = runner.model(input_ids, positions, cache, capture)
            return out.hidden, out.aux, out.pre_norm, runner.logits(out.hidden)

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
        tables = self.runner.table_rows(seqs, width, pad)
        slots = torch.tensor([s.state_slot or 0 for s in seqs] + [0] * pad)
        hidden, aux, pre_norm, logits = self.call(ids, positions, tables, slots)
        self.cache.restore_pending_recurrent(self.pending_recurrent)
        return PassOutput(hidden[:b], [a[:b] for a in aux], pre_norm[:b] if pre_norm is not None else None,
                          logits[:b], _PaddedCommit(self, self.batch))


class _PaddedCommit:
    """commit(rows per real sequence) on a graph's cache: the captured commit graph when there is
    one (padded rows count 1 and write the scratch slot), else the cache's own commit."""

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

    def __init__(self, runner, max_tokens: int, max_batch: int, capture: tuple[int, ...], table_width: int):
        self.batch_sizes = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.passes: dict[tuple[int, int], _CapturedBatchPass] = {}
        pool = None
        for b in sorted(self.batch_sizes, reverse=True):  # largest first, so the shared pool fits the rest
            for t in range(max_tokens, 0, -1):
                graph = _CapturedBatchPass(runner, b, t, table_width, capture, pool)
                pool = graph.call.pool()
                self.passes[(b, t)] = graph

    def get(self, batch: int, num_tokens: int) -> _CapturedBatchPass | None:
        for b in self.batch_sizes:
            if b >= batch:
                return self.passes.get((b, num_tokens))
        return None
