"""Prompt chunks: the step's prefills run as few target passes as padding allows.

When several requests arrive together, each step's token budget holds chunks of several prompts.
Run one by one, every chunk pays a whole eager forward's per-layer host overhead (on the H200 the
demo model's 512-token prefill is ~30 ms, almost all of it Python and launches), so eight clients
waited for eight forwards before the last one's first token. Grouped, the chunks share one pass:
rows are padded at their ends to the group's longest chunk, attention runs per sequence (the call
it would make alone) and recurrent layers skip the padding (cache/paged.py `BatchCache`), so a
sequence's rows are the same whether it is prefilled alone or with others.

Padding is compute spent on nothing, so a group takes a chunk only while its padded size stays
within PADDING_ALLOWANCE of its real tokens: the tail of one prompt (a few tokens) does not ride in
a pass of 500-token chunks; tails group with tails.
"""
from __future__ import annotations

import time

from verispec.engine import constrained
from verispec.engine.prefix_rows import features_at, prepend_row
from verispec.engine.sequence import Sequence
from verispec.spec.proposer import TargetStep

PADDING_ALLOWANCE = 1.25  # a group's padded tokens (B x longest chunk) may be this much its real ones
PADDING_SLACK = 16  # ... plus this many per row, so chunks a few tokens apart always group


def groups(chunks: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
    """The step's (sequence, chunk tokens) in passes: longest first, each group as long as its
    padding stays within the allowance (a group keeps the plan's order inside)."""
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


def run(engine, chunks: list[tuple[Sequence, int]]) -> None:
    """Every prompt chunk of the step, committed; a sequence whose prompt is done gets its first
    token chosen and emitted, and its drafter observes the prompt rows."""
    if not engine.config.batch_prefill:
        for chunk in chunks:
            run_group(engine, [chunk])
        return
    for group in groups(chunks):
        run_group(engine, group)


def run_group(engine, group: list[tuple[Sequence, int]]) -> None:
    """One target pass over the chunks of `group`, then each sequence's bookkeeping."""
    now = time.perf_counter()
    for seq, _ in group:
        if seq.first_scheduled is None:
            seq.first_scheduled = now
        if seq.proposer is None:
            engine._attach_proposer(seq)
    seqs = [seq for seq, _ in group]
    counts = [n for _, n in group]
    observing = any(seq.proposer is not None for seq in seqs)
    capture = engine.proposer.capture_layers if observing else ()  # every sequence's proposer is of its kind
    starts = [seq.num_cached for seq in seqs]
    out = engine.runner.prefill(seqs, counts, capture, keep_all_rows=observing)
    observed, emitted = [], []
    for b, (seq, start, n) in enumerate(zip(seqs, starts, counts)):
        seq.num_cached += n
        end = start + n
        if engine.prefix is not None:
            engine.prefix.on_commit(seq, start, lambda i, b=b: features_at(out, b, i))
        if end < seq.num_tokens:  # mid-prompt, or resumed after a preemption: the next token is known
            next_token, chunk = seq.token_ids[end], None
        else:
            logits = out.logits[b]  # [1, V]: the chunk's last token
            next_token = engine._choose(logits[-1], seq)
            tokens, grammar_done = constrained.commit(seq, [next_token])
            chunk = seq.out.push(tokens, logits[-1:], grammar_done=grammar_done)
        if seq.proposer is not None:  # also after the last token: the drafter's state stays the committed one
            step = TargetStep(seq.token_ids[start:end], start, out.hidden[b, :n], [a[b, :n] for a in out.aux], next_token,
                              out.pre_norm[b, :n] if out.pre_norm is not None else None)
            hit = seq.prefix_hit
            if hit is not None and hit.features is not None and start == hit.num_tokens:
                step = prepend_row(step, seq.token_ids[start - 1], hit.features)
            observed.append((seq, step))
        seq.prefix_hit = None
        if chunk is not None:
            emitted.append((seq, chunk))
    if observed and engine.batched_drafting:
        engine.proposer.observe_rows(observed)
    else:
        for seq, step in observed:
            seq.proposer.observe(step)
    for seq, chunk in emitted:
        engine._emit(seq, chunk)
