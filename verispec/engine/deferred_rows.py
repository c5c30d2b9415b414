"""Committed rows a drafter has not observed yet: those of rounds in which its sequence drafted nothing.

A sequence given no drafts (the draft policy's choice, or a model-free proposer that matched
nothing) does not need its drafter to run now: the drafter sees the rows when the sequence next
drafts, all of them in one observe step (a TargetStep over the contiguous unobserved positions),
or once MAX_DEFERRED_ROWS of them piled up. So a round in which nobody drafts runs no drafter pass.
For a proposer that reads the target's features, each round's rows are copied out of the pass
(one gather per tensor for the whole batch: a CUDA graph's outputs are rewritten by its next
replay); a model-free one rebuilds its state from the sequence's tokens, so only positions are kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.spec.proposer import TargetStep

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

    def add(self, rows: list[tuple[object, int, int, int]], out) -> list[tuple[object, TargetStep]]:
        """rows: (sequence, its batch row b in `out`, first committed position, rows committed) of
        one pass `out` (hidden [B, W, H], aux, pre_norm). Returns the steps of the sequences that
        reached max_rows, taken out to be observed now."""
        if not rows:
            return []
        copied = None
        if self.keep_features:
            width = max(n for _, _, _, n in rows)
            batch_rows = [b for _, b, _, _ in rows]
            device = out.hidden.device
            if batch_rows == list(range(out.hidden.shape[0])):
                index = None  # every row, in order: a plain copy
            elif device.type == "cuda":
                # from pinned memory without blocking: a blocking copy would wait for the step the
                # overlapped loop queued behind this one, and so lose the overlap
                index = torch.tensor(batch_rows, pin_memory=True).to(device, non_blocking=True)
            else:
                index = torch.tensor(batch_rows, device=device)

            def gather(x: torch.Tensor) -> torch.Tensor:  # [B, W, H] -> [Z, width, H], a copy
                return x[:, :width].clone() if index is None else x[:, :width].index_select(0, index)

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
        """The unobserved rows of those of `seqs` that have any, one step each (forgotten here)."""
        steps = []
        for seq in seqs:
            pending = self._pending.pop(seq.id, None)
            if pending is not None:
                steps.append((seq, self._step(seq, pending)))
        return steps

    def drop(self, seq) -> None:
        """The sequence's blocks went back: its drafter state goes, and these rows with it."""
        self._pending.pop(seq.id, None)

    def _step(self, seq, pending: _Pending) -> TargetStep:
        start, end = pending.start, pending.start + pending.num_rows
        tokens = seq.token_ids
        hidden, aux, pre_norm = None, [], None
        if pending.pieces:
            def cat(part) -> torch.Tensor:  # the pieces' rows in order -> [num_rows, H]
                return torch.cat([part(rows)[z, :n] for rows, z, n in pending.pieces])

            hidden = cat(lambda r: r.hidden)
            aux = [cat(lambda r, i=i: r.aux[i]) for i in range(len(pending.pieces[0][0].aux))]
            if pending.pieces[0][0].pre_norm is not None:
                pre_norm = cat(lambda r: r.pre_norm)
        return TargetStep(tokens[start:end], start, hidden, aux, tokens[end], pre_norm)
