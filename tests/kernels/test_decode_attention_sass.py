"""The split-K attention kernel compiled for sm_90 on the CPU (tools/sass/offline_sass.py), as
`decode_attention` launches it for Qwen3-8B under programmatic launch: its results are checked on the
GPU (test_decode_attention.py), this checks what its prefetch rests on.

- with PREFETCH each program asks L2 for its first key block (`prefetch.global.L2`, SASS
  `CCTL.E.PF2`) before `griddepcontrol.wait` (SASS `ACQBULK`): after it, the prefetch would only
  add instructions in front of the loads it was meant to hide;
- without it, or without programmatic launch, there is no prefetch at all;
- nothing spills to local memory.
"""
from __future__ import annotations

import pytest

from tools.sass import offline_sass
from verispec.kernels.decode_attention import split_config

# each module compiles its kernels for sm_90 in a subprocess (10-25 s): `make test-slow` and CI run it
pytestmark = pytest.mark.slow

pytest.importorskip("triton")

CASES = [dict(tokens=t, paged=paged, pdl=pdl, prefetch=prefetch)
         for t in (1, 4) for paged in (False, True) for pdl, prefetch in ((True, True), (True, False), (False, False))]


@pytest.fixture(scope="module")
def compiled() -> list:
    return offline_sass.compile_frags([dict(case, kernel="split_attention") for case in CASES])


def _ids(case: dict) -> str:
    layout = "paged" if case["paged"] else "contiguous"
    return f"t{case['tokens']}-{layout}-pdl{int(case['pdl'])}-pf{int(case['prefetch'])}"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_ids(case) for case in CASES])
def test_prefetch_comes_before_the_launch_wait(compiled, index):
    case, result = CASES[index], compiled[index]
    ops = offline_sass.instructions(result.sass)
    prefetches = [i for i, op in enumerate(ops) if op.startswith("CCTL.E.PF2")]
    waits = [i for i, op in enumerate(ops) if op.startswith("ACQBULK")]
    assert result.stack == 0, f"{result.stack} bytes of spills"
    assert bool(waits) == case["pdl"]
    if not case["prefetch"]:
        assert not prefetches
        return
    # a key block's cache lines of K and V, over the program's threads (64 keys x 2 lines x 2 over
    # 128 threads: 2 prefetches a thread)
    config = split_config(128, 2)
    assert len(prefetches) == config["BLOCK_N"] * config["LINES"] * 2 // (config["num_warps"] * 32), ops[:80]
    assert max(prefetches) < min(waits)


@pytest.fixture(scope="module")
def compiled_prompt() -> list:
    return offline_sass.compile_frags([dict(kernel="chunk_attention", paged=paged) for paged in (True, False)])


@pytest.mark.parametrize("index", range(2), ids=["paged", "contiguous"])
def test_the_prompt_kernel_keeps_its_tiles_in_registers(compiled_prompt, index):
    """The prompt kernel holds two [128, 128] float32 sums a program (a share's and the folded
    ones) beside q: with 128-key blocks it spilled 600 bytes a thread and took 1.3x its time; its
    64-key blocks spill 56-120 bytes."""
    assert compiled_prompt[index].stack <= 128, f"{compiled_prompt[index].stack} bytes of spills"
