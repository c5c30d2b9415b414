"""The scheduler: which sequences run in the next step, and how many tokens each.

Waiting sequences are admitted in arrival order while `max_num_seqs` and free KV blocks allow.
Each step gives every decoding sequence one verify pass of k+1 tokens (k drafts, chosen from the
batch size) and spends the rest of the token budget (`max_num_batched_tokens`) on prompt chunks,
so a long prompt never stalls the running decodes. When a decoding sequence needs a block and none
is free, the newest running sequence is preempted: its blocks are freed and it goes back to the
front of the queue, to be prefilled again over everything it has so far (recomputation). Nothing
is lost or cut short: a preempted sequence continues exactly where it stopped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from verispec import log
from verispec.cache.paged import BlockAllocator, SlotAllocator
from verispec.engine.sequence import Sequence, SequenceStatus


@dataclass
class StepPlan:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens of its chunk)
    decodes: list[Sequence] = field(default_factory=list)
    num_drafts: int = 0  # drafts per decoding sequence this step

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, blocks: BlockAllocator, slots: SlotAllocator | None, max_num_seqs: int,
                 max_num_batched_tokens: int, prefill_chunk: int, on_free: Callable[[Sequence], None],
                 on_allocate: Callable[[list[int]], None] = lambda blocks: None):
        self.blocks = blocks
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.on_free = on_free  # called when a sequence's resources go back (finish or preemption)
        self.on_allocate = on_allocate  # called with newly handed-out block ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ---- resources ----------------------------------------------------------------------------------
    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for positions 0..num_tokens-1; False (nothing allocated) when they do not fit."""
        need = self.blocks.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        new_blocks = self.blocks.allocate(need)
        self.on_allocate(new_blocks)
        seq.block_table.extend(new_blocks)
        return True

    def release(self, seq: Sequence) -> None:
        """Give a sequence's blocks and state slot back (finished, cancelled or preempted)."""
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
        seq.table_row = None  # a cached graph-input row names the freed blocks
        if seq.state_slot is not None and self.slots is not None:
            self.slots.free(seq.state_slot)
            seq.state_slot = None
        seq.num_cached = 0
        self.on_free(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)

    def _preempt_newest(self) -> Sequence:
        victim = self.running.pop()
        self.release(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        log.debug("preempted sequence %d (%d tokens so far; %d free blocks)", victim.id, victim.num_tokens,
                  self.blocks.num_free)
        return victim

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self, drafts_for_batch: Callable[[int], int]) -> StepPlan:
        plan = StepPlan()
        decoding = [s for s in self.running if not s.in_prefill]
        plan.num_drafts = drafts_for_batch(len(decoding)) if decoding else 0
        width = plan.num_drafts + 1
        for seq in decoding:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below by an older sequence
            while not self._grow(seq, seq.num_cached + width):
                if self._preempt_newest() is seq:
                    break
            else:
                plan.decodes.append(seq)
        budget = self.max_num_batched_tokens - len(plan.decodes) * width
        for seq in [s for s in self.running if s.in_prefill]:
            if seq.status is SequenceStatus.RUNNING:  # not preempted meanwhile
                budget -= self._plan_chunk(plan, seq, budget)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if self.slots is not None and self.slots.num_free == 0:
                break
            used = self._plan_chunk(plan, seq, budget, admitting=True)
            if not used:
                break  # not enough free blocks for its first chunk: wait for some to free up
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if self.slots is not None:
                seq.state_slot = self.slots.allocate()
            self.running.append(seq)
            budget -= used
        return plan

    def _plan_chunk(self, plan: StepPlan, seq: Sequence, budget: int, admitting: bool = False) -> int:
        """Schedule the next prompt chunk of `seq` within `budget` tokens; returns tokens used."""
        remaining = seq.prefill_target - seq.num_cached
        if not admitting and not plan.decodes and not plan.prefills:
            budget = max(budget, 1)  # a lone prefill always makes progress
        num = min(remaining, self.prefill_chunk, budget)
        if num <= 0:
            return 0
        while not self._grow(seq, seq.num_cached + num):
            # when nothing else can run, a sequence mid-prompt takes blocks from newer ones (else all
            # could stall half-prefilled); otherwise it waits for blocks to free up, as admission does
            if admitting or self.running[-1] is seq or not plan.empty:
                return 0
            self._preempt_newest()
        plan.prefills.append((seq, num))
        return num
