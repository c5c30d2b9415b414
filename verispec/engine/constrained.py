"""Grammar constraints inside the engine's speculative round (Engine._round, StepUpdate.verified).

A round with no constrained sequence never reaches this module. Otherwise, per constrained sequence:
drafts are cut at the first token its grammar forbids (a forbidden draft would be rejected anyway),
the masks of its verified positions are computed on the host while the verify pass runs (the launch
is asynchronous on CUDA), and the target's logits at every verified position are masked before
verification, greedy or sampled, so constrained speculative output == constrained plain output.
Raw logits still feed logprobs (the model's own, as for unconstrained requests).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verispec.grammar.constraint import GrammarCompiler, fill_masks, unpack_allowed
from verispec.spec.proposer import Draft

if TYPE_CHECKING:
    from verispec.engine.sequence import Sequence


class RoundGrammar:
    """The grammar side of one round over `seqs` (built only when some sequence is constrained)."""

    def __init__(self, compiler: GrammarCompiler, seqs: list[Sequence]):
        self.compiler = compiler
        self.seqs = seqs

    @classmethod
    def of(cls, compiler: GrammarCompiler, seqs: list[Sequence]) -> RoundGrammar | None:
        if all(s.constraint is None for s in seqs):
            return None
        return cls(compiler, seqs)

    def cut_drafts(self, drafts: list[Draft]) -> list[Draft]:
        out = []
        for seq, draft in zip(self.seqs, drafts):
            if seq.constraint is not None and draft.token_ids:
                keep = seq.constraint.valid_prefix(draft.token_ids)
                if keep < len(draft.token_ids):
                    probs = draft.probs[:keep] if draft.probs is not None else None
                    draft = Draft(draft.token_ids[:keep], probs)
            out.append(draft)
        return out

    def mask(self, logits: torch.Tensor, drafts: list[Draft]) -> torch.Tensor:
        """logits [B, W, V] of the verify pass -> a copy with what each grammar forbids at -inf
        (rows of unconstrained sequences unchanged)."""
        batch, width, vocab = logits.shape
        rows = [(seq.constraint, b * width, draft.token_ids)
                for b, (seq, draft) in enumerate(zip(self.seqs, drafts)) if seq.constraint is not None]
        packed = fill_masks(self.compiler, rows, batch * width)  # host work: overlaps the verify pass
        allowed = unpack_allowed(packed, vocab, logits.device).view(batch, width, vocab)
        return logits.masked_fill(~allowed, float("-inf"))


def mask_one(compiler: GrammarCompiler, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """logits [V] of a sequence's next position (its first token, after prefill) -> masked copy."""
    packed = fill_masks(compiler, [(seq.constraint, 0, [])], 1)
    allowed = unpack_allowed(packed, logits.shape[-1], logits.device)[0]
    return logits.masked_fill(~allowed, float("-inf"))


def commit(seq: Sequence, token_ids: list[int]) -> tuple[list[int], bool]:
    """Advance a sequence's grammar over the tokens it commits -> (tokens kept, grammar finished)."""
    if seq.constraint is None:
        return token_ids, False
    keep, done = seq.constraint.advance(token_ids)
    return token_ids[:keep], done
