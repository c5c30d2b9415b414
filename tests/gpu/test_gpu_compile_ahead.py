"""On CUDA: prewarm's dry run compiles every Triton kernel the captures meet, and the captured
engine answers as one whose kernels compiled inside the captures.

Each engine is built in a fresh process with an empty Triton cache (kernels already in a process's
memory would compile nothing): a tiny Llama, bfloat16, exact numerics (the prompt graphs too), a
replay proposer drafting 3 tokens (verify passes of 1..4 tokens). The dry run must have built
kernels, none failing, and the captures after it must compile none; the greedy tokens must equal
those of the same engine started with VERISPEC_COMPILE_AHEAD=0.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from triton import knobs
from tests.gpu.replay import KeyedReplay
from tools.tiny import build_tiny_model
from verispec.engine import warmup
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams

model_dir, tokenizer_dir = sys.argv[1], sys.argv[2]
build_tiny_model(model_dir, "llama", seed=0, tokenizer_dir=tokenizer_dir, num_hidden_layers=2, hidden_size=128,
                 intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
base = load_engine(model_dir, dtype="bfloat16", device="cuda", max_num_seqs=4, kv_cache_gb=0.25,
                   max_model_len=512, numerics="exact")
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
prompt = base.tokenizer.encode("def fibonacci(n):\n    return")
plain = base.generate_all(prompt, params).token_ids  # eager: compiles the eager passes' kernels
engine = Engine(base.model, base.tokenizer, base.config, base.model_dir,
                proposer=KeyedReplay({tuple(prompt): plain}, base.model.vocab_size, wrong_at=lambda i: i % 3 == 2),
                num_drafts=3)
compiled = []
knobs.compilation.listener = lambda *, src, **kw: compiled.append(getattr(src, "name", "?"))
summary = warmup.compile_ahead(engine)
during_dry_run = len(compiled)
warmup._capture(engine)
result = {"summary": summary, "dry_run_compiles": during_dry_run, "capture_compiles": compiled[during_dry_run:],
          "tokens": engine.generate_all(prompt, params).token_ids, "plain": plain}
print("RESULT " + json.dumps(result))
"""


def _run(tmp_path: Path, tokenizer_dir: Path, name: str, ahead: bool) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton-{name}"),
               VERISPEC_COMPILE_AHEAD="1" if ahead else "0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / name), str(tokenizer_dir)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_the_dry_run_compiles_what_the_captures_meet(tmp_path, tokenizer_dir):
    ahead = _run(tmp_path, tokenizer_dir, "ahead", ahead=True)
    inside = _run(tmp_path, tokenizer_dir, "inside", ahead=False)
    summary = ahead["summary"]
    assert summary is not None and summary["failed"] == 0, summary
    assert summary["built"] > 0 and ahead["dry_run_compiles"] == summary["built"], (summary, ahead["dry_run_compiles"])
    assert ahead["capture_compiles"] == [], f"compiled inside the captures: {ahead['capture_compiles']}"
    assert inside["summary"] is None and inside["capture_compiles"], "without the dry run the captures compile"
    assert ahead["tokens"] == inside["tokens"] == ahead["plain"]
