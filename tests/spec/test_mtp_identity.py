"""MTP self-speculation (`--mtp`) is lossless: greedy output == plain greedy with random and
trained heads from every place a head can be, rejection at every chain position (the head's rows
hold exactly the committed ones), and sampling keeps the target's distribution.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tests.spec.conftest import assert_greedy_identity, greedy, spec_engine
from tests.spec.mtp_checkpoints import (NEW_TOKENS, PREFILL_STEP, PROMPTS, SOURCES,  # noqa: F401 (fixtures)
                                        head_for, mtp_dirs, plain)
from tests.spec.test_sampling import chi_square
from tools.tiny import corpus_text
from verispec.cache.kv import KVCache
from verispec.cache.paged import BatchCache
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.spec.mtp import MtpHidden, MtpProposer


# ---- lossless speculation --------------------------------------------------------------------------
@pytest.mark.parametrize("source", SOURCES)
def test_identity_random_head(plain, mtp_dirs, source):
    """--mtp greedy == plain greedy, token for token, at depths 1..3, through Engine.load."""
    engine, prompts, outputs = plain
    for depth in (1, 2, 3):
        spec = load_engine(str(mtp_dirs[source]), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP,
                           mtp=True, num_draft_tokens=depth)
        assert isinstance(spec.proposer, MtpProposer) and spec.num_drafts == depth
        for i, ids in enumerate(prompts):
            result = spec.generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == outputs[i], f"{source} depth={depth} prompt {i}"
            assert result.stats.method == "mtp"
            assert 0 < result.stats.drafted <= depth * result.stats.rounds


def test_identity_wrapper_checkpoint(mtp_dirs):
    """The layout of the real releases (qwen3_5, text under model.language_model.*, tied lm_head,
    mtp.* at the top level), with --mtp-hidden pre-norm as well."""
    d = str(mtp_dirs["wrapper"])
    base = load_engine(d, dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP)
    ids = base.tokenizer.encode(PROMPTS[1])
    expected = base.generate_all(ids, greedy(NEW_TOKENS)).token_ids
    for hidden in ("post-norm", "pre-norm"):
        spec = load_engine(d, dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP, mtp=True,
                           num_draft_tokens=2, mtp_hidden=hidden)
        assert spec.proposer.hidden is MtpHidden(hidden)
        result = spec.generate_all(ids, greedy(NEW_TOKENS))
        assert result.token_ids == expected and result.stats.method == "mtp" and result.stats.drafted > 0


class ScriptedMtp(MtpProposer):
    """The real MTP proposer (head, paged drafter rows, in-round rows overwritten) whose drafts are
    replaced by a script: the target's own continuation, right where right(index, chain_position)
    says. Records the head's logits at every draft, to be checked against the head run from
    scratch on the committed sequence: its rows must hold exactly the committed ones, whatever
    was accepted. Drives one sequence at a time."""

    def __init__(self, head, continuation, vocab_size, right, hidden=MtpHidden.POST_NORM):
        super().__init__(head, hidden)
        self.continuation, self.vocab_size, self.right = continuation, vocab_size, right
        self.prompt_len = 0
        self.records: list[tuple[int, list[int], list[torch.Tensor]]] = []
        self.features: dict[int, torch.Tensor] = {}  # position -> the target feature observed there

    def start(self, seq):
        super().start(seq)
        self.prompt_len = len(seq.prompt_ids)

    def observe(self, rows):
        super().observe(rows)
        for _, step in rows:
            features = step.hidden if self.hidden is MtpHidden.POST_NORM else step.pre_norm
            for i, row in enumerate(features):
                self.features[step.start_position + i] = row.clone()

    def propose(self, seqs, num_drafts, params, generators):
        assert len(seqs) == 1
        self._logits = []
        self._next_position = self._states[seqs[0].id].next_position
        drafts = super().propose(seqs, num_drafts, params, generators)
        self.records.append((self._next_position, drafts[0].token_ids, self._logits))
        return drafts

    def _choose_rows(self, logits, params, generators, active):
        j = len(self._logits)
        self._logits.append(logits[0].clone())
        index = self._next_position + 1 + j - self.prompt_len  # the draft's index in the continuation
        token = self.continuation[index] if index < len(self.continuation) else 0
        token = token if self.right(index, j) else (token + 1) % self.vocab_size
        return torch.tensor([token], device=logits.device), [None]


def check_records(proposer: ScriptedMtp, sequence: list[int]) -> None:
    """Each recorded draft's head logits == the head run from scratch over the committed sequence
    (the target features observed at positions 0..p-1, each with the token after it), then chained
    on the drafts before it (fed back after mtp.norm). The features are the ones the engine passed:
    the target's own numbers depend on its pass shapes (its SSM state is kept in float32)."""
    head = proposer.head
    # observed in order up to every draft's position at least (the rows of a last round that drafted
    # nothing are never observed: the sequence finished)
    observed = sorted(proposer.features)
    assert observed == list(range(len(observed))) and len(observed) <= len(sequence) - 1
    assert all(next_position <= len(observed) for next_position, _, _ in proposer.records)
    features = torch.stack([proposer.features[i] for i in observed])[None]
    with torch.no_grad():
        for next_position, drafts, logits in proposer.records:
            cache = KVCache(head.cache_specs(), next_position + len(drafts) + 1, torch.float64, "cpu")
            rows = head(torch.tensor([sequence[1:next_position + 1]]), features[:, :next_position],
                        torch.arange(next_position)[None], cache)
            cache.commit(next_position)
            fed = rows[:, -1:]
            for j, got in enumerate(logits):
                torch.testing.assert_close(got, head.logits(fed[0, -1]), atol=1e-9, rtol=1e-9,
                                           msg=f"draft {j} at position {next_position}")
                fed = head(torch.tensor([[drafts[j]]]), fed, torch.tensor([[next_position + j]]), cache)
                cache.commit(1)


