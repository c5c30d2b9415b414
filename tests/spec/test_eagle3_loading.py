"""EAGLE3 checkpoints: naming variants, optional norms, and clear errors for incompatible drafters."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.spec.conftest import eagle3_proposer, greedy, spec_engine
from tools.tiny import write_random_eagle3
from verispec.errors import VerispecError
from verispec.spec.eagle3 import load_eagle3


@pytest.fixture(scope="module")
def target(targets):
    return targets["llama"]


@pytest.fixture(scope="module")
def target_config(target):
    return json.loads((target.model_dir / "config.json").read_text())


def rewrite(drafter_dir, tensors=None, config=None):
    if tensors is not None:
        save_file(tensors, str(drafter_dir / "model.safetensors"))
    if config is not None:
        (drafter_dir / "config.json").write_text(json.dumps(config))


def test_midlayer_naming_is_the_same_drafter(tmp_path, target, target_config, prompt_ids):
    plain_dir = write_random_eagle3(tmp_path / "layers", target_config, seed=5)
    mid_dir = write_random_eagle3(tmp_path / "midlayer", target_config, seed=5)
    tensors = load_file(str(mid_dir / "model.safetensors"))
    rewrite(mid_dir, {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()})
    a = load_eagle3(plain_dir, target.model)
    b = load_eagle3(mid_dir, target.model)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("norms", [dict(norm_before_fc=True), dict(fc_norm=True), dict(norm_before_fc=True, fc_norm=True)])
def test_optional_feature_norms_load_and_speculate_losslessly(tmp_path, target, target_config, prompt_ids, norms):
    drafter_dir = write_random_eagle3(tmp_path / "d", target_config, seed=3, aux_layer_ids=[0, 2, 3, 5], **norms)
    drafter = load_eagle3(drafter_dir, target.model)
    assert (drafter.input_norm is not None) == norms.get("norm_before_fc", False)
    assert (drafter.fc_norm is not None) == norms.get("fc_norm", False)
    if drafter.input_norm is not None:  # the checkpoint's weight was loaded, not left at ones
        assert not torch.all(drafter.input_norm.weight == 1)
    ids = prompt_ids[1]
    plain = target.generate_all(ids, greedy(32)).token_ids
    assert spec_engine(target, eagle3_proposer(target, drafter_dir), 3).generate_all(ids, greedy(32)).token_ids == plain


def test_hidden_size_mismatch_names_both_sides(tmp_path, target, target_config):
    d = write_random_eagle3(tmp_path / "d", target_config)
    config = json.loads((d / "config.json").read_text())
    config["target_hidden_size"] = 96
    rewrite(d, config=config)
    with pytest.raises(VerispecError, match=r"target hidden size 96.*hidden size 64"):
        load_eagle3(d, target.model)


def test_vocab_mismatch_is_named(tmp_path, target, target_config):
    bigger = dict(target_config, vocab_size=target_config["vocab_size"] + 10)
    d = write_random_eagle3(tmp_path / "d", bigger)
    with pytest.raises(VerispecError, match=r"vocabulary of 524 tokens, but the target model has 514"):
        load_eagle3(d, target.model)


def test_missing_tensor_is_named(tmp_path, target, target_config):
    d = write_random_eagle3(tmp_path / "d", target_config)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["lm_head.weight"]
    rewrite(d, tensors)
    with pytest.raises(VerispecError, match="missing tensor 'lm_head.weight'"):
        load_eagle3(d, target.model)


def test_d2t_outside_target_vocab(tmp_path, target, target_config):
    d = write_random_eagle3(tmp_path / "d", target_config, d2t_offset_stride=2)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + target_config["vocab_size"]
    rewrite(d, tensors)
    with pytest.raises(VerispecError, match="d2t maps draft ids outside"):
        load_eagle3(d, target.model)


def test_not_an_eagle3_checkpoint(tmp_path, target, target_config):
    d = write_random_eagle3(tmp_path / "d", target_config)
    config = json.loads((d / "config.json").read_text())
    config["speculators_model_type"] = "mlp"
    rewrite(d, config=config)
    with pytest.raises(VerispecError, match="not an EAGLE3 speculator"):
        load_eagle3(d, target.model)


def test_aux_layer_out_of_range(tmp_path, target, target_config):
    d = write_random_eagle3(tmp_path / "d", target_config, aux_layer_ids=[1, 2, 99])
    with pytest.raises(VerispecError, match=r"aux layer ids \[1, 2, 99\]"):
        load_eagle3(d, target.model)


def test_cli_bad_drafter_is_one_line(tmp_path, target):
    proc = subprocess.run([sys.executable, "-m", "verispec", "generate", "-m", str(target.model_dir), "--eagle3",
                           str(tmp_path), "--prompt", "x", "--max-tokens", "2"], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"verispec: error: --eagle3 {tmp_path}: no config.json there (expected a speculators EAGLE3 directory)"]


@pytest.mark.slow  # boots a subprocess / builds a model end to end: `make test-slow`
def test_cli_generate_json_reports_eagle3_stats(tmp_path, target, target_config):
    d = write_random_eagle3(tmp_path / "d", target_config)
    proc = subprocess.run([sys.executable, "-m", "verispec", "generate", "-m", str(target.model_dir), "--eagle3", str(d),
                           "--draft-block", "3", "--prompt", "def f", "--max-tokens", "9", "--json"],
                          capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    plain = subprocess.run([sys.executable, "-m", "verispec", "generate", "-m", str(target.model_dir), "--prompt",
                            "def f", "--max-tokens", "9", "--json"], capture_output=True, text=True,
                           env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    base = json.loads(plain.stdout)
    assert out["token_ids"] == base["token_ids"] and out["text"] == base["text"]
    assert out["stats"]["method"] == "eagle3" and base["stats"]["method"] == "ar"
    assert out["stats"]["drafted"] > 0 and base["stats"]["drafted"] == 0
