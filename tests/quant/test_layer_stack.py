"""The CPU layer kernel (quant/layer_stack.py, quant/kernels/cpu_layers.c) on tiny GGUF files
(Llama Q4_1, Qwen2 Q8_0 with q/k/v biases and a tied head, Qwen3 Q4_0 with q/k norms), float16
and bfloat16: the logits of the torch layers it replaces (the same products and rounding points,
so only float32 sums differ) and of transformers in float32 from the same file (the oracle; within
the activations' dtype), and a row's bits whatever pass computes it: a prompt at once, in chunks,
token by token, beside other sequences."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.gguf.files import write_gguf
from tests.models.family_checks import hf_logits, random_ids
from verispec.cache.paged import BatchCache, PagedPools
from verispec.engine.engine import load_engine
from verispec.quant import layer_stack
from verispec.quant.kernels import cpu_layers

pytestmark = pytest.mark.skipif(cpu_layers.failure() is not None, reason=f"no kernel: {cpu_layers.failure()}")

CASES = [("llama", "Q4_1"), ("qwen2", "Q8_0"), ("qwen3", "Q4_0")]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
BLOCK = 16
PROMPT = 40  # spans three blocks
# the torch layers against the kernel: the same roundings, float32 sums in another order (norms,
# attention): measured up to 0.008 (float16) and 0.09 (bfloat16) on logits up to ~6
TORCH_ATOL = {torch.float16: 0.02, torch.bfloat16: 0.15}
# transformers in float32 against either (the activations rounded to the dtype at every layer):
# measured up to 0.021 and 0.22, the torch layers alike
HF_ATOL = {torch.float16: 0.04, torch.bfloat16: 0.3}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    root = tmp_path_factory.mktemp("stack-gguf")
    return {(arch, qtype): write_gguf(root / f"{arch}-{qtype}", arch, qtype, tokenizer, seed=11, tie=arch == "qwen2")
            for arch, qtype in CASES}


def hf_from_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def engine_for(files, arch, qtype, dtype, **fields):
    return load_engine(str(files[arch, qtype].path), dtype=dtype, device="cpu", prefill_step_size=16, **fields)


class Pass:
    """One sequence's tokens through the model in passes of the given sizes on a paged cache."""

    def __init__(self, model, num_sequences: int = 1):
        self.model = model
        dtype = model.model.norm.weight.dtype
        self.pools = PagedPools(model.cache_specs(), 1 + 8 * num_sequences, BLOCK, 1, dtype, "cpu")
        self.tables = torch.arange(1, 1 + 8 * num_sequences).view(num_sequences, 8)

    @torch.inference_mode()
    def logits(self, ids: list[list[int]], starts: list[int]) -> torch.Tensor:
        """ids [B][T] at positions starts[b].. -> logits [B, T, V] (every row real)."""
        t = len(ids[0])
        positions = torch.tensor([[s + j for j in range(t)] for s in starts])
        cache = BatchCache(self.pools, self.tables[:len(ids)], positions, None, max(starts) + t,
                           row_starts=starts, row_lengths=[t] * len(ids))
        return self.model.logits(self.model(torch.tensor(ids), positions, cache).hidden).float()


def in_passes(model, ids: list[int], sizes: list[int]) -> torch.Tensor:
    runner, out, start = Pass(model), [], 0
    for size in sizes:
        out.append(runner.logits([ids[start:start + size]], [start])[0])
        start += size
    return torch.cat(out)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch, qtype", CASES, ids=[f"{a}-{q}" for a, q in CASES])
