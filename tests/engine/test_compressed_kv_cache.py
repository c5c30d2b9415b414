"""The engine on a compressed KV cache (`--kv-cache-dtype fp8|tq4|tq3`, CPU, float32): the pools hold
codes and scales and fit several times the tokens; on that compressed cache speculative greedy ==
plain greedy (replays of the request's own output, always right and always wrong), a prefix-cache
hit == a miss, and batching and preemption change nothing. Tiny random Llama, Qwen3, Gemma 3
(sliding windows shorter than the prompts), Qwen3.5 (hybrid: its attention layers compressed) and
Gemma 4 (sliding windows and layers reading another layer's K/V) checkpoints."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.doubles import KeyedReplay
from tools.tiny import build_tiny_gemma3, build_tiny_gemma4, build_tiny_qwen3_5, corpus_text
from verispec.cache.paged import kv_bytes_per_token, state_bytes_per_slot
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
FORMATS = ["fp8", "tq4", "tq3"]
# what a pool row of the tiny models (float32, head dim 16) stores: codes' dtype and each format's
# tokens against float32 K/V's (4 bytes a value; fp8: 1 + 1/16, tq: bits / 8 + 4/16)
CODE_DTYPE = {"fp8": kv_fp8.CODE_DTYPE, "tq4": torch.uint8, "tq3": torch.uint8}
MIN_RATIO = {"fp8": 3.5, "tq4": 5.0, "tq3": 5.5}


@pytest.fixture(scope="module")
def model_dirs(tiny_models, tmp_path_factory, tokenizer_dir) -> dict:
    gemma3 = tmp_path_factory.mktemp("kv-gemma3")
    build_tiny_gemma3(gemma3, seed=61, tokenizer_dir=tokenizer_dir, sliding_window=12)
    qwen3_5 = tmp_path_factory.mktemp("kv-qwen3_5")
    build_tiny_qwen3_5(qwen3_5, seed=62, tokenizer_dir=tokenizer_dir)
    gemma4 = tmp_path_factory.mktemp("kv-gemma4")
    build_tiny_gemma4(gemma4, seed=63, tokenizer_dir=tokenizer_dir, num_kv_shared_layers=2)
    return {"llama": tiny_models.get("fp8-llama", "llama", **SHAPE),
            "qwen3": tiny_models.get("fp8-qwen3", "qwen3", head_dim=16, **SHAPE),
            "gemma3": gemma3, "qwen3_5": qwen3_5, "gemma4": gemma4}


def load(model_dir, kv: str = "fp8", **fields) -> Engine:
    fields = dict(dict(max_num_seqs=4, kv_cache_gb=0.02, prefill_step_seconds=0, kv_cache_dtype=kv,
                       prefix_cache=False, dtype="float32"), **fields)
    return Engine.load(EngineConfig(model=str(model_dir), device="cpu", max_model_len=1024, **fields))


def params() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def prompts_of(engine: Engine) -> list[list[int]]:
    ids = engine.tokenizer.encode(corpus_text(20_000))
    return [ids[i * 300:i * 300 + n] for i, n in enumerate(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def reference(model_dirs):
    """{(family, format): (engine, prompts, each prompt's greedy tokens alone)} on a compressed cache."""
    cache = {}

    def get(family: str, kv: str):
        if (family, kv) not in cache:
            engine = load(model_dirs[family], kv)
            prompts = prompts_of(engine)
            cache[family, kv] = engine, prompts, [engine.generate_all(p, params()).token_ids for p in prompts]
        return cache[family, kv]
    return get


@pytest.mark.parametrize("kv", FORMATS)
def test_pools_hold_codes_and_scales_and_more_tokens(model_dirs, kv):
    packed = load(model_dirs["llama"], kv, kv_cache_gb=0.0003)
    plain = load(model_dirs["llama"], "auto", kv_cache_gb=0.0003)
    layer = packed.pools.keys[0]
    assert layer.dtype == CODE_DTYPE[kv] and packed.pools.key_scales[0].shape == layer.shape[:2]
    assert packed.budget.num_tokens >= MIN_RATIO[kv] * plain.budget.num_tokens
    assert packed.describe().kv_cache_dtype == kv and f"({kv})" in packed.describe().cache
    assert plain.describe().kv_cache_dtype == "float32"
    # the compression is real: the logprobs move (the tokens of a tiny random model may not)
    prompt = prompts_of(packed)[0]
    with_logprobs = replace(params(), logprobs=True)
    a = [lp.logprob for lp in packed.generate_all(prompt, with_logprobs).logprobs]
    b = [lp.logprob for lp in plain.generate_all(prompt, with_logprobs).logprobs]
    assert a != b and a == pytest.approx(b, abs=0.5 if kv == "fp8" else 1.5)


def cases(families: list[str], everywhere: tuple[str, ...], first: str) -> list:
    """(family, format) pairs: `everywhere`'s formats on every family, tq4 on `first` alone in the
    quick run (its path is tq3's with 4-bit values) and on the rest under -m slow."""
    pairs = [(family, kv) for family in families for kv in everywhere]
    pairs += [pytest.param(family, "tq4", marks=() if family == first else pytest.mark.slow) for family in families]
    return pairs


@pytest.mark.parametrize("family,kv", cases(["llama", "qwen3", "gemma3", "qwen3_5", "gemma4"], ("fp8", "tq3"), "llama"))
@pytest.mark.parametrize("replay", ["right", "wrong"])
def test_speculative_greedy_is_plain_greedy_on_the_compressed_cache(reference, family, kv, replay):
    base, prompts, alone = reference(family, kv)
    continuations = {tuple(p): a for p, a in zip(prompts, alone)}
    engine = Engine(base.model, base.tokenizer, base.config, base.model_dir,
                    proposer=KeyedReplay(continuations, base.model.vocab_size, wrong_at=lambda i: replay == "wrong"),
                    num_drafts=3)
    results = engine.generate_batch(prompts, params())
    assert [r.token_ids for r in results] == alone, f"{family} {kv} replay {replay}, together"
    assert [engine.generate_all(p, params()).token_ids for p in prompts[:2]] == alone[:2]
    assert (sum(r.stats.accepted for r in results) > 0) == (replay == "right")


@pytest.mark.parametrize("family,kv", cases(["qwen3", "gemma3", "qwen3_5"], ("fp8", "tq3"), "qwen3"))
def test_prefix_hits_batching_and_preemption_change_nothing(model_dirs, reference, family, kv):
    _, prompts, alone = reference(family, kv)
    cached = load(model_dirs[family], kv, prefix_cache=True)
    assert [cached.generate_all(p, params()).token_ids for p in prompts] == alone
    # the same prompts again (whole-prompt hits), and longer ones sharing their blocks (partial hits)
    repeat = [cached.generate_all(p, params()) for p in prompts]
    assert [r.token_ids for r in repeat] == alone
    assert sum(r.stats.cached_tokens for r in repeat) > 0
    longer = [p + p[:len(p) // 2] for p in prompts]
    fresh = load(model_dirs[family], kv)
    assert [cached.generate_all(p, params()).token_ids for p in longer] == \
        [fresh.generate_all(p, params()).token_ids for p in longer]
    assert [r.token_ids for r in fresh.generate_batch(prompts, params())] == alone
    # 8 blocks: the longest request fits, the four together do not (a hybrid's 5 state slots beside them)
    specs = fresh.model.cache_specs()
    budget = 9 * 16 * kv_bytes_per_token(specs, torch.float32, kv) + 5 * state_bytes_per_slot(specs, torch.float32)
    tight = load(model_dirs[family], kv, kv_cache_gb=budget / 2**30)
    assert [r.token_ids for r in tight.generate_batch(prompts, params())] == alone
    assert tight.load_stats()["preemptions"] > 0, "the small cache preempted nobody"


@pytest.mark.parametrize("value,message", [("fp4", "must be one of auto, fp8, tq4, tq3"), ("TQ4", "must be one of")])
def test_bad_kv_cache_dtype_is_one_line_before_loading(value, message):
    with pytest.raises(VerispecError, match=message) as error:
        check_options(EngineConfig(model="nowhere", device="cpu", kv_cache_dtype=value))
    assert "\n" not in str(error.value)


def test_tq_refuses_head_dims_it_cannot_rotate(tiny_models):
    odd = tiny_models.get("tq-llama-d24", "llama", hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with pytest.raises(VerispecError, match="tq4 needs attention head dims that are powers of two.*24"):
        load(odd, "tq4")


@pytest.mark.parametrize("kv", FORMATS)
def test_pools_zero_and_copy_blocks_with_their_scales(model_dirs, kv):
    engine = load(model_dirs["llama"], kv)
    pools = engine.pools
    pools.key_scales[0][16:32] = 7
    pools.copy_block(1, 2)
    assert torch.equal(pools.key_scales[0][32:48], pools.key_scales[0][16:32])
    pools.zero_blocks([2])
    assert not pools.key_scales[0][32:48].any()


@pytest.mark.parametrize("kv", ["fp8", "tq3"])
@pytest.mark.parametrize("replay", ["right", "wrong"])
def test_exact_numerics_hold_on_the_compressed_cache(model_dirs, kv, replay):
    """float16 on a CPU under --numerics exact: tokens and logprobs bit for bit alone, batched, from a
    prefix hit and speculating (every writer encodes and every reader decodes the same values)."""
    base = load(model_dirs["qwen3"], kv, dtype="float16", numerics="exact", prefix_cache=True)
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
