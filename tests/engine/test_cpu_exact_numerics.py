"""Exact numerics on the CPU in float16 and bfloat16: a request's tokens and logprobs are bit for bit
the same alone, repeated (a full prefix-cache hit), after a partial hit, beside 2 or 7 others, with
16-token prompt chunks, under preemption, and speculating with replays of its own output that are
always right and always wrong. Tiny random Llama, Qwen3, Qwen3.5 hybrid (its Gated DeltaNet prompt
chunks stepping token by token, as decode steps do), Gemma 3 (sliding windows), Gemma 4 dense and
MoE, and Qwen3-MoE checkpoints (routed experts: each expert's rows one product, summed into their
tokens in expert order, whatever else is in the pass)."""
from __future__ import annotations

import pytest
import torch

from tests.doubles import KeyedReplay
from tests.exact_checks import check, corpus_prompts, greedy_with_logprobs, record
from tools.tiny import build_tiny_gemma3, build_tiny_gemma4, build_tiny_qwen3_5
from verispec.config import EngineConfig
from verispec.engine.engine import Engine
from verispec.sampling.params import SamplingParams

NEW_TOKENS = 24
PROMPT_TOKENS = [17, 70, 129, 250, 33, 190, 96, 5]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
FAMILIES = ["llama", "qwen3", "qwen3_5", "gemma3", "gemma4", "gemma4_moe", "qwen3_moe"]
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[1])
DTYPES = ["float16", "bfloat16"]


@pytest.fixture(scope="module")
def model_dirs(tiny_models, tmp_path_factory, tokenizer_dir) -> dict:
    root = tmp_path_factory.mktemp("exact-families")
    build_tiny_qwen3_5(root / "qwen3_5", seed=41, tokenizer_dir=tokenizer_dir)
    build_tiny_gemma3(root / "gemma3", seed=43, tokenizer_dir=tokenizer_dir)
    build_tiny_gemma4(root / "gemma4", seed=44, tokenizer_dir=tokenizer_dir)
    build_tiny_gemma4(root / "gemma4_moe", moe=True, seed=45, tokenizer_dir=tokenizer_dir)
    return {"llama": tiny_models.get("exact-llama", "llama", **SHAPE),
            "qwen3": tiny_models.get("exact-qwen3", "qwen3", head_dim=16, **SHAPE),
            "qwen3_moe": tiny_models.get("exact-qwen3-moe", "qwen3_moe", head_dim=16, **SHAPE, **MOE),
            **{family: root / family for family in ("qwen3_5", "gemma3", "gemma4", "gemma4_moe")}}


def load(model_dir, dtype: str, **fields) -> Engine:
    # prefill_step_seconds=0: chunks follow --prefill-step-size, not the host's speed
    fields = dict(dict(max_num_seqs=8, kv_cache_gb=0.02, prefill_step_seconds=0, numerics="exact"), **fields)
    return Engine.load(EngineConfig(model=str(model_dir), dtype=dtype, device="cpu", max_model_len=1024, **fields))


def params() -> SamplingParams:
    return greedy_with_logprobs(NEW_TOKENS)


def prompts_of(engine: Engine) -> list[list[int]]:
    return corpus_prompts(engine.tokenizer, PROMPT_TOKENS)


@pytest.fixture(scope="module")
def reference(model_dirs):
    """{(family, dtype): (engine, prompts, each prompt generated alone, first in a fresh engine)}."""
    cache = {}

    def get(family: str, dtype: str):
        if (family, dtype) not in cache:
            engine = load(model_dirs[family], dtype)
            assert engine.describe().numerics == "exact"
            prompts = prompts_of(engine)
            cache[family, dtype] = engine, prompts, [record(engine.generate_all(p, params())) for p in prompts]
        return cache[family, dtype]
    return get


