"""`verispec train-drafter`: EAGLE3 drafters and MTP heads trained on tiny targets.

Each trained drafter must load with verispec's own loaders, be accepted more often than an
untrained one (measured by running the engine on held-out text), keep speculative greedy output
identical to plain greedy, and leave the target loadable by transformers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from verispec.cli import main as cli_main
from tools.tiny import write_random_eagle3
from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams
from verispec.train import DrafterTrainOptions, Method, train_drafter

FAST = dict(steps=80, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5, eval_prompts=4, eval_prompt_len=16,
            eval_tokens=32, gen_sequences=32, gen_prompt_len=8, eval_every=0, save_every=1000, device="cpu",
            save_dtype="float32", progress=False)
PROMPTS = ["def add(a, b):\n", "class Point:\n    def __init__(self", "for i in range(10):\n    print"]


def greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def spec_equals_plain(target: Path, **proposer) -> int:
    """Speculative greedy == plain greedy on PROMPTS in float64; returns the accepted drafts."""
    plain = load_engine(str(target), dtype="float64", device="cpu")
    spec = load_engine(str(target), dtype="float64", device="cpu", **proposer)
    assert spec.proposer is not None
    accepted = 0
    for text in PROMPTS:
        ids = plain.tokenizer.encode(text)
        want = plain.generate_all(ids, greedy()).token_ids
        got = spec.generate_all(ids, greedy())
        assert got.token_ids == want
        accepted += got.stats.accepted
    return accepted


def acceptance(target: Path, **proposer) -> float:
    """The engine's greedy acceptance over PROMPTS (float32, as evaluation runs)."""
    engine = load_engine(str(target), device="cpu", **proposer)
    drafted = accepted = 0
    for text in PROMPTS:
        stats = engine.generate_all(engine.tokenizer.encode(text), greedy()).stats
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    return accepted / drafted