_rng = random.Random(3)
SCATTERED = [_rng.random() < 0.7 for _ in range(NEW_TOKENS)]  # fixed, without a period
PATTERNS = {  # right(continuation index, position in the chain); depth 3 -> verify passes of 4
    "always-right": (lambda i, j: True, {4}),
    "always-wrong": (lambda i, j: False, {1}),
    "reject-first": (lambda i, j: j != 0, {1}),
    "reject-second": (lambda i, j: j != 1, {2}),
    "reject-third": (lambda i, j: j != 2, {3}),
    "scattered": (lambda i, j: SCATTERED[i % len(SCATTERED)], {1, 2, 3, 4}),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_rejection_at_every_chain_position(plain, mtp_dirs, pattern, monkeypatch):
    """Depth 3 with scripted drafts: rejection at each position of the chain (and none, and all)
    rolls back the target's recurrent state and the head's in-round rows; the output is plain
    greedy and the head always drafts from exactly the committed rows (pre-norm features for the
    scattered pattern)."""
    engine, prompts, outputs = plain
    head = head_for(engine, mtp_dirs["hf-sidecar"])
    right, expected_commits = PATTERNS[pattern]
    verify_commits = Counter()
    commit = BatchCache.commit

    def recording_commit(cache, num_rows):
        if cache.positions.shape[1] == 4:  # the target's verify passes (one sequence)
            verify_commits[num_rows[0]] += 1
        commit(cache, num_rows)

    monkeypatch.setattr(BatchCache, "commit", recording_commit)
    for i in (1, 0):
        hidden = MtpHidden.PRE_NORM if pattern == "scattered" else MtpHidden.POST_NORM
        proposer = ScriptedMtp(head, outputs[i], engine.model.vocab_size, right, hidden)
        result = spec_engine(engine, proposer, 3).generate_all(prompts[i], greedy(NEW_TOKENS))
        assert result.token_ids == outputs[i], f"{pattern} prompt {i}"
        assert result.stats.method == "mtp"
        if pattern == "always-right":
            assert result.stats.accepted == result.stats.drafted
        elif pattern in ("always-wrong", "reject-first"):
            assert result.stats.accepted == 0
        else:
            assert 0 < result.stats.accepted < result.stats.drafted
        check_records(proposer, prompts[i] + outputs[i])
    assert set(verify_commits) == expected_commits, verify_commits


def train_head(engine: Engine, head, prompts: list[list[int]], steps: int = 300, seed: int = 0) -> None:
    """Distil the target into the head on its greedy continuations of `prompts`: every row i
    (h_i, t_{i+1}) learns the target's own distribution of t_{i+2} (soft labels), as a real MTP head
    approximates it. Its drafts are then accepted part of the time, and its q overlaps p without
    equalling it (what the sampling test needs to mean anything)."""
    sequences = [ids + engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompts]
    batches = []
    with torch.no_grad():
        for seq in sequences:
            out = engine.model(torch.tensor([seq]), torch.arange(len(seq))[None], engine.model.make_cache(len(seq)))
            soft = torch.softmax(engine.model.logits(out.hidden[0, 1:-1]), -1)  # p(t_{i+2} | t_{<=i+1})
            batches.append((torch.tensor([seq[1:-1]]), out.hidden[:, :-2], soft))
    torch.manual_seed(seed)
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    for step in range(steps):
        tokens, hidden, labels = batches[step % len(batches)]
        cache = KVCache(head.cache_specs(), tokens.shape[1], hidden.dtype, hidden.device)
        logits = head.logits(head(tokens, hidden, torch.arange(tokens.shape[1])[None], cache))
        loss = torch.nn.functional.cross_entropy(logits[0], labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in params:
        p.requires_grad_(False)


def first_tokens(engine: Engine, ids: list[int], k: int = 4) -> tuple[list[int], torch.Tensor]:
    """The target's k most likely next tokens after `ids` and their top-k (temperature 1) probabilities."""
    with torch.no_grad():
        hidden = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], engine.model.make_cache(len(ids))).hidden
        top = torch.topk(engine.model.logits(hidden[0, -1]).double(), k)
    return top.indices.tolist(), torch.softmax(top.values, -1)


