"""The prefix (prompt) cache: a request that starts with tokens whose K/V are already in the paged
cache reuses those blocks instead of computing them again.

Identity. A full block is named by a chained hash: blake2b over its parent block's hash and its
own token ids, so equal hashes mean equal tokens at equal positions from the start (K/V depend on
nothing else). The first block's parent is the request's salt (`root_hash`): only requests with
the same salt share blocks. Every full, committed block of every sequence is registered under its hash in the
`BlockAllocator`, which keeps blocks nobody holds until their memory is needed (LRU).

A hit of M tokens (whole blocks) shares those blocks and starts the prefill at position M. At
least one prompt token is always computed, since the next token needs its logits: a hit that
covers the whole prompt copies its last block and recomputes just the prompt's last token there
(`whole_prompt_hits`; hybrid models and feature-keeping drafters stop a block short instead). Two things are
not K/V and are kept beside the blocks:

- Recurrent state (Gated DeltaNet layers of Qwen3.5/3.6). It cannot be rebuilt from K/V, so it is
  snapshotted into spare state slots at block boundaries a sequence's commit lands on: prefill
  chunk ends (the scheduler ends one chunk at the prompt's last block boundary) and, during
  decoding, the latest boundary only (each new one replaces the sequence's previous). A hit on a
  hybrid model stops at the longest matched block that has a snapshot. Snapshots are LRU too, and
  go with their block when it is evicted.
- A drafter's row at the hit's last position. EAGLE3 and the MTP head keep one K/V row per
  position p made from the target's features at p *and token p+1*, so the row at a block's last
  position depends on the next block's first token, which the hashes do not cover. So a hit with a
  drafter takes a private copy of its last block (target and drafter rows), and the drafter
  recomputes that one row from the target features at the block's last position, which are stored
  per registered block. Every other drafter row of the shared blocks is a function of the prefix.
  Only a drafting sequence's blocks hold drafter rows, so only those keep features; a sequence that
  never drafts (`plain_only`) registers its blocks without them, may hit any block, and hits as a
  plain engine's would. A drafting sequence's hit ends at a block with features, and a block it
  computes takes the name of a featureless one, so later drafting sequences can hit it.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from verispec import log
from verispec.cache.paged import BlockAllocator, PagedPools

ROOT_HASH = b"verispec-prefix-v1"


def root_hash(salt: str | None) -> bytes:
    """The parent of a sequence's first block: a salt starts a chain no other salt's blocks can
    match, so requests with different salts never share (or learn of) each other's blocks."""
    if salt is None:
        return ROOT_HASH
    digest = hashlib.blake2b(ROOT_HASH, digest_size=16)
    digest.update(salt.encode("utf-8", "surrogatepass"))
    return digest.digest()


