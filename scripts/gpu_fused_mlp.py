"""On the lent GPU: a 4-bit gated MLP's decode / verify pass as one kernel, split along the
intermediate dimension, against the two launches it would replace (gate/up with SiLU in its
epilogue, then down). Measured slower (docs/benchmarks.md, "Nineteenth session"): kept here, not in
the package, so that the idea is not tried again without something new.

The kernel (Gluon, sm_90, the weights in quant_frag's fragment order): program p computes the
intermediate values of one 64-value block of down's K (SiLU(gate) * up for units 64p .. 64p + 63:
the gate/up tiles' whole K loop, `quant_frag.frag_sums`), keeps them in registers as the mma's B
operand, and multiplies them by down's block p of every output row (`quant_frag.block_sums`): a
float32 partial sum per output row. After a grid-wide barrier (all P = I/64 programs resident: the
launcher asks the driver's occupancy calculation) each program adds the P partial sums of 32
output columns in a fixed order. One launch, no intermediate activation in memory, and rows
independent: every output element's terms and their order depend on neither M nor other rows.

Checks: the torch reference (gate and up rounded to the activations' dtype, SiLU(gate) * up
rounded, down's sums in float32), the unfused launches, a row alone == the same row among M.
Times: under a CUDA graph cycling through copies of the weights (read from memory, not L2), the
whole kernel and its parts (`--phases`: 1 the gate/up part alone, 2 without the barrier and sums).

  python3 scripts/gpu_fused_mlp.py [--rows 1,4] [--tiles 4x1x2x4,...] [--shape 4096x12288] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_persistent_bound import random_frag, synchronize_or_exit  # noqa: E402
from verispec.quant.kernels.grid_sync import grid_barrier, resident_per_multiprocessor  # noqa: E402
from gpu_timing import cycle_time_us  # noqa: E402
from verispec.kernels import launch, offline_sass  # noqa: E402
from verispec.quant.kernels import frag_dequantize  # noqa: E402
from verispec.quant.kernels import frag as qf  # noqa: E402
from verispec.quant.kernels import gemv as quant_gemv  # noqa: E402
from verispec.quant.kernels.gemv import gl, gluon  # noqa: E402

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

BLOCK = qf.BLOCK  # intermediate units a program takes: one block of down's K
PASS_TILES = 4  # gate/up row tiles (8 gate + 8 up rows each) a pass of the K loop takes
COLUMNS = 32  # output columns a program adds the partial sums of


@dataclasses.dataclass(frozen=True)
class FusedTiles:
    """Warps a program; gate/up blocks a warp a step and steps in flight; down tiles a warp a step."""
    num_warps: int = 8
    gate_blocks: int = 1
    gate_depth: int = 2
    down_tiles: int = 2


def unsupported_reason(x: torch.Tensor, gate_up: qf.FragWeights, down: qf.FragWeights) -> str | None:
    """Why `fused_mlp` cannot take these (None: it can)."""
    if reason := qf.unsupported_reason(x.device, x.dtype, 4, gate_up.group_size, gate_up.in_features):
        return reason
    hidden, intermediate = gate_up.in_features, gate_up.out_features // 2
    if x.shape[-1] != hidden or down.in_features != intermediate or down.out_features != hidden:
        return (f"shapes: x [.., {x.shape[-1]}], gate/up [{gate_up.out_features}, {gate_up.in_features}], "
                f"down [{down.out_features}, {down.in_features}]")
    if intermediate % BLOCK:
        return f"{intermediate} intermediate features (not a multiple of {BLOCK})"
    if hidden % COLUMNS:
        return f"{hidden} hidden features (not a multiple of {COLUMNS})"
    if down.group_size % BLOCK:
        return f"down's group size {down.group_size} (a multiple of {BLOCK})"
    if gate_up.zero_point != down.zero_point:
        return "gate/up and down with different zero-point conventions"
    if gate_up.terms.dtype != x.dtype or down.terms.dtype != x.dtype:
        return f"activations in {x.dtype} for terms in {gate_up.terms.dtype} / {down.terms.dtype}"
    return None


if gluon is not None:
    _PASS_TILES = gl.constexpr(PASS_TILES)
    _COLUMNS = gl.constexpr(COLUMNS)
    _MAX_ROWS = gl.constexpr(qf.MAX_ROWS)

    @gluon.jit
    def _intermediate_operand(X, WG, TG, M, stride_xm, p, H: gl.constexpr, GROUP_G: gl.constexpr,
                              ZERO_POINT: gl.constexpr, KBG: gl.constexpr, DEPTH_G: gl.constexpr,
                              DECODE_ASM: gl.constexpr, LWG: gl.constexpr, LXG: gl.constexpr, LTG: gl.constexpr):
        """Program p's 64 intermediate values SiLU(gate) * up [64 (k in the mma's order), 8 rows],
        rounded to the activations' dtype as the unfused path stores them."""
        DT: gl.constexpr = X.dtype.element_ty
        MT: gl.constexpr = _MAX_ROWS
        RT: gl.constexpr = _PASS_TILES
        # two passes of 4 gate/up tiles: units 64p + 32*pass + 8*rt + g
        y0 = qf.frag_sums(X, WG, TG, M, stride_xm, 2 * p, H, GROUP_G, ZERO_POINT, KBG, True, DECODE_ASM, LWG,
                          LXG, LTG, DEPTH_G, RT)
        h0 = qf.silu_gated(y0, RT, DT).to(DT)
        y1 = qf.frag_sums(X, WG, TG, M, stride_xm, 2 * p + 1, H, GROUP_G, ZERO_POINT, KBG, False, DECODE_ASM, LWG,
                          LXG, LTG, DEPTH_G, RT)
        h1 = qf.silu_gated(y1, RT, DT).to(DT)
        a = gl.reshape(gl.permute(gl.join(h0, h1), (2, 0, 1)), [64, MT])  # [block position, row]
        # block position 16t + 4c + 2h + j is what the mma sees at k = 16c + 8h + 2t + j (quant_frag)
        return gl.reshape(gl.permute(gl.reshape(a, [4, 4, 2, 2, MT]), (1, 2, 0, 3, 4)), [64, MT])

    @gluon.jit
    def _down_pointers(WD, TD, p, I: gl.constexpr, GROUP_D: gl.constexpr, LW: gl.constexpr, LT: gl.constexpr,
                       BT: gl.constexpr):
        """Pointers to the words and group terms of down's block p for the step's BT row tiles (batch
        entry b: tile b, to be advanced by BT tiles a step)."""
        NB: gl.constexpr = I // 64
        wb = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LW)))))
        wg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, LW)))))
        wt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, LW)))))
        wc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LW)))))
        w_tile = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wb, 1), 2), 3), 4)
        w_lane = (gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wg, 0), 1), 3), 4) * 16
                  + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wt, 0), 1), 2), 4) * 4
                  + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wc, 0), 1), 2), 3))
        w_ptr = WD + (w_tile.to(gl.int64) * NB + p) * 128 + w_lane
        tb = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LT))))
        tg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LT))))
        tw = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LT))))
        t_tile = gl.expand_dims(gl.expand_dims(gl.expand_dims(tb, 1), 2), 3)
        t_ptr = (TD.to(gl.pointer_type(gl.int32), bitcast=True) + t_tile.to(gl.int64) * (I // GROUP_D * 16)
                 + (p * 64 // GROUP_D) * 16
                 + gl.expand_dims(gl.expand_dims(gl.expand_dims(tg, 0), 1), 3) * 2
                 + gl.expand_dims(gl.expand_dims(gl.expand_dims(tw, 0), 1), 2))
        return w_ptr, t_ptr

    @gluon.jit
    def _fused_mlp_kernel(X, WG, TG, WD, TD, PART, Y, COUNTER, M, stride_xm, stride_ym,
                          H: gl.constexpr, I: gl.constexpr, GROUP_G: gl.constexpr, GROUP_D: gl.constexpr,
                          ZERO_POINT: gl.constexpr, DECODE_ASM: gl.constexpr, KBG: gl.constexpr,
                          DEPTH_G: gl.constexpr, LWG: gl.constexpr, LXG: gl.constexpr, LTG: gl.constexpr,
                          KBD: gl.constexpr, LWD: gl.constexpr, LTD: gl.constexpr, P: gl.constexpr,
                          PP: gl.constexpr, PHASES: gl.constexpr = 3):
        """One program per block of down's K (P = I / 64); PP: P rounded up to a power of two.
        PHASES (for measurements): 1 the gate/up part alone, 2 without the barrier and the sums."""
        p = gl.program_id(0)
        WS: gl.constexpr = gl.num_warps()
        MT: gl.constexpr = _MAX_ROWS
        DT: gl.constexpr = X.dtype.element_ty
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        LS: gl.constexpr = gl.SliceLayout(2, MMA)
        BT: gl.constexpr = WS * KBD  # down tiles a step
        STEPS: gl.constexpr = H // 16 // BT

        # down's first two steps' words do not depend on anything: asked for before the gate/up loop
        w_ptr, t_ptr = _down_pointers(WD, TD, p, I, GROUP_D, LWD, LTD, BT)
        W_STEP: gl.constexpr = BT * (I // 64) * 128
        T_STEP: gl.constexpr = BT * (I // GROUP_D) * 16
        words_a = gl.load(w_ptr)
        terms_a = gl.load(t_ptr)
        words_b = gl.load(w_ptr + gl.minimum(1, STEPS - 1) * W_STEP)
        terms_b = gl.load(t_ptr + gl.minimum(1, STEPS - 1) * T_STEP)
        a = _intermediate_operand(X, WG, TG, M, stride_xm, p, H, GROUP_G, ZERO_POINT, KBG, DEPTH_G, DECODE_ASM,
                                  LWG, LXG, LTG)
        L3: gl.constexpr = gl.BlockedLayout([1, 2, 1], [1, 4, 8], [1, WS, 1], [2, 1, 0])
        a3 = gl.expand_dims(gl.convert_layout(a, gl.SliceLayout(0, L3)), 0)
        a3, _ = gl.broadcast(a3, gl.zeros([BT, 64, MT], DT, layout=L3))
        b = gl.convert_layout(a3, LB)
        zero = gl.zeros([BT, 16, MT], gl.float32, layout=MMA)
        xs = mma_v2(gl.full([BT, 16, 64], 1.0, DT, layout=LA), b, zero)

        # partial sums of down's block p for every output row: PART [P, 8, H] float32
        pt = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        pr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        pm = gl.arange(0, MT, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        col = gl.expand_dims(gl.expand_dims(pt, 1), 2) * 16 + gl.expand_dims(gl.expand_dims(pr, 0), 2)
        row = gl.expand_dims(gl.expand_dims(pm, 0), 1)
        part_ptr = PART + (p * MT + row).to(gl.int64) * H + col
        part_mask = (row < M) & (col >= 0)
        if PHASES == 1:  # measuring the gate/up part alone: keep its result
            gl.store(part_ptr, xs, mask=part_mask)
        else:
            _down_steps(part_ptr, part_mask, w_ptr, t_ptr, words_a, terms_a, words_b, terms_b, b, xs, zero, STEPS,
                        W_STEP, T_STEP, BT, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
        if PHASES == 3:
            grid_barrier(COUNTER, P)
            _add_partials(PART, Y, M, stride_ym, p, H, P, PP, WS)

    @gluon.jit
    def _down_steps(part_ptr, part_mask, w_ptr, t_ptr, words_a, terms_a, words_b, terms_b, b, xs, zero,
                    STEPS: gl.constexpr, W_STEP: gl.constexpr, T_STEP: gl.constexpr, BT: gl.constexpr,
                    ZERO_POINT: gl.constexpr, DECODE_ASM: gl.constexpr, DT: gl.constexpr, LA: gl.constexpr,
                    LB: gl.constexpr, LS: gl.constexpr):
        """Down's block p times b for every output row tile, BT tiles a step, stored as partial sums
        (the first two steps' words and terms already loaded)."""
        # two steps in flight: three buffers in turn, unrolled by three; loads past the last step
        # re-read it (never used)
        for tri in range(STEPS // 3):
            s = 3 * tri
            words_c = gl.load(w_ptr + gl.minimum(s + 2, STEPS - 1) * W_STEP)
            terms_c = gl.load(t_ptr + gl.minimum(s + 2, STEPS - 1) * T_STEP)
            out = qf.block_sums(zero, words_a, terms_a, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS, b=b, xs=xs)
            gl.store(part_ptr + s * (BT * 16), out, mask=part_mask)
            words_a = gl.load(w_ptr + gl.minimum(s + 3, STEPS - 1) * W_STEP)
            terms_a = gl.load(t_ptr + gl.minimum(s + 3, STEPS - 1) * T_STEP)
            out = qf.block_sums(zero, words_b, terms_b, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS, b=b, xs=xs)
            gl.store(part_ptr + (s + 1) * (BT * 16), out, mask=part_mask)
            words_b = gl.load(w_ptr + gl.minimum(s + 4, STEPS - 1) * W_STEP)
            terms_b = gl.load(t_ptr + gl.minimum(s + 4, STEPS - 1) * T_STEP)
            out = qf.block_sums(zero, words_c, terms_c, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS, b=b, xs=xs)
            gl.store(part_ptr + (s + 2) * (BT * 16), out, mask=part_mask)
        if STEPS % 3 >= 1:
            out = qf.block_sums(zero, words_a, terms_a, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS, b=b, xs=xs)
            gl.store(part_ptr + (STEPS - STEPS % 3) * (BT * 16), out, mask=part_mask)
        if STEPS % 3 == 2:
            out = qf.block_sums(zero, words_b, terms_b, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS, b=b, xs=xs)
            gl.store(part_ptr + (STEPS - 1) * (BT * 16), out, mask=part_mask)

    @gluon.jit
    def _add_partials(PART, Y, M, stride_ym, p, H: gl.constexpr, P: gl.constexpr, PP: gl.constexpr,
                      WS: gl.constexpr):
        """y's columns of chunk p (and p + P, ...): the P partial sums added in a fixed order."""
        MT: gl.constexpr = _MAX_ROWS
        CHUNKS: gl.constexpr = H // _COLUMNS
        LR: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WS, 1], [1, 0])
        rp = gl.arange(0, PP, layout=gl.SliceLayout(1, LR))
        rc = gl.arange(0, _COLUMNS, layout=gl.SliceLayout(0, LR))
        yc = gl.arange(0, _COLUMNS, layout=gl.SliceLayout(0, LR))
        for chunk in range(p, CHUNKS, P):
            for m in range(M):
                src = (PART + (gl.expand_dims(rp, 1) * MT + m).to(gl.int64) * H + chunk * _COLUMNS
                       + gl.expand_dims(rc, 0))
                parts = gl.load(src, mask=gl.expand_dims(rp, 1) < P, other=0.0)
                total = gl.sum(parts, axis=0)
                gl.store(Y + m * stride_ym + chunk * _COLUMNS + yc, total.to(Y.dtype.element_ty))


def programs(gate_up: qf.FragWeights) -> int:
    """The kernel's program count: one per block of down's K."""
    return gate_up.out_features // 2 // BLOCK


def launch_constexprs(gate_up: qf.FragWeights, down: qf.FragWeights, tiles: FusedTiles, half: bool) -> dict:
    """`_fused_mlp_kernel`'s compile-time arguments (also what offline_sass compiles for CI)."""
    hidden, intermediate = gate_up.in_features, gate_up.out_features // 2
    gate_tiles = qf.FragTiles(blocks=tiles.gate_blocks, num_warps=tiles.num_warps, depth=tiles.gate_depth,
                              row_tiles=PASS_TILES)
    kbg = qf.step_blocks(hidden, gate_tiles)
    lwg, lxg, ltg = qf._layouts(tiles.num_warps, kbg, PASS_TILES)
    lwd, _, ltd = qf._layouts(tiles.num_warps, tiles.down_tiles, 1)
    p = programs(gate_up)
    return dict(H=hidden, I=intermediate, GROUP_G=gate_up.group_size, GROUP_D=down.group_size,
                ZERO_POINT=gate_up.zero_point, DECODE_ASM=qf._decode_asm(half), KBG=kbg, DEPTH_G=tiles.gate_depth,
                LWG=lwg, LXG=lxg, LTG=ltg, KBD=tiles.down_tiles, LWD=lwd, LTD=ltd, P=p, PP=1 << (p - 1).bit_length())


@functools.cache
def _scratch(device: torch.device, count: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial sums [P, 8, H] (float32) and the barrier's counter (grid_sync's
    grid_barrier: it starts at 0 and every launch on it has this P), one set per device and shape."""
    partial = torch.empty(count, qf.MAX_ROWS, hidden, dtype=torch.float32, device=device)
    return partial, torch.zeros(1, dtype=torch.int64, device=device)


_resident_checked: dict = {}


def _resident_reason(kernel, warps: int, count: int, device: torch.device) -> str | None:
    """Why the compiled kernel's P programs may not all be resident at once (None: they are), from
    the driver's occupancy calculation (registers, shared memory, warps): a grid barrier over
    programs that cannot all run at once would never end."""
    try:
        per_sm = resident_per_multiprocessor(kernel, warps)
    except RuntimeError as exc:
        return str(exc)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if per_sm * sms < count:
        return f"{count} programs, {per_sm} a multiprocessor x {sms} resident at once"
    return None


def fused_mlp(x: torch.Tensor, gate_up: qf.FragWeights, down: qf.FragWeights,
              tiles: FusedTiles | None = None, phases: int = 3) -> torch.Tensor:
    """x [M, H] (M <= 8) -> down(SiLU(gate) * up) [M, H] in x's dtype; gate_up's rows interleaved in
    chunks of 8 (quant_frag's SiLU-gated order). Raises ValueError where the kernel cannot run.
    phases < 3 leaves y unwritten: for measuring the kernel's parts (1: gate/up, 2: without the sums)."""
    reason = unsupported_reason(x, gate_up, down)
    if not reason and x.shape[0] > qf.MAX_ROWS:
        reason = f"{x.shape[0]} rows (at most {qf.MAX_ROWS})"
    tiles = tiles or FusedTiles()
    x = x.contiguous()
    count = programs(gate_up)
    constexprs = dict(launch_constexprs(gate_up, down, tiles, x.dtype == torch.float16), PHASES=phases)
    key = (x.device, x.dtype, tiles, tuple(sorted((k, str(v)) for k, v in constexprs.items())))
    partial, counter = _scratch(x.device, count, gate_up.in_features)
    y = torch.empty(x.shape[0], gate_up.in_features, dtype=x.dtype, device=x.device)
    args = (x, gate_up.words, gate_up.terms, down.words, down.terms, partial, y, counter,
            x.shape[0], x.stride(0), y.stride(0))
    if not reason and key not in _resident_checked:
        kernel = _fused_mlp_kernel.warmup(*args, **constexprs, num_warps=tiles.num_warps, launch_pdl=True,
                                          grid=(count,))
        _resident_checked[key] = _resident_reason(kernel, tiles.num_warps, count, x.device)
    reason = reason or _resident_checked[key]
    if reason:
        raise ValueError(f"fused_mlp: {reason}")
    _fused_mlp_kernel[(count,)](*args, **constexprs, num_warps=tiles.num_warps, launch_pdl=launch.PDL)
    return y


def reference(x: torch.Tensor, gate_up: qf.FragWeights, down: qf.FragWeights) -> torch.Tensor:
    """What `fused_mlp` computes, in torch: gate and up rounded to x's dtype, SiLU(gate) * up
    rounded to it, down's sums in float32."""
    w = frag_dequantize.dequantize(gate_up, torch.float32)  # [2I, H], chunks of 8 gate rows then their 8 up rows
    gu = (x.float() @ w.T).to(x.dtype).float().view(x.shape[0], -1, 2, qf.GATE_CHUNK)
    gate, up = gu[:, :, 0].reshape(x.shape[0], -1), gu[:, :, 1].reshape(x.shape[0], -1)
    h = (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype)
    return (h.float() @ frag_dequantize.dequantize(down, torch.float32).T).to(x.dtype)


def compile_fused_mlp(hidden: int, intermediate: int, tiles=None, dtype: torch.dtype = torch.bfloat16,
                      group: int = 64, rows: int = 1) -> offline_sass.CompiledFrag:
    """`_fused_mlp_kernel` for a gated MLP [hidden -> intermediate -> hidden] as
    `fused_mlp` launches it (the same specializations as `compile_frag`)."""
    def shape_only(n: int, k: int) -> qf.FragWeights:
        return qf.FragWeights(torch.empty(0), torch.empty(0), n, k, group, False)

    tiles = tiles or FusedTiles()
    act = "*" + offline_sass._TYPES[dtype]
    signature = {"X": act, "WG": "*i32", "TG": act, "WD": "*i32", "TD": act, "PART": "*fp32", "Y": act,
                 "COUNTER": "*i32", "M": "i32", "stride_xm": "i32", "stride_ym": "i32"}
    constexprs = launch_constexprs(shape_only(2 * intermediate, hidden), shape_only(hidden, intermediate), tiles,
                                      dtype == torch.float16)
    if rows == 1:
        constexprs["M"] = 1
    return offline_sass.compile_gluon(_fused_mlp_kernel, signature, constexprs,
                         ("X", "WG", "TG", "WD", "TD", "PART", "Y", "COUNTER", "stride_xm", "stride_ym"),
                         tiles.num_warps)


def separate(x, gate_up, down):
    return qf.frag_gemv(qf.frag_gemv(x, gate_up, silu_gate=True), down)


def check(hidden: int, intermediate: int, tiles: FusedTiles, group: int) -> dict:
    torch.manual_seed(1)
    gate_up, down = random_frag(2 * intermediate, hidden, group), random_frag(hidden, intermediate, group)
    x = torch.randn(qf.MAX_ROWS, hidden, device="cuda", dtype=torch.bfloat16)
    out = {"shape": f"{hidden}x{intermediate}", "group": group, "tiles": str(tiles)}
    y = fused_mlp(x, gate_up, down, tiles)
    synchronize_or_exit()
    ref = reference(x, gate_up, down)
    unfused = separate(x, gate_up, down)
    scale = ref.float().abs().max().item()
    out["max_abs_vs_reference"] = (y.float() - ref.float()).abs().max().item()
    out["max_abs_unfused_vs_reference"] = (unfused.float() - ref.float()).abs().max().item()
    out["reference_max_abs"] = scale
    out["rows_independent"] = all(torch.equal(fused_mlp(x[:m], gate_up, down, tiles), y[:m])
                                  for m in range(1, qf.MAX_ROWS + 1))
    out["row_alone_equal"] = all(torch.equal(fused_mlp(x[i:i + 1], gate_up, down, tiles)[0], y[i])
                                 for i in range(qf.MAX_ROWS))
    out["repeat_equal"] = torch.equal(fused_mlp(x, gate_up, down, tiles), y)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--tiles", default="4x1x2x4,4x2x2x4,4x1x2x8,4x2x2x8")
    parser.add_argument("--shape", default="4096x12288")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--phases", default="1,2", help="also time the kernel's parts (1: gate/up, 2: no sums)")
    parser.add_argument("--compile-only", action="store_true",
                        help="on the CPU: compile each tiling for sm_90 and print its registers, stack and shared memory")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    hidden, intermediate = (int(v) for v in args.shape.split("x"))
    args.phases = [int(v) for v in args.phases.split(",") if v]
    all_tiles = [FusedTiles(*(int(v) for v in t.split("x"))) for t in args.tiles.split(",")]
    results = []
    if args.compile_only:
        for tiles in all_tiles:
            c = compile_fused_mlp(hidden, intermediate, tiles)
            print(json.dumps({"tiles": str(tiles), "registers": c.registers, "stack": c.stack, "shared": c.shared}))
        return
    if not args.skip_check:
        for tiles in all_tiles[:1]:
            for shape, group in (((1024, 2048), 64), ((1024, 2048), 128), ((hidden, intermediate), 64)):
                row = check(*shape, tiles, group)
                print(json.dumps(row), flush=True)
                results.append(row)
    torch.manual_seed(0)
    sets = [(random_frag(2 * intermediate, hidden), random_frag(hidden, intermediate)) for _ in range(args.copies)]
    for m in (int(v) for v in args.rows.split(",")):
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        row = {"rows": m, "separate_us": round(cycle_time_us([lambda s=s: separate(x, *s) for s in sets], 10), 2)}
        for tiles in all_tiles:
            try:
                fused_mlp(x, *sets[0], tiles)
                synchronize_or_exit()
            except ValueError as error:
                row[f"fused_{tiles.num_warps}x{tiles.gate_blocks}x{tiles.gate_depth}x{tiles.down_tiles}"] = str(error)
                continue
            label = f"fused_{tiles.num_warps}x{tiles.gate_blocks}x{tiles.gate_depth}x{tiles.down_tiles}_us"
            row[label] = round(cycle_time_us([lambda s=s: fused_mlp(x, *s, tiles) for s in sets], 10), 2)
            for phases in args.phases:
                row[label.replace("_us", f"_phases{phases}_us")] = round(cycle_time_us(
                    [lambda s=s: fused_mlp(x, *s, tiles, phases) for s in sets], 10), 2)
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        Path(args.out, "fused_mlp.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
