"""Offline (no GPU needed): compile the fragment-order 4-bit kernel (kernels/quant_frag.py) for
sm_90 and print its SASS, or a summary of its main loop: the instruction mix and where the global
loads sit relative to the mmas (a load issued right before its use cannot hide its latency).

  python3 scripts/frag_sass.py --n 4096 --k 4096 --tiles 1x8x1x1 [--sass FILE]
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from verispec.kernels import quant_frag as qf  # noqa: E402


def compile_sass(n: int, k: int, tiles: qf.FragTiles, group: int = 64, silu_gate: bool = False,
                 grid_wait: bool = True, release: int = 0, rows: int = 1) -> tuple[str, dict]:
    blocks = tiles.blocks
    while (k // qf.BLOCK) % (blocks * tiles.num_warps) and blocks > 1:
        blocks //= 2
    lw, lx, lt = qf._layouts(tiles.num_warps, blocks, tiles.row_tiles)
    fn = qf._frag_kernel
    sig = {"X": "*bf16", "WQ": "*i32", "T": "*bf16", "Y": "*bf16", "M": "i32", "N": "i32",
           "stride_xm": "i32", "stride_ym": "i32"}
    constexprs = dict(K=k, GROUP=group, ZERO_POINT=False, KB=blocks, GRID_WAIT=grid_wait,
                      DECODE_ASM=qf._decode_asm(False), LW=lw, LX=lx, LT=lt, DEPTH=tiles.depth,
                      SILU_GATE=silu_gate, RT=tiles.row_tiles, RELEASE=release)
    for name in constexprs:
        sig[name] = "constexpr"
    # as the launcher specializes them: 16-byte aligned pointers, sizes and strides that are
    # multiples of 16 (N and the strides here), and M == 1 as a constant (one-row decode)
    if rows == 1:
        sig["M"] = "constexpr"
        constexprs["M"] = 1
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("X", "WQ", "T", "Y", "N", "stride_xm", "stride_ym")}
    src = GluonASTSource(fn, sig, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tiles.num_warps})
    cubin = compiled.asm["cubin"]
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    meta = {"shared": compiled.metadata.shared}
    return sass, meta


def summarize(sass: str) -> None:
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", ln).split(";")[0].strip() for ln in lines]
    opcode = [re.sub(r"^@!?U?P\w+\s+", "", o).split(" ")[0] for o in ops]
    print(f"{len(ops)} instructions")
    print(collections.Counter(o.split(".")[0] for o in opcode).most_common(25))
    # the sequence of loads and mmas, in order, with their positions
    trace = [(i, o) for i, o in enumerate(opcode) if o.startswith(("LDG", "HMMA", "BRA", "BAR", "LDS", "STS"))]
    compact = []
    for i, o in trace:
        key = o.split(".")[0]
        if compact and compact[-1][1] == key:
            compact[-1][2] += 1
        else:
            compact.append([i, key, 1])
    print(" ".join(f"{key}x{c}@{i}" for i, key, c in compact))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--tiles", default="1x8x1x1")
    parser.add_argument("--silu-gate", action="store_true")
    parser.add_argument("--sass", default=None, help="write the whole SASS here")
    args = parser.parse_args()
    tiles = qf.FragTiles(*(int(v) for v in args.tiles.split("x")))
    sass, meta = compile_sass(args.n, args.k, tiles, silu_gate=args.silu_gate)
    print(meta)
    summarize(sass)
    if args.sass:
        Path(args.sass).write_text(sass)


if __name__ == "__main__":
    main()
