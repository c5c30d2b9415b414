"""Committed rows a drafter has not observed yet: those of rounds in which its sequence drafted nothing.

A sequence given no drafts (the draft policy's choice, or a model-free proposer that matched
nothing) does not need its drafter to run now: the drafter sees the rows when the sequence next
drafts, all of them in one observe step (a TargetStep over the contiguous unobserved positions),
or once MAX_DEFERRED_ROWS of them piled up. So a round in which nobody drafts runs no drafter pass.
For a proposer that reads the target's features, each round's rows are copied out of the pass
(one gather per tensor for the whole batch: a CUDA graph's outputs are rewritten by its next
replay); a model-free one rebuilds its state from the sequence's tokens, so only positions are kept.
The rows taken together come back as one padded batch ([Z, n_max, H] per tensor, each sequence's
steps reading their rows of it), so the drafter observes them all in one pass of a few dozen
operations: a step per sequence, each sliced, projected and attended alone, cost a 64-sequence
flush ~3,000 operations, 0.1 s of host time on the GPU machine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.spec.proposer import PassRowStep, TargetStep

# bounds the features kept per sequence (at 8B: 5 x 4096 bf16 values a row) and the catch-up pass's
# width; above the adaptive policy's probe interval, so a probing sequence usually flushes first
MAX_DEFERRED_ROWS = 32


@dataclass
class _Rows:
    """One pass's copied rows for some sequences: hidden [Z, W, H], aux each [Z, W, H_t], pre_norm."""

    hidden: torch.Tensor
    aux: list[torch.Tensor]
    pre_norm: torch.Tensor | None


@dataclass
class _Pending:
    start: int  # the first position the drafter has not observed
    num_rows: int = 0
    pieces: list[tuple[_Rows, int, int]] = field(default_factory=list)  # (copied rows, row z, rows kept)


class DeferredRows:
    def __init__(self, keep_features: bool, max_rows: int = MAX_DEFERRED_ROWS):
        self.keep_features = keep_features
        self.max_rows = max_rows
        self._pending: dict[int, _Pending] = {}

    def __contains__(self, seq) -> bool:
        return seq.id in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, rows: list[tuple[object, int, int, int]], out, owned: bool = False
            ) -> list[tuple[object, TargetStep]]:
        """rows: (sequence, its batch row b in `out`, first committed position, rows committed) of
        one pass `out` (hidden [B, W, H], aux, pre_norm); `owned`: out's tensors are a copy nobody
        rewrites (else a graph's outputs, copied here). Returns the steps of the sequences that
        reached max_rows, taken out to be observed now."""
        if not rows:
            return []
        copied = None
        if self.keep_features:
            width = max(n for _, _, _, n in rows)
            batch_rows = [b for _, b, _, _ in rows]
            device = out.hidden.device
            # every row, in order: a plain copy
            index = None if batch_rows == list(range(out.hidden.shape[0])) else device_index(batch_rows, device)

            def gather(x: torch.Tensor) -> torch.Tensor:  # [B, W, H] -> [Z, width, H], a copy
                if index is None:
                    return x[:, :width] if owned else x[:, :width].clone()
                return x[:, :width].index_select(0, index)

            copied = _Rows(gather(out.hidden), [gather(a) for a in out.aux],
                           gather(out.pre_norm) if out.pre_norm is not None else None)
        full = []
        for z, (seq, _, start, n) in enumerate(rows):
            pending = self._pending.get(seq.id)
            if pending is None:
                pending = self._pending[seq.id] = _Pending(start)
            elif pending.start + pending.num_rows != start:  # pragma: no cover - the engine commits in order
                raise AssertionError(f"sequence {seq.id}: deferred rows end at "
                                     f"{pending.start + pending.num_rows}, the next starts at {start}")
            pending.num_rows += n
            if copied is not None:
                pending.pieces.append((copied, z, n))
            if pending.num_rows >= self.max_rows:
                full.append(seq)
        return self.take(full)

    def take(self, seqs: list) -> list[tuple[object, TargetStep]]:
        """The unobserved rows of those of `seqs` that have any, one step each (forgotten here);
        their features one padded batch, which every step reads its row of."""
        taken = [(seq, self._pending.pop(seq.id)) for seq in seqs if seq.id in self._pending]
        with_rows = [pending for _, pending in taken if pending.pieces]
        batch = _gather(with_rows)
        row_of = {id(pending): z for z, pending in enumerate(with_rows)}
        steps = []
        for seq, pending in taken:
            start, end = pending.start, pending.start + pending.num_rows
            tokens, next_token = seq.token_ids[start:end], seq.token_ids[end]
            if pending.pieces:
                steps.append((seq, PassRowStep(tokens, start, next_token, batch, row_of[id(pending)])))
            else:
                steps.append((seq, TargetStep(tokens, start, None, [], next_token, None)))
        return steps

    def drop(self, seq) -> None:
        """The sequence's blocks went back: its drafter state goes, and these rows with it."""
        self._pending.pop(seq.id, None)



def _gather(pendings: list[_Pending]) -> _Rows | None:
    """Every pending's rows as one padded batch: hidden [Z, n_max, H], aux each [Z, n_max, H_t],
    pre_norm, row z holding pending z's rows in order, then its last row again up to n_max (finite
    padding past a step's length, which a drafter never attends to). Every copied pass flattened
    into one tensor per kind, one index of all the rows wanted, one index_select per kind."""
    if not pendings:
        return None
    passes: dict[int, tuple[_Rows, int]] = {}  # id -> (the pass's rows, its first flat row)
    flat = 0
    width = max(pending.num_rows for pending in pendings)
    index: list[int] = []
    for pending in pendings:
        wanted = []
        for rows, z, n in pending.pieces:
            if id(rows) not in passes:
                passes[id(rows)] = (rows, flat)
                flat += rows.hidden.shape[0] * rows.hidden.shape[1]
            first = passes[id(rows)][1] + z * rows.hidden.shape[1]
            wanted.extend(range(first, first + n))
        index.extend(wanted + wanted[-1:] * (width - len(wanted)))
    ordered = [rows for rows, _ in passes.values()]
    where = device_index(index, ordered[0].hidden.device)

    def select(part) -> torch.Tensor:  # one kind of every pass -> [Z, width, ...]
        whole = torch.cat([part(rows).flatten(0, 1) for rows in ordered])
        return whole.index_select(0, where).unflatten(0, (len(pendings), width))

    return _Rows(select(lambda r: r.hidden), [select(lambda r, i=i: r.aux[i]) for i in range(len(ordered[0].aux))],
                 select(lambda r: r.pre_norm) if ordered[0].pre_norm is not None else None)


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """An index tensor on `device`. On CUDA from pinned memory without blocking: a blocking copy
    would wait for the step the overlapped loop queued behind this one, and so lose the overlap."""
    if device.type == "cuda":
        return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, device=device)