def test_the_kernel_gives_the_torch_layers_and_transformers_logits(files, arch, qtype, dtype):
    engine = engine_for(files, arch, qtype, dtype)
    model = engine.model
    assert isinstance(model.layer_stack, layer_stack.LayerStack)
    ids = random_ids(PROMPT, model.vocab_size, seed=5)
    stack = model.layer_stack
    model.layer_stack = counted = mock.Mock(wraps=stack)
    got = in_passes(model, ids, [PROMPT])
    assert counted.called, "the pass did not run the kernel"
    model.layer_stack = None
    torch_layers = in_passes(model, ids, [PROMPT])
    model.layer_stack = stack
    torch.testing.assert_close(got, torch_layers, atol=TORCH_ATOL[DTYPES[dtype]], rtol=0)
    hf = hf_logits(hf_from_gguf(files[arch, qtype].path), ids)
    torch.testing.assert_close(got, hf, atol=HF_ATOL[DTYPES[dtype]], rtol=0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch, qtype", CASES, ids=[f"{a}-{q}" for a, q in CASES])
def test_a_rows_bits_do_not_depend_on_the_pass(files, arch, qtype, dtype):
    model = engine_for(files, arch, qtype, dtype).model
    ids = random_ids(PROMPT, model.vocab_size, seed=6)
    whole = in_passes(model, ids, [PROMPT])
    assert torch.equal(in_passes(model, ids, [16, 16, 8]), whole)
    assert torch.equal(in_passes(model, ids, [3, 1, 4, 1, 5, 9, 2, 6, 5, 4]), whole)
    assert torch.equal(in_passes(model, ids, [1] * PROMPT), whole)
    # beside other sequences at other positions: sequence 1 of 3, its rows between theirs
    runner = Pass(model, num_sequences=3)
    others = [random_ids(PROMPT, model.vocab_size, seed=s) for s in (7, 8)]
    runner.logits([others[0][:20], ids[:20], others[1][:20]], [0, 0, 0])
    runner.logits([others[0][20:30], ids[20:30], others[1][20:30]], [20, 20, 20])
    tail = runner.logits([others[0][30:], ids[30:], others[1][30:]], [30, 30, 30])[1]
    assert torch.equal(tail, whole[30:])


def test_the_engine_is_exact_with_the_kernel_and_speculation_keeps_its_text(files):
    """Served: `auto` numerics on a CPU are exact where the kernel runs every layer (no slower
    prompts to pay for), and an always-right and always-wrong replay keep plain greedy output."""
    from tests.doubles import KeyedReplay
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    base = engine_for(files, "llama", "Q4_1", "float16", numerics="auto")
    assert base.describe().numerics == "exact"
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [random_ids(n, base.model.vocab_size, seed=n) for n in (9, 33, 17)]
    alone = [base.generate_all(p, params).token_ids for p in prompts]
    assert [r.token_ids for r in base.generate_batch(prompts, params)] == alone
    for wrong in (False, True):
        engine = Engine(base.model, base.tokenizer, base.config, base.model_dir, num_drafts=3,
                        proposer=KeyedReplay({tuple(p): a for p, a in zip(prompts, alone)}, base.model.vocab_size,
                                             wrong_at=lambda i, wrong=wrong: wrong))
        results = engine.generate_batch(prompts, params)
        assert [r.token_ids for r in results] == alone
        assert (sum(r.stats.accepted for r in results) > 0) == (not wrong)


def test_models_and_caches_the_kernel_does_not_take(files):
    model = engine_for(files, "llama", "Q4_1", "float32").model
    assert model.layer_stack is None
    stack, reason = layer_stack.build(model)
    assert stack is None and "float32" in reason  # logged under VERISPEC_DEBUG=1 at load
    stack = engine_for(files, "llama", "Q4_1", "float16").model.layer_stack
    inputs = lambda cache: type("Inputs", (), {"paged": True, "cache": cache})()  # noqa: E731
    specs = model.cache_specs()
    assert stack.takes(inputs(type("Cache", (), {"pools": PagedPools(specs, 4, BLOCK, 1, torch.float16, "cpu")})()))
    fp8 = PagedPools(specs, 4, BLOCK, 1, torch.float16, "cpu", kv_cache_dtype="fp8")
    assert not stack.takes(inputs(type("Cache", (), {"pools": fp8})()))  # fp8 rows: the torch layers decode them
    assert not stack.takes(type("Inputs", (), {"paged": False})())  # the contiguous cache
    # a tensor-parallel shard's products are all-reduced between the ops: the torch layers run it
    from verispec.models.layers.parallel import Shard, make_row_parallel

    sharded = engine_for(files, "llama", "Q4_1", "float16").model
    make_row_parallel(sharded.model.layers[0].self_attn.o_proj, Shard(rank=0, world_size=1))
    stack, reason = layer_stack.build(sharded)
    assert stack is None and "tensor-parallel" in reason


def test_the_weights_are_held_once_and_the_tied_table_reads_the_heads_blocks(files):
    """Once the integer-dot blocks serve every pass the checkpoint's tensors are dropped (a CPU
    load holds the weights once); the tied Q8_0 table then looks its rows up in the head's blocks,
    and they are the `gguf` library's dequantized rows."""
    import gguf
    from gguf.quants import dequantize

    from verispec.quant.layers.linear import MLXAffineEmbedding, QuantizedLinear

    model = engine_for(files, "qwen2", "Q8_0", "float16").model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.qdot_blocks is not None and m.released() for m in layers)
    table = model.model.embed_tokens
    assert isinstance(table, MLXAffineEmbedding) and table.weight.numel() == 0
    assert table.qdot_blocks is model.lm_head.qdot_blocks
    reader = gguf.GGUFReader(str(files["qwen2", "Q8_0"].path))
    stored = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(dequantize(stored.data, stored.tensor_type)).half()
    with torch.inference_mode():
        rows = table(torch.arange(expected.shape[0]))
    assert torch.equal(rows, expected)
    assert torch.equal(model.lm_head.dequantized_weight(torch.float16), expected)


def test_a_cpu_server_process_imports_no_compiler_stack(files):
    """A CPU engine on a GGUF file (its tokenizer cached) loads without Triton, dynamo or
    transformers' model code: ~170 MiB of a small model's process that it never runs."""
    import os
    import subprocess
    import sys

    path = files["qwen2", "Q8_0"].path
    engine_for(files, "qwen2", "Q8_0", "float16")  # the tokenizer is built and cached
    script = ("import sys; from verispec.engine.engine import load_engine; "
              f"e = load_engine({str(path)!r}, dtype='float16', device='cpu'); "
              "print(sorted(m for m in ('triton', 'torch._dynamo', 'sympy', 'transformers.models.auto') "
              "if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