def chain_hashes(token_ids: list[int], block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (a trailing partial block has none), each chained
    to `parent` (the hash of the block before token_ids[0], or the root)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(np.asarray(token_ids[start:start + block_size], dtype=np.int64).tobytes())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


@dataclass
class TargetFeatures:
    """The target's outputs at one position, as a proposer observes them (TargetStep's rows)."""

    hidden: torch.Tensor  # [H]
    aux: list[torch.Tensor]  # per captured layer [H]
    pre_norm: torch.Tensor | None  # [H]


@dataclass
class PrefixHit:
    blocks: list[int]  # the sequence's first blocks (the last one a private copy when `copied`)
    num_tokens: int  # positions reused: len(blocks) * block_size (one less when the hit covers the whole prompt)
    snapshot_slot: int | None = None  # recurrent state after num_tokens positions (hybrid models)
    features: TargetFeatures | None = None  # the target's outputs at position num_tokens - 1 (drafters)


@dataclass
class PrefixStats:
    lookups: int = 0  # admissions that looked for a prefix
    hits: int = 0  # ... and reused at least one block
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # ... and reused


class PrefixCache:
    """Matching, registration and what is kept beside the blocks (snapshots, drafter features).

    `snapshot_slots` are state-slot ids of the pools reserved for snapshots (empty without
    recurrent layers); `keep_features` is set when a drafter needs the boundary features.
    """

    def __init__(self, blocks: BlockAllocator, pools: PagedPools, snapshot_slots: list[int], keep_features: bool):
        self.blocks = blocks
        self.pools = pools
        self.block_size = blocks.block_size
        self.hybrid = bool(pools.recurrent_layers)
        self.keep_features = keep_features
        self._free_snapshots = list(snapshot_slots)
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> state slot, oldest first
        self._features: dict[int, TargetFeatures] = {}  # registered block -> features at its last position
        self.stats = PrefixStats()
        blocks.on_evict = self._on_evict

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def keeps_features_of(self, seq) -> bool:
        """Whether seq's block ends keep the target's features: only a drafting sequence's drafter
        writes its rows into the blocks that a drafting hit resumes from."""
        return self.keep_features and seq.drafting

    # ---- admission ----------------------------------------------------------------------------------
    def hit_needs_features(self, seq) -> bool:
        """Whether a hit for seq must end at a block with features kept: its drafter recomputes its
        row at the hit's last position from them. Not for a sequence that never drafts."""
        return self.keep_features and not seq.plain_only

    def whole_prompt_hits(self, seq) -> bool:
        """A prompt cached to its last token may hit all its blocks: its last block is then copied
        and only the last token computed (one decode-sized pass instead of a block of prefill).
        Not on hybrid models (the recurrent state is snapshotted at block edges only) nor for a
        sequence whose drafter needs features (they are kept at block edges only)."""
        return not self.hybrid and not self.hit_needs_features(seq)

    def hit_blocks(self, seq) -> int:
        """Whole blocks a hit may cover. At least one prompt token is always computed (the next
        token needs its logits): either the hit stops a block short of the prompt's last token, or
        (`whole_prompt_hits`) it covers the prompt and the scheduler recomputes the last token."""
        if self.whole_prompt_hits(seq):
            return seq.prefill_target // self.block_size
        return max(seq.prefill_target - 1, 0) // self.block_size

    def _registered_run(self, hashes: list[bytes]) -> list[int]:
        """The registered blocks `hashes` start with."""
        found: list[int] = []
        for block_hash in hashes:
            block = self.blocks.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def match(self, seq) -> PrefixHit | None:
        """The longest usable cached prefix of seq's tokens (whole blocks, at most hit_blocks), its
        blocks shared (a reference taken on each). None on a miss."""
        hashes = seq.full_block_hashes(self.hit_blocks(seq))
        found = self._registered_run(hashes)
        needs_features = self.hit_needs_features(seq)
        # where the hit ends, the recurrent state (hybrid models) and the drafter's features must be kept
        while found and not self._resumable(found[-1], hashes[len(found) - 1], needs_features):
            found.pop()
        if not found:
            return None
        hit = PrefixHit(list(found), len(found) * self.block_size)
        if self.hybrid:
            last_hash = hashes[len(found) - 1]
            self._snapshots.move_to_end(last_hash)
            hit.snapshot_slot = self._snapshots[last_hash]
        if needs_features:
            hit.features = self._features[found[-1]]
        for block in found:
            self.blocks.share(block)
        return hit

    def being_computed(self, seq, running) -> bool:
        """True when a sequence of `running` is prefilling the block `seq` would hit next (requests
        with a common prefix arriving together, n > 1 choices): waiting for it costs at most that
        prefill, and saves computing the same blocks twice."""
        limit = self.hit_blocks(seq)
        if seq.block_table or limit < 1:
            return False
        hashes = seq.full_block_hashes(limit)
        nxt = len(self._registered_run(hashes))
        if nxt == limit:
            return False
        size = self.block_size
        return any(other.in_prefill and other.num_cached <= nxt * size and other.prefill_target >= (nxt + 1) * size
                   and other.full_block_hashes(nxt + 1)[nxt] == hashes[nxt] for other in running)

    def record(self, seq) -> None:
        """Count an admitted sequence's lookup (its prompt tokens, and the hit it took, if any); the
        first admission of a request is what its usage reports as cached tokens."""
        hit = seq.prefix_hit.num_tokens if seq.prefix_hit is not None else 0
        stats = self.stats
        stats.lookups += 1
        stats.queried_tokens += seq.prefill_target
        if hit:
            stats.hits += 1
            stats.hit_tokens += hit
        if seq.num_preemptions == 0:
            seq.stats.cached_tokens = hit
            log.debug("[KVCache] %s", f"hit {hit}/{seq.prefill_target} tokens" if hit else
                      f"miss ({seq.prefill_target} tokens)")

    def _resumable(self, block: int, block_hash: bytes, needs_features: bool) -> bool:
        return ((not self.hybrid or block_hash in self._snapshots)
                and (not needs_features or block in self._features))

    # ---- after a commit -----------------------------------------------------------------------------
    def on_commit(self, seq, start: int, features_at=None, decoding: bool = False) -> None:
        """seq committed positions start..seq.num_cached-1: register the blocks that became full, keep
        the drafter features at their last positions (`features_at(i)` -> TargetFeatures of the pass's
        row i; asked only where `keeps_features_of(seq)`), and snapshot the recurrent state at a
        block boundary."""
        size = self.block_size
        full = min(seq.num_cached, seq.num_tokens) // size  # a stop string may have cut the last tokens
        if full > seq.num_registered:
            hashes = seq.full_block_hashes(full)
            keeps_features = self.keeps_features_of(seq)
            for j in range(seq.num_registered, full):
                block = seq.block_table[j]
                row = (j + 1) * size - 1 - start
                if not keeps_features or row < 0:
                    self.blocks.register(block, hashes[j])
                elif self.blocks.register(block, hashes[j]) or self._replaces_featureless(block, hashes[j]):
                    self._features[block] = features_at(row)
            seq.num_registered = full
        if self.hybrid and seq.num_cached % size == 0 and full > 0 and seq.state_slot is not None:
            self._snapshot(seq, seq.full_block_hashes(full)[full - 1], decoding)

    def _replaces_featureless(self, block: int, block_hash: bytes) -> bool:
        """A drafting sequence's block takes its hash from a block registered without features (by
        a sequence that did not draft), which a drafting hit could not resume from."""
        other = self.blocks.lookup(block_hash)
        if other is None or other in self._features or self.blocks.hash_of(block) is not None:
            return False
        self.blocks.rename(block_hash, block)
        return True

    def _snapshot(self, seq, block_hash: bytes, decoding: bool) -> None:
        if block_hash in self._snapshots:
            self._snapshots.move_to_end(block_hash)
            return
        if decoding and seq.decode_snapshot is not None:
            # only the latest decode boundary is worth keeping (a follow-up turn extends all of it)
            self._drop_snapshot(seq.decode_snapshot)
        if not self._free_snapshots:
            if not self._snapshots:
                return
            self._drop_snapshot(next(iter(self._snapshots)))
        slot = self._free_snapshots.pop()
        self.pools.copy_state(seq.state_slot, slot)
        self._snapshots[block_hash] = slot
        if decoding:
            seq.decode_snapshot = block_hash

    def _drop_snapshot(self, block_hash: bytes) -> None:
        slot = self._snapshots.pop(block_hash, None)
        if slot is not None:
            self._free_snapshots.append(slot)

    def _on_evict(self, block: int, block_hash: bytes) -> None:
        self._features.pop(block, None)
        self._drop_snapshot(block_hash)
