"""Warm-up: CUDA-graph capture for the verify passes (and the drafters' passes), and one short
generation so that the first request pays no compilation."""
from __future__ import annotations

import time

import torch

from verispec import log
from verispec.engine.params import SamplingParams
from verispec.kernels import decode_attention as split_k

PREWARM_PROMPT_TOKENS = 100


def graphs_possible(device: torch.device, enabled: bool) -> bool:
    if device.type != "cuda":
        return False
    reason = None
    if not enabled:
        reason = "disabled (--no-cuda-graphs)"
    elif not split_k.available(device):
        reason = "Triton is not installed, so attention cannot read the cache in place"
    if reason:
        log.debug("CUDA graphs off: %s; decode steps run eagerly", reason)
        return False
    return True


def capture_graphs(engine) -> float:
    if not engine.use_graphs or engine.runner.graphs is not None:
        return 0.0
    from verispec.engine.cuda_graphs import BatchGraphs

    t0 = time.perf_counter()
    capture = engine.proposer.capture_layers if engine.proposer else ()
    table_width = engine.blocks.blocks_for(engine.max_model_len + engine.num_drafts + 1)
    engine.runner.graphs = BatchGraphs(engine.runner, engine.num_drafts + 1, engine.config.max_num_seqs, capture,
                                       table_width)
    if engine.batched_drafting:
        engine.proposer.capture_batch_graphs(engine.runner.graphs.batch_sizes, engine.num_drafts + 1, table_width)
    elif engine.proposer is not None:
        engine.proposer.capture_graphs(engine.num_drafts + 1, engine.max_model_len + engine.num_drafts + 1)
    seconds = time.perf_counter() - t0
    log.debug("captured CUDA graphs for batch sizes %s x steps of 1..%d tokens in %.2fs",
              engine.runner.graphs.batch_sizes, engine.num_drafts + 1, seconds)
    return seconds


def prewarm(engine) -> float:
    t0 = time.perf_counter()
    engine.capture_graphs()
    # a prompt of ~100 tokens and a few speculative rounds: the compiled small ops specialise on
    # one-token shapes, so a one-token warm-up would leave the first real prefill to compile its
    # multi-token variants (measured: ~1.8 s added to the first request's TTFT)
    ids = (engine.tokenizer.encode("def hello(world):\n    return world + 1\n\n" * 12) or [0])[:PREWARM_PROMPT_TOKENS]
    engine.generate_all(ids, SamplingParams(max_tokens=2 * (engine.num_drafts + 1) + 1, temperature=0.0,
                                            ignore_eos=True))
    return time.perf_counter() - t0
