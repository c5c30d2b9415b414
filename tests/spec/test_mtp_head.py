"""MTP self-speculation (`--mtp`), its head: the Qwen3.5 MTP head against one assembled from
transformers' own Qwen3.5 decoder layer and RMSNorm (transformers drops the head), where its
weights come from, its norm convention, missing and broken heads.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.spec.conftest import greedy
from tests.spec.mtp_checkpoints import (NEW_TOKENS, PREFILL_STEP, add_to_shard, head_for,  # noqa: F401 (fixtures)
                                        mtp_dirs, plain, sequence_logits, strip_head)
from tools.tiny import write_mtp_sidecar
from verispec.cache.kv import KVCache
from verispec.engine.engine import load_engine
from verispec.errors import VerispecError
from verispec.loading.model_loader import load_model
from verispec.models.layers.norm import RMSNorm
from verispec.spec import mtp as mtp_module
from verispec.spec.mtp import NormConvention, head_tensor_name, load_mtp_head


# ---- the head --------------------------------------------------------------------------------------
def test_head_matches_transformers_layers(mtp_dirs):
    """Our head against one assembled from transformers' Qwen3.5 modules (RMSNorm with 1 + w,
    the full-attention decoder layer, its rotary embedding), float32, one pass over 12 rows:
    checks the embedding-first concatenation, every norm and the layer."""
    from transformers import Qwen3_5ForCausalLM as HFQwen3_5ForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as HFLayer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    hf = HFQwen3_5ForCausalLM.from_pretrained(str(mtp_dirs["none"]), dtype=torch.float32).eval()
    config = hf.config
    config._attn_implementation = "eager"
    target = load_model(mtp_dirs["hf-sidecar"], torch.float32, torch.device("cpu"))
    ours = load_mtp_head(mtp_dirs["hf-sidecar"], target)
    tensors = strip_head(load_file(str(mtp_dirs["hf-sidecar"] / "mtp.safetensors")))
    full = config.layer_types.index("full_attention")
    layer = HFLayer(config, full).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in tensors.items() if k.startswith("layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps)
        norms[name].weight.data.copy_(tensors[f"{name}.weight"])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=gen)
    hidden = torch.randn(1, 12, config.hidden_size, generator=gen)
    positions = torch.arange(12)[None]
    with torch.no_grad():
        e = hf.model.embed_tokens(ids)
        x = torch.cat((norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](hidden)), -1) @ tensors["fc.weight"].T
        mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
        x = layer(x, hf.model.rotary_emb(x, positions[None].expand(3, 1, 12)), attention_mask=mask)
        ref = hf.lm_head(norms["norm"](x))
        got = ours.logits(ours(ids, hidden, positions, KVCache(ours.cache_specs(), 12, torch.float32, "cpu")))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)  # measured 6e-7; a swapped cat: 3.9


def test_head_shares_the_targets_embedding_and_lm_head(plain, mtp_dirs):
    engine = plain[0]
    head = head_for(engine, mtp_dirs["hf-sidecar"])
    names = {n for n, _ in head.named_parameters()}
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert head.target is engine.model


# ---- where the weights are -------------------------------------------------------------------------
def test_head_in_shards_leaves_the_backbone_loading_alone(mtp_dirs, monkeypatch):
    """model.safetensors with mtp.* inside: the backbone loads the same (the head's tensors are
    skipped with the debug line), and the head loads from the shard."""
    lines = []
    monkeypatch.setattr("verispec.loading.model_loader.log.debug", lambda msg, *a: lines.append(msg % a))
    with_head = load_model(mtp_dirs["shards"], torch.float64, torch.device("cpu"))
    without = load_model(mtp_dirs["none"], torch.float64, torch.device("cpu"))
    for (name, a), (_, b) in zip(with_head.named_parameters(), without.named_parameters()):
        assert torch.equal(a, b), name
    ignored = [line for line in lines if "ignored" in line]
    assert len(ignored) == 1 and "ignored 15 checkpoint tensors" in ignored[0] and "mtp." in ignored[0]
    head = load_mtp_head(mtp_dirs["shards"], with_head)
    sidecar = load_mtp_head(mtp_dirs["hf-sidecar"], without)
    for (name, a), (_, b) in zip(head.named_parameters(), sidecar.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("prefix", ["model.", "model.language_model.", "language_model."])
def test_wrapper_prefixes_in_shards(mtp_dirs, tmp_path, prefix):
    d = tmp_path / "m"
    shutil.copytree(mtp_dirs["none"], d)
    tensors = load_file(str(mtp_dirs["hf-sidecar"] / "mtp.safetensors"))
    add_to_shard(d, {prefix + k: v for k, v in tensors.items()})
    target = load_model(d, torch.float64, torch.device("cpu"))
    head = load_mtp_head(d, target)
    ref = load_mtp_head(mtp_dirs["hf-sidecar"], target)
    for (name, a), (_, b) in zip(head.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name


def test_head_tensor_names():
    assert head_tensor_name("mtp.fc.weight", sidecar=False) == "fc.weight"
    assert head_tensor_name("model.language_model.mtp.norm.weight", sidecar=False) == "norm.weight"
    assert head_tensor_name("language_model.mtp.layers.0.mlp.up_proj.weight", sidecar=False) == \
        "layers.0.mlp.up_proj.weight"
    assert head_tensor_name("model.language_model.layers.0.mlp.up_proj.weight", sidecar=False) is None
    assert head_tensor_name("model.visual.blocks.0.attn.qkv.weight", sidecar=False) is None
    assert head_tensor_name("fc.weight", sidecar=True) == "fc.weight"  # a sidecar holds only the head


@pytest.mark.parametrize("sidecar", ["mtp/weights.safetensors", "model-mtp.safetensors"])
def test_other_sidecar_names(mtp_dirs, tmp_path, sidecar):
    d = tmp_path / "m"
    shutil.copytree(mtp_dirs["none"], d)
    write_mtp_sidecar(d / sidecar, strip_head(load_file(str(mtp_dirs["hf-sidecar"] / "mtp.safetensors"))))
    target = load_model(d, torch.float64, torch.device("cpu"))
    head = load_mtp_head(d, target)
    ref = load_mtp_head(mtp_dirs["hf-sidecar"], target)
    assert head.norm_convention is NormConvention.HF
    for (name, a), (_, b) in zip(head.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name


# ---- the norm convention ---------------------------------------------------------------------------
def test_hf_and_mlx_sidecars_of_one_head_compute_the_same_logits(plain, mtp_dirs):
    """The same head saved both ways (HF: w, applied as 1 + w; MLX: 1 + w stored, metadata
    format=mlx; or a config declaring mlx_lm_extra_tensors): identical logits, every norm of
    the head (q/k norms included) following the file's convention."""
    engine, prompts, outputs = plain
    ids = prompts[1] + outputs[1]
    ref = sequence_logits(head_for(engine, mtp_dirs["hf-sidecar"]), engine, ids)
    for source in ("mlx-sidecar", "declared-mlx"):
        head = head_for(engine, mtp_dirs[source])
        assert head.norm_convention is NormConvention.MLX
        norms = [m for m in head.modules() if isinstance(m, RMSNorm)]
        assert len(norms) == 7 and not any(m.unit_offset for m in norms)
        assert torch.equal(sequence_logits(head, engine, ids), ref), source
    assert all(m.unit_offset for m in head_for(engine, mtp_dirs["shards"]).modules() if isinstance(m, RMSNorm))


