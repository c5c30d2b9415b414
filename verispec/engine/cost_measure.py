"""The engine's own passes timed into a draft-cost table (engine/draft_costs.py): verify passes by
batch size and width, and the proposer's drafting by batch size and drafts.

Runs on the engine's worker (or the bench's) before serving: sequences are prefilled through the
engine's runner (CUDA graphs replay where captured, so the times are the graphs'), timed, and
their blocks given back. Used by `--draft-costs measure` (at the first step, after prewarm's graph
capture) and by `verispec bench --write-draft-costs`.
"""
from __future__ import annotations

import statistics
import time

import torch

from verispec.engine.draft_costs import TableCosts
from verispec.engine.output import OutputBuilder
from verispec.engine.sequence import Sequence
from verispec.sampling.params import SamplingParams
from verispec.sampling.sampler import TokenHistory
from verispec.spec.proposer import TargetStep

PROMPT_TOKENS = 32  # a short context: the table is about widths and batch sizes, not context length
MAX_CPU_BATCH = 16  # a CPU's start-up measures up to this many sequences (each row costs it time)


def prefilled_sequence(engine, prompt_ids: list[int], k: int) -> Sequence:
    """A sequence prefilled through the engine's own runner (not queued: the caller drives steps
    itself), holding blocks for k+1 more positions, its proposer observing as in generation."""
    greedy = SamplingParams(temperature=0.0, max_tokens=k + 2, ignore_eos=True)
    history = TokenHistory(engine.model.vocab_size, prompt_ids, engine.device)
    out = OutputBuilder(engine.tokenizer, greedy, k + 2, history, engine.eos_token_ids)
    seq = Sequence(prompt_ids, greedy, k + 2, out, None, "bench", sink=lambda chunk: None)
    if not engine.scheduler.reserve(seq, len(prompt_ids) + k + 1):
        raise RuntimeError("the KV cache has no room for the step-cost sequences")
    engine.runner.apply(engine.scheduler.take_cache_ops())
    if engine.scheduler.slots is not None:
        seq.state_slot = engine.scheduler.slots.allocate()
        engine.pools.clear_state(seq.state_slot)
    proposer = engine.proposer
    if proposer is not None:
        proposer.start(seq)
        seq.drafting = True
    capture = engine.runner.capture_layers
    result = engine.runner.prefill([seq], [len(prompt_ids)], capture, keep_all_rows=proposer is not None)
    seq.num_cached = len(prompt_ids)
    token = int(torch.argmax(result.logits[0, -1]))
    seq.out.token_ids.append(token)
    if proposer is not None:
        step = TargetStep(prompt_ids, 0, result.hidden[0], [a[0] for a in result.aux], token,
                          result.pre_norm[0] if result.pre_norm is not None else None)
        proposer.observe([(seq, step)])
    return seq


def default_batches(engine) -> list[int]:
    """The batch sizes to time: the captured graphs' buckets, else powers of two up to
    --max-num-seqs (a CPU's up to MAX_CPU_BATCH; the table extends past its last point)."""
    graphs = engine.runner.graphs
    if graphs is not None:
        return list(graphs.batch_sizes)
    top = engine.config.max_num_seqs if engine.device.type == "cuda" else min(engine.config.max_num_seqs,
                                                                               MAX_CPU_BATCH)
    out, b = [], 1
    while b < top:
        out.append(b)
        b *= 2
    return out + [top]


def _median_ms(fn, iters: int, device: torch.device) -> float:
    fn()  # the first call may compile or allocate
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(engine, batches: list[int] | None = None, iters: int = 5) -> TableCosts:
    """Time the engine's verify passes at each batch size x width 1..k+1 and its proposer's drafting
    at each batch size x 1..k drafts (k: the engine's drafts per round). Nothing is committed."""
    k = engine.num_drafts
    proposer = engine.proposer
    batches = sorted(set(batches or default_batches(engine)))
    device = engine.device
    capture = engine.runner.capture_layers
    vocab = min(engine.model.vocab_size, engine.num_real_tokens)
    prompts = [[(7 * i + 3 * j + 1) % vocab for j in range(PROMPT_TOKENS)] for i in range(max(batches))]
    seqs = [prefilled_sequence(engine, ids, k) for ids in prompts]
    verify, draft = {}, {}
    try:
        for b in batches:
            group = seqs[:b]
            for width in range(1, k + 2):
                rows = [[s.last_token] * width for s in group]

                def verify_pass(group=group, rows=rows):
                    out = engine.runner.verify(group, rows, capture)
                    out.logits.argmax(-1).tolist()  # the engine syncs on this every round

                verify[(b, width)] = _median_ms(verify_pass, iters, device)
            if proposer is None:
                continue
            greedy = [s.params for s in group]
            for n in range(1, k + 1):
                draft[(b, n)] = _median_ms(lambda group=group, n=n: proposer.propose(
                    group, [n] * len(group), greedy, [None] * len(group)), iters, device)
    finally:
        for s in seqs:
            engine.scheduler.release(s)
        engine.runner.apply(engine.scheduler.take_cache_ops())
    return TableCosts(verify, draft, source=f"measured on {device.type}")
