"""Warm-up: CUDA-graph capture for the verify passes (and the drafters' passes), and one short
generation so that the first request pays no compilation."""
from __future__ import annotations

import contextlib
import os
import time

import torch

from verispec import config, log
from verispec.cache.paged import BatchCache
from verispec.sampling.params import SamplingParams
from verispec.kernels import decode_attention as split_k

PREWARM_PROMPT_TOKENS = 100


def pin_triton_cache_dir(device: torch.device) -> str | None:
    """Give Triton one on-disk cache for the whole process, from its first compile on: Triton's own
    directory (~/.triton/cache, or the TRITON_CACHE_DIR the user set), set in TRITON_CACHE_DIR.

    Why: unless the variable is set, inductor sets it to its own directory the first time it builds
    a kernel launcher, and Triton reads it at every compile. Kernels compiled before that moment
    (fla's, ours) land in ~/.triton/cache; after it, in inductor's directory. Which comes first
    differs between a first start (inductor compiles early) and a later one (its graphs come from
    its cache): on the H200 a second start recompiled 109 kernels the first had compiled, because
    it looked in the other directory. (Asking inductor for its directory imports dynamo: 1.7 s of a
    start that may compile nothing with it.) Returns the directory (None off CUDA or without
    Triton). Also where Triton's compiles start being logged under VERISPEC_DEBUG=1
    (`log_compiles`): before anything compiles, like the directory."""
    if device.type != "cuda":
        return None
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - Triton ships with CUDA torch
        return None
    # a library's variable, set for the libraries (not one of ours: config.EnvSettings reads those)
    os.environ.setdefault("TRITON_CACHE_DIR", knobs.cache.dir)
    log_compiles()
    return os.environ["TRITON_CACHE_DIR"]


def log_compiles() -> None:
    """Under VERISPEC_DEBUG=1, one line per Triton kernel built or read from the disk cache, with
    its specialisation, and torch.compile's recompiles with the guard that failed: a first request
    that stalls shows which shape it compiled."""
    if not log.debug_enabled():
        return
    torch._logging.set_logs(recompiles=True)
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - Triton ships with CUDA torch
        return

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        log.debug("triton: %s %s in %.0f ms (%s)", getattr(src, "name", "?"), "read" if cache_hit else "compiled",
                  times.total / 1000, _specialisation(src))

    knobs.compilation.listener = listener


def _specialisation(src) -> str:
    """A compiled kernel's constants by argument name, and how many arguments it takes as aligned:
    what tells two compiles of one kernel apart."""
    names = getattr(getattr(src, "fn", None), "arg_names", None) or []
    constants = getattr(src, "constants", None) or {}
    parts = [f"{names[k[0]] if len(k) == 1 and k[0] < len(names) else k}={v}" for k, v in constants.items()]
    return f"{' '.join(parts)[:240]}; {len(getattr(src, 'attrs', None) or {})} arguments aligned"


def graphs_possible(device: torch.device, enabled: bool, split_hybrid: bool = False) -> bool:
    """Whether verify passes are captured; `split_hybrid`: a model with recurrent layers split over
    tensor-parallel ranks, whose graphed passes are not yet checked on GPUs (they run eagerly)."""
    if device.type != "cuda":
        return False
    reason = None
    if not enabled:
        reason = "disabled (--no-cuda-graphs)"
    elif not split_k.available(device):
        reason = "Triton is not installed, so attention cannot read the cache in place"
    elif split_hybrid:
        reason = "a model with recurrent layers split over tensor-parallel ranks"
    if reason:
        log.debug("CUDA graphs off: %s; decode steps run eagerly", reason)
        return False
    return True


def capture_graphs(engine) -> float:
    if not engine.use_graphs or engine.runner.graphs is not None:
        return 0.0
    from verispec.kernels.cuda_graph import warm_up_once

    t0 = time.perf_counter()
    summary = compile_ahead(engine)
    with warm_up_once() if summary is not None else contextlib.nullcontext():
        _capture(engine)
    seconds = time.perf_counter() - t0
    graphs, prompts = engine.runner.graphs, engine.runner.prompt_graphs
    log.debug("captured CUDA graphs for batch sizes %s x steps of 1..%d tokens%s in %.2fs",
              graphs.batch_sizes, engine.num_drafts + 1,
              f", prompt chunks of up to {prompts.buckets[-1]} tokens (passes of up to {prompts.batch_sizes[-1]} "
              f"sequences' to {prompts.longest_batched})" if prompts else "", seconds)
    return seconds


def _capture(engine) -> None:
    """The target's verify passes, the drafter's passes and the prompt graphs, captured."""
    from verispec.engine.cuda_graphs import BatchGraphs
    from verispec.engine.prompt_graphs import capture_prompt_graphs

    capture = engine.proposer.capture_layers if engine.proposer else ()
    table_width = engine.blocks.blocks_for(engine.max_model_len + engine.num_drafts + 1)
    args = (engine.num_drafts + 1, engine.config.max_num_seqs, capture, table_width)
    if engine.peers is None:
        engine.runner.graphs = BatchGraphs(engine.runner, *args)
    else:  # every rank captures the same graphs, collectives in lockstep
        with engine.peers.collective():
            engine.peers.capture_graphs(*args)
            engine.runner.graphs = BatchGraphs(engine.runner, *args)
            engine.peers.keep_graphs(engine.runner.graphs)
    if engine.proposer is not None:
        engine.proposer.capture_graphs(engine.runner.graphs.batch_sizes, engine.num_drafts + 1, table_width)
    engine.runner.prompt_graphs = capture_prompt_graphs(engine.runner, engine.config.prefill_step_size,
                                                        engine.config.max_num_seqs, table_width, capture,
                                                        engine.runner.graphs.pool)


