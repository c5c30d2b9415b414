"""The engine on an fp8 KV cache (`--kv-cache-dtype fp8`, CPU, float32): the pools hold e4m3 codes
and scales and fit about twice the tokens; on that compressed cache speculative greedy == plain
greedy (replays of the request's own output, always right and always wrong), a prefix-cache hit ==
a miss, and batching and preemption change nothing. Tiny random Llama, Qwen3 and Gemma 3 (sliding
windows shorter than the prompts) checkpoints."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.doubles import KeyedReplay
from tools.tiny import build_tiny_gemma3, corpus_text
from verispec.cache.paged import kv_bytes_per_token
from verispec.config import EngineConfig
from verispec.engine.engine import Engine
from verispec.engine.options import check_options
from verispec.errors import VerispecError
from verispec.kernels import kv_fp8
from verispec.sampling.params import SamplingParams

NEW_TOKENS = 20
PROMPT_TOKENS = [40, 9, 70, 23]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model_dirs(tiny_models, tmp_path_factory, tokenizer_dir) -> dict:
    gemma3 = tmp_path_factory.mktemp("fp8-gemma3")
    build_tiny_gemma3(gemma3, seed=61, tokenizer_dir=tokenizer_dir, sliding_window=12)
    return {"llama": tiny_models.get("fp8-llama", "llama", **SHAPE),
            "qwen3": tiny_models.get("fp8-qwen3", "qwen3", head_dim=16, **SHAPE),
            "gemma3": gemma3}


def load(model_dir, **fields) -> Engine:
    fields = dict(dict(max_num_seqs=4, kv_cache_gb=0.02, prefill_step_seconds=0, kv_cache_dtype="fp8",
                       prefix_cache=False, dtype="float32"), **fields)
    return Engine.load(EngineConfig(model=str(model_dir), device="cpu", max_model_len=1024, **fields))


def params() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def prompts_of(engine: Engine) -> list[list[int]]:
    ids = engine.tokenizer.encode(corpus_text(20_000))
    return [ids[i * 300:i * 300 + n] for i, n in enumerate(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def reference(model_dirs):
    """{family: (engine, prompts, each prompt's greedy tokens alone)} on an fp8 cache."""
    cache = {}

    def get(family: str):
        if family not in cache:
            engine = load(model_dirs[family])
            prompts = prompts_of(engine)
            cache[family] = engine, prompts, [engine.generate_all(p, params()).token_ids for p in prompts]
        return cache[family]
    return get


def test_pools_hold_codes_and_scales_and_twice_the_tokens(model_dirs):
    fp8 = load(model_dirs["llama"], kv_cache_gb=0.0003)
    plain = load(model_dirs["llama"], kv_cache_gb=0.0003, kv_cache_dtype="auto")
    layer = fp8.pools.keys[0]
    assert layer.dtype == kv_fp8.CODE_DTYPE and fp8.pools.key_scales[0].shape == layer.shape[:2]
    # float32 K/V: 4 bytes a value against 1 + 1/head_dim
    assert fp8.budget.num_tokens >= 3.5 * plain.budget.num_tokens
    assert fp8.describe().kv_cache_dtype == "fp8" and "(fp8)" in fp8.describe().cache
    assert plain.describe().kv_cache_dtype == "float32"
    # the compression is real: the logprobs move (the tokens of a tiny random model may not)
    prompt = prompts_of(fp8)[0]
    with_logprobs = replace(params(), logprobs=True)
    a = [lp.logprob for lp in fp8.generate_all(prompt, with_logprobs).logprobs]
    b = [lp.logprob for lp in plain.generate_all(prompt, with_logprobs).logprobs]
    assert a != b and a == pytest.approx(b, abs=0.5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("replay", ["right", "wrong"])
def test_speculative_greedy_is_plain_greedy_on_the_compressed_cache(reference, family, replay):
    base, prompts, alone = reference(family)
    continuations = {tuple(p): a for p, a in zip(prompts, alone)}
    engine = Engine(base.model, base.tokenizer, base.config, base.model_dir,
                    proposer=KeyedReplay(continuations, base.model.vocab_size, wrong_at=lambda i: replay == "wrong"),
                    num_drafts=3)
    results = engine.generate_batch(prompts, params())
    assert [r.token_ids for r in results] == alone, f"{family} replay {replay}, together"
    assert [engine.generate_all(p, params()).token_ids for p in prompts[:2]] == alone[:2]
    assert (sum(r.stats.accepted for r in results) > 0) == (replay == "right")


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_prefix_hits_batching_and_preemption_change_nothing(model_dirs, reference, family):
    _, prompts, alone = reference(family)
    cached = load(model_dirs[family], prefix_cache=True)
    assert [cached.generate_all(p, params()).token_ids for p in prompts] == alone
    # the same prompts again (whole-prompt hits), and longer ones sharing their blocks (partial hits)
    repeat = [cached.generate_all(p, params()) for p in prompts]
    assert [r.token_ids for r in repeat] == alone
    assert sum(r.stats.cached_tokens for r in repeat) > 0
    longer = [p + p[:len(p) // 2] for p in prompts]
    fresh = load(model_dirs[family])
    assert [cached.generate_all(p, params()).token_ids for p in longer] == \
        [fresh.generate_all(p, params()).token_ids for p in longer]
    assert [r.token_ids for r in fresh.generate_batch(prompts, params())] == alone
    # 8 blocks: the longest request fits, the four together do not
    per_token = kv_bytes_per_token(fresh.model.cache_specs(), torch.float32, "fp8")
    tight = load(model_dirs[family], kv_cache_gb=9 * 16 * per_token / 2**30)
    assert [r.token_ids for r in tight.generate_batch(prompts, params())] == alone
    assert tight.load_stats()["preemptions"] > 0, "the small cache preempted nobody"


@pytest.mark.parametrize("value,message", [("fp4", "must be one of auto, fp8"), ("tq4", "not served yet")])
def test_bad_kv_cache_dtype_is_one_line_before_loading(value, message):
    with pytest.raises(VerispecError, match=message) as error:
        check_options(EngineConfig(model="nowhere", device="cpu", kv_cache_dtype=value))
    assert "\n" not in str(error.value)


def test_fp8_pools_zero_and_copy_blocks_with_their_scales(model_dirs):
    engine = load(model_dirs["llama"])
    pools = engine.pools
    pools.key_scales[0][16:32] = 7
    pools.copy_block(1, 2)
    assert torch.equal(pools.key_scales[0][32:48], pools.key_scales[0][16:32])
    pools.zero_blocks([2])
    assert not pools.key_scales[0][32:48].any()


@pytest.mark.parametrize("replay", ["right", "wrong"])
def test_exact_numerics_hold_on_the_compressed_cache(model_dirs, replay):
    """float16 on a CPU under --numerics exact: tokens and logprobs bit for bit alone, batched, from a
    prefix hit and speculating (every writer encodes and every reader decodes the same values)."""
    base = load(model_dirs["qwen3"], dtype="float16", numerics="exact", prefix_cache=True)
    assert base.describe().numerics == "exact"
    exact = replace(params(), logprobs=True, top_logprobs=2)
    record = lambda r: (r.token_ids, [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in r.logprobs])  # noqa: E731
    prompts = prompts_of(base)
    alone = [record(base.generate_all(p, exact)) for p in prompts]
    assert [record(base.generate_all(p, exact)) for p in prompts] == alone  # whole-prompt hits
    assert [record(r) for r in base.generate_batch(prompts, exact)] == alone
    continuations = {tuple(p): a[0] for p, a in zip(prompts, alone)}
    engine = Engine(base.model, base.tokenizer, base.config, base.model_dir,
                    proposer=KeyedReplay(continuations, base.model.vocab_size, wrong_at=lambda i: replay == "wrong"),
                    num_drafts=3)
    assert [record(r) for r in engine.generate_batch(prompts, exact)] == alone
