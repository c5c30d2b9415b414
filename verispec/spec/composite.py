"""Several proposers as one (`--suffix --eagle3 DIR`): per sequence per round, the longest draft.

Members are asked in order, cheapest first (a model-free proposer before a model drafter), each
only for the sequences whose best draft so far is shorter than the member could offer: a suffix
draft that already reaches the model drafter's count spares the drafter that sequence. Every
member observes every committed step, so each is ready whenever it is asked. A model-free member
drafts only what its counts back (spec/suffix.py), so "longest" means the longest confident
draft; a model drafter always offers its full count.
"""
from __future__ import annotations

from dataclasses import dataclass

from verispec.spec.proposer import Draft, Proposer, TargetCache, TargetStep


@dataclass(frozen=True)
class Member:
    proposer: Proposer
    max_drafts: int  # drafts per round it is asked for at most (the engine's count may be lower)


class LongestDraft(Proposer):
    def __init__(self, members: list[Member]):
        if len(members) < 2:
            raise ValueError("a composite proposer needs at least two members")
        self.members = members
        self.method = "+".join(m.proposer.method for m in members)
        readers = [m.proposer for m in members if m.proposer.capture_layers]
        if len(readers) > 1:  # each reads the pass's captured streams by position in its own list
            raise ValueError("a composite proposer takes at most one drafter that reads target layers")
        self.capture_layers = readers[0].capture_layers if readers else ()
        # the costliest member's: the model drafter runs for every sequence the cheaper one leaves short
        self.draft_cost_fraction = max(m.proposer.draft_cost_fraction for m in members)
        self.needs_target_features = any(m.proposer.needs_target_features for m in members)

    @property
    def pools(self):
        """The one member's own K/V pools, which the engine zeroes and copies with the target's."""
        return next((m.proposer.pools for m in self.members if m.proposer.pools is not None), None)

    def bind(self, target: TargetCache) -> None:
        for m in self.members:
            m.proposer.bind(target)
        if sum(m.proposer.pools is not None for m in self.members) > 1:  # the runner follows one drafter's pools
            raise ValueError("a composite proposer takes at most one drafter with K/V rows of its own")

    def capture_graphs(self, batch_sizes: list[int], max_tokens: int, table_width: int) -> None:
        for m in self.members:
            m.proposer.capture_graphs(batch_sizes, max_tokens, table_width)

    def drop_graphs(self) -> None:
        for m in self.members:
            m.proposer.drop_graphs()

    def start(self, seq) -> None:
        for m in self.members:
            m.proposer.start(seq)

    def release(self, seq) -> None:
        for m in self.members:
            m.proposer.release(seq)

    def observe(self, rows: list[tuple[object, TargetStep]]) -> None:
        for m in self.members:
            m.proposer.observe(rows)

    def propose(self, seqs, num_drafts, params, generators) -> list[Draft]:
        best = [Draft([]) for _ in seqs]
        for m in self.members:
            asked = [b for b, k in enumerate(num_drafts) if len(best[b].token_ids) < min(k, m.max_drafts)]
            if not asked:
                continue
            made = m.proposer.propose([seqs[b] for b in asked], [min(num_drafts[b], m.max_drafts) for b in asked],
                                      [params[b] for b in asked], [generators[b] for b in asked])
            for b, draft in zip(asked, made):
                if len(draft.token_ids) > len(best[b].token_ids):  # ties: the earlier (cheaper) member
                    best[b] = draft
        return best
