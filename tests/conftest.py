"""Shared fixtures: one tiny tokenizer and a cache of tiny random checkpoints per test session."""
from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU), so tests/kernels
# checks their arithmetic in CI too. Set before any kernel module is imported: @triton.jit reads
# it when it decorates. The engine never launches a Triton kernel on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# what verispec caches (GGUF tokenizers) goes to a directory of this session's, not the user's
os.environ.setdefault("VERISPEC_CACHE_DIR", tempfile.mkdtemp(prefix="verispec-test-cache-"))
# An engine with exact CPU numerics turns oneDNN off for its process as it loads (its float16
# products pick a kernel by row count on AMX / AVX512-FP16 CPUs: models/layers/numerics.py). A
# server has one engine; a test process has hundreds, so off from the start: a test's results then
# do not depend on whether an exact engine loaded before it.
torch.backends.mkldnn.enabled = False


def _interpreter_loop_bounds_fix() -> None:
    """Triton 3.6's interpreter turns a scalar used as a loop bound into an int with
    int(ndarray of shape (1,)), which numpy 2.4 refuses; a kernel whose loop bounds come from its
    inputs (split-K attention) then cannot run there. Same conversion, of the one element."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_verispec_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._verispec_fixed = True
    interpreter._patch_lang_tensor = patched


_interpreter_loop_bounds_fix()


def _interpreter_dot_row_by_row() -> None:
    """The interpreter's tl.dot is numpy's matmul, which hands BLAS a kernel chosen by the operands'
    shapes (and the CPU's instruction set): a one-row product and a four-row one sum in different
    orders, so a row's bits would depend on its neighbours' count, which the GPU kernels are
    tested not to do. np.einsum (no BLAS) sums each output element over k in one fixed order."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_verispec_fixed", False):
        return

    def widened(handle):
        # bfloat16 is held as its 16 bits in a uint16 array (numpy has no bfloat16): the float32
        # with those high bits is the same value
        if handle.dtype.is_bf16():
            return (handle.data.astype(np.uint32) << 16).view(np.float32)
        return handle.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = widened(a), widened(b)
        if a_data.dtype != out.data.dtype or b_data.dtype != out.data.dtype:
            return out  # fp8 operands (converted inside the original): keep its product
        product = np.einsum("...ik,...kj->...ij", a_data, b_data, dtype=out.data.dtype, optimize=False)
        return interpreter.TensorHandle(product + d.data, out.dtype)

    create_dot._verispec_fixed = True
    builder.create_dot = create_dot


_interpreter_dot_row_by_row()

from tools.tiny import build_tiny_model, build_tokenizer

# Saving a fixture checkpoint draws a "Writing model shards" bar on stderr where a test may be
# capturing a CLI's output (CI's stderr is not a terminal, but tqdm draws anyway).
import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()

# Tiny models run as fast on one thread, and multi-threaded OpenMP collapses when the CI machine's
# few cores are busy (measured on 2 busy cores: tests/unit + tests/models 110 s -> 10 s).
torch.set_num_threads(1)


class TinyModels:
    """Builds tiny Hugging Face checkpoints on first request and reuses them for the session.

    `build_tiny_model` sets every norm weight to 1.0, which would hide a norm weight that is
    never applied (or q_norm/k_norm swapped), so the norm weights are re-drawn and the checkpoint
    saved again. `modify(model)`, when given, edits the transformers model before that save.
    """

    def __init__(self, root: Path, tokenizer_dir: Path):
        self.root = root
        self.tokenizer_dir = tokenizer_dir
        self._dirs: dict[str, Path] = {}

    def get(self, name: str, model_type: str, extra_vocab: int = 0, modify=None, **overrides) -> Path:
        if name not in self._dirs:
            out = self.root / name
            seed = zlib.crc32(name.encode())  # the same weights whichever tests run first
            model = build_tiny_model(out, model_type, seed=seed, tokenizer_dir=self.tokenizer_dir,
                                     extra_vocab=extra_vocab, **overrides)
            gen = torch.Generator().manual_seed(seed + 1)
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "norm" in pname:
                        p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
                if modify is not None:
                    modify(model)
            # save_pretrained rewrites generation_config.json from the model; keep build_tiny_model's
            gen_config = (out / "generation_config.json").read_text()
            model.save_pretrained(str(out))
            (out / "generation_config.json").write_text(gen_config)
            self._dirs[name] = out
        return self._dirs[name]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("models"), tokenizer_dir)


