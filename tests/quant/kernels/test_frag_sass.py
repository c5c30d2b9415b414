"""The fragment-order 4-bit kernel compiled for sm_90 on the CPU (tools/sass/offline_sass.py),
as `frag_gemv` launches it for each of Qwen3-8B's layers at one row (decode) and four (verify):
its arithmetic is checked on the GPU (test_frag.py), this checks what its speed rests on.

- it compiles (a Gluon error would otherwise show only on a GPU);
- every global load is 64 or 128 bits wide: the words, activation pairs and group terms are
  vector loads (a narrower one means ptxas lost the vectorization: ~4x the load instructions);
- nothing spills to local memory;
- its registers leave room for the whole grid at once on an H200 (132 multiprocessors): a layer
  whose programs need a second wave takes about twice as long.
"""
from __future__ import annotations

import dataclasses

import pytest

from tools.sass import offline_sass
from verispec.quant.kernels import frag as qf

# each module compiles its kernels for sm_90 in a subprocess (10-25 s): `make test-slow` and CI run it
pytestmark = pytest.mark.slow

pytest.importorskip("triton.experimental.gluon")

H200_MULTIPROCESSORS = 132
REGISTERS_PER_MULTIPROCESSOR = 65536

# Qwen3-8B: (name, N, K, SiLU(gate) * up in the epilogue)
LAYERS = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 24576, 4096, True),
          ("down", 4096, 12288, False), ("lm_head", 151936, 4096, False)]


def programs_per_multiprocessor(registers: int, warps: int) -> int:
    """Programs resident at once by their registers (allocated per warp, rounded up to 8 a thread)."""
    per_thread = -(-registers // 8) * 8
    return min(REGISTERS_PER_MULTIPROCESSOR // (per_thread * 32 * warps), 2048 // (32 * warps))


CASES = [(name, n, k, silu_gate, rows) for name, n, k, silu_gate in LAYERS for rows in (1, 4)]


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every case compiled in one child process (see offline_sass.compile_frags), plus float16
    activations (another decode and widening) on o: {(name, rows) or "o-f16": CompiledFrag}."""
    cases = [dict(n=n, k=k, tiles=list(dataclasses.astuple(qf.tiles_for(n, k, rows))), silu_gate=silu_gate, rows=rows)
             for _, n, k, silu_gate, rows in CASES]
    cases.append(dict(n=4096, k=4096, tiles=list(dataclasses.astuple(qf.tiles_for(4096, 4096))), dtype="float16"))
    results = offline_sass.compile_frags(cases)
    keyed = {(name, rows): result for (name, _, _, _, rows), result in zip(CASES, results)}
    keyed["o-f16"] = results[-1]
    return keyed


def _global_loads(sass: str) -> dict[str, int]:
    return {op: count for op, count in offline_sass.opcode_counts(sass).items() if op.startswith("LDG")}


@pytest.mark.parametrize("name,n,k,silu_gate,rows", CASES, ids=[f"{case[0]}-{case[4]}" for case in CASES])
def test_compiled_kernel_loads_vectors_without_spills(compiled, name, n, k, silu_gate, rows):
    tiles = qf.tiles_for(n, k, rows)
    result = compiled[(name, rows)]
    loads = _global_loads(result.sass)
    assert loads, "no global loads in the compiled kernel"
    assert set(loads) <= {"LDG.E.128", "LDG.E.64"}, f"{name}: narrow global loads {loads}"
    assert result.stack == 0, f"{name}: {result.stack} bytes of local memory a thread (spills)"
    grid = -(-n // (qf.TILE_ROWS * qf.MAX_ROW_TILES)) * qf.MAX_ROW_TILES // tiles.row_tiles
    if name != "lm_head":  # the vocabulary's 2,374 programs take several waves whatever the registers
        resident = programs_per_multiprocessor(result.registers, tiles.num_warps) * H200_MULTIPROCESSORS
        assert grid <= resident, (f"{name}: {result.registers} registers a thread leave room for {resident} "
                                  f"programs at once, the grid has {grid}")


def test_half_precision_activations_compile_alike(compiled):
    """float16 activations take another decode (1024 + q) and widening: same loads, no spills."""
    result = compiled["o-f16"]
    assert set(_global_loads(result.sass)) <= {"LDG.E.128", "LDG.E.64"} and result.stack == 0