def transformers_loads(target: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    ours = load_engine(str(target), dtype="float32", device="cpu").model
    cache = ours.make_cache(4)
    with torch.no_grad():
        want = model(ids).logits[0]
        got = ours.logits(ours(ids, torch.arange(4)[None], cache).hidden)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def check_vocab_maps(drafter_dir: Path, target_vocab: int) -> torch.Tensor:
    tensors = load_file(str(drafter_dir / "model.safetensors"))
    config = json.loads((drafter_dir / "config.json").read_text())
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    vd = config["draft_vocab_size"]
    assert d2t.dtype == torch.long and d2t.shape == (vd,)
    assert t2d.dtype == torch.bool and t2d.shape == (target_vocab,)
    target_ids = torch.arange(vd) + d2t
    assert bool(t2d[target_ids].all()) and int(t2d.sum()) == vd
    assert bool((target_ids[1:] > target_ids[:-1]).all())  # distinct, ascending
    assert tensors["lm_head.weight"].shape[0] == vd
    return target_ids


@pytest.mark.slow  # boots a subprocess / builds a model end to end: `make test-slow`
def test_eagle3_on_qwen3_5_target_via_cli(tmp_path, qwen3_5_target, data_file, capsys):
    out = tmp_path / "eagle3"
    code = cli_main(["train-drafter", "--method", "eagle3", "-m", str(qwen3_5_target), "--data", str(data_file),
                     "--out", str(out), "--steps", "80", "--batch-size", "8", "--seq-len", "64", "--lr", "3e-3",
                     "--warmup-steps", "5", "--ttt-steps", "3", "--draft-vocab-size", "200", "--eval-prompts", "4",
                     "--eval-tokens", "32", "--gen-sequences", "32", "--save-dtype", "float32", "--device", "cpu"])
    assert code == 0
    assert "held-out acceptance" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 200
    target_vocab = json.loads((qwen3_5_target / "config.json").read_text())["vocab_size"]
    check_vocab_maps(out, target_vocab)
    summary = json.loads((out / "training-eagle3.json").read_text())
    assert summary["after"]["acceptance"] > summary["before"]["acceptance"] + 0.4

    trained = acceptance(qwen3_5_target, eagle3=str(out), num_draft_tokens=3)
    random_dir = write_random_eagle3(tmp_path / "random", json.loads((qwen3_5_target / "config.json").read_text()),
                                     aux_layer_ids=config["eagle_aux_hidden_state_layer_ids"])
    untrained = acceptance(qwen3_5_target, eagle3=str(random_dir), num_draft_tokens=3)
    assert trained > untrained + 0.4, (trained, untrained)
    assert spec_equals_plain(qwen3_5_target, eagle3=str(out), num_draft_tokens=3) > 0
    transformers_loads(qwen3_5_target)


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_eagle3_on_llama_family_target(tmp_path, qwen3_target, train_text):
    out = tmp_path / "eagle3"
    summary = train_drafter(DrafterTrainOptions(method=Method.EAGLE3, model=str(qwen3_target), out=str(out),
                                                ttt_steps=2, layer_type="qwen3", copy_embedding=True, **FAST),
                            documents=[train_text])
    assert summary["after"]["acceptance"] > summary["before"]["acceptance"] + 0.4
    tensors = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" in tensors and "layers.0.self_attn.q_norm.weight" in tensors
    target_vocab = json.loads((qwen3_target / "config.json").read_text())["vocab_size"]
    target_ids = check_vocab_maps(out, target_vocab)
    assert len(target_ids) == min(32000, target_vocab)  # default: the whole (small) vocabulary
    assert spec_equals_plain(qwen3_target, eagle3=str(out), num_draft_tokens=2) > 0
    transformers_loads(qwen3_target)


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_mtp_head_for_a_target_that_has_none(tmp_path, qwen3_5_target, train_text):
    target = tmp_path / "target"
    shutil.copytree(qwen3_5_target, target)
    assert load_engine(str(target), device="cpu", mtp=True).proposer is None  # no head yet
    summary = train_drafter(DrafterTrainOptions(method=Method.MTP, model=str(target), out=str(target),
                                                ttt_steps=2, **FAST), documents=[train_text])
    assert summary["after"]["acceptance"] > summary["before"]["acceptance"] + 0.4
    tensors = load_file(str(target / "mtp.safetensors"))
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= set(tensors)
    assert len(tensors) == 15
    # zero-centred norms (HF convention): the trained values sit around 0, not around 1
    assert float(tensors["mtp.norm.weight"].abs().mean()) < 0.5
    assert acceptance(target, mtp=True, num_draft_tokens=2) > 0.3
    assert spec_equals_plain(target, mtp=True, num_draft_tokens=2) > 0
    transformers_loads(target)


def test_interrupted_run_resumes_to_the_same_weights(tmp_path, qwen3_target, train_text, monkeypatch):
    import verispec.train.loop as loop

    opts = dict(FAST, steps=12, save_every=5, eval_prompts=0, gen_sequences=8, ttt_steps=2)
    straight = train_drafter(DrafterTrainOptions(method=Method.EAGLE3, model=str(qwen3_target), out=str(tmp_path / "a"),
                                                 **opts), documents=[train_text])
    assert straight["steps"] == 12

    real, calls = loop.target_batch, {"n": 0}

    def count_then_die(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["die_at"]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    # the vocabulary pass makes ceil((windows + generated) / batch) forwards before training's
    data_windows = straight["train_windows"] + 8
    calls["die_at"] = -(-data_windows // FAST["batch_size"]) + 8
    monkeypatch.setattr(loop, "target_batch", count_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(DrafterTrainOptions(method=Method.EAGLE3, model=str(qwen3_target), out=str(tmp_path / "b"),
                                          **opts), documents=[train_text])
    state = torch.load(tmp_path / "b" / ".train-state" / "eagle3.pt", weights_only=False)
    assert state["step"] == 5 and not state["finished"]
    monkeypatch.setattr(loop, "target_batch", real)
    resumed = train_drafter(DrafterTrainOptions(method=Method.EAGLE3, model=str(qwen3_target), out=str(tmp_path / "b"),
                                                **opts), documents=[train_text])
    assert resumed["steps"] == 12
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)
    # a finished run is not trained again; other settings are refused in one line
    again = train_drafter(DrafterTrainOptions(method=Method.EAGLE3, model=str(qwen3_target), out=str(tmp_path / "b"),
                                              **opts), documents=[train_text])
    assert again["steps"] == 12
    from verispec.errors import VerispecError

    with pytest.raises(VerispecError, match="other settings.*--restart"):
        train_drafter(DrafterTrainOptions(method=Method.EAGLE3, model=str(qwen3_target), out=str(tmp_path / "b"),
                                          **dict(opts, ttt_steps=3)), documents=[train_text])


@pytest.mark.parametrize("target, args, message", [
    ("qwen3_5_target", ["--method", "medusa"], "--method 'medusa' is not supported (accepted: eagle3, mtp)"),
    ("qwen3_target", ["--method", "mtp"], "needs a Qwen3.5-architecture target"),
    ("qwen3_target", ["--method", "eagle3", "--data", "/nonexistent/text"],
     "--data /nonexistent/text: no such file or directory"),
    ("qwen3_target", ["--method", "eagle3", "--steps", "0"], "--steps must be >= 1"),
    ("qwen3_5_target", ["--method", "mtp", "--draft-vocab-size", "100"], "--draft-vocab-size is for --method eagle3"),
    ("qwen3_target", ["--method", "eagle3", "--aux-layers", "1,x"], "--aux-layers '1,x' must be comma-separated"),
    ("qwen3_target", ["--method", "eagle3", "--aux-layers", "1,2,99"], "aux layer ids [1, 2, 99]"),
])
def test_cli_errors_are_one_line(tmp_path, request, data_file, capsys, target, args, message):
    model_dir = request.getfixturevalue(target)
    capsys.readouterr()  # building the fixture model may print a save progress bar: only the CLI's output counts
    base = ["train-drafter", "-m", str(model_dir), "--out", str(tmp_path / "o"),
            "--device", "cpu", "--seq-len", "64", "--eval-prompts", "0", "--gen-sequences", "0", "--steps", "1"]
    if "--data" not in args:
        base += ["--data", str(data_file)]
    code = cli_main(base + args)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.count("\n") == 1