def test_cpu_reports_exact_only_where_it_holds(model_dirs, tmp_path, tokenizer_dir):
    assert load(model_dirs["llama"], "float16").describe().numerics == "exact"
    assert load(model_dirs["llama"], "bfloat16").describe().numerics == "exact"
    assert load(model_dirs["llama"], "float16", numerics="fast").describe().numerics == "fast"
    # on a CPU exact prompts cost prefill time: the default asks for them only on CUDA
    assert load(model_dirs["llama"], "float16", numerics="auto").describe().numerics == "fast"
    assert load(model_dirs["llama"], "float32").describe().numerics == "fast"
    # a hybrid's prompt chunks step token by token under exact numerics; auto leaves a CPU on fast
    assert load(model_dirs["qwen3_5"], "float16").describe().numerics == "exact"
    assert load(model_dirs["qwen3_5"], "float16", numerics="auto").describe().numerics == "fast"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_repeated_batched_and_partially_cached_requests_are_the_request_alone(model_dirs, reference, family, dtype):
    engine, prompts, alone = reference(family, dtype)
    check([record(engine.generate_all(p, params())) for p in prompts], alone, "repeated (full prefix hits)")
    check([record(r) for r in engine.generate_batch(prompts, params())], alone, "all 8 together")
    for first in (0, 3, 5):
        group = prompts[first:first + 3]
        check([record(r) for r in engine.generate_batch(group, params())], alone[first:first + 3], "3 together")
    # a partial hit: each prompt's first part is cached (by the runs above), its new tail is not
    longer = [p + p[: len(p) // 2] for p in prompts]
    fresh = load(model_dirs[family], dtype, prefix_cache=False)
    want = [record(fresh.generate_all(p, params())) for p in longer]
    check([record(engine.generate_all(p, params())) for p in longer], want, "partial prefix hits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["chunks-of-16", "preempted"])
def test_engine_settings_do_not_change_a_request(model_dirs, reference, family, dtype, case):
    _, prompts, alone = reference(family, dtype)
    # a cache that holds the longest request but not the batch: the hybrid has one attention layer in
    # four, so a token takes fewer bytes of it; the Gemmas' take more
    small = {"qwen3_5": 0.0001, "gemma3": 0.00023, "gemma4": 0.00023, "gemma4_moe": 0.00023}.get(family, 0.0002)
    fields = {"chunks-of-16": dict(prefill_step_size=16), "preempted": dict(kv_cache_gb=small)}[case]
    engine = load(model_dirs[family], dtype, **fields)
    check([record(r) for r in engine.generate_batch(prompts, params())], alone, case)
    if case == "preempted":
        assert engine.load_stats()["preemptions"] > 0, "the small cache preempted nobody"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("replay", ["right", "wrong"])
def test_speculation_does_not_change_a_request(reference, family, dtype, replay):
    base, prompts, alone = reference(family, dtype)
    continuations = {tuple(p): a[0] for p, a in zip(prompts, alone)}
    engine = Engine(base.model, base.tokenizer, base.config, base.model_dir,
                    proposer=KeyedReplay(continuations, base.model.vocab_size, wrong_at=lambda i: replay == "wrong"),
                    num_drafts=3)
    results = engine.generate_batch(prompts, params())
    check([record(r) for r in results], alone, f"replay {replay}, together")
    check([record(engine.generate_all(p, params())) for p in prompts[:3]], alone[:3], f"replay {replay}, alone")
    assert (sum(r.stats.accepted for r in results) > 0) == (replay == "right")


def test_fast_numerics_differ_where_exact_do_not(model_dirs):
    """The checks above have teeth: under --numerics fast in float32, where a one-row product runs
    another kernel than a wider one, the same requests batched change some request's bits."""
    engine = load(model_dirs["qwen3"], "float32", numerics="fast")
    prompts = prompts_of(engine)
    alone = [record(engine.generate_all(p, params())) for p in prompts]
    assert [record(r) for r in engine.generate_batch(prompts, params())] != alone


def test_exact_cpu_numerics_run_without_onednn(monkeypatch):
    """oneDNN's float16/bfloat16 products pick a kernel by row count on AMX / AVX512-FP16 CPUs (one
    row alone and the same row in a verify pass got other bits there): an exact CPU engine turns it
    off as it loads; fast numerics and CUDA leave it as it is."""
    from verispec.models.layers import numerics

    monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)
    numerics.keep_cpu_products_row_invariant("fast", "cpu")
    numerics.keep_cpu_products_row_invariant("exact", "cuda")
    assert torch.backends.mkldnn.enabled
    numerics.keep_cpu_products_row_invariant("exact", "cpu")
    assert not torch.backends.mkldnn.enabled
