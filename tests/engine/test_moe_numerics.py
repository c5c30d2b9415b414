"""Which numerics a mixture-of-experts model runs: float experts take exact numerics on a CPU (each
expert's rows one product, summed into their tokens in expert order: tests/engine/test_cpu_exact_numerics.py
holds it to bits) and where the row-invariant expert kernels run (CUDA with Triton); quantized
experts stay fast (their GEMV is chosen by the pass's token count)."""
from __future__ import annotations

import pytest
import torch

from tests.models.test_qwen_moe import QWEN3_MOE
from verispec.kernels import expert_gemv
from verispec.loading.model_loader import load_model, resolve_numerics
from verispec.models.layers.exact import use_row_invariant_experts
from verispec.models.layers.moe import FusedExperts
from verispec.quant.in_memory import quantize_model_


@pytest.fixture
def model(tiny_models):
    return load_model(tiny_models.get("qwen3_moe", "qwen3_moe", **QWEN3_MOE), torch.bfloat16, torch.device("cpu"))


def test_float_experts_are_exact_on_a_cpu_and_where_their_kernels_run(model, monkeypatch):
    assert resolve_numerics(model, "exact") == ("exact", None)  # a CPU: the loop over experts
    numerics, reason = resolve_numerics(model, "auto")
    assert numerics == "fast" and "on a CPU" in reason  # as for dense models: exact prompts cost prefill time
    monkeypatch.setattr(expert_gemv, "available", lambda device: True)
    assert resolve_numerics(model, "exact") == ("exact", None)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and not any(m.exact for m in experts)
    assert use_row_invariant_experts(model) == len(experts) and all(m.exact for m in experts)


def test_quantized_experts_stay_fast(model, monkeypatch):
    quantize_model_(model, "mlx-4bit", group_size=32)  # the experts too (intermediate 32)
    monkeypatch.setattr(expert_gemv, "available", lambda device: True)
    numerics, reason = resolve_numerics(model, "exact")
    assert numerics == "fast" and "quantized experts" in reason


def test_auto_leaves_float_experts_fast_and_exact_turns_them_exact():
    from verispec.models.layers import numerics

    numerics_auto, reason = numerics.resolve("auto", "cuda", torch.bfloat16, float_experts=True)
    assert numerics_auto == "fast" and "--numerics exact" in reason
    assert numerics.resolve("exact", "cuda", torch.bfloat16, float_experts=True) == ("exact", None)
    assert numerics.resolve("auto", "cuda", torch.bfloat16) == ("exact", None)  # dense: unchanged
