"""Start-up as a user meets it: every flag is checked before a model loads (one error line, exit 2,
nothing printed before it), and the log lines say what happens on this device only."""
from __future__ import annotations

import logging
import socket

import pytest
import torch

from verispec import cli
from verispec.bench.options import Method
from verispec.engine import warmup
from verispec.engine.engine import load_engine


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the flags must be refused before one."""
    from verispec.engine import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(loading, "load_model", refuse)


@pytest.fixture
def logs(caplog):
    from verispec import log

    log.setup_logging()
    logger = logging.getLogger("verispec")
    logger.addHandler(caplog.handler)  # verispec's logger does not propagate
    yield caplog
    logger.removeHandler(caplog.handler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD_FLAGS = [
    (["--draft-schedule", "nonsense"], "--draft-schedule 'nonsense'"),
    (["--draft-schedule", "1:2,0:1"], "--draft-schedule"),
    (["--dtype", "float8"], "--dtype 'float8'"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--kv-cache-gb", "0"], "--kv-cache-gb"),
    (["--mtp", "--eagle3", "./drafter"], "--mtp and --eagle3"),
    (["--no-spec", "--num-draft-tokens", "2"], "--num-draft-tokens"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
]


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("flags,named", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_before_any_load(no_loading, logs, capsys, command, flags, named):
    extra = ["--port", str(free_port())] if command == "serve" else ["--prompt", "hi"]
    assert cli.main([command, *flags, *extra]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verispec") and named in lines[0], err
    assert not logs.records, logs.text  # no "model: ..." line before the error


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line_and_names_no_model(no_loading, logs, capsys):
    assert cli.main(["serve", "--device", "cuda", "--port", str(free_port())]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["verispec: error: --device cuda was asked for but CUDA is not available on this machine"]
    assert not logs.records, logs.text


def test_bench_help_lists_every_method(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(m.value in text for m in Method), text


def test_cpu_prewarm_names_no_cuda_phase_and_the_start_up_phases_are_logged(qwen3_dir, logs):
    engine = load_engine(str(qwen3_dir), dtype="float32", device="cpu")
    try:
        assert "start-up: loading the weights" in logs.text and "start-up: allocating the KV cache" in logs.text
        warmup.prewarm(engine)
    finally:
        engine.shutdown()
    phases = [r.getMessage() for r in logs.records if "prewarm phases" in r.getMessage()]
    assert phases and "first generation" in phases[0]
    assert "CUDA graphs" not in phases[0] and "prompt lengths" not in phases[0]


def test_the_quantize_formats_the_parser_names_are_the_converters():
    from verispec.cli import QUANTIZE_FORMATS
    from verispec.quant.convert import OUTPUT_FORMATS

    assert QUANTIZE_FORMATS == tuple(OUTPUT_FORMATS)


def test_checking_the_serve_flags_imports_no_model_code():
    """`serve` checks its flags and starts its engine process before any model code is imported
    (torch.compile's machinery alone took 2-3 s of that)."""
    import subprocess
    import sys

    code = ("import sys; from verispec import cli; from verispec.config import EngineConfig; "
            "from verispec.engine.options import check_options; "
            "check_options(EngineConfig(model='x', device='cpu', eagle3='verispec/drafters/smollm2-eagle3')); "
            "print(sorted(m for m in ('verispec.models.base', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