@pytest.fixture(scope="module")
def trained(plain, mtp_dirs):
    engine, prompts, _ = plain
    head = head_for(engine, mtp_dirs["shards"])
    text = corpus_text(20_000)
    held_out = [engine.tokenizer.encode(text[i:i + 200]) for i in range(1000, 20_000, 3000)]
    # and prompt 0 followed by each of its 4 likeliest first tokens: the sampling test drafts there
    branches = [prompts[0] + [a] for a in first_tokens(engine, prompts[0])[0]]
    train_head(engine, head, held_out + branches)
    return head, held_out


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_identity_trained_head_with_partial_acceptance(plain, trained):
    engine, prompts, outputs = plain
    head, held_out = trained
    cases = list(zip(prompts, outputs))
    cases += [(ids, engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids) for ids in held_out[:2]]
    engines = ((f"depth={depth}", spec_engine(engine, MtpProposer(head), depth)) for depth in (1, 2, 3))
    accepted, drafted = assert_greedy_identity(engines, cases, NEW_TOKENS)
    # both branches of verification ran
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_sampling_keeps_the_target_distribution(plain, trained):
    """End to end with the (trained) MTP head drafting from q = its processed distribution: the
    pair (first token, second token) follows the target's processed distribution p(a) p(b | a).
    The first token comes from prefill, the second is the first verified one (its draft accepted
    or rejected, both happen). top_k = 4 keeps the support at 16 pairs for a chi-square test."""
    engine, prompts, _ = plain
    head, _ = trained
    ids = prompts[0]
    params = dict(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    cells, probs = {}, []
    for a, pa in zip(*first_tokens(engine, ids)):
        seconds, p_second = first_tokens(engine, ids + [a])
        for b, pb in zip(seconds, p_second):
            cells[(a, b)] = len(probs)
            probs.append(pa * pb)
    joint = torch.stack(probs)
    spec = spec_engine(engine, MtpProposer(head), 1)
    counts: Counter = Counter()
    n, accepted = 500, 0
    for seed in range(n):
        result = spec.generate_all(ids, SamplingParams(seed=seed, **params))
        assert result.stats.drafted == 1
        accepted += result.stats.accepted
        counts[cells[tuple(result.token_ids[:2])]] += 1
    assert 0 < accepted < n, accepted
    assert chi_square(counts, joint, n) < 37.70  # 15 degrees of freedom, p = 0.001
