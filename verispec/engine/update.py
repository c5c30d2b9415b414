"""The step's last phase: what the passes computed is accepted, committed, observed and emitted.

After a prompt chunk's pass each sequence commits its chunk (and, at the prompt's end, chooses
its first token); after a verify pass each sequence keeps the longest accepted prefix of its
drafts plus one token of the target's own (spec/verify.py), commits those rows, and its drafter
observes them. Then output: detokenized chunks to the clients, and a finished sequence's blocks
go back before its client hears of it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from verispec import log
from verispec.cache.prefix import PrefixCache
from verispec.engine import constrained
from verispec.engine.prefix_rows import KeptRows, prepend_row
from verispec.engine.prompt_logprobs import score_chunk
from verispec.engine.runner import ModelRunner, PassOutput
from verispec.engine.scheduler import Scheduler
from verispec.engine.sequence import Sequence
from verispec.engine.types import GenerationChunk
from verispec.grammar.constraint import GrammarCompiler
from verispec.sampling.sampler import apply_penalties, processed_probs, sample
from verispec.spec.proposer import Draft, PassRowStep
from verispec.spec.verify import verify_greedy, verify_sampling, verify_seeded


@dataclass
class RoundInputs:
    """A verify pass's inputs: each sequence's drafts (cut by its grammar) and its row of tokens,
    [last token] + drafts, padded to the pass's width."""

    drafts: list[Draft]
    rows: list[list[int]]

    @classmethod
    def of(cls, seqs: list[Sequence], drafts: list[Draft]) -> "RoundInputs":
        width = 1 + max(len(d.token_ids) for d in drafts)
        rows = []
        for seq, draft in zip(seqs, drafts):
            row = [seq.last_token] + draft.token_ids
            rows.append(row + [row[-1]] * (width - len(row)))  # padding: computed, never read
        return cls(drafts, rows)


