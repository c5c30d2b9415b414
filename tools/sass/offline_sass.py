"""Compile the fragment-order 4-bit kernel (quant_frag.py), the split-K attention kernel
(decode_attention.py) and the MLP's streaming kernel (stream_chain.py) for sm_90 on a machine without
a GPU, and read what ptxas made of them: the SASS (Triton's bundled nvdisasm) and the registers,
stack and shared memory (cuobjdump). The kernels' arithmetic is checked on the GPU; this lets CPU CI
check that they compile, with the launcher's specializations, into the instructions and register
budget their speed depends on (tests/kernels/test_*_sass.py), and scripts/frag_sass.py print them.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from verispec.quant.kernels import frag as qf

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class CompiledFrag:
    sass: str
    registers: int
    stack: int  # bytes of local memory a thread (spills)
    shared: int  # bytes a program


def _tool(name: str) -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_frag(n: int, k: int, tiles: qf.FragTiles, dtype: torch.dtype = torch.bfloat16, group: int = 64,
                 silu_gate: bool = False, rows: int = 1) -> CompiledFrag:
    """`frag._frag_kernel` for a weight [n, k] and `rows` activation rows, as `frag_gemv`
    launches it with programmatic launch on: the launcher's specializations included (16-byte
    aligned pointers, N and the strides multiples of 16, M == 1 a constant). Not in a process
    with TRITON_INTERPRET set (Triton's own reductions are then interpreter functions, which a
    compile cannot call): `compile_frags` runs there."""
    fn = qf._frag_kernel
    act = "*" + _TYPES[dtype]
    signature = {"X": act, "WQ": "*i32", "T": act, "Y": act, "M": "i32", "N": "i32", "stride_xm": "i32",
                 "stride_ym": "i32"}
    constexprs = qf.launch_constexprs(k, group, False, tiles, dtype == torch.float16, silu_gate, pdl=True)
    if rows == 1:
        constexprs["M"] = 1
    return compile_gluon(fn, signature, constexprs, ("X", "WQ", "T", "Y", "N", "stride_xm", "stride_ym"),
                         tiles.num_warps)


def compile_split_attention(tokens: int, paged: bool, pdl: bool, prefetch: bool) -> CompiledFrag:
    """`decode_attention._split_kernel` as `_launch` compiles it for Qwen3-8B's attention (bfloat16,
    4 query heads a kv head, head dim 128, 16 splits) at `tokens` query tokens."""
    from verispec.kernels import decode_attention as da
    fn = da._split_kernel
    signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KS": "*bf16", "VS": "*bf16", "POS": "*i32",
                 "OPART": "*fp32", "LSE": "*fp32",
                 "BT": "*i32", "KCB": "*bf16", "VCB": "*bf16", "scale": "fp32", "window": "i32"}
    strides = [name for name in fn.arg_names if name.startswith("stride_")]
    signature.update({name: "i32" for name in strides})
    config = da.split_config(128, 2)
    num_warps, num_stages = config.pop("num_warps"), config.pop("num_stages")
    constexprs = dict(config, T=tokens, G=4, D=128, NUM_SPLITS=16, BLOCK_M=16, HAS_WINDOW=False, IEEE=False,
                      PAGED=paged, PAGE=16, MIN_KEYS=da.MIN_SHARE_KEYS, PDL=pdl, EARLY=pdl, PREFETCH=prefetch,
                      FP8=False, KBITS=0, VBITS=0)
    # the launcher's 16-divisibility specializations (the positions' and table's are turned off)
    divisible = ("Q", "K", "V", "KS", "VS", "OPART", "LSE", "KCB", "VCB", *(n for n in strides if n not in ("stride_pb", "stride_btb")))
    return compile_gluon(fn, signature, constexprs, divisible, num_warps, num_stages=num_stages, gluon=False)


def compile_chunk_attention(paged: bool, block_n: int | None = None, num_stages: int | None = None,
                            num_warps: int | None = None) -> CompiledFrag:
    """`prompt_attention._chunk_kernel` as `_launch_chunk` compiles it for a Qwen3-8B prompt chunk
    (bfloat16, 4 query heads a kv head, head dim 128, 16 shares, 32 query tokens a program);
    block_n / num_stages / num_warps override the launcher's (to compare tilings)."""
    from verispec.kernels import decode_attention as da
    from verispec.kernels import prompt_attention
    fn = prompt_attention._chunk_kernel
    signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KS": "*bf16", "VS": "*bf16", "POS": "*i32",
                 "LEN": "*i32", "OUT": "*bf16", "BT": "*i32", "KCB": "*bf16", "VCB": "*bf16", "scale": "fp32",
                 "window": "i32", "T": "i32", "has_len": "i32"}
    strides = [name for name in fn.arg_names if name.startswith("stride_")]
    signature.update({name: "i32" for name in strides})
    launch = prompt_attention.chunk_launch_config(128, 2, group=4)
    block_n = block_n or launch["BLOCK_N"]
    constexprs = dict(G=4, D=128, SHARES=16, TQ=launch["TQ"], BLOCK_M=launch["BLOCK_M"], BLOCK_N=block_n,
                      BLOCK_D=launch["BLOCK_D"], HAS_WINDOW=False, IEEE=False, PAGED=paged, PAGE=16,
                      MIN_KEYS=da._min_share_keys(block_n, 8), FP8=False, KBITS=0, VBITS=0,
                      ONE_WALK=prompt_attention.ONE_WALK)
    divisible = ("Q", "K", "V", "KS", "VS", "OUT", "KCB", "VCB", *(n for n in strides if n not in ("stride_pb", "stride_btb")))
    return compile_gluon(fn, signature, constexprs, divisible, num_warps or launch["num_warps"],
                         num_stages=num_stages or launch["num_stages"], gluon=False)