def compile_ahead(engine) -> dict | None:
    """Every pass the captures will make, run once dry first (kernels/compile_ahead.py): the Triton
    kernels they meet compile from a pool of threads instead of one by one inside the captures.
    On a warm Triton cache the dry passes find them all built from disk. Tensor-parallel ranks
    capture in lockstep and compile as they capture. Returns the dry run's summary (None: not run)."""
    from verispec.kernels import compile_ahead as ahead

    reason = None
    if not config.env().compile_ahead:
        reason = "VERISPEC_COMPILE_AHEAD=0"
    elif not ahead.available():
        reason = "Triton is not installed"
    elif engine.peers is not None:
        reason = "tensor-parallel ranks capture in lockstep"
    if reason:
        log.debug("Triton kernels compile inside the captures (%s)", reason)
        return None
    t0 = time.perf_counter()
    with ahead.dry_run() as summary:
        _capture(engine)
    # what the dry run built is garbage: the captures start again from nothing
    engine.runner.graphs = engine.runner.prompt_graphs = None
    if engine.proposer is not None:
        engine.proposer.drop_graphs()
    log.debug("compiled %d Triton kernels ahead in %.1fs (the last %.1fs waiting for the threads)%s%s",
              summary["built"], time.perf_counter() - t0, summary["wait_s"],
              f"; {summary['failed']} failed and compile where met" if summary["failed"] else "",
              f"; {summary['skipped_tuners']} autotuned launches left to the captures" if summary["skipped_tuners"] else "")
    return summary


def prewarm_prompt(tokenizer) -> list[int]:
    return (tokenizer.encode("def hello(world):\n    return world + 1\n\n" * 12) or [0])[:PREWARM_PROMPT_TOKENS]


def prewarm(engine) -> float:
    t0 = time.perf_counter()
    graphs_s = engine.capture_graphs()
    t1 = time.perf_counter()
    # a prompt of ~100 tokens and a few speculative rounds: the compiled small ops specialise on
    # one-token shapes, so a one-token warm-up would leave the first real prefill to compile its
    # multi-token variants (measured: ~1.8 s added to the first request's TTFT)
    engine.generate_all(prewarm_prompt(engine.tokenizer), SamplingParams(
        max_tokens=2 * (engine.num_drafts + 1) + 1, temperature=0.0, ignore_eos=True))
    t2 = time.perf_counter()
    if engine.device.type == "cuda":
        warm_prompt_lengths(engine)
    t3 = time.perf_counter()
    gate = getattr(engine.draft_policy, "gate", None)
    if gate is not None:
        gate.forget()
    # where a start-up's minutes go (an empty Triton cache compiles kernels in each phase); phases that
    # did not run on this device are left out rather than shown as 0.0s
    phases = ([f"CUDA graphs {graphs_s:.1f}s"] if engine.use_graphs else []) + [f"first generation {t2 - t1:.1f}s"]
    if engine.device.type == "cuda":
        phases.append(f"prompt lengths {t3 - t2:.1f}s")
    log.info("prewarm phases: %s", ", ".join(phases))
    return t3 - t0


# Prompt lengths prewarm prefills once each (one token generated). Triton kernels specialise on
# their integer arguments' divisibility by 16 (lengths, and strides derived from them), and the
# Gated DeltaNet chunk kernels also on the number of 64-token chunks: on the H200 the demo model's
# first chunk took 0.6-5 s at each prompt length whose class the process had not compiled yet
# (ptxas runs inside the prefill). 16 consecutive lengths cover every
# residue mod 16, at one and at two chunks. Short passes take kernels whose pass length is a
# compile-time constant: the split-K attention (up to split_k.MAX_QUERY_TOKENS tokens) and the
# Gated DeltaNet per-position kernel (up to the cache's max_tracked_positions). The graphs compile
# them for 1..k+1 tokens; a prompt's last piece meets the others when the step's token budget or a
# prefix hit leaves that few (0.5-4 s each on the H200), so lengths 1..16 are prewarmed too.
# Triton's on-disk cache keeps them all for the next start.
WARM_LENGTH_STARTS = (17, PREWARM_PROMPT_TOKENS)
WARM_LENGTHS_PER_START = 16
SHORT_PASS_TOKENS = max(split_k.MAX_QUERY_TOKENS, BatchCache.max_tracked_positions)


def warm_lengths(max_model_len: int) -> list[list[int]]:
    """The prompt lengths prewarm prefills, one group (one batch) per list."""
    groups = [list(range(1, SHORT_PASS_TOKENS + 1))]
    groups += [list(range(first, first + WARM_LENGTHS_PER_START)) for first in WARM_LENGTH_STARTS]
    return [[n for n in group if n < max_model_len] for group in groups]


def warm_prompt_lengths(engine) -> None:
    """Each length alone (one-sequence passes), then each group together: prompt chunks of
    several sequences share a padded pass (engine/scheduler.py `prefill_groups`), whose shapes compile again."""
    vocab = engine.num_real_tokens
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    def prompts(lengths: list[int], salt: int) -> list[list[int]]:
        # token ids that differ from the first one on, so that no prompt hits another's cached
        # prefix (a hit would prefill only the tail: another length)
        return [[(1000003 * n + salt * j) % vocab for j in range(n)] for n in lengths]

    for lengths in warm_lengths(engine.max_model_len):
        if not lengths:
            continue
        for prompt in prompts(lengths, 7919):
            engine.generate_all(prompt, params)
        engine.generate_batch(prompts(lengths, 7907), params)  # one batch per group: within the step's budget, unsplit
