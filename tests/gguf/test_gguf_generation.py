"""GGUF models end to end: `-m file.gguf` (or a directory holding one) decodes exactly as transformers
does from the same file (float32 logits, 64 greedy tokens), the tokenizer and chat template come
from the metadata, and what is not supported is refused by name."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams
from verispec.errors import ModelNotFoundError, UnsupportedModelError
from verispec.loading.gguf import GGUFCheckpoint
from verispec.loading.resolve import resolve_model

from tests.models.family_checks import hf_logits, our_logits, random_ids

# Same weights and the same float32 kernels on both sides: measured 0.0 for every case.
LOGITS_ATOL = 1e-5
LOGITS_RTOL = 1e-5
NEW_TOKENS = 64
MIN_DISTINCT_TOKENS = 8
PROMPT_LENS = (9, 40)  # both longer than gemma3's 8-token window; 40 spans several prefill chunks
GENERATION_CASES = [("llama", "Q4_1"), ("llama", "Q8_0"), ("llama", "Q4_K"), ("llama", "F16"), ("qwen2", "Q8_0"),
                    ("qwen3", "Q4_0"), ("qwen3", "Q6_K"), ("gemma3", "Q4_1"), ("gemma3", "Q4_K"),
                    ("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_K")]


def hf_from_gguf(path):
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run the full 64 tokens on both sides
    return hf


@pytest.mark.parametrize("arch, qtype", GENERATION_CASES, ids=[f"{a}-{t}" for a, t in GENERATION_CASES])
def test_greedy_and_logits_match_transformers(gguf_files, arch, qtype):
    case = gguf_files.get(arch, qtype)
    hf = hf_from_gguf(case.path)
    engine = load_engine(str(case.path), dtype="float32", device="cpu", prefill_step_size=16)
    vocab = engine.model.vocab_size
    ids = random_ids(60, vocab, seed=1)
    torch.testing.assert_close(our_logits(engine.model, ids), hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    for n in PROMPT_LENS:
        prompt = random_ids(n, vocab, seed=n)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              pad_token_id=0)[0, n:].tolist()
        got = engine.generate_all(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        assert got.token_ids == ref, f"prompt of {n}"
        assert len(set(ref)) >= MIN_DISTINCT_TOKENS  # not a fixed point, which any model would match


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# Our default frequencies divided by the factors vs transformers' llama3 formula: the same values up
# to float32 rounding of the division (measured ~1e-6 on the logits); ignoring the factors moves them > 1e-2.
LLAMA3_ATOL = 1e-4


def test_llama3_rope_from_rope_freqs(gguf_files, tmp_path):
    """Llama 3.x files carry their RoPE scaling as llama.cpp's per-frequency factors (rope_freqs).
    transformers' GGUF loader ignores that tensor, so the oracle is transformers' own llama3 RoPE
    on the original (unconverted) model."""
    from tests.gguf.files import write_gguf

    case = write_gguf(tmp_path, "llama", "F32", gguf_files.hf_tokenizer, seed=5, llama3_rope=LLAMA3_ROPE)
    checkpoint = GGUFCheckpoint(case.path)
    assert "rope_freqs.weight" in checkpoint.tensor_shapes
    assert "frequency_factors" in checkpoint.config["rope_parameters"]
    engine = load_engine(str(case.path), dtype="float32", device="cpu", prefill_step_size=16)
    ids = random_ids(100, engine.model.vocab_size, seed=2)
    ref = hf_logits(case.hf_model, ids)
    got = our_logits(engine.model, ids)
    torch.testing.assert_close(got, ref, atol=LLAMA3_ATOL, rtol=1e-5)
    assert (hf_logits(hf_from_gguf(case.path), ids) - ref).abs().max() > 1e-2  # why it is not the oracle here


def test_gemma3_config_from_metadata(gguf_files):
    """What llama.cpp's loader decides for gemma3 (sliding pattern, local RoPE base, attention
    scale) and what transformers builds from the same file agree."""
    case = gguf_files.get("gemma3", "Q8_0")
    config = GGUFCheckpoint(case.path).config
    hf_config = hf_from_gguf(case.path).config
    assert config["layer_types"] == hf_config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == hf_config.sliding_window == 8
    assert config["query_pre_attn_scalar"] == hf_config.query_pre_attn_scalar == 256
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1e6


def test_tokenizer_and_chat_template_from_metadata(gguf_files):
    case = gguf_files.get("qwen3", "Q4_0")
    engine = load_engine(str(case.path), dtype="float32", device="cpu")
    tok = engine.tokenizer
    assert tok.hf.chat_template == case.chat_template
    assert case.eos_id in tok.eos_token_ids
    ref = AutoTokenizer.from_pretrained(str(case.path.parent), gguf_file=case.path.name)
    text = "def fibonacci(n):\n    return n"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    prompt, ids = tok.chat_prompt_ids([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    result = engine.generate_all(ids, SamplingParams(max_tokens=8, temperature=0))
    assert 1 <= len(result.token_ids) <= 8


def test_tokenizer_is_built_once_then_read_from_the_cache(gguf_files, tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    case = gguf_files.get("qwen3", "Q4_0")
    built = GGUFCheckpoint(case.path).tokenizer()
    [saved] = (tmp_path / "cache" / "gguf-tokenizers").iterdir()
    assert (saved / "tokenizer.json").is_file()
    cached = GGUFCheckpoint(case.path).tokenizer()
    assert Path(cached.hf.name_or_path) == saved
    text = "def fibonacci(n):\n    return n <|im_end|> ünïcode"
    assert cached.encode(text) == built.encode(text) and cached.decode(built.encode(text)) == built.decode(built.encode(text))
    assert cached.eos_token_ids == built.eos_token_ids and cached.hf.chat_template == built.hf.chat_template
    assert cached.chat_prompt_ids([{"role": "user", "content": "hi"}]) == built.chat_prompt_ids([{"role": "user",
                                                                                                  "content": "hi"}])


def test_directory_holding_one_gguf_resolves_to_it(gguf_files, tmp_path):
    case = gguf_files.get("llama", "Q8_0")
    assert resolve_model(str(case.path.parent)) == case.path.resolve()
    assert resolve_model(str(case.path)) == case.path.resolve()
    shutil.copy(case.path, tmp_path / "a.gguf")
    shutil.copy(case.path, tmp_path / "b.gguf")
    with pytest.raises(ModelNotFoundError, match="2 GGUF files"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


def _write_minimal(path, arch: str, tensor_type: str = "F32", extra=None):
    """A metadata-complete GGUF with one tensor, for refusals."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in dict(embedding_length=64, block_count=1, feed_forward_length=64, context_length=128,
                           **(extra or {})).items():
        writer.add_uint32(f"{arch}.{key}", value) if isinstance(value, int) else writer.add_string(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if tensor_type == "F32":
        writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    else:
        writer.add_tensor("token_embd.weight", np.zeros((8, 64 // block * size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_inputs_are_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"architecture 'phi3'.*supported: llama, qwen2, qwen3, gemma3"):
        GGUFCheckpoint(_write_minimal(tmp_path / "phi3.gguf", "phi3"))
    checkpoint = GGUFCheckpoint(_write_minimal(tmp_path / "iq4.gguf", "llama", "IQ4_NL"))
    with pytest.raises(UnsupportedModelError, match=r"type IQ4_NL, which is not supported \(supported: F32, .*Q6_K"):
        list(checkpoint.tensors())
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'yarn'"):
        GGUFCheckpoint(_write_minimal(tmp_path / "yarn.gguf", "llama", extra={"rope.scaling.type": "yarn"}))


def test_speculation_on_a_gguf_target(gguf_files, tmp_path):
    """An EAGLE3 drafter on a GGUF target keeps plain greedy output (float64); `--mtp` on a model
    without an MTP head decodes plainly (the head lookup never needs a config.json)."""
    from tools.tiny import write_random_eagle3

    case = gguf_files.get("llama", "Q4_1")
    plain = load_engine(str(case.path), dtype="float64", device="cpu", prefill_step_size=16)
    drafter = write_random_eagle3(tmp_path / "eagle3", GGUFCheckpoint(case.path).config, seed=3, aux_layer_ids=[0, 1, 1])
    spec = load_engine(str(case.path), dtype="float64", device="cpu", prefill_step_size=16, eagle3=str(drafter),
                       num_draft_tokens=3)
    mtp = load_engine(str(case.path), dtype="float64", device="cpu", mtp=True)
    assert mtp.proposer is None
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for n in PROMPT_LENS:
        prompt = random_ids(n, plain.model.vocab_size, seed=n)
        ref = plain.generate_all(prompt, params).token_ids
        result = spec.generate_all(prompt, params)
        assert result.token_ids == ref and result.stats.method == "eagle3" and result.stats.drafted > 0
        assert mtp.generate_all(prompt, params).token_ids == ref