# Qwen3-8B's MLP and attention output products: (out_features, in_features)
STREAM_SHAPES = {"o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@dataclasses.dataclass
class _Product:
    """What stream_chain.constexprs reads of a weight: its shape and group size."""
    out_features: int
    in_features: int
    group_size: int = 64


def compile_stream_chain(products: list[str], plan: list[tuple[int, int]], slots: int, warps: int,
                         programs: int = 132, half: bool = False, **options) -> CompiledFrag:
    """`stream_chain._stream_kernel` for a chain of STREAM_SHAPES products (e.g. o, gate_up, down),
    plan: each product's (row tiles, blocks a warp a step); options: stream_chain.constexprs'."""
    from verispec.quant.kernels import stream_chain as sc
    layout = sc.tma_layout()
    act = "*fp16" if half else "*bf16"
    signature = {name: act for name in ("X", "A", "H", "Y", "R", "RN", "NW")}
    signature.update({"M": "i32", "COUNTER": "*i64", "XS": "*fp32", "EPS": "fp32"})
    for i, (rt, kb) in enumerate(list(plan) + [plan[-1]] * (3 - len(plan)), 1):
        signature[f"wd{i}"] = f"tensordesc<i32[{rt}, {warps * kb}, {sc.WORD_ROWS}],{layout!r}>"
        signature[f"td{i}"] = f"tensordesc<i32[{rt}, {warps * kb}, {sc.TERM_COLS}],{layout!r}>"
    fws = [_Product(*STREAM_SHAPES[name]) for name in products]
    constexprs = sc.constexprs(fws, [tuple(step) for step in plan], slots, programs, warps, half=half, **options)
    return compile_gluon(sc._stream_kernel, signature, constexprs, ("X", "A", "H", "Y"), warps)


def compile_gluon(fn, signature: dict, constexprs: dict, divisible: tuple[str, ...], num_warps: int,
                  num_stages: int | None = None, gluon: bool = True) -> CompiledFrag:
    """A Gluon (or, gluon False, plain Triton) kernel compiled for sm_90 (signature: the runtime
    arguments' types; constexprs: the rest; divisible: the arguments the launcher sees as multiples
    of 16), with its SASS and usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = dict(signature)
    for name in constexprs:
        signature[name] = "constexpr"
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    source = (GluonASTSource if gluon else ASTSource)(fn, signature, constexprs, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"offline_sass: no resource usage in cuobjdump's output: {usage[:200]!r}")
    registers, stack, shared = (int(v) for v in found.groups())
    return CompiledFrag(sass, registers, stack, max(shared, compiled.metadata.shared))


def instructions(sass: str) -> list[str]:
    """The SASS's instructions in order, predicates dropped (e.g. 'LDG.E.128 R12, desc[UR6][R60.64]')."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", ln).split(";")[0].strip() for ln in lines]
    return [re.sub(r"^@!?U?P\w+\s+", "", op) for op in ops]


def opcode_counts(sass: str) -> collections.Counter:
    """Instructions by full opcode (with its modifiers: LDG.E.128 apart from LDG.E)."""
    return collections.Counter(op.split(" ")[0] for op in instructions(sass))


def compile_frags(cases: list[dict]) -> list[CompiledFrag]:
    """`compile_frag(**case)` for each case (dtype as its name, e.g. "bfloat16"; tiles as
    [blocks, warps, depth, row_tiles]; or, with "kernel": "split_attention",
    `compile_split_attention(**case)`; with "kernel": "stream_chain", `compile_stream_chain(**case)`),
    in a fresh Python process without TRITON_INTERPRET (the test suite runs the other kernels in
    Triton's interpreter), importing this checkout's verispec and tools."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    env["VERISPEC_TRITON"] = "1"  # the kernels defined without a GPU (verispec/kernels/triton_import.py)
    done = subprocess.run([sys.executable, "-m", "tools.sass.offline_sass"], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, cwd=_ROOT)
    if done.returncode:
        raise RuntimeError(f"offline_sass: compiling {len(cases)} cases failed: {done.stderr[-2000:]}")
    return [CompiledFrag(**result) for result in json.loads(done.stdout)]


def _main() -> None:
    results = []
    for case in json.loads(sys.stdin.read()):
        kernel = case.pop("kernel", "frag")
        if kernel == "split_attention":
            results.append(dataclasses.asdict(compile_split_attention(**case)))
            continue
        if kernel == "chunk_attention":
            results.append(dataclasses.asdict(compile_chunk_attention(**case)))
            continue
        if kernel == "stream_chain":
            results.append(dataclasses.asdict(compile_stream_chain(**case)))
            continue
        case = dict(case, tiles=qf.FragTiles(*case["tiles"]), dtype=getattr(torch, case.get("dtype", "bfloat16")))
        results.append(dataclasses.asdict(compile_frag(**case)))
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
