"""Exact numerics on CUDA in bfloat16: a request's tokens and logprobs are bit for bit the same
alone, repeated (a full prefix-cache hit), after a partial hit, beside 2 or 7 others, with 64-token
prompt chunks, without the prefix cache, under preemption, eagerly (prompt chunks and decode steps
without CUDA graphs), and speculating with replays of
its own output that are always right and always wrong. Llama, Qwen3 (q/k norms), Gemma 3 (sliding
windows, soft-capped logits), Gemma 4 dense and MoE, Qwen3 in MLX 4- and 8-bit (their exact kernels, and decoded to bf16 as
`auto` runs a small quantized model), the Qwen3.5 hybrid and Qwen3-MoE (routed experts), tiny
random checkpoints with the engine's real kernels."""
from __future__ import annotations

import pytest
import torch

from tests.exact_checks import check, corpus_prompts, greedy_with_logprobs, record
from tests.gpu.replay import KeyedReplay
from tools.tiny import build_tiny_gemma3, build_tiny_gemma4, build_tiny_model, build_tiny_qwen3_5
from verispec.cli import main as cli_main
from verispec.config import EngineConfig
from verispec.engine.engine import Engine
from verispec.models.layers import numerics
from verispec.quant import dense
from verispec.sampling.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW_TOKENS = 48
PROMPT_TOKENS = [17, 70, 129, 250, 300, 33, 190, 96]
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)
# Qwen3 quantized (`verispec quantize`): its layers run quant/kernels/exact.py; "-decoded": the same
# checkpoint under --numerics auto, whose layers a small model has decoded to bfloat16 (quant/dense.py)
# "qwen3_5": the hybrid, whose Gated DeltaNet prompt chunks step token by token under exact numerics
# "qwen3_moe": routed experts on the union kernel (up to 16 tokens) and the grouped one (more)
FAMILIES = ["llama", "qwen3", "gemma3", "qwen3-mlx-4bit", "qwen3-mlx-8bit", "qwen3-mlx-4bit-decoded", "qwen3_5",
            "qwen3_moe", "gemma4", "gemma4_moe"]
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[2])


