"""The scheduler: which sequences run in the next step, and how many tokens each.

Waiting sequences are admitted in arrival order while `max_num_seqs` and free KV blocks allow.
Each step gives every decoding sequence one verify pass of k+1 tokens (k drafts each, chosen by
the engine's draft policy) and spends the rest of the token budget (`max_num_batched_tokens`) on prompt chunks,
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
from typing import Callable, Union

from verispec import log
from verispec.cache.paged import BlockAllocator, SlotAllocator
from verispec.cache.prefix import PrefixCache
from verispec.engine.prefill_pacer import PrefillPacer
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


# What the scheduler did to the cache's bookkeeping that the device must follow, in order: the
# runner applies these to the target's pools (and a drafter's own) before the step's passes.
@dataclass(frozen=True)
class ZeroBlocks:
    blocks: list[int]  # newly handed out: stale rows must not leak into masked attention


@dataclass(frozen=True)
class CopyBlock:
    src: int  # a shared prefix-cache block ...
    dst: int  # ... made private, because its last rows are rewritten


@dataclass(frozen=True)
class RestoreState:
    snapshot_slot: int  # a prefix hit's recurrent-state snapshot ...
    state_slot: int  # ... becomes an admitted sequence's starting state


@dataclass(frozen=True)
class ClearState:
    state_slot: int  # an admitted sequence with no snapshot starts from zeros


@dataclass(frozen=True)
class Released:
    seq: Sequence  # blocks went back (finished or preempted): its drafter state goes too


CacheOp = Union[ZeroBlocks, CopyBlock, RestoreState, ClearState, Released]


@dataclass
class StepPlan:
    """One step: prompt chunks in passes (each pass a list of (sequence, chunk tokens)), the
    decoding sequences with the drafts each gets, and the cache operations to apply first."""

    prefill_groups: list[list[tuple[Sequence, int]]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # drafts each of `decodes` gets this step

    @property
    def width(self) -> int:
        """Tokens per sequence in the verify pass: 1 + the most drafts any sequence gets."""
        return 1 + max(self.drafts, default=0)
    cache_ops: list[CacheOp] = field(default_factory=list)

    @property
    def prefills(self) -> list[tuple[Sequence, int]]:
        return [chunk for group in self.prefill_groups for chunk in group]

    @property
    def empty(self) -> bool:
        return not self.prefill_groups and not self.decodes


# A pass groups prompt chunks while its padded size (B x its longest chunk) stays within this
# factor of its real tokens, plus a few tokens a row: a prompt's short tail does not ride in a
# pass of long chunks (padding is compute spent on nothing), tails group with tails.
PADDING_ALLOWANCE = 1.25
PADDING_SLACK = 16


def batches_prompts(asked: bool | None, device_type: str) -> bool:
    """Whether one step's prompt chunks share a pass (EngineConfig.batch_prefill, None: the device's
    default): on CUDA, where they share its launches. On a CPU a pass costs its rows and every first
    token waited for the whole padded pass; one pass a chunk gets each out as its own pass ends
    (docs/benchmarks.md, "Several prompts at once")."""
    return asked if asked is not None else device_type == "cuda"


def prefill_groups(chunks: list[tuple[Sequence, int]], batched: bool = True) -> list[list[tuple[Sequence, int]]]:
    """The step's (sequence, chunk tokens) in passes: longest first, each group as long as its
    padding stays within the allowance (a group keeps the plan's order inside). Grouped, chunks
    share one pass's per-layer host overhead: eight clients' prompts need not wait for eight
    forwards. batched=False: one pass per chunk."""
    if not batched:
        return [[chunk] for chunk in chunks]
    order = sorted(range(len(chunks)), key=lambda i: -chunks[i][1])
    out: list[list[int]] = []
    for i in order:
        n = chunks[i][1]
        if out:
            group = out[-1]
            longest = chunks[group[0]][1]
            real = sum(chunks[j][1] for j in group) + n
            rows = len(group) + 1
            if rows * longest <= PADDING_ALLOWANCE * real + PADDING_SLACK * rows:
                group.append(i)
                continue
        out.append([i])
    return [[chunks[i] for i in sorted(group)] for group in out]


class Scheduler:
    """Owns the block and state-slot allocators and the prefix cache; what it does to them that
    the device must follow comes out as cache operations (in a step's plan, or `take_cache_ops`)."""

    def __init__(self, blocks: BlockAllocator, slots: SlotAllocator | None, max_num_seqs: int,
                 max_num_batched_tokens: int, prefill_chunk: int, prefix: PrefixCache | None = None,
                 batch_prefill: bool = True, pacer: PrefillPacer | None = None,
                 starts_plain: Callable[[int], bool] = lambda batch: False):
        self.blocks = blocks
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.prefix = prefix
        self.batch_prefill = batch_prefill
        self.pacer = pacer  # on a CPU: caps a step's prompt tokens by time (engine/prefill_pacer.py)
        # whether a new sequence joining a batch this size never drafts (engine.py `_starts_plain`)
        self.starts_plain = starts_plain
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._ops: list[CacheOp] = []

    def take_cache_ops(self) -> list[CacheOp]:
        """The cache operations recorded since the last call (the device has not seen them yet)."""
        ops, self._ops = self._ops, []
        return ops

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
        self._ops.append(ZeroBlocks(new_blocks))
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
        seq.drafting = False
        self._ops.append(Released(seq))

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
    def schedule(self, choose_drafts: Callable[[list[Sequence]], list[int]]) -> StepPlan:
        """choose_drafts(decoding sequences) -> drafts for each (engine/draft_policy.py)."""
        plan = StepPlan()
        chunks: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.running if not s.in_prefill]
        counts = choose_drafts(decoding) if decoding else []
        # every row of the verify pass is padded to the widest, and padding writes into its own blocks
        width = 1 + max(counts, default=0)
        for seq, k in zip(decoding, counts):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below by an older sequence
            while not self._grow(seq, seq.num_cached + width):
                if self._preempt_newest() is seq:
                    break
            else:
                plan.decodes.append(seq)
                plan.drafts.append(k)
        budget = self.max_num_batched_tokens - len(plan.decodes) * width
        if self.pacer is not None and plan.decodes:
            # only decoding streams wait on a prompt chunk: with none, a prompt runs in whole chunks
            budget = min(budget, self.pacer.token_budget())
        for seq in [s for s in self.running if s.in_prefill]:
            if seq.status is SequenceStatus.RUNNING:  # not preempted meanwhile
                budget -= self._plan_chunk(plan, chunks, seq, budget)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if self.slots is not None and self.slots.num_free == 0:
                break
            if seq.first_scheduled is None and self.starts_plain(len(self.running) + 1):
                seq.plain_only = True  # known before its prefix is taken: it may hit blocks without drafter features
            if self.prefix is not None and not seq.scores_prompt and self.prefix.being_computed(seq, self.running):
                break  # admitted once that block is registered: a hit instead of computing it twice
            self._take_prefix(seq)
            used = self._plan_chunk(plan, chunks, seq, budget, admitting=True)
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
            self._start_state(seq)
            budget -= used
        plan.prefill_groups = prefill_groups(chunks, self.batch_prefill)
        plan.cache_ops = self.take_cache_ops()
        return plan

    def _start_state(self, seq: Sequence) -> None:
        """An admitted sequence's recurrent state: the prefix hit's snapshot, else zeros."""
        if seq.state_slot is None:
            return
        hit = seq.prefix_hit
        if hit is not None and hit.snapshot_slot is not None:
            self._ops.append(RestoreState(hit.snapshot_slot, seq.state_slot))
        else:
            self._ops.append(ClearState(seq.state_slot))

    def _take_prefix(self, seq: Sequence) -> None:
        """A sequence about to be admitted takes the cached blocks its tokens start with."""
        if self.prefix is None or seq.block_table or seq.scores_prompt:
            return  # a hit's rows are not computed, and prompt logprobs need every row
        hit = self.prefix.match(seq)
        whole = hit is not None and hit.num_tokens >= seq.prefill_target
        if hit is not None and (self.prefix.hit_needs_features(seq) or whole):
            # the hit's last block is rewritten (the drafter's row at its last position, or the
            # prompt's last token): that block becomes a private copy
            if self.blocks.num_free > 0:
                [copy] = self.blocks.allocate(1)
                self._ops.append(CopyBlock(hit.blocks[-1], copy))
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

    def _plan_chunk(self, plan: StepPlan, chunks: list[tuple[Sequence, int]], seq: Sequence, budget: int,
                    admitting: bool = False) -> int:
        """Schedule the next prompt chunk of `seq` within `budget` tokens; returns tokens used."""
        remaining = seq.prefill_target - seq.num_cached
        if not admitting and not plan.decodes and not chunks:
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
            if admitting or self.running[-1] is seq or plan.decodes or chunks:
                return 0
            self._preempt_newest()
        chunks.append((seq, num))
        return num
