"""On CUDA, a row's result alone == the same row among 8, over many random inputs, bit for bit: the
fragment-order 4-bit product (quant_frag.frag_gemv) in several tiles and its default ones, with and
without the SiLU(gate) * up epilogue, and the MLP's streaming kernel (stream_mlp.StreamMLP) as the
engine runs it. Speculative greedy == plain greedy rests on this (a verify pass runs k+1 rows where a
decode step runs one). The streaming kernel run again and again on one input must also give one
result, the launched products' (its slots are handed back to the producer only after a fence; a short
gate_up, K = 512, once showed it).
"""
from __future__ import annotations

import pytest
import torch

from verispec.quant.kernels import frag as qf, frag_dequantize, stream_mlp
from verispec.quant import mlx_affine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or qf.gluon is None
                                 or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU and Gluon")]

DEVICE = "cuda"
TRIALS = 10
REPEATS = 60
ROWS = qf.MAX_ROWS
# weight [N, K] -> tiles (BLOCKSxWARPSxDEPTHxROWTILES; "default": what frag_gemv picks for the width)
GEMV_CASES = {(3072, 512): ["1x4x1x4", "1x8x1x1", "2x4x1x2", "1x4x2x4", "default"],
              (24576, 4096): ["1x4x2x4", "1x4x1x4", "default"],
              (512, 1536): ["2x4x1x2", "4x4x1x1", "1x8x1x1", "default"]}
# (hidden, intermediate): a tiny test model's MLP (a short gate_up) and Qwen3-8B's
STREAM_SHAPES = [(512, 1024), (4096, 12288)]


def random_frag(n: int, k: int, seed: int, group: int = 64) -> qf.FragWeights:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
    packed, scales, biases = mlx_affine.quantize(w, mlx_affine.AffineSpec(4, group))
    return qf.repack(packed, scales, biases, group)


def tiles_of(text: str) -> qf.FragTiles | None:
    return None if text == "default" else qf.FragTiles(*(int(v) for v in text.split("x")))


@pytest.mark.parametrize("silu_gate", [False, True])
@pytest.mark.parametrize("shape,tiles", [(shape, t) for shape, tiles in GEMV_CASES.items() for t in tiles],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_frag_gemv_rows_alone_equal_rows_together(shape, tiles, silu_gate):
    n, k = shape
    fw = random_frag(n, k, seed=n + k)
    w = frag_dequantize.dequantize(fw, torch.float64)
    gen = torch.Generator().manual_seed(0)
    differing, worst, baseline = 0, 0.0, 0.0
    for _ in range(TRIALS):
        x = torch.randn(ROWS, k, generator=gen).to(DEVICE, torch.bfloat16)
        together = qf.frag_gemv(x, fw, tiles_of(tiles), silu_gate=silu_gate)
        for r in range(ROWS):
            differing += not torch.equal(qf.frag_gemv(x[r:r + 1], fw, tiles_of(tiles), silu_gate=silu_gate)[0],
                                         together[r])
        if not silu_gate:  # against float64, next to a bf16 product of the same weights
            ref = x.double() @ w.T
            worst = max(worst, float(((together.double() - ref).norm(dim=1) / ref.norm(dim=1)).max()))
            plain = (x @ w.to(torch.bfloat16).T).double()
            baseline = max(baseline, float(((plain - ref).norm(dim=1) / ref.norm(dim=1)).max()))
    assert differing == 0, f"{differing} of {ROWS * TRIALS} rows differ alone"
    assert worst < 2 * baseline + 1e-4, (worst, baseline)


@pytest.mark.parametrize("hidden,intermediate", STREAM_SHAPES)
def test_stream_mlp_rows_alone_equal_rows_together_and_runs_repeat(hidden, intermediate):
    gate_up = random_frag(2 * intermediate, hidden, seed=1)
    down = random_frag(hidden, intermediate, seed=2)
    stream = stream_mlp.StreamMLP(gate_up, down, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    differing = 0
    for _ in range(TRIALS):
        x = torch.randn(ROWS, hidden, generator=gen).to(DEVICE, torch.bfloat16)
        together = stream(x)
        for r in range(ROWS):
            differing += not torch.equal(stream(x[r:r + 1])[0], together[r])
    assert differing == 0, f"{differing} of {ROWS * TRIALS} rows differ alone"
    # one input again and again: one result, the two products launched with the same tiles
    (rt1, kb1), (rt2, kb2) = stream.plan
    x = torch.randn(ROWS, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    h = qf.frag_gemv(x, gate_up, qf.FragTiles(kb1, stream_mlp.WARPS, 1, rt1), silu_gate=True)
    launched = qf.frag_gemv(h, down, qf.FragTiles(kb2, stream_mlp.WARPS, 1, rt2))
    wrong = sum(not torch.equal(stream(x), launched) for _ in range(REPEATS))
    assert wrong == 0, f"{wrong} of {REPEATS} runs differ from the launched products"
