"""Training drafters for a target model: `verispec train-drafter` (EAGLE3 drafters and MTP heads).

A drafter is fitted to the target's own predictions: the target runs over the training text
(and over continuations it generated itself), its features (EAGLE3: the residual streams entering
the aux layers; MTP: the final hidden state) are the drafter's inputs and its next-token
distribution the drafter's label. Acceptance is evaluated by running the engine's speculative
greedy decoding with the current drafter on held-out text.

Modules: `data` (text -> token windows, held-out split, self-generated continuations),
`features` (target forward), `attention` (the multi-step "test-time training" unroll mask),
`eagle3` / `mtp` (the two drafter kinds: build, train forward, save), `evaluate` (acceptance),
`loop` (optimiser, schedule, progress, evaluation, checkpoints), `progress`.
"""
from verispec.train.options import DrafterTrainOptions, Method

__all__ = ["DrafterTrainOptions", "Method", "train_drafter"]


def train_drafter(options: DrafterTrainOptions, documents=None):
    """Train a drafter as `options` say; returns the run summary (a dict). `documents`, when
    given, is a list of texts used instead of reading `options.data` paths."""
    from verispec.train.loop import run

    return run(options, documents)
