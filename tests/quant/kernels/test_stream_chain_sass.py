"""The persistent streaming kernel of verispec/quant/kernels/stream_chain.py (a producer warp copying
4-bit weights by TMA into a shared-memory ring, consumer warps multiplying from it with frag.py's
`block_sums`), compiled for sm_90 on the CPU (tools/sass/offline_sass.py): its arithmetic is checked
on the GPU; this keeps it compiling as frag.py changes, and checks what its design rests on: the
weights move by TMA (no global loads of words), the consumer's loop has no spills, and the ring fits
in an H200 multiprocessor's shared memory.
"""
from __future__ import annotations

import pytest

from tools.sass import offline_sass

# each module compiles its kernels for sm_90 in a subprocess (10-25 s): `make test-slow` and CI run it
pytestmark = pytest.mark.slow

pytest.importorskip("triton.experimental.gluon")

H200_SHARED_PER_BLOCK = 232448  # bytes a program may take (cudaDevAttrMaxSharedMemoryPerBlockOptin)


def test_stream_kernel_compiles_for_sm90():
    # o -> add + RMSNorm -> gate_up -> down, two consumer partitions of 4 warps, 2 slots a ring
    case = dict(kernel="stream_chain", products=["o", "gate_up", "down"], plan=[[1, 4], [2, 2], [1, 4]], slots=2,
                warps=4, mode=1, parts=2, norm=True)
    [result] = offline_sass.compile_frags([case])
    assert result.stack == 0, "the kernel spills"
    assert result.shared <= H200_SHARED_PER_BLOCK
    ops = offline_sass.opcode_counts(result.sass)
    assert ops.get("UTMALDG.2D", 0) + ops.get("UTMALDG.3D", 0) > 0, "the weights are not copied by TMA"
    assert ops.get("HMMA.16816.F32.BF16", 0) > 0
    assert ops.get("LDS.128", 0) > 0, "the consumers do not read the words from shared memory"
    # a consumer's reads of a slot are fenced against the producer's next TMA write to it (without
    # the fence, a producer running ahead into the next product overwrote slots still being read)
    assert ops.get("FENCE.VIEW.ASYNC.S", 0) > 1, ops
    # the only 128-bit global loads left are the activations' (2 where a step loads them, in each
    # of two consumer partitions: 64 today), not the words (one more a row tile at each place)
    assert ops.get("LDG.E.128", 0) <= 80, ops