class StepUpdate:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, grammars: GrammarCompiler):
        self.scheduler = scheduler
        self.runner = runner
        self.grammars = grammars

    @property
    def prefix(self) -> PrefixCache | None:
        return self.scheduler.prefix

    # ---- output ------------------------------------------------------------------------------------
    def emit(self, seq: Sequence, chunk: GenerationChunk) -> None:
        if chunk.finish_reason is not None:
            self.finish(seq, chunk)
        else:
            seq.emit(chunk)

    def finish(self, seq: Sequence, chunk: GenerationChunk) -> None:
        """The sequence's last chunk: its blocks (and drafter state) go back first, then the client
        hears of it."""
        self.scheduler.finish(seq)
        self.runner.apply(self.scheduler.take_cache_ops())
        seq.emit(chunk)
        _log_request(seq)

    def fail(self, seqs: list[Sequence], exc: BaseException) -> None:
        """A failed step: each of its unfinished sequences ends with the error."""
        for seq in seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.sink(exc)
        self.runner.apply(self.scheduler.take_cache_ops())

    def kept_rows(self, seqs: list[Sequence], out, starts: list[int], counts: list[int]) -> KeptRows | None:
        """The rows of a pass the prefix cache keeps for a drafter, copied when first asked for: those
        of the sequences whose block ends keep features (None: nobody's do)."""
        prefix = self.prefix
        if prefix is None or not any(prefix.keeps_features_of(seq) for seq in seqs):
            return None
        counts = [n if prefix.keeps_features_of(seq) else 0 for seq, n in zip(seqs, counts)]
        return KeptRows(out, starts, counts, prefix.block_size)

    # ---- after a prompt chunk's pass ---------------------------------------------------------------
    def prefilled(self, group: list[tuple[Sequence, int]], starts: list[int], out: PassOutput) -> None:
        """Each sequence commits its chunk (a scoring one first scores its rows' next prompt tokens);
        one whose prompt is done gets its first token chosen and emitted (or, asked for none, ends);
        a drafting sequence's proposer observes the chunk's rows."""
        observed, emitted = [], []
        kept = self.kept_rows([seq for seq, _ in group], out, starts, [n for _, n in group])
        for b, (seq, n) in enumerate(group):
            start = starts[b]
            seq.num_cached += n
            end = start + n
            if self.prefix is not None:
                self.prefix.on_commit(seq, start, row_features(kept, b))
            if out.all_rows is not None and b in out.all_rows:
                score_chunk(seq, start, out.all_rows[b], self.runner.logits)
            if end < seq.num_tokens:  # mid-prompt, or resumed after a preemption: the next token is known
                next_token, chunk = seq.token_ids[end], None
            elif seq.max_new_tokens == 0:  # the prompt's logprobs were the whole request
                next_token, chunk = None, seq.out.prompt_only()
            else:
                logits = out.logits[b]  # [1, V]: the chunk's last token
                next_token = self.choose(logits[-1], seq)
                tokens, grammar_done = constrained.commit(seq, [next_token])
                chunk = seq.out.push(tokens, logits[-1:], grammar_done=grammar_done)
            # also after the last token: the drafter's state stays the committed one (a prompt-only
            # request has no next token, and ends here)
            if seq.drafting and next_token is not None:
                # a row of the pass: a drafter reads every sequence's rows of it at once
                step = PassRowStep(seq.token_ids[start:end], start, next_token, out, b)
                hit = seq.prefix_hit
                if hit is not None and hit.features is not None and start == hit.num_tokens:
                    step = prepend_row(step, seq.token_ids[start - 1], hit.features)
                observed.append((seq, step))
            seq.prefix_hit = None
            if chunk is not None:
                emitted.append((seq, chunk))
        # the first tokens go out before the drafter reads the prompt rows: its pass over a prompt's
        # rows (the default model's drafter on the 2-core CPU: 0.43 s for 384 tokens, after the
        # target's 2.3 s) is no part of the time to first token
        for seq, chunk in emitted:
            self.emit(seq, chunk)
        self.runner.observe([(seq, step) for seq, step in observed if not seq.finished])  # a finished one's went

    @torch.inference_mode()
    def choose(self, logits: torch.Tensor, seq: Sequence) -> int:
        """logits [V] of a sequence's next position -> its token (grammar, penalties, sampling)."""
        if seq.constraint is not None:
            logits = constrained.mask_one(self.grammars, seq, logits)
        return sample(apply_penalties(logits, seq.params, seq.history), seq.params, seq.generator,
                      seq.seeded_at(seq.num_tokens))

    # ---- after a verify pass -----------------------------------------------------------------------
    def verified(self, seqs: list[Sequence], inputs: RoundInputs, out: PassOutput,
                 grammar: constrained.RoundGrammar | None, greedy_choices: list[list[int]] | None = None,
                 synced_at: float | None = None) -> tuple[list[int], float]:
        """Each sequence accepts the longest right prefix of its drafts plus one token of the
        target's, commits them and emits its chunk; its drafter observes the committed rows.
        Returns the number of drafts each accepted, and when the pass's results reached the host
        (perf_counter seconds). greedy_choices: the pass's argmax per row, where the caller read it
        back already (with synced_at, when it did)."""
        drafts = inputs.drafts
        # what each grammar allows, computed on the host while the verify pass runs; raw logits stay for logprobs
        logits = grammar.mask(out.logits, drafts) if grammar is not None else out.logits
        if greedy_choices is None and any(s.params.greedy and not s.params.adjusts_logits for s in seqs):
            greedy_choices = logits.argmax(-1).tolist()  # one device sync for the whole batch
        synced_at = synced_at if synced_at is not None else time.perf_counter()
        results = []
        for b, (seq, draft) in enumerate(zip(seqs, drafts)):
            n = len(draft.token_ids) + 1
            plain_greedy = seq.params.greedy and not seq.params.adjusts_logits
            choices = greedy_choices[b] if greedy_choices is not None else None
            results.append(self._accept(draft, None if plain_greedy else logits[b, :n], seq, choices))
        out.cache.commit([accepted + 1 for accepted, _ in results])
        observed, deferred, chunks = [], [], []
        deferring = self.runner.deferred
        kept = self.kept_rows(seqs, out, [seq.num_cached for seq in seqs], [accepted + 1 for accepted, _ in results])
        for b, (seq, draft, (accepted, token)) in enumerate(zip(seqs, drafts, results)):
            n = accepted + 1
            position = seq.num_cached
            chunks.append(self.commit(seq, draft.token_ids, accepted, token,
                                      out.logits[b, :n] if seq.params.logprobs else None, row_features(kept, b)))
            if not seq.drafting:
                continue
            # also after the last token: the drafter's state stays the committed one; a sequence
            # that drafted nothing has its rows observed when it next drafts (engine/deferred_rows.py)
            if not draft.token_ids or seq in deferring:
                deferred.append((seq, b, position, n))
            else:
                observed.append((seq, PassRowStep(inputs.rows[b][:n], position, token, out, b)))
        self.runner.observe(observed)
        self.runner.defer(deferred, out)
        for seq, chunk in zip(seqs, chunks):
            self.emit(seq, chunk)
        return [accepted for accepted, _ in results], synced_at

    def commit(self, seq: Sequence, drafts: list[int], accepted: int, token: int,
               logits: torch.Tensor | None, features=None) -> GenerationChunk:
        """One sequence's round kept: its first `accepted` drafts and `token` are committed (cache
        length, stats, grammar, output, prefix cache); returns its chunk, not yet emitted.
        logits [accepted + 1, V] for logprobs (None: not wanted); features(i): the pass's row i
        for the prefix cache's drafter features (None: no drafter observes)."""
        position = seq.num_cached
        seq.num_cached += accepted + 1
        stats = seq.stats
        stats.rounds += 1
        stats.drafted += len(drafts)
        stats.accepted += accepted
        tokens, grammar_done = constrained.commit(seq, drafts[:accepted] + [token])
        chunk = seq.out.push(tokens, logits, grammar_done=grammar_done)
        if self.prefix is not None:  # after the push: the committed tokens are in seq.token_ids now
            self.prefix.on_commit(seq, position, features, decoding=True)
        chunk.num_drafted = min(accepted, len(chunk.token_ids))  # a stop may cut the round short
        chunk.num_rounds = 1
        return chunk

    def _accept(self, draft: Draft, logits: torch.Tensor | None, seq: Sequence,
                greedy_choices: list[int] | None) -> tuple[int, int]:
        """logits [k+1, V] from one target pass over [last token] + k drafts -> (accepted, next token).

        Penalties for position i are computed on the committed sequence plus drafts[:i].
        """
        drafts, params, history = draft.token_ids, seq.params, seq.history

        def penalised(i: int) -> torch.Tensor:
            if not params.adjusts_logits or i == 0:
                return apply_penalties(logits[i], params, history)
            history.add(drafts[:i])
            try:
                return apply_penalties(logits[i], params, history)
            finally:
                history.remove(drafts[:i])

        if params.greedy and not params.adjusts_logits:
            return verify_greedy(drafts, lambda i: greedy_choices[i])
        if params.greedy:
            return verify_greedy(drafts, lambda i: int(torch.argmax(penalised(i))))
        if seq.seed is not None:  # the token after i drafts sits at position num_tokens + i
            return verify_seeded(drafts, lambda i: sample(penalised(i), params, None, seq.seeded_at(seq.num_tokens + i)))
        return verify_sampling(drafts, draft.probs, lambda i: processed_probs(penalised(i), params), seq.generator)


def row_features(kept: KeptRows | None, b: int):
    """on_commit's `features_at` for batch row b: pass row i -> its kept TargetFeatures."""
    return (lambda i: kept.at(b, i)) if kept is not None else None


def _log_request(seq: Sequence) -> None:
    stats = seq.stats
    spec = ""
    if stats.drafted:
        spec = (f", {stats.method}: accepted {stats.accepted}/{stats.drafted} "
                f"({100 * stats.accepted / stats.drafted:.0f}%), "
                f"{(stats.generated_tokens - 1) / max(stats.rounds, 1):.2f} tokens/round")
    log.debug("request %d: prompt=%d tokens, generated=%d, ttft=%.1fms, prefill=%.1f tok/s, "
              "decode=%.1f tok/s, preempted %d times, finish=%s%s", seq.id, stats.prompt_tokens,
              stats.generated_tokens, stats.ttft_ms, stats.prefill_tok_per_s, stats.decode_tok_per_s,
              seq.num_preemptions, seq.out.finish_reason.value if seq.out.finish_reason else None, spec)


def mark_first_scheduled(group: list[tuple[Sequence, int]]) -> None:
    now = time.perf_counter()
    for seq, _ in group:
        if seq.first_scheduled is None:
            seq.first_scheduled = now
