"""Our small-op kernels end to end: with queries and keys prepared by kernels/qk_prep.py (which
also writes the keys and values into the engine's paged cache) and the residual add + RMSNorm by
kernels/rms_norm.py, run here by Triton's interpreter (tests/conftest.py), greedy output equals
the unfused model's, token for token."""
from __future__ import annotations

import pytest
import torch

from tools.tiny import build_tiny_gemma3, build_tiny_qwen3_5
from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams
from verispec.kernels import qk_prep, rms_norm
from verispec.models.layers import fused

pytestmark = pytest.mark.skipif(qk_prep.triton is None or torch.cuda.is_available(),
                                reason="CPU check through Triton's interpreter (CUDA runs it in the GPU scripts)")


def checkpoint(case: str, tiny_models, tokenizer_dir, tmp_path):
    if case == "qwen3":
        return tiny_models.get("qwen3", "qwen3")
    if case == "mistral-window":
        return tiny_models.get("mistral-window", "mistral", sliding_window=8)
    builder = {"gemma3": build_tiny_gemma3, "qwen3_5": build_tiny_qwen3_5}[case]
    builder(tmp_path / case, seed=3, tokenizer_dir=tokenizer_dir)
    return tmp_path / case


# Llama-family attention writes its keys and values in the kernel; Gemma 3 (unit-offset q/k
# norms, two RoPE tables) and Qwen3.5's gated attention (queries a strided view, partial RoPE)
# prepare q and k there and write the cache themselves
@pytest.mark.parametrize("case,writes_cache", [("qwen3", True), ("mistral-window", True), ("gemma3", False),
                                               ("qwen3_5", False)])
def test_greedy_output_equals_the_unfused_model(tiny_models, tokenizer_dir, tmp_path, monkeypatch, case,
                                                writes_cache):
    engine = load_engine(str(checkpoint(case, tiny_models, tokenizer_dir, tmp_path)), device="cpu")
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
    monkeypatch.setattr(rms_norm, "unsupported_reason", lambda *a: None)
    norm_calls = []
    norm_kernel = rms_norm.add_rms_norm
    monkeypatch.setattr(rms_norm, "add_rms_norm", lambda *a: norm_calls.append(1) or norm_kernel(*a))
    # Gemma 3's sandwich norms keep the compiled path: only the families that add then norm take it
    norms = [m for m in engine.model.modules() if hasattr(m, "add_norm")]
    assert bool(norms) == (case != "gemma3")
    for m in norms:
        monkeypatch.setattr(m, "add_norm", fused.fast_add_rms_norm)
    if norms:
        monkeypatch.setattr(engine.model, "final_add_norm", fused.fast_add_rms_norm)
    got = engine.generate_all(prompt, params).token_ids
    assert got == want
    assert calls and all(c == writes_cache for c in calls)
    assert bool(norm_calls) == bool(norms)
