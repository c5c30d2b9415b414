"""MTP self-speculation (`--mtp`) from the command line and the engine's configuration checks."""
from __future__ import annotations

import json

import pytest

from tests.spec.mtp_checkpoints import mtp_dirs, run_cli  # noqa: F401 (a fixture)
from verispec.cli import main as cli_main
from verispec.engine.engine import load_engine
from verispec.errors import VerispecError


# ---- configuration and CLI -------------------------------------------------------------------------
@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_cli_generate_json_reports_mtp(mtp_dirs):
    common = ["generate", "-m", str(mtp_dirs["hf-sidecar"]), "--prompt", "def f", "--max-tokens", "9", "--json",
              "--dtype", "float64"]
    (spec_code, spec_out, spec_err), (base_code, base_out, base_err) = run_cli(common + ["--mtp", "--mtp-depth", "2"],
                                                                               common)
    assert spec_code == 0 and base_code == 0, spec_err + base_err
    out, ref = json.loads(spec_out), json.loads(base_out)
    assert out["token_ids"] == ref["token_ids"] and out["text"] == ref["text"]
    assert out["stats"]["method"] == "mtp" and ref["stats"]["method"] == "ar"
    assert out["stats"]["drafted"] > 0


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_cli_mtp_without_a_head_logs_why_and_generates(mtp_dirs):
    [(code, stdout, stderr)] = run_cli(["generate", "-m", str(mtp_dirs["none"]), "--prompt", "def f",
                                        "--max-tokens", "5", "--json", "--mtp"])
    assert code == 0, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and "start-up:" not in line]
    assert len(lines) == 1 and "no MTP head" in lines[0] and "decoding without speculation" in lines[0], lines
    out = json.loads(stdout)
    assert out["stats"]["method"] == "ar" and len(out["token_ids"]) == 5


@pytest.mark.parametrize("args, message", [
    (["--mtp", "--mtp-depth", "0"], "--num-draft-tokens must be >= 1, got 0"),
    (["--mtp", "--eagle3", "/nowhere"], "--mtp and --eagle3 are two proposers; use one of them"),
    (["--mtp-depth", "2"], "--num-draft-tokens sets the drafts per round: it needs a proposer (--eagle3 DIR, --mtp, "
                           "--suffix or --ngram)"),
    (["--mtp-hidden", "pre-norm"], "--mtp-hidden needs --mtp"),
])
def test_cli_bad_mtp_flags_are_one_line(mtp_dirs, capsys, args, message):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for command in ("generate", "serve"):
        extra = ["--prompt", "x"] if command == "generate" else ["--port", str(port)]
        code = cli_main([command, "-m", str(mtp_dirs["hf-sidecar"]), *extra, *args])
        err = capsys.readouterr().err
        assert code == 2 and err.splitlines() == [f"verispec: error: {message}"], err


def test_cli_bad_mtp_hidden_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "-m", "x", "--prompt", "x", "--mtp", "--mtp-hidden", "middle"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert "--mtp-hidden" in err and "post-norm" in err and "pre-norm" in err


def test_engine_config_checks(mtp_dirs):
    with pytest.raises(VerispecError, match="--mtp-hidden 'middle' is not supported"):
        load_engine(str(mtp_dirs["hf-sidecar"]), mtp=True, mtp_hidden="middle")
    with pytest.raises(VerispecError, match="--num-draft-tokens must be >= 1"):
        load_engine(str(mtp_dirs["hf-sidecar"]), mtp=True, num_draft_tokens=0)
    with pytest.raises(VerispecError, match="two proposers"):
        load_engine(str(mtp_dirs["hf-sidecar"]), mtp=True, eagle3="/nowhere")