def test_the_wrong_convention_changes_the_logits(plain, mtp_dirs, tmp_path):
    """Decided by the format, never by the values: the MLX file without its metadata is read as HF
    (every norm shifted twice), the HF file under a config declaring mlx_lm_extra_tensors as MLX
    (never shifted); both change the logits."""
    engine, prompts, outputs = plain
    ids = prompts[1] + outputs[1]
    ref = sequence_logits(head_for(engine, mtp_dirs["hf-sidecar"]), engine, ids)
    stripped = tmp_path / "stripped"
    shutil.copytree(mtp_dirs["mlx-sidecar"], stripped)
    f = stripped / "mtp.safetensors"
    save_file(load_file(str(f)), str(f))  # no metadata
    declared = tmp_path / "declared"
    shutil.copytree(mtp_dirs["hf-sidecar"], declared)
    config = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps(dict(config, mlx_lm_extra_tensors={"mtp_file": "mtp.safetensors"})))
    for d, convention in ((stripped, NormConvention.HF), (declared, NormConvention.MLX)):
        head = head_for(engine, d)
        assert head.norm_convention is convention
        assert (sequence_logits(head, engine, ids) - ref).abs().max() > 0.1


# ---- missing and broken heads ----------------------------------------------------------------------
def test_missing_head_is_logged_and_decoding_goes_on(plain, mtp_dirs, monkeypatch):
    engine, prompts, outputs = plain
    lines = []
    monkeypatch.setattr(mtp_module.log, "warning", lambda msg, *a: lines.append(msg % a))
    spec = load_engine(str(mtp_dirs["none"]), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP,
                       mtp=True)
    assert spec.proposer is None
    assert len(lines) == 1
    assert "no MTP head" in lines[0] and "model.safetensors" in lines[0] and "mtp/weights.safetensors" in lines[0]
    result = spec.generate_all(prompts[0], greedy(NEW_TOKENS))
    assert result.token_ids == outputs[0] and result.stats.method == "ar"


def test_mtp_on_a_model_without_a_head_architecture(tiny_models, monkeypatch):
    lines = []
    monkeypatch.setattr(mtp_module.log, "warning", lambda msg, *a: lines.append(msg % a))
    d = tiny_models.get("mtp-llama", "llama")
    spec = load_engine(str(d), dtype="float32", device="cpu", mtp=True)
    assert spec.proposer is None
    assert len(lines) == 1 and "model type 'llama' has no MTP head" in lines[0]
    assert spec.generate_all([1, 2, 3], greedy(4)).stats.method == "ar"


def test_incomplete_or_misshapen_head_is_refused(plain, mtp_dirs, tmp_path):
    engine = plain[0]
    tensors = strip_head(load_file(str(mtp_dirs["hf-sidecar"] / "mtp.safetensors")))
    d = tmp_path / "m"
    shutil.copytree(mtp_dirs["none"], d)
    write_mtp_sidecar(d / "mtp.safetensors", {k: v for k, v in tensors.items() if k != "layers.0.self_attn.k_norm.weight"})
    with pytest.raises(VerispecError, match=r"missing tensors: mtp\.layers\.0\.self_attn\.k_norm\.weight"):
        load_mtp_head(d, engine.model)
    write_mtp_sidecar(d / "mtp.safetensors", dict(tensors, **{"fc.weight": torch.zeros(64, 64)}))
    with pytest.raises(VerispecError, match=r"'mtp\.fc\.weight'.*shape \(64, 64\).*\(64, 128\)"):
        load_mtp_head(d, engine.model)
    # quantized tensors in a float checkpoint: nothing says how they were quantized
    write_mtp_sidecar(d / "mtp.safetensors", dict(tensors, **{"fc.scales": torch.zeros(64, 2)}))
    with pytest.raises(VerispecError, match=r"quantized \(it has \.scales tensors\).*no MLX `quantization` section"):
        load_mtp_head(d, engine.model)
