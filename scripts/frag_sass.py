"""Offline (no GPU needed): compile the fragment-order 4-bit kernel (kernels/quant_frag.py) for
sm_90 with the launcher's specializations (tools/sass/offline_sass.py) and print its
registers, its instruction mix and where its global loads sit relative to its mmas (a load issued
right before its use cannot hide its latency).

  python3 scripts/frag_sass.py --n 4096 --k 4096 --tiles 1x8x1x1 [--rows 4] [--silu-gate] [--sass FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's verispec and tools


def load_mma_order(sass: str) -> str:
    """Runs of loads, mmas, branches and shared-memory traffic, in program order (KINDxCOUNT@INDEX)."""
    from tools.sass import offline_sass

    runs: list[list] = []
    for i, op in enumerate(offline_sass.instructions(sass)):
        kind = op.split(" ")[0].split(".")[0]
        if kind not in ("LDG", "HMMA", "BRA", "BAR", "LDS", "STS"):
            continue
        if runs and runs[-1][1] == kind:
            runs[-1][2] += 1
        else:
            runs.append([i, kind, 1])
    return " ".join(f"{kind}x{count}@{i}" for i, kind, count in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--tiles", default="1x8x1x1", help="BLOCKSxWARPSxDEPTHxROWTILES")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--silu-gate", action="store_true")
    parser.add_argument("--sass", default=None, help="write the whole SASS here")
    args = parser.parse_args()
    from tools.sass import offline_sass
    from verispec.quant.kernels import frag as qf

    tiles = qf.FragTiles(*(int(v) for v in args.tiles.split("x")))
    compiled = offline_sass.compile_frag(args.n, args.k, tiles, silu_gate=args.silu_gate, rows=args.rows)
    counts = offline_sass.opcode_counts(compiled.sass)
    print(f"registers {compiled.registers}, stack {compiled.stack} B, shared {compiled.shared} B, "
          f"{sum(counts.values())} instructions")
    print(", ".join(f"{op} {c}" for op, c in counts.most_common(25)))
    print(load_mma_order(compiled.sass))
    if args.sass:
        Path(args.sass).write_text(compiled.sass)


if __name__ == "__main__":
    main()
