"""EAGLE3 speculation on a Gemma 4 target: lossless (speculative greedy == plain greedy, float64),
and the drafter fed the right target features.

Targets (`build_tiny_gemma4`): `dense` (gemma4_text, the 31B's structure at toy size) and
`moe_wrapper` (gemma4, routed experts, text weights under model.language_model.*). Both have an
8-token sliding window, so every verify pass past the first few tokens rolls back K/V rows of
layers whose window has slid.

Which features: EAGLE3 aux id k is the residual stream entering target layer k, which for Gemma 4
is the output of layer k-1 *after* its layer_scalar — transformers' `hidden_states[k]` (index 0 =
the sqrt(H)-scaled embeddings; `hidden_states[N]` is the final-normed output, not an aux feature).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma4ForCausalLM as HFGemma4ForCausalLM
from transformers import Gemma4ForConditionalGeneration as HFGemma4ForConditionalGeneration

from verispec.cache.kv import KVCache
from verispec.cache.paged import BatchCache
from tools.tiny import build_tiny_gemma4, write_random_eagle3
from verispec.engine.engine import load_engine
from verispec.loading.model_loader import load_model
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3

from tests.spec.conftest import PROMPTS, ReplayProposer, greedy, spec_engine

NEW_TOKENS = 64
TARGETS = {
    "dense": dict(moe=False, wrapper=False),
    "moe_wrapper": dict(moe=True, wrapper=True),
}
# float32 on both sides (transformers' Gemma 4 norms compute in float32 even for float64 weights):
# measured 0.0 between ForwardOutput.aux and transformers' hidden_states.
AUX_ATOL = 1e-5
AUX_RTOL = 1e-5
# The wrong conventions (before layer_scalar; the output of layer k instead of its input) must be
# far outside that tolerance, or the test could not tell them apart.
CONVENTION_GAP_MIN = 1e-2


@pytest.fixture(scope="module")
def gemma4_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4-spec")
    for i, (name, case) in enumerate(TARGETS.items()):
        build_tiny_gemma4(root / name, seed=31 + i, tokenizer_dir=tokenizer_dir, **case)
    return {name: root / name for name in TARGETS}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, gemma4_dirs):
    """(name, float64 engine, prompt ids, plain greedy continuations)."""
    engine = load_engine(str(gemma4_dirs[request.param]), dtype="float64", device="cpu", prefill_step_size=16)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 16  # one prompt spans several prefill chunks
    plain = [engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompts]
    return request.param, engine, prompts, plain


def text_config(engine) -> dict:
    config = json.loads((engine.model_dir / "config.json").read_text())
    return config.get("text_config", config)


# ---- which features the drafter sees ----------------------------------------------------------
@pytest.mark.parametrize("name", list(TARGETS))
def test_aux_features_are_taken_after_layer_scalar(gemma4_dirs, name):
    path = gemma4_dirs[name]
    cls = HFGemma4ForConditionalGeneration if TARGETS[name]["wrapper"] else HFGemma4ForCausalLM
    hf = cls.from_pretrained(str(path), dtype=torch.float32, experts_implementation="eager").eval()
    ours = load_model(path, torch.float32, torch.device("cpu"))
    n = ours.num_layers
    ids = torch.randint(0, ours.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    capture = tuple(range(n))
    with torch.inference_mode():
        ref = hf(ids, output_hidden_states=True).hidden_states
        out = ours(ids, torch.arange(30)[None], ours.make_cache(30), capture)
    assert len(ref) == n + 1 and len(out.aux) == n
    torch.testing.assert_close(out.aux[0], ours.embed(ids), atol=0, rtol=0)  # the scaled embeddings
    for k in capture:
        torch.testing.assert_close(out.aux[k], ref[k], atol=AUX_ATOL, rtol=AUX_RTOL, msg=lambda m: f"aux {k}: {m}")
    torch.testing.assert_close(out.hidden, ref[n], atol=AUX_ATOL, rtol=AUX_RTOL)
    for k in range(1, n):
        before_scalar = out.aux[k] / ours.model.layers[k - 1].layer_scalar
        assert (before_scalar - ref[k]).abs().max() > CONVENTION_GAP_MIN, f"layer {k - 1}'s layer_scalar is ~1"
        assert (out.aux[k - 1] - ref[k]).abs().max() > CONVENTION_GAP_MIN  # "output of layer k" is another thing


def test_drafter_embedding_is_not_scaled(target, tmp_path):
    """A drafter without its own embedding shares the target's table, unscaled (EAGLE3 embeds raw
    ids even for Gemma targets), while the target's first layer sees the sqrt(H)-scaled one."""
    _, engine, prompts, _ = target
    drafter_dir = write_random_eagle3(tmp_path / "shared", text_config(engine), seed=2, with_embedding=False)
    drafter = load_eagle3(drafter_dir, engine.model)
    ids = torch.tensor([prompts[0]])
    raw = engine.model.input_embeddings()(ids)
    torch.testing.assert_close(drafter.embed(ids), raw, atol=0, rtol=0)
    torch.testing.assert_close(engine.model.embed(ids), raw * engine.model.hidden_size ** 0.5)


