"""Checkpoint shapes verispec must load (padded vocab, sharded with an index) and the clear errors
it must give for ones it cannot (unsupported RoPE or model_type, missing or misshapen weights)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams
from verispec.errors import UnsupportedModelError, VerispecError
from verispec.loading.model_loader import load_model

CPU = torch.device("cpu")
LOGITS_ATOL = 1e-5  # as in test_parity (measured difference: 0.0)
LOGITS_RTOL = 1e-5
EXTRA_VOCAB = 64


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


@torch.inference_mode()
def our_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.make_cache(len(ids))
    return model.logits(model(torch.tensor([ids]), torch.arange(len(ids))[None], cache).hidden)[0]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    path.write_text(json.dumps(config))


# ---- padded vocabulary ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def padded_vocab_dir(tiny_models) -> Path:
    """A model with 64 vocab rows past the tokenizer's, whose padding rows are made to win the
    argmax often, so a missing mask would show up as emitted ids >= len(tokenizer)."""

    def boost_padding(model):
        num_real = model.config.vocab_size - EXTRA_VOCAB
        model.lm_head.weight[num_real:] *= 4.0

    return tiny_models.get("padded_vocab", "llama", extra_vocab=EXTRA_VOCAB, modify=boost_padding)


def test_padded_vocab_greedy_matches_transformers_with_padding_suppressed(padded_vocab_dir):
    hf = AutoModelForCausalLM.from_pretrained(str(padded_vocab_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    engine = load_engine(str(padded_vocab_dir), dtype="float32", device="cpu", prefill_step_size=16)
    num_real = engine.tokenizer.vocab_size
    assert engine.model.vocab_size == num_real + EXTRA_VOCAB
    padding = list(range(num_real, engine.model.vocab_size))
    unmasked_hits = 0
    for seed in range(3):
        ids = prompt(40, num_real, seed)
        with torch.inference_mode():
            unmasked = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, pad_token_id=0)
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, pad_token_id=0,
                              suppress_tokens=padding)[0, len(ids):].tolist()
        unmasked_hits += sum(t >= num_real for t in unmasked[0, len(ids):].tolist())
        got = engine.generate_all(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)).token_ids
        assert got == ref
        assert max(got) < num_real
    assert unmasked_hits > 0, "fixture too weak: padding rows never win without the mask"


def test_padded_vocab_sampling_never_emits_padding(padded_vocab_dir):
    engine = load_engine(str(padded_vocab_dir), dtype="float32", device="cpu")
    num_real = engine.tokenizer.vocab_size
    for seed in range(4):
        out = engine.generate_all(prompt(10, num_real, seed),
                                  SamplingParams(max_tokens=64, temperature=1.5, seed=seed, ignore_eos=True))
        assert len(out.token_ids) == 64
        assert max(out.token_ids) < num_real


# ---- sharded checkpoint -----------------------------------------------------------------------

def test_sharded_checkpoint_with_index_loads(qwen3_dir, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert not (sharded / "model.safetensors").exists()
    ours = load_model(sharded, torch.float32, CPU)
    ids = prompt(30, ours.vocab_size, 0)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(our_logits(ours, ids), ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_sharded_checkpoint_missing_shard_is_named(qwen3_dir, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (sharded / victim).unlink()
    with pytest.raises(VerispecError, match=victim):
        load_model(sharded, torch.float32, CPU)


# ---- clear errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 64}},
    # the transformers v4 spelling
    {"rope_parameters": None, "rope_theta": 10000.0,
     "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
])
def test_unsupported_rope_type_is_named(qwen3_dir, tmp_path, rope):
    path = copy_model(qwen3_dir, tmp_path / "m")
    edit_config(path, **rope)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(path, torch.float32, CPU)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_engine(str(path), dtype="float32", device="cpu")


def test_unknown_model_type_is_named(qwen3_dir, tmp_path):
    path = copy_model(qwen3_dir, tmp_path / "m")
    edit_config(path, model_type="frobnicator")
    with pytest.raises(UnsupportedModelError, match="frobnicator") as info:
        load_model(path, torch.float32, CPU)
    assert "qwen3" in str(info.value)  # lists what is supported


def _rewrite_weights(path: Path, change) -> None:
    weights = load_file(str(path / "model.safetensors"))
    change(weights)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_weight_is_named(qwen3_dir, tmp_path):
    path = copy_model(qwen3_dir, tmp_path / "m")
    name = "model.layers.1.self_attn.k_norm.weight"
    _rewrite_weights(path, lambda w: w.pop(name))
    with pytest.raises(VerispecError, match=name.replace(".", r"\.")):
        load_model(path, torch.float32, CPU)


def test_untied_model_missing_lm_head_is_named(qwen3_dir, tmp_path):
    path = copy_model(qwen3_dir, tmp_path / "m")
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False
    _rewrite_weights(path, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(VerispecError, match=r"lm_head\.weight"):
        load_model(path, torch.float32, CPU)


def test_misshapen_weight_is_named(qwen3_dir, tmp_path):
    path = copy_model(qwen3_dir, tmp_path / "m")
    name = "model.layers.0.mlp.up_proj.weight"

    def shrink(w):
        w[name] = w[name][:-1].contiguous()

    _rewrite_weights(path, shrink)
    with pytest.raises(VerispecError, match=name.replace(".", r"\.")):
        load_model(path, torch.float32, CPU)


def test_unused_checkpoint_tensors_are_ignored(qwen3_dir, tmp_path):
    """Old checkpoints carry e.g. rotary inv_freq buffers; they are not weights of ours."""
    path = copy_model(qwen3_dir, tmp_path / "m")

    def add_buffer(w):
        w["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _rewrite_weights(path, add_buffer)
    reference = load_model(qwen3_dir, torch.float32, CPU)
    ours = load_model(path, torch.float32, CPU)
    ids = prompt(12, ours.vocab_size, 0)
    torch.testing.assert_close(our_logits(ours, ids), our_logits(reference, ids), atol=0, rtol=0)


def test_missing_weights_file_is_clear(qwen3_dir, tmp_path):
    path = copy_model(qwen3_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(VerispecError, match="no safetensors weights"):
        load_model(path, torch.float32, CPU)
