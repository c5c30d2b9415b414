"""The persistent streaming kernel of verispec/quant/kernels/stream_chain.py (a producer warp copying 4-bit
weights by TMA into a shared-memory ring, consumer warps multiplying from it with frag.py's
`block_sums`), compiled for sm_90 on the CPU: its arithmetic and speed are measured on the GPU
(docs/benchmarks.md); this keeps it compiling as frag.py changes, and
checks what its design rests on: the weights move by TMA (no global loads of words), the
consumer's loop has no spills, and the ring fits in an H200 multiprocessor's shared memory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_stream_chain.py"
H200_SHARED_PER_BLOCK = 232448  # bytes a program may take (cudaDevAttrMaxSharedMemoryPerBlockOptin)


def test_stream_kernel_compiles_for_sm90():
    # a fresh process without TRITON_INTERPRET (the suite interprets the other kernels)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--compile-only", "--chain", "layer", "--slots", "2",
                           "--mode", "1", "--parts", "2", "--warps", "4", "--plans", "gate_up=2x2,down=1x4,o=1x4",
                           "--norm", "--sass"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["norm"] and result["parts"] == 2
    assert result["spill_bytes"] == 0
    assert result["shared"] <= H200_SHARED_PER_BLOCK
    ops = result["opcodes"]
    assert ops.get("UTMALDG.2D", 0) + ops.get("UTMALDG.3D", 0) > 0, "the weights are not copied by TMA"
    assert ops.get("HMMA.16816.F32.BF16", 0) > 0
    assert ops.get("LDS.128", 0) > 0, "the consumers do not read the words from shared memory"
    # a consumer's reads of a slot are fenced against the producer's next TMA write to it (without
    # the fence, a producer running ahead into the next product overwrote slots still being read)
    assert ops.get("FENCE.VIEW.ASYNC.S", 0) > 1, ops
    # the only 128-bit global loads left are the activations' (2 where a step loads them, in each
    # of two consumer partitions: 64 today), not the words (one more a row tile at each place)
    assert ops.get("LDG.E.128", 0) <= 80, ops
