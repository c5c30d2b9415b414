"""The Gemma 4 assistant MTP drafter (`gemma4_assistant`): parity with transformers'
Gemma4AssistantForCausalLM, lossless speculation through the engine, the window cap, lookup.

Oracle: transformers' `Gemma4AssistantForCausalLM` fed what its candidate generator
(SinglePositionMultiTokenCandidateGenerator) feeds it: inputs_embeds = cat(the target's scaled
embedding of the next token, the target's final hidden at the last position), position_ids = the
next token's position, the target's `shared_kv_states` and an all-ones attention mask.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM as HFGemma4ForCausalLM

from verispec.cli import main as cli_main
from tools.tiny import build_tiny_gemma4, build_tiny_gemma4_assistant
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.errors import VerispecError
from verispec.loading.model_loader import load_model
from verispec.spec import gemma4_assistant as assistant_module
from verispec.spec.gemma4_assistant import AssistantProposer, find_assistant, load_assistant
from verispec.bench.steps import prefilled_sequence
from verispec.spec.proposer import TargetStep

from tests.spec.conftest import PROMPTS, ReplayProposer, assert_greedy_identity, greedy, spec_engine
from tests.spec.test_sampling import chi_square
from tests.spec.second_token import CHI2_CRIT_3DF_P001, samples_after, second_token_counts, second_token_target

NEW_TOKENS = 48
VOCAB = 520  # past the tokenizer's 514: padding rows the drafter must never propose; 8 centroids of 65
# float32 on both sides: measured ~1e-6 on logits of magnitude ~2
ATOL = 1e-5
RTOL = 1e-5
# Each wrong convention (RoPE at the last row instead of the next token's position; an exclusive
# sliding window; no sliding window) must move the logits far past that tolerance.
GAP_MIN = 1e-2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4-assistant")
    build_tiny_gemma4(root / "target", seed=41, tokenizer_dir=tokenizer_dir, vocab_size=VOCAB)
    target_config = json.loads((root / "target" / "config.json").read_text())
    build_tiny_gemma4_assistant(root / "assistant", target_config, seed=42)
    build_tiny_gemma4_assistant(root / "ordered", target_config, seed=43, ordered_embeddings=True,
                                num_centroids=8, centroid_top_k=2)
    return {"root": root, "target": root / "target", "assistant": root / "assistant", "ordered": root / "ordered"}


@pytest.fixture(scope="module")
def plain(dirs):
    """(float64 engine, prompt ids, plain greedy continuations)."""
    engine = load_engine(str(dirs["target"]), dtype="float64", device="cpu", prefill_step_size=16)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 16  # one prompt spans several prefill chunks
    outputs = [engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompts]
    return engine, prompts, outputs


def train_assistant(engine, drafter, sequences: list[list[int]], steps: int = 160, seed: int = 0) -> None:
    """Distil the target's next-token distributions into the drafter's first two chained steps, so
    the tests run a drafter that is right part of the time (a random one is never right) and whose
    sampling distribution q overlaps the target's p. Row p: token p embedded, the target's hidden at
    p-1, RoPE at p, keys 0..p-1; it predicts token p+1, and its fed-back hidden with token p+1
    predicts token p+2."""
    model = engine.model
    batches = []
    with torch.no_grad():
        for seq in sequences:
            n = len(seq)
            ids = torch.tensor([seq])
            cache = model.make_cache(n)
            hidden = model(ids, torch.arange(n)[None], cache).hidden
            cache.commit(n)
            logits = model.logits(hidden[0])
            logits[:, engine.num_real_tokens:] = float("-inf")
            soft = logits.softmax(-1)  # [n, V]: row i is the target's distribution for token i+1
            p = torch.arange(1, n - 2)[None]
            batches.append((cache, n, p, model.embed(ids[:, 1:n - 2]), hidden[:, :n - 3],
                            model.embed(ids[:, 2:n - 1]), soft[1:n - 2], soft[2:n - 1]))
    params = list(drafter.parameters())
    for t in params:
        t.requires_grad_(True)
    torch.manual_seed(seed)
    opt = torch.optim.Adam(params, lr=3e-3)
    for step in range(steps):
        cache, n, p, emb1, hid, emb2, soft1, soft2 = batches[step % len(batches)]
        h1, logits1 = drafter(torch.cat((emb1, hid), -1), p, p - 1, n, cache)
        _, logits2 = drafter(torch.cat((emb2, h1), -1), p, p - 1, n, cache)
        loss = (torch.nn.functional.cross_entropy(logits1[0], soft1)
                + torch.nn.functional.cross_entropy(logits2[0], soft2))
        opt.zero_grad()
        loss.backward()
        opt.step()
    for t in params:
        t.requires_grad_(False)


@pytest.fixture(scope="module")
def trained(plain, dirs):
    engine, prompts, outputs = plain
    drafter = load_assistant(dirs["assistant"], engine.model)
    train_assistant(engine, drafter, [ids + out for ids, out in zip(prompts, outputs)])
    return drafter


def proposer_for(engine, drafter, window=None) -> AssistantProposer:
    return AssistantProposer(drafter, engine.model, engine.num_real_tokens, window)


# ---- parity with transformers -------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["assistant", "ordered"])
def test_forward_matches_transformers(dirs, variant):
    """Three chained draft steps at context lengths shorter and longer than the sliding window
    (8: sliding layers see the last 9 rows, transformers' inclusive window), from the same target
    K/V; the cache rows past the committed ones are poisoned, so reading one would show."""
    hf_target = HFGemma4ForCausalLM.from_pretrained(str(dirs["target"]), dtype=torch.float32).eval()
    hf = Gemma4AssistantForCausalLM.from_pretrained(str(dirs[variant]), dtype=torch.float32).eval()
    target = load_model(dirs["target"], torch.float32, torch.device("cpu"))
    drafter = load_assistant(dirs[variant], target)
    assert (drafter.masked_embedding is not None) == (variant == "ordered")
    gen = torch.Generator().manual_seed(7)
    for length in (5, 9, 23):
        ids = torch.randint(0, VOCAB, (1, length), generator=gen)
        token = torch.randint(0, VOCAB, (1, 1), generator=gen)
        with torch.inference_mode():
            ref = hf_target(ids, output_hidden_states=True, return_shared_kv_states=True)
            cache = target.make_cache(length + 8)
            out = target(ids, torch.arange(length)[None], cache)
            cache.commit(length)
            for k, v in zip(cache.keys, cache.values):
                k[:, :, length:] = float("nan")
                v[:, :, length:] = float("nan")
            for t in ("sliding_attention", "full_attention"):
                layer = target.kv_owner_layer(t)
                torch.testing.assert_close(cache.keys[layer][:, :, :length], ref.shared_kv_states[t][0],
                                           atol=ATOL, rtol=RTOL)
            hf_hidden, hf_token = ref.hidden_states[-1][:, -1:], token
            hidden, ours_token = out.hidden[:, -1:], token
            rope, last = torch.tensor([[length]]), torch.tensor([[length - 1]])
            for step in range(3):
                expected = hf(inputs_embeds=torch.cat((hf_target.get_input_embeddings()(hf_token), hf_hidden), -1),
                              position_ids=rope, attention_mask=torch.ones(1, length + 1, dtype=torch.long),
                              shared_kv_states=ref.shared_kv_states)
                inputs = torch.cat((target.embed(ours_token), hidden), -1)
                hidden, logits = drafter(inputs, rope, last, length, cache)
                where = f"{variant} length {length} step {step}"
                torch.testing.assert_close(logits, expected.logits, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: {m}")
                torch.testing.assert_close(hidden, expected.last_hidden_state, atol=ATOL, rtol=RTOL)
                if step == 0 and length > 9:  # the conventions that must not pass
                    wrong_rope = drafter(inputs, rope - 1, last, length, cache)[1]
                    assert (wrong_rope - expected.logits).abs().max() > GAP_MIN
                    windows = drafter.base_windows
                    for wrong in ([8, 8, 8, None], [None] * 4):
                        drafter.base_windows = wrong
                        assert (drafter(inputs, rope, last, length, cache)[1] - expected.logits).abs().max() > GAP_MIN
                    drafter.base_windows = windows
                hf_hidden, hf_token = expected.last_hidden_state, expected.logits.argmax(-1)
                ours_token = logits.argmax(-1)
                assert torch.equal(hf_token, ours_token)


def test_proposer_drafts_what_transformers_drafts(dirs):
    """The proposer end to end (seed hidden and token, RoPE position, key bound, chaining) against
    the candidate generator's loop on transformers' models: after a prefill, and after a verify
    pass whose last two rows were rejected (still in the cache buffer past its length)."""
    hf_target = HFGemma4ForCausalLM.from_pretrained(str(dirs["target"]), dtype=torch.float32).eval()
    hf = Gemma4AssistantForCausalLM.from_pretrained(str(dirs["assistant"]), dtype=torch.float32).eval()
    engine = load_engine(str(dirs["target"]), dtype="float32", device="cpu")
    target = engine.model
    proposer = AssistantProposer(load_assistant(dirs["assistant"], target), target)
    num_drafts, params = 3, SamplingParams(temperature=0.0)

    def oracle(committed: list[int], next_token: int) -> list[int]:
        with torch.inference_mode():
            ref = hf_target(torch.tensor([committed]), output_hidden_states=True, return_shared_kv_states=True)
            hidden, token, out = ref.hidden_states[-1][:, -1:], torch.tensor([[next_token]]), []
            for _ in range(num_drafts):
                step = hf(inputs_embeds=torch.cat((hf_target.get_input_embeddings()(token), hidden), -1),
                          position_ids=torch.tensor([[len(committed)]]), shared_kv_states=ref.shared_kv_states,
                          attention_mask=torch.ones(1, len(committed) + 1, dtype=torch.long))
                hidden, token = step.last_hidden_state, step.logits.argmax(-1)
                out.append(int(token))
        return out

    ids = torch.randint(0, 500, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    seq = sequence_in(spec_engine(engine, proposer, num_drafts), ids, next_token=7)
    drafts = proposer.propose([seq], [num_drafts], [params], [None])[0].token_ids
    assert drafts == oracle(ids, 7)
    verify = [7] + drafts
    out = verify_and_commit(engine_of[proposer], seq, verify, 2)
    proposer.observe([(seq, TargetStep(verify[:2], 20, out.hidden[0, :2], [], 11))])
    assert proposer.propose([seq], [num_drafts], [params], [None])[0].token_ids == oracle(ids + verify[:2], 11)


engine_of: dict = {}  # proposer -> the engine it drafts for (sequence_in)


def sequence_in(spec: Engine, ids: list[int], next_token: int):
    """A sequence of `spec`'s (its proposer bound to its paged cache), prefilled over `ids` with
    room for a verify pass, whose proposer observed the prompt with `next_token` after it."""
    seq = prefilled_sequence(spec, ids, 4)
    with torch.inference_mode():
        hidden = spec.model(torch.tensor([ids]), torch.arange(len(ids))[None], spec.model.make_cache(len(ids))).hidden[0]
    spec.proposer.observe([(seq, TargetStep(ids, 0, hidden, [], next_token))])
    engine_of[spec.proposer] = spec
    return seq


def verify_and_commit(spec: Engine, seq, tokens: list[int], keep: int):
    """A verify pass over `tokens` after the sequence's committed rows; the first `keep` committed."""
    out = spec.runner.verify([seq], [tokens], ())
    out.cache.commit([keep])
    seq.num_cached += keep
    return out


def test_window_reads_only_the_last_rows(plain, dirs):
    """--assistant-window W: corrupting rows before the last W leaves the logits unchanged with the
    window and changes them without it."""
    engine = plain[0]
    drafter = load_assistant(dirs["assistant"], engine.model)
    model, n, window = engine.model, 30, 4
    ids = torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = model.make_cache(n)
        hidden = model(ids, torch.arange(n)[None], cache).hidden
        cache.commit(n)
        inputs = torch.cat((model.embed(ids[:, -1:]), hidden[:, -2:-1]), -1)
        args = (torch.tensor([[n - 1]]), torch.tensor([[n - 2]]), n - 1, cache)
        before = [drafter(inputs, *args, max_window=w)[1] for w in (window, None)]
        for k, v in zip(cache.keys, cache.values):
            k[:, :, :n - 1 - window] += 1.0
            v[:, :, :n - 1 - window] += 1.0
        after = [drafter(inputs, *args, max_window=w)[1] for w in (window, None)]
    torch.testing.assert_close(after[0], before[0], atol=0, rtol=0)
    assert (after[1] - before[1]).abs().max() > GAP_MIN


# ---- loading ------------------------------------------------------------------------------------
def test_loading_refuses_what_does_not_fit(plain, dirs, tmp_path):
    engine = plain[0]
    with pytest.raises(VerispecError, match="not a Gemma 4 assistant checkpoint: its config.json has model_type "
                                            "'gemma4_text', expected 'gemma4_assistant'"):
        load_assistant(dirs["target"], engine.model)
    bad = tmp_path / "bad"
    shutil.copytree(dirs["assistant"], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(config, backbone_hidden_size=48)))
    with pytest.raises(VerispecError, match="backbone of hidden size 48; the target has hidden size 64"):
        load_assistant(bad, engine.model)
    from safetensors.torch import load_file, save_file
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["post_projection.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(VerispecError, match="missing tensors: post_projection.weight"):
        load_assistant(bad, engine.model)


# ---- lossless -----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_identity_trained_assistant(plain, trained, k):
    engine, prompts, outputs = plain
    # window 4: shorter than two of the prompts
    engines = ((f"k={k} window={w}", spec_engine(engine, proposer_for(engine, trained, w), k)) for w in (None, 4))
    accepted, drafted = assert_greedy_identity(engines, list(zip(prompts, outputs)), NEW_TOKENS, method="assistant")
    assert 0 < accepted < drafted  # a real drafter: right part of the time


def test_identity_random_assistants(plain, dirs):
    engine, prompts, outputs = plain
    for variant in ("assistant", "ordered"):
        spec = spec_engine(engine, proposer_for(engine, load_assistant(dirs[variant], engine.model)), 2)
        for i, ids in enumerate(prompts):
            result = spec.generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == outputs[i] and result.stats.method == "assistant"
            assert result.stats.drafted > 0


class RecordingProposer(AssistantProposer):
    """Records its drafts; with `poison`, first fills the target cache's rows from each sequence's
    committed length on (the last verify pass's rejected K/V) with NaN; `extra_rows` > 0 reads past
    the committed rows."""

    poison = False
    extra_rows = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drafts: list[list[int]] = []

    def propose(self, seqs, num_drafts, params, generators):
        pools = self._target.pools
        if self.poison:  # each sequence's rows from its committed length to the end of its blocks
            for seq in seqs:
                size = pools.block_size
                positions = range(seq.num_cached, len(seq.block_table) * size)
                rows = torch.tensor([seq.block_table[p // size] * size + p % size for p in positions], dtype=torch.long)
                for k, v in zip(pools.keys, pools.values):
                    k[rows] = float("nan")
                    v[rows] = float("nan")
        drafts = super().propose(seqs, num_drafts, params, generators)
        self.drafts.extend(d.token_ids for d in drafts)
        return drafts

    def _last_rows(self, seqs):
        return [row + self.extra_rows for row in super()._last_rows(seqs)]


class PoisoningProposer(RecordingProposer):
    poison = True


class LeakingProposer(RecordingProposer):
    poison = True
    extra_rows = 1


def test_drafts_read_only_committed_rows(plain, trained):
    """The rows past cache.length hold rejected drafts' K/V when the assistant runs: poisoned, the
    drafts do not change (while a drafter reading one row more sees the poison)."""
    engine, prompts, outputs = plain
    runs = {}
    for cls in (RecordingProposer, PoisoningProposer, LeakingProposer):
        proposer = cls(trained, engine.model, engine.num_real_tokens)
        result = spec_engine(engine, proposer, 3).generate_all(prompts[1], greedy(NEW_TOKENS))
        assert result.token_ids == outputs[1]
        if cls is RecordingProposer:
            assert 0 < result.stats.accepted < result.stats.drafted  # some rows were rejected
        runs[cls] = proposer.drafts
    assert runs[PoisoningProposer] == runs[RecordingProposer]
    assert runs[LeakingProposer] != runs[RecordingProposer]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_replay_proposers_on_the_gemma_target(plain, k):
    """Always right (every verify pass committed whole), always wrong (none), and partly right
    (rejections at every chain depth) on the target the assistant drafts for."""
    engine, prompts, outputs = plain
    for i, ids in enumerate(prompts):
        cases = {
            "right": ReplayProposer(outputs[i], engine.model.vocab_size),
            "wrong": ReplayProposer(outputs[i], engine.model.vocab_size, right_at=lambda j: False),
            "partly": ReplayProposer(outputs[i], engine.model.vocab_size, right_at=lambda j: j % (k + 2) != 1),
        }
        for name, proposer in cases.items():
            result = spec_engine(engine, proposer, k).generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == outputs[i], f"{name} k={k} prompt {i}"
            stats = result.stats
            if name == "right":
                assert stats.accepted == stats.drafted and stats.rounds == -(-(NEW_TOKENS - 1) // (k + 1))
            elif name == "wrong":
                assert stats.accepted == 0 and stats.rounds == NEW_TOKENS - 1
            else:
                assert 0 < stats.accepted < stats.drafted


# ---- sampling -----------------------------------------------------------------------------------
@pytest.mark.slow  # 30-70 s on the 2-core CI machine: `make test-slow` runs it
def test_sampling_through_the_assistant_keeps_the_target_distribution(plain, trained):
    """The second generated token (the first verified one), given the first, follows the target's
    processed distribution; the drafts are sampled from the assistant's own q (recorded), which
    is accepted part of the time."""
    engine, prompts, _ = plain
    ids = prompts[0]
    first, top, target = second_token_target(engine, ids)
    proposer = proposer_for(engine, trained)
    q_rows = []
    propose = proposer.propose

    def recording(*args):
        [draft] = propose(*args)
        q_rows.append(draft.probs)
        return [draft]

    proposer.propose = recording
    results = samples_after(spec_engine(engine, proposer, 1), ids, first)
    assert 0 < sum(r.stats.accepted for r in results) < len(results)
    assert all(q is not None and q.shape == (1, engine.model.vocab_size) for q in q_rows)
    assert all(abs(float(q.sum()) - 1) < 1e-5 and float(q[0, engine.num_real_tokens:].sum()) == 0 for q in q_rows)
    assert chi_square(second_token_counts(results, top), target, len(results)) < CHI2_CRIT_3DF_P001


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_sampled_drafts_follow_the_assistants_q(plain, trained, dirs):
    """Sampling drafts: q is the processed distribution of the assistant's own logits (a second
    draft's q given the first draft), the drafts are drawn from q (chi-square), and padding rows
    past the tokenizer's vocabulary get no mass (nor the greedy choice, even when they score highest)."""
    engine, prompts, outputs = plain
    model, ids = engine.model, prompts[0]
    n = len(ids)
    with torch.inference_mode():
        cache = model.make_cache(n + 8)
        hidden = model(torch.tensor([ids]), torch.arange(n)[None], cache).hidden[0]
        cache.commit(n)

    def proposer(drafter):
        prop = proposer_for(engine, drafter)
        seq = sequence_in(spec_engine(engine, prop, 3), ids, next_token=outputs[0][0])

        def propose(k, params, generator):
            return prop.propose([seq], [k], [params], [generator])[0]
        return propose

    propose = proposer(trained)
    params = SamplingParams(temperature=1.0, top_k=4)
    draft = propose(2, params, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        rope, last = torch.tensor([[n]]), torch.tensor([[n - 1]])
        h1, logits1 = trained(torch.cat((model.embed(torch.tensor([[outputs[0][0]]])), hidden[None, -1:]), -1),
                              rope, last, n, cache)
        _, logits2 = trained(torch.cat((model.embed(torch.tensor([[draft.token_ids[0]]])), h1), -1), rope, last, n, cache)
    for row, logits in enumerate((logits1, logits2)):
        top = torch.topk(logits[0, -1, :engine.num_real_tokens].float(), 4)
        expected = torch.zeros(model.vocab_size).index_put_((top.indices,), top.values.softmax(-1))
        torch.testing.assert_close(draft.probs[row], expected, atol=1e-6, rtol=1e-6)
    q = draft.probs[0].double()
    support = q.nonzero().flatten().tolist()
    gen = torch.Generator().manual_seed(1)
    counts = Counter(support.index(propose(1, params, gen).token_ids[0]) for _ in range(2000))
    assert chi_square(counts, q[support], 2000) < 16.27  # 3 degrees of freedom, p = 0.001
    full = propose(1, SamplingParams(temperature=1.0), gen).probs[0]
    assert float(full[engine.num_real_tokens:].sum()) == 0 and abs(float(full.sum()) - 1) < 1e-5
    padded = load_assistant(dirs["assistant"], model)
    with torch.no_grad():
        padded.lm_head.weight[engine.num_real_tokens:] = padded.lm_head.weight[:VOCAB - engine.num_real_tokens] * 50
    tokens = proposer(padded)(3, SamplingParams(temperature=0.0), None).token_ids
    assert all(t < engine.num_real_tokens for t in tokens)


# ---- where the assistant comes from -------------------------------------------------------------
def test_missing_assistant_is_logged_and_decoding_goes_on(plain, dirs, monkeypatch):
    engine, prompts, outputs = plain
    lines = []
    monkeypatch.setattr(assistant_module.log, "warning", lambda msg, *a: lines.append(msg % a))
    spec = load_engine(str(dirs["target"]), dtype="float64", device="cpu", prefill_step_size=16, mtp=True)
    assert spec.proposer is None
    assert len(lines) == 1
    assert "no Gemma 4 assistant checkpoint" in lines[0] and str(dirs["target"]) + "-assistant" in lines[0]
    assert "--mtp-model" in lines[0] and "decoding without speculation" in lines[0]
    result = spec.generate_all(prompts[0], greedy(NEW_TOKENS))
    assert result.token_ids == outputs[0] and result.stats.method == "ar"


def test_assistant_found_beside_the_model_or_in_the_hub_cache(plain, dirs, tmp_path, monkeypatch):
    engine, prompts, outputs = plain
    side = tmp_path / "side"
    shutil.copytree(dirs["target"], side / "gemma-tiny")
    shutil.copytree(dirs["assistant"], side / "gemma-tiny-assistant")
    assert find_assistant(str(side / "gemma-tiny"), side / "gemma-tiny", None) == side / "gemma-tiny-assistant"
    hub = tmp_path / "hub"
    for name, src in (("tiny", dirs["target"]), ("tiny-assistant", dirs["assistant"])):
        shutil.copytree(src, hub / f"models--org--{name}" / "snapshots" / "abc")
    for var in ("VERISPEC_MODEL_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = load_engine("org/tiny", dtype="float64", device="cpu", prefill_step_size=16, mtp=True,
                       num_draft_tokens=3, assistant_window=4)
    assert isinstance(spec.proposer, AssistantProposer) and spec.num_drafts == 3 and spec.proposer.window == 4
    result = spec.generate_all(prompts[1], greedy(NEW_TOKENS))
    assert result.token_ids == outputs[1] and result.stats.method == "assistant"
    # the snapshot path itself names the hub id
    found = find_assistant(str(hub / "models--org--tiny" / "snapshots" / "abc"),
                           hub / "models--org--tiny" / "snapshots" / "abc", None)
    assert found == hub / "models--org--tiny-assistant" / "snapshots" / "abc"


def test_engine_option_checks(dirs, tiny_models):
    with pytest.raises(VerispecError, match="--num-draft-tokens must be >= 1, got 0"):
        load_engine(str(dirs["target"]), mtp=True, num_draft_tokens=0)
    with pytest.raises(VerispecError, match="--assistant-window must be >= 1, got 0"):
        load_engine(str(dirs["target"]), mtp=True, assistant_window=0)
    qwen = tiny_models.get("qwen3", "qwen3")
    with pytest.raises(VerispecError, match="--mtp-model is for a Gemma 4 assistant drafter, but the target is a "
                                            "'qwen3' model"):
        load_engine(str(qwen), mtp=True, mtp_model=str(dirs["assistant"]))


def run_cli(*commands: list[str]) -> list[tuple[int, str, str]]:
    """Run `python -m verispec ...` commands concurrently (each its own process, offline)."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    procs = [subprocess.Popen([sys.executable, "-m", "verispec", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for args in commands]
    return [(p.returncode, *out) for p, out in ((p, p.communicate()) for p in procs)]


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_cli_mtp_on_gemma(plain, dirs):
    """Without an assistant: one stderr line and plain decoding. With --mtp-model: the assistant,
    the same tokens."""
    engine, _, _ = plain
    common = ["generate", "-m", str(dirs["target"]), "--prompt", "def f", "--max-tokens", "12", "--json",
              "--dtype", "float64", "--no-chat-template"]
    (code, out, err), (spec_code, spec_out, spec_err) = run_cli(
        common + ["--mtp"], common + ["--mtp", "--mtp-model", str(dirs["assistant"]), "--num-mtp-tokens", "3"])
    assert code == 0 and spec_code == 0, err + spec_err
    lines = [line for line in err.splitlines() if line.strip() and "start-up:" not in line]
    assert len(lines) == 1 and "no Gemma 4 assistant checkpoint" in lines[0], lines
    base, spec = json.loads(out), json.loads(spec_out)
    assert base["stats"]["method"] == "ar" and spec["stats"]["method"] == "assistant"
    assert spec["token_ids"] == base["token_ids"] and spec["stats"]["drafted"] > 0
    assert not [line for line in spec_err.splitlines() if line.strip() and "start-up:" not in line], spec_err


@pytest.mark.parametrize("args, message", [
    (["--mtp", "--mtp-model", "{target}"], "is not a Gemma 4 assistant checkpoint: its config.json has model_type "
                                           "'gemma4_text', expected 'gemma4_assistant'"),
    (["--mtp", "--mtp-model", "/nowhere/x"], "--mtp-model: model '/nowhere/x' not found"),
    (["--mtp-model", "{assistant}"], "--mtp-model needs --mtp"),
    (["--assistant-window", "4"], "--assistant-window needs --mtp"),
    (["--mtp", "--assistant-window", "0"], "--assistant-window must be >= 1, got 0"),
    (["--mtp", "--num-mtp-tokens", "0"], "--num-draft-tokens must be >= 1, got 0"),
])
def test_cli_bad_assistant_flags_are_one_line(dirs, capsys, args, message):
    args = [a.format(target=dirs["target"], assistant=dirs["assistant"]) for a in args]
    code = cli_main(["generate", "-m", str(dirs["target"]), "--prompt", "x", *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("verispec: error: "), err
    assert message in err