# ---- lossless ------------------------------------------------------------------------------------
def test_eagle3_random_drafter_identity(target, tmp_path):
    """Random drafters, one with its own embedding and full draft vocabulary, one sharing the
    target's embedding with every 3rd id (non-trivial d2t offsets) and a qwen3 layer."""
    _, engine, prompts, plain = target
    cfg = text_config(engine)
    drafters = [
        write_random_eagle3(tmp_path / "full", cfg, seed=1, aux_layer_ids=[1, 2, 4]),
        write_random_eagle3(tmp_path / "offset", cfg, seed=2, d2t_offset_stride=3, with_embedding=False,
                            layer_type="qwen3", norm_before_residual=False),  # default aux ids [2, 3, 3]
    ]
    for drafter_dir in drafters:
        proposer = Eagle3Proposer(load_eagle3(drafter_dir, engine.model), engine.model.vocab_size)
        for k in range(1, 5):
            spec = spec_engine(engine, proposer, k)
            for i, ids in enumerate(prompts):
                result = spec.generate_all(ids, greedy(NEW_TOKENS))
                assert result.token_ids == plain[i], f"{drafter_dir.name} k={k} prompt {i}"
                assert result.stats.method == "eagle3" and result.stats.drafted > 0


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_always_right_proposer(target, k):
    """All k drafts accepted each round: every verify pass is committed whole."""
    _, engine, prompts, plain = target
    for i, ids in enumerate(prompts):
        proposer = ReplayProposer(plain[i], engine.model.vocab_size)
        result = spec_engine(engine, proposer, k).generate_all(ids, greedy(NEW_TOKENS))
        assert result.token_ids == plain[i]
        assert result.stats.accepted == result.stats.drafted
        assert result.stats.rounds == -(-(NEW_TOKENS - 1) // (k + 1))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_partly_right_proposer(target, k, monkeypatch):
    """Drafts right except at continuation indices == reject_at (mod k + 2; a period of k + 1 would
    put every wrong one on a bonus token): rejections fall at every depth of the chain, so
    (k+1)-token verify passes are committed partially at each n in 1..k."""
    _, engine, prompts, plain = target
    verify_commits = set()
    commit = BatchCache.commit

    def recording_commit(cache, num_rows):
        if cache.positions.shape[1] == k + 1:  # the target's verify passes (one sequence)
            verify_commits.add(num_rows[0])
        commit(cache, num_rows)

    monkeypatch.setattr(BatchCache, "commit", recording_commit)
    for reject_at in range(k + 2):
        for i, ids in enumerate(prompts):
            proposer = ReplayProposer(plain[i], engine.model.vocab_size, right_at=lambda j: j % (k + 2) != reject_at)
            result = spec_engine(engine, proposer, k).generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == plain[i], f"reject_at={reject_at} prompt {i}"
            assert 0 < result.stats.accepted < result.stats.drafted
    assert set(range(1, k + 1)) <= verify_commits
