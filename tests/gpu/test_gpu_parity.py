"""Parity with transformers on CUDA: logits over a prompt and greedy generation, per model family.

Tiny random checkpoints (hidden 256, 4 layers, 8 query / 2 kv heads), transformers on the same
device and dtype as the oracle; prompts of 40-151 tokens with a 64-token prefill chunk, decode steps
as CUDA graphs over the split-K kernel. float32: logits within 1e-4 and the same 64 greedy tokens. In
bfloat16 both sides round differently (fused small ops round once where transformers' eager ops round
after each), and random models' near-flat logits make greedy choices flip, so bf16 is held only to
logits within a few bf16 steps (relative 5e-2; a real mistake is far above that).
"""
from __future__ import annotations

import pytest
import torch

from tools.tiny import build_tiny_model
from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
NEW_TOKENS = 64
PROMPTS = 4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES = {
    "llama": dict(num_key_value_heads=2, rope_scaling=LLAMA3_ROPE),
    "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(num_key_value_heads=2, head_dim=64),
    "mistral": dict(num_key_value_heads=2, sliding_window=32),
}
SIZE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            max_position_embeddings=2048)
FLOAT32_LOGITS_ATOL = 1e-4  # measured <= 1.9e-5 (Mistral's transformers cache truncates to the window)
BF16_LOGITS_RTOL = 5e-2  # measured 1.7e-2 to 2.2e-2 (relative norm of the difference)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict:
    root = tmp_path_factory.mktemp("gpu-parity")
    for model_type, overrides in CASES.items():
        build_tiny_model(root / model_type, model_type, tokenizer_dir=tokenizer_dir, **{**SIZE, **overrides})
    return {model_type: root / model_type for model_type in CASES}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(checkpoints, model_type, dtype):
    from transformers import AutoModelForCausalLM

    model_dir = checkpoints[model_type]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(DEVICE).eval()
    engine = load_engine(str(model_dir), dtype=dtype, device=DEVICE, prefill_step_size=64, kv_cache_gb=0.25,
                         max_num_seqs=4)
    engine.capture_graphs()
    vocab = engine.num_real_tokens
    for p in range(PROMPTS):
        length = 40 + 37 * p  # some prompts longer than the prefill chunk
        ids = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(p)).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([ids], device=DEVICE)).logits[0].float()
            out = engine.model(torch.tensor([ids], device=DEVICE), torch.arange(length, device=DEVICE)[None],
                               engine.model.make_cache(length))
            ours = engine.model.logits(out.hidden)[0].float()
        if dtype == "float32":
            assert float((ours - ref).abs().max()) < FLOAT32_LOGITS_ATOL, p
            hf_ids = hf.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, length:].tolist()
            result = engine.generate_all(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
            assert result.token_ids == hf_ids, p
        else:
            assert float((ours - ref).norm() / ref.norm()) < BF16_LOGITS_RTOL, p
