"""Prompt tokens per step sized by time on the CPU (engine/prefill_pacer.py), with a synthetic clock:
a decoding stream's gap beside a long prompt stays near the target on a slow CPU, a fast CPU still
gets whole chunks, and the scheduler never plans more prompt tokens than the pacer allows beside a
decoding stream (alone, a prompt runs in whole chunks)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from verispec.cache.paged import BlockAllocator
from verispec.engine.prefill_pacer import MIN_BUDGET, PrefillPacer, prefill_pacer_for
from verispec.engine.scheduler import Scheduler
from verispec.engine.sequence import Sequence
from verispec.sampling.params import SamplingParams

CHUNK = 2048  # --prefill-step-size


def run_prompt(pacer: PrefillPacer, num_prompt_tokens: int, decode_s: float, token_s: float) -> list[tuple[int, float]]:
    """Prefill one prompt beside a decoding stream on a synthetic clock: a step costs decode_s
    plus token_s per prompt token, growing along the prompt (attention reads the context).
    Returns (prompt tokens, seconds) per step."""
    steps, done = [], 0
    while done < num_prompt_tokens:
        num = min(pacer.token_budget(), CHUNK, num_prompt_tokens - done)
        seconds = decode_s + num * token_s * (1 + (done + num) / 8192)
        pacer.observe(num, seconds)
        steps.append((num, seconds))
        done += num
    return steps


def test_a_slow_cpu_keeps_each_step_near_the_target_beside_an_8k_prompt():
    """20 ms a prompt token (float16 on a 2-core host): a 2048-token chunk would be a 40 s gap."""
    pacer = PrefillPacer(target_s=1.0)
    steps = run_prompt(pacer, 8000, decode_s=0.05, token_s=0.02)
    assert max(seconds for _, seconds in steps) <= 1.2, steps
    # and the prompt is not starved: after the first few steps, each runs most of what fits
    settled = steps[4:]
    assert min(num for num, _ in settled[:-1]) >= 20, steps


def test_a_fast_cpu_gets_whole_chunks():
    pacer = PrefillPacer(target_s=1.0)
    steps = run_prompt(pacer, 40_000, decode_s=0.01, token_s=1e-5)
    assert [num for num, _ in steps[-5:-1]] == [CHUNK] * 4, steps


def test_decoding_alone_over_the_target_still_lets_the_prompt_progress():
    pacer = PrefillPacer(target_s=1.0)
    steps = run_prompt(pacer, 300, decode_s=3.0, token_s=0.01)
    assert all(num >= MIN_BUDGET for num, _ in steps[:-1])
    assert pacer.token_budget() == MIN_BUDGET


def test_only_a_cpu_is_paced():
    assert prefill_pacer_for(torch.device("cpu"), None) is not None
    assert prefill_pacer_for(torch.device("cpu"), 0) is None
    assert prefill_pacer_for(torch.device("cpu"), 2.5).target_s == 2.5
    assert prefill_pacer_for(torch.device("cuda", 0), None) is None


class FixedPacer:
    def __init__(self, budget: int):
        self.budget = budget

    def token_budget(self) -> int:
        return self.budget


def test_the_scheduler_paces_prompts_only_beside_decoding_streams():
    block = 16
    scheduler = Scheduler(BlockAllocator(64, block), None, 4, 4096, CHUNK, pacer=FixedPacer(40))

    def add(n: int) -> Sequence:
        seq = Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=4), 4,
                       SimpleNamespace(history=[], token_ids=[]), None, "ar", lambda chunk: None, block_size=block)
        scheduler.add(seq)
        return seq

    first = add(300)
    plan = scheduler.schedule(lambda batch: 0)
    assert [n for _, n in plan.prefills] == [300]  # nobody decodes: the prompt runs whole
    first.num_cached = 300  # its prompt is in: it decodes from the next step
    first.token_ids.append(7)
    add(300)
    add(5)
    plan = scheduler.schedule(lambda batch: [0] * len(batch))
    assert plan.decodes == [first]
    assert [n for _, n in plan.prefills] == [40]  # beside a stream: the pacer's 40; the third waits
