"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers: each prompt token's
logprob equals the Hugging Face model's own log-softmax of its logits at the position before, in
float64 on the CPU, however the prompt is chunked, batched, drafted for, or already cached."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from verispec.engine.engine import load_engine
from verispec.engine.prompt_logprobs import ROWS_PER_SLICE
from verispec.errors import InvalidRequestError
from verispec.sampling.params import SamplingParams



def reference(model_dir, prompt_ids: list[int]) -> torch.Tensor:
    """[P - 1, V] log-probabilities of each next prompt token, from transformers in float64."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0, :-1].log_softmax(-1)


def assert_matches(entries, prompt_ids, ref, top_n, tolerance):
    assert [e.token_id for e in entries] == prompt_ids[1:]
    for position, entry in enumerate(entries):
        assert math.isclose(entry.logprob, float(ref[position, prompt_ids[position + 1]]), abs_tol=tolerance)
        values, ids = ref[position].topk(top_n)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(math.isclose(v, float(r), abs_tol=tolerance) for (_, v), r in zip(entry.top, values))


@pytest.fixture(scope="module")
def prompt_ids(qwen3_dir):
    from verispec.loading.tokenizer import Tokenizer

    text = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n" * 12
    ids = Tokenizer.from_dir(qwen3_dir).encode(text, add_special_tokens=True)
    assert len(ids) > ROWS_PER_SLICE + 10  # the rows of one pass are scored in several slices
    return ids


@pytest.fixture(scope="module")
def ref(qwen3_dir, prompt_ids):
    return reference(qwen3_dir, prompt_ids)


# The logits of one row are float64 here, but the log-softmax over them runs in float32, as a
# generated token's does (sampler.token_logprobs): float32's precision bounds the difference.
F32 = 1e-5


@pytest.mark.parametrize("chunk", [2048, 37])
def test_prompt_logprobs_are_the_models(qwen3_dir, prompt_ids, ref, chunk):
    engine = load_engine(str(qwen3_dir), dtype="float64", device="cpu", prefill_step_size=chunk)
    result = engine.generate_all(prompt_ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3))
    assert len(result.token_ids) == 4
    assert_matches(result.prompt_logprobs, prompt_ids, ref, 3, F32)
    plain = engine.generate_all(prompt_ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert plain.prompt_logprobs is None and plain.token_ids == result.token_ids


def test_max_tokens_zero_scores_the_prompt_alone(qwen3_dir, prompt_ids, ref):
    engine = load_engine(str(qwen3_dir), dtype="float64", device="cpu")
    result = engine.generate_all(prompt_ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert result.token_ids == [] and result.text == "" and result.finish_reason.value == "length"
    assert_matches(result.prompt_logprobs, prompt_ids, ref, 0, F32)
    # no new token needs no room: a prompt may fill the whole context (and no more)
    full = load_engine(str(qwen3_dir), dtype="float64", device="cpu", max_model_len=len(prompt_ids))
    assert_matches(full.generate_all(prompt_ids, SamplingParams(max_tokens=0, prompt_logprobs=0)).prompt_logprobs,
                   prompt_ids, ref, 0, F32)
    with pytest.raises(InvalidRequestError, match="context length"):
        full.generate_all(prompt_ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    with pytest.raises(InvalidRequestError, match="context length"):
        full.generate_all(prompt_ids + [5], SamplingParams(max_tokens=0, prompt_logprobs=0))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_a_prefix_cache_hit_is_not_taken_while_scoring(qwen3_dir, prompt_ids, ref):
    """A cached prefix has no rows in this request's passes: the scoring request computes them."""
    engine = load_engine(str(qwen3_dir), dtype="float64", device="cpu")
    engine.generate_all(prompt_ids, SamplingParams(max_tokens=2, temperature=0.0))
    warm = engine.generate_all(prompt_ids, SamplingParams(max_tokens=2, temperature=0.0))
    assert warm.stats.cached_tokens > 0
    scored = engine.generate_all(prompt_ids, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    assert scored.stats.cached_tokens == 0 and scored.token_ids == warm.token_ids
    assert_matches(scored.prompt_logprobs, prompt_ids, ref, 1, F32)


def test_batched_with_others_and_drafting(qwen3_dir, prompt_ids, ref):
    """In one batch with plain requests, chunked, with a proposer observing every row."""
    engine = load_engine(str(qwen3_dir), dtype="float64", device="cpu", suffix=True, prefill_step_size=50)
    short = prompt_ids[:40]
    params = [SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.0,
                                                                            prompt_logprobs=2),
              SamplingParams(max_tokens=0, prompt_logprobs=2), SamplingParams(max_tokens=6, temperature=0.0)]
    results = engine.generate_batch([prompt_ids, prompt_ids, short, short], params)
    assert results[0].token_ids == results[1].token_ids
    assert results[0].prompt_logprobs is None and results[3].prompt_logprobs is None
    assert_matches(results[1].prompt_logprobs, prompt_ids, ref, 2, F32)
    assert_matches(results[2].prompt_logprobs, short, ref, 2, F32)


def test_preempted_and_recomputed_sequences_keep_their_scores(qwen3_dir):
    """Room for about two sequences: prompts are preempted mid-prompt and after it, then prefilled
    again (from a prefix hit once their scores are complete); each score is computed once, and
    equals the one computed alone with plenty of room."""
    roomy = load_engine(str(qwen3_dir), dtype="float64", device="cpu", prefill_step_size=8)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, roomy.model.vocab_size, (40,), generator=g).tolist() for _ in range(5)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    alone = [roomy.generate_all(p, params) for p in prompts]
    per_token = 2 * 2 * 2 * 16 * 8  # K+V, layers, kv heads, head dim 16, float64
    tight = load_engine(str(qwen3_dir), dtype="float64", device="cpu", prefill_step_size=8, block_size=4,
                        kv_cache_gb=(4 * 36 + 4) * per_token / 2**30, max_model_len=100)
    together = tight.generate_batch(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for got, want, prompt in zip(together, alone, prompts):
        assert got.token_ids == want.token_ids
        assert [e.token_id for e in got.prompt_logprobs] == prompt[1:]
        assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-9) and [t for t, _ in a.top] == [t for t, _ in b.top]
                   for a, b in zip(got.prompt_logprobs, want.prompt_logprobs))
    assert tight.blocks.num_used == 0