@pytest.fixture(scope="session")
def qwen3_dir(tiny_models) -> Path:
    """The default small model for engine-level tests (GQA, q/k norms)."""
    return tiny_models.get("qwen3", "qwen3")


# Parametrized cases kept out of `make test` for time (the default suite stays near 7 minutes on
# 2 cores): each feature keeps a quick case there; `make test-slow` (and CI) runs these too.
SLOW_CASES = {
    "tests/spec/test_identity.py::test_eagle3_random_drafter_identity[full-llama]",  # offset-llama stays
    "tests/unit/test_fused_ops.py::test_hybrid_rewrites_same_outputs",
    "tests/engine/test_tensor_parallel_families.py::test_two_ranks_give_the_whole_models_output[gemma4-moe]",
    "tests/spec/test_identity.py::test_eagle3_random_drafter_identity[offset-qwen3]",
    "tests/spec/test_identity.py::test_eagle3_random_drafter_identity[offset-qwen2]",
    "tests/spec/test_identity.py::test_eagle3_random_drafter_identity[full-qwen3]",
    "tests/spec/test_identity.py::test_eagle3_random_drafter_identity[full-qwen2]",
    "tests/spec/test_mtp_identity.py::test_identity_random_head[hf-sidecar]",
    "tests/spec/test_mtp_identity.py::test_identity_random_head[mlx-sidecar]",
    "tests/spec/test_gemma4_eagle3.py::test_eagle3_random_drafter_identity[moe_wrapper]",
    "tests/spec/test_gemma4_eagle3.py::test_eagle3_random_drafter_identity[dense]",
    "tests/spec/test_gemma4_eagle3.py::test_partly_right_proposer[dense-2]",
    "tests/spec/test_gemma4_eagle3.py::test_partly_right_proposer[dense-3]",
    "tests/spec/test_gemma3_eagle3.py::test_eagle3_random_drafter_identity[text]",
    "tests/spec/test_identity.py::test_eagle3_random_drafter_identity[offset-llama]",
    *(f"tests/spec/test_gemma4_eagle3.py::test_partly_right_proposer[moe_wrapper-{k}]" for k in (1, 2, 3, 4)),
    "tests/spec/test_gemma3_eagle3.py::test_eagle3_random_drafter_identity[wrapper]",
    "tests/engine/test_tensor_parallel.py::test_two_ranks_give_the_whole_models_output[llama]",
    "tests/engine/test_tensor_parallel_families.py::test_two_ranks_give_the_whole_models_output[gemma3]",
    "tests/engine/test_tensor_parallel_families.py::test_two_ranks_give_the_whole_models_output[gemma4]",
    "tests/engine/test_tensor_parallel_families.py::test_two_ranks_give_the_whole_models_output[qwen3_5_moe]",
    "tests/engine/test_tensor_parallel_quantized.py::test_a_quantized_checkpoint_sharded_at_load_gives_its_unsharded_output[8bit]",
    "tests/engine/test_prefix_cache.py::test_gemma4_with_assistant[True]",
    "tests/engine/test_compressed_kv_cache.py::test_prefix_hits_batching_and_preemption_change_nothing[gemma3-tq3]",
    "tests/engine/test_compressed_kv_cache.py::test_prefix_hits_batching_and_preemption_change_nothing[gemma3-fp8]",
    *(f"tests/engine/test_cpu_exact_numerics.py::test_repeated_batched_and_partially_cached_requests_are_the_request_alone"
      f"[{case}]" for case in ("qwen3_5-bfloat16", "qwen3-float16", "llama-float16")),
    "tests/engine/test_tensor_parallel_families.py::test_two_ranks_give_the_whole_models_output[qwen3_5]",
    "tests/engine/test_tensor_parallel_families.py::test_two_ranks_give_the_whole_models_output[qwen3_moe]",
    "tests/spec/test_gemma4_eagle3.py::test_partly_right_proposer[dense-4]",
    "tests/spec/test_gemma3_eagle3.py::test_always_right_and_partly_right_proposers[wrapper-1]",
}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    collected = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in collected}
    stale = sorted(c for c in SLOW_CASES if c.split("::")[0] in files and c not in collected)
    if stale and not config.option.keyword:  # a -k run collects a file's other cases too
        raise pytest.UsageError(f"tests/conftest.py SLOW_CASES names cases that do not exist: {stale}")
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
