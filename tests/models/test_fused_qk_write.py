"""The fused attention prologue end to end: with queries and keys prepared by kernels/qk_prep.py
(run here by Triton's interpreter, tests/conftest.py), which also writes the keys and values into
the engine's paged cache, greedy output equals the unfused model's, token for token."""
from __future__ import annotations

import pytest
import torch

from verispec.engine.engine import load_engine
from verispec.engine.params import SamplingParams
from verispec.kernels import qk_prep
from verispec.models.layers import fused

pytestmark = pytest.mark.skipif(qk_prep.triton is None or torch.cuda.is_available(),
                                reason="CPU check through Triton's interpreter (CUDA runs it in the GPU scripts)")


@pytest.mark.parametrize("name,model_type,overrides", [("qwen3", "qwen3", {}),
                                                       ("mistral-window", "mistral", {"sliding_window": 8})])
def test_greedy_output_equals_the_unfused_model(tiny_models, monkeypatch, name, model_type, overrides):
    engine = load_engine(str(tiny_models.get(name, model_type, **overrides)), device="cpu")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(5, 22))
    want = engine.generate_all(prompt, params).token_ids

    calls = []
    kernel = qk_prep.prepare_qk
    monkeypatch.setattr(qk_prep, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(qk_prep, "prepare_qk", lambda *a: calls.append(a[-1] is not None) or kernel(*a))
    attentions = [m for m in engine.model.modules() if hasattr(m, "prepare_qk")]
    assert attentions
    for m in attentions:
        monkeypatch.setattr(m, "prepare_qk", fused.fast_prepare_qk)
    got = engine.generate_all(prompt, params).token_ids
    assert got == want
    assert calls and all(calls)  # every pass wrote its keys and values in the kernel
