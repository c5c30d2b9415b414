"""The scheduler: which sequences run in the next step, and how many tokens each.

Waiting sequences are admitted in arrival order while `max_num_seqs` and free KV blocks allow.
Each step gives every decoding sequence one verify pass of k+1 tokens (k drafts, chosen from the
batch size) and spends the rest of the token budget (`max_num_batched_tokens`) on prompt chunks,
so a long prompt never stalls the running decodes. When a decoding sequence needs a block and none
is free, the newest running sequence is preempted: its blocks are freed and it goes back to the
front of the queue, to be prefilled again over everything it has so far (recomputation). Nothing
is lost or cut short: a preempted sequence continues exactly where it stopped.

With the prefix cache (verispec/cache/prefix.py), an admitted sequence first takes the cached
blocks its tokens start with and is prefilled from there; a preempted one usually finds its own
blocks still cached, so recomputation is short.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from verispec import log
from verispec.cache.paged import BlockAllocator, SlotAllocator
from verispec.cache.prefix import PrefixCache
from verispec.engine.sequence import Sequence, SequenceStatus


# The default token budget of a step on a GPU: a prompt token costs ~2 x parameters FLOPs, so the
# budget keeps a step's compute near that of 2048 tokens of an 8B model (tens of ms on an H200,
# the time running decodes wait behind a prefill). Small models then take many prompts in one
# pass (the demo model: 8 clients' 512-token prompts in one pass, not four): their passes cost
# per-layer host overhead, not compute. On a CPU, compute-bound, the budget stays 2048.
STEP_PARAM_TOKENS = 2048 * 8e9
MAX_STEP_TOKENS = 16384


def default_token_budget(num_params: int, device_type: str, prefill_chunk: int) -> int:
    """--max-num-batched-tokens when none is given."""
    base = max(2048, prefill_chunk)
    if device_type != "cuda":
        return base
    by_compute = int(STEP_PARAM_TOKENS / max(num_params, 1)) // 256 * 256
    return max(base, min(MAX_STEP_TOKENS, by_compute))


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
                 on_allocate: Callable[[list[int]], None] = lambda blocks: None,
                 prefix: PrefixCache | None = None,
                 on_copy: Callable[[int, int], None] = lambda src, dst: None,
                 on_admit: Callable[[Sequence], None] = lambda seq: None):
        self.blocks = blocks
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.on_free = on_free  # called when a sequence's resources go back (finish or preemption)
        self.on_allocate = on_allocate  # called with newly handed-out block ids
        self.prefix = prefix
        self.on_copy = on_copy  # block src -> dst (a shared block made private)
        self.on_admit = on_admit  # a sequence got its blocks and state slot (restore or clear its state)
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

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for positions 0..num_tokens-1 of a running sequence ahead of its scheduled step
        (overlapped decoding queues steps ahead); False (nothing allocated) when they do not fit."""
        return self._grow(seq, num_tokens)

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
        seq.num_registered = 0
        seq.prefix_hit = None
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
            if self.prefix is not None and self.prefix.being_computed(seq, self.running):
                break  # admitted once that block is registered: a hit instead of computing it twice
            self._take_prefix(seq)
            used = self._plan_chunk(plan, seq, budget, admitting=True)
            if not used:
                self.release(seq)  # gives back the shared prefix blocks too
                break  # not enough free blocks for its first chunk: wait for some to free up
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if self.slots is not None:
                seq.state_slot = self.slots.allocate()
            self.running.append(seq)
            if self.prefix is not None:
                self.prefix.record(seq)
            self.on_admit(seq)
            budget -= used
        return plan

    def _take_prefix(self, seq: Sequence) -> None:
        """A sequence about to be admitted takes the cached blocks its tokens start with."""
        if self.prefix is None or seq.block_table:
            return
        hit = self.prefix.match(seq)
        whole = hit is not None and hit.num_tokens >= seq.prefill_target
        if hit is not None and (self.prefix.keep_features or whole):
            # the hit's last block is rewritten (the drafter's row at its last position, or the
            # prompt's last token): that block becomes a private copy
            if self.blocks.num_free > 0:
                [copy] = self.blocks.allocate(1)
                self.on_copy(hit.blocks[-1], copy)
                self.blocks.free([hit.blocks[-1]])
                hit.blocks[-1] = copy
            elif whole and len(hit.blocks) > 1:  # no block to copy into: stop the hit a block short
                self.blocks.free([hit.blocks.pop()])
                hit.num_tokens -= self.blocks.block_size
                whole = False
            else:
                self.blocks.free(hit.blocks)
                hit = None
        if hit is None:
            return
        if whole:
            hit.num_tokens = seq.prefill_target - 1  # the last token is computed again, in the copy
        seq.block_table = list(hit.blocks)
        seq.num_cached = hit.num_tokens
        seq.num_registered = len(hit.blocks)
        seq.prefix_hit = hit

    def _plan_chunk(self, plan: StepPlan, seq: Sequence, budget: int, admitting: bool = False) -> int:
        """Schedule the next prompt chunk of `seq` within `budget` tokens; returns tokens used."""
        remaining = seq.prefill_target - seq.num_cached
        if not admitting and not plan.decodes and not plan.prefills:
            budget = max(budget, 1)  # a lone prefill always makes progress
        num = min(remaining, self.prefill_chunk, budget)
        if num <= 0:
            return 0
        if self.prefix is not None and self.prefix.hybrid:
            # end a chunk at the last block boundary a later prompt can hit (recurrent state is
            # snapshotted where a commit lands on a boundary)
            size = self.blocks.block_size
            edge = (seq.prefill_target - 1) // size * size
            if seq.num_cached < edge < seq.num_cached + num:
                num = edge - seq.num_cached
        while not self._grow(seq, seq.num_cached + num):
            # when nothing else can run, a sequence mid-prompt takes blocks from newer ones (else all
            # could stall half-prefilled); otherwise it waits for blocks to free up, as admission does
            if admitting or self.running[-1] is seq or not plan.empty:
                return 0
            self._preempt_newest()
        plan.prefills.append((seq, num))
        return num
