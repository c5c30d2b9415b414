"""Decode and verify steps as captured CUDA graphs.

A step is the target's forward over T tokens (T = 1 for plain decoding, k + 1 for a verify
pass) plus its logits, at whatever position: inputs go through static buffers, the KV cache is
written at device-side positions and read by the split-K kernel, so one graph per T serves every
position. Capture happens once, before serving (prewarm), into rows at the very end of the
cache, which no sequence reaches before they are overwritten.
"""
from __future__ import annotations

import torch

from verispec.cache.kv import KVCache
from verispec.models.base import CausalLM


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
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)

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