@pytest.fixture(scope="module")
def root(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("gpu-exact")
    build_tiny_model(root / "llama", "llama", tokenizer_dir=tokenizer_dir, **SHAPE)
    build_tiny_model(root / "qwen3", "qwen3", tokenizer_dir=tokenizer_dir, head_dim=64, **SHAPE)
    build_tiny_gemma3(root / "gemma3", tokenizer_dir=tokenizer_dir, hidden_size=256, intermediate_size=512,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    build_tiny_qwen3_5(root / "qwen3_5", seed=41, tokenizer_dir=tokenizer_dir)
    build_tiny_model(root / "qwen3_moe", "qwen3_moe", tokenizer_dir=tokenizer_dir, head_dim=64, **SHAPE, **MOE)
    build_tiny_gemma4(root / "gemma4", seed=44, tokenizer_dir=tokenizer_dir)
    build_tiny_gemma4(root / "gemma4_moe", moe=True, seed=45, tokenizer_dir=tokenizer_dir)
    for quant in ("mlx-4bit", "mlx-8bit"):
        assert cli_main(["quantize", "-m", str(root / "qwen3"), "--format", quant, "--out",
                         str(root / f"qwen3-{quant}")]) == 0
    return root


def load(root, family: str, **fields) -> Engine:
    decoded = family.endswith("-decoded")
    fields = dict(dict(max_num_seqs=8, kv_cache_gb=0.25, numerics="auto" if decoded else "exact"), **fields)
    with pytest.MonkeyPatch.context() as patch:
        if not decoded:  # the quantized layers' own exact kernels, not a decoded copy
            patch.setattr(numerics, "SMALL_MODEL_BYTES", 0)
        engine = Engine.load(EngineConfig(model=str(root / family.removesuffix("-decoded")), dtype="bfloat16",
                                          device="cuda", max_model_len=1024, **fields))
    assert engine.describe().numerics == "exact"
    assert dense.has_decodable_layers(engine.model) == ("mlx" in family and not decoded)
    if engine.config.cuda_graphs:
        engine.capture_graphs()
        # prompt chunks replay graphs wherever rows are independent of their pass
        assert (engine.runner.prompt_graphs is None) == (family == "qwen3_5")
    return engine


def params() -> SamplingParams:
    return greedy_with_logprobs(NEW_TOKENS)


def prompts_of(engine: Engine) -> list[list[int]]:
    return corpus_prompts(engine.tokenizer, PROMPT_TOKENS)


@pytest.fixture(scope="module")
def reference(root):
    """{family: (prompts, each prompt generated alone, first in a fresh engine)}."""
    cache = {}

    def get(family: str):
        if family not in cache:
            engine = load(root, family)
            prompts = prompts_of(engine)
            cache[family] = engine, prompts, [record(engine.generate_all(p, params())) for p in prompts]
        return cache[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_repeated_batched_and_partially_cached_requests_are_the_request_alone(root, reference, family):
    engine, prompts, alone = reference(family)
    check([record(engine.generate_all(p, params())) for p in prompts], alone, "repeated (full prefix hits)")
    check([record(r) for r in engine.generate_batch(prompts, params())], alone, "all 8 together")
    for first in (0, 3, 5):
        group = prompts[first:first + 3]
        check([record(r) for r in engine.generate_batch(group, params())], alone[first:first + 3], "3 together")
    # a partial hit: each prompt's first half is cached (by the runs above), its new tail is not
    longer = [p + p[: len(p) // 2] for p in prompts]
    fresh = load(root, family, prefix_cache=False)
    want = [record(fresh.generate_all(p, params())) for p in longer]
    check([record(engine.generate_all(p, params())) for p in longer], want, "partial prefix hits")


def settings_cases():
    for family in FAMILIES:
        for case in ("chunks-of-64", "no-prefix-cache", "eager", "preempted"):
            # Gemma 3's and 4's sliding layers keep a window's blocks only: no cache that holds its
            # longest request alone preempted any of the 8 on the H200 (their preemption is tested on
            # the CPU, as the hybrid's, whose state slots take most of a cache that small)
            if case != "preempted" or family not in ("gemma3", "gemma4", "gemma4_moe", "qwen3_5"):
                yield pytest.param(family, case, id=f"{case}-{family}")


@pytest.mark.parametrize("family,case", list(settings_cases()))
def test_engine_settings_do_not_change_a_request(root, reference, family, case):
    _, prompts, alone = reference(family)
    if case == "preempted":  # caches too small for all 8 at once (families differ in bytes a token)
        for gb in (0.0015, 0.001, 0.0008, 0.0007, 0.0006, 0.0005):
            engine = load(root, family, kv_cache_gb=gb)
            if engine.max_model_len < max(map(len, prompts)) + NEW_TOKENS:
                break  # the cache no longer holds the longest request alone
            check([record(r) for r in engine.generate_batch(prompts, params())], alone, f"{case} ({gb} GiB)")
            if engine.load_stats()["preemptions"] > 0:
                return
        pytest.fail("no cache size that holds the longest request preempted anybody")
    fields = {"chunks-of-64": dict(prefill_step_size=64), "no-prefix-cache": dict(prefix_cache=False),
              "eager": dict(cuda_graphs=False)}[case]
    engine = load(root, family, **fields)
    check([record(r) for r in engine.generate_batch(prompts, params())], alone, case)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("replay", ["right", "wrong"])
def test_speculation_does_not_change_a_request(reference, family, replay):
    base, prompts, alone = reference(family)
    continuations = {tuple(p): a[0] for p, a in zip(prompts, alone)}
    engine = Engine(base.model, base.tokenizer, base.config, base.model_dir,
                    proposer=KeyedReplay(continuations, base.model.vocab_size, wrong_at=lambda i: replay == "wrong"),
                    num_drafts=3)
    engine.capture_graphs()
    check([record(r) for r in engine.generate_batch(prompts, params())], alone, f"replay {replay}, together")
    check([record(engine.generate_all(p, params())) for p in prompts[:3]], alone[:3], f"replay {replay}, alone")


def test_prompt_chunks_replayed_from_graphs_are_the_eager_passes_bits(root):
    """Chunks at, under and over the graphs' buckets (engine/prompt_graphs.py), up to the longest
    prompt the engine's 1,024-token context takes, against an engine without CUDA graphs."""
    graphed, eager = load(root, "llama"), load(root, "llama", cuda_graphs=False)
    lengths = [1, 15, 16, 17, 255, 256, 257, 700, 768, 1024 - NEW_TOKENS]
    assert graphed.runner.prompt_graphs.get(1, lengths[-1]) is not None
    prompts = corpus_prompts(graphed.tokenizer, lengths)
    assert [len(p) for p in prompts] == lengths
    check([record(graphed.generate_all(p, params())) for p in prompts],
          [record(eager.generate_all(p, params())) for p in prompts], "prompt passes from graphs")


def test_several_sequences_prompt_chunks_replayed_from_graphs_are_the_eager_passes_bits(root):
    """Eight prompts of different lengths arriving together (engine/prompt_graphs.py: one pass of
    several sequences, each padded to the chunk bucket and the batch bucket) against each prompt
    alone on an engine without CUDA graphs; and the passes did replay graphs of several sequences."""
    graphed, eager = load(root, "llama"), load(root, "llama", cuda_graphs=False)
    lengths = [3, 17, 40, 64, 100, 130, 200, 250]
    prompts = corpus_prompts(graphed.tokenizer, lengths)
    passes = []
    replay = graphed.runner._graphed_prefill

    def counted(graphed_pass, seqs, *args):
        passes.append((graphed_pass.num_seqs, len(seqs)))
        return replay(graphed_pass, seqs, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graphed.runner, "_graphed_prefill", counted)
        together = [record(r) for r in graphed.generate_batch(prompts, params())]
    assert any(n > 1 for _, n in passes), passes
    check(together, [record(eager.generate_all(p, params())) for p in prompts], "several prompts from graphs")
