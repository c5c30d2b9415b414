"""On the lent GPU: a chain of 4-bit products as one persistent kernel whose weights never stop
streaming - a producer warp copies every tile's words and group terms into a shared-memory ring by
TMA, running ahead of the consumer warps across the grid barriers between products (the weights do
not depend on the activations), while the consumer warps multiply from shared memory.

Why (docs/gpu.md, eighteenth and nineteenth sessions): a 4-bit product pays a fixed ~4 us per launch
(its start: the first loads' full latency and a pipeline that fills only then; its tail), ~145
times a step; one persistent kernel with grid barriers pays less a boundary but was slower as
every product's warps then had to load their own weights after the barrier. Here the ring holds up
to S chunks of each program's next weights, so after a barrier the consumers find them already on
the multiprocessor.

The chain: gate_up (SiLU(gate) * up in its epilogue) -> down of Qwen3-8B's shape (`--chain mlp`),
or o -> gate_up -> down (`--chain layer`, no norm between them: only the products' cost is
measured). Program p takes tiles p, p + P, ... of each product (16 rows, the whole K), its
consumer warps split K as `quant_frag.frag_sums` does with `num_warps` warps and one block a step
(warp w: blocks w, w + W, ...; the warps' sums added in the same fixed order), so the results
equal `quant_frag.frag_gemv` with FragTiles(1, W, 1, 1) bit for bit, whatever the rows.

Checks: the launched products with the same tiles (same bits), a row alone == the same row among
M. Times: under a CUDA graph cycling through copies of the weights (read from memory, not L2),
against the launched products with the shipped tiles; `--math 0` leaves the multiplications out
(the ring's streaming alone: the bound of this design).

  python3 scripts/gpu_stream_chain.py [--rows 1,4] [--slots 24,32] [--chain mlp,layer] [--out DIR]
  python3 scripts/gpu_stream_chain.py --compile-only   # CPU: registers and shared memory, sm_90
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verispec.kernels import quant_frag as qf  # noqa: E402
from verispec.kernels.quant_gemv import gl, gluon  # noqa: E402

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from triton.runtime.jit import constexpr_function

    from verispec.kernels.quant_gemv import wait_for_previous_grid

WORD_ROWS = 128  # int32 words of one 16-row tile's 64-value block
TERM_COLS = 16  # int32 words of one group's terms (8 rows g x (s_g, s_g+8), (o_g, o_g+8))
PRODUCER_REGS = 40


def _powers(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


def smem_layouts(warps: int, blocks: int, row_tiles: int):
    """Register layouts for a slot's words [RT, W*KB, 128] and terms [RT, W*KB, 16] (int32; RT
    row tiles of W*KB blocks each, as TMA writes them) whose permutation to [W*KB, RT, ...]
    reshapes to quant_frag's LW [W*KB, RT, 8, 4, 4] and LT [W*KB, RT, 8, 2] (block b of a step on
    warp b % W; the registers in LW's order: word c, then row tile, then block)."""
    tiles = [[r, 0, 0] for r in _powers(row_tiles)]
    blocks_ = [[0, warps * b, 0] for b in _powers(blocks)]
    warp_bases = [[0, b, 0] for b in _powers(warps)]
    shape = [row_tiles, warps * blocks]
    words = gl.DistributedLinearLayout([[0, 0, 1], [0, 0, 2]] + tiles + blocks_,
                                       [[0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64]], warp_bases, [],
                                       shape + [WORD_ROWS])
    terms = gl.DistributedLinearLayout([[0, 0, 1]] + tiles + blocks_,
                                       [[0, 0, 0], [0, 0, 0], [0, 0, 2], [0, 0, 4], [0, 0, 8]], warp_bases, [],
                                       shape + [TERM_COLS])
    return words, terms


if gluon is not None:
    _WORD_ROWS = gl.constexpr(WORD_ROWS)
    _TERM_COLS = gl.constexpr(TERM_COLS)

    # host functions the layouts come from (a dict: Triton's dependency check refuses plain callables)
    _HOST_LAYOUTS = {"frag": qf._layouts, "slot": smem_layouts, "powers": _powers}


    @constexpr_function
    def _frag_layout(which, warps, blocks, row_tiles):
        return _HOST_LAYOUTS["frag"](int(warps), int(blocks), int(row_tiles))[int(which)]

    @constexpr_function
    def _slot_layout(which, warps, blocks, row_tiles):
        return _HOST_LAYOUTS["slot"](int(warps), int(blocks), int(row_tiles))[int(which)]

    @constexpr_function
    def _tiled_acc_layout(warps, blocks, row_tiles):
        """The mma accumulator's layout [BT, 16*RT, 8] seen as [BT, RT, 16, 8] (row tile apart)."""
        warps, blocks, row_tiles = int(warps), int(blocks), int(row_tiles)
        regs = [[0, 0, 0, 1], [0, 0, 8, 0]] + [[0, r, 0, 0] for r in _HOST_LAYOUTS["powers"](row_tiles)]
        regs += [[warps * b, 0, 0, 0] for b in _HOST_LAYOUTS["powers"](blocks)]
        lanes = [[0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]]
        return gl.DistributedLinearLayout(regs, lanes, [[b, 0, 0, 0] for b in _HOST_LAYOUTS["powers"](warps)], [],
                                          [warps * blocks, row_tiles, 16, 8])

    @constexpr_function
    def _tma_layout():
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)

    @gluon.jit
    def grid_barrier(COUNTER, P: gl.constexpr):
        """The consumer warps of all P programs arrive before any leaves (the counter only grows:
        this barrier's target is the next multiple of P)."""
        gl.thread_barrier()
        old = gl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
        target = (old // P + 1) * P
        seen = old + 1
        while seen < target:
            seen = gl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
        gl.thread_barrier()

    @gluon.jit
    def _slot_views(ring_w, ring_t, S: gl.constexpr, RT: gl.constexpr, BT: gl.constexpr):
        """The rings as this product's slots: [S, RT, BT, 128] words and [S, RT, BT, 16] terms."""
        words = ring_w._reinterpret(gl.int32, [S, RT, BT, _WORD_ROWS], _tma_layout())
        terms = ring_t._reinterpret(gl.int32, [S, RT, BT, _TERM_COLS], _tma_layout())
        return words, terms

    @gluon.jit
    def _issue(w_desc, t_desc, ring_w, ring_t, full, empty, count, group, step, NB: gl.constexpr, S: gl.constexpr,
               RT: gl.constexpr, BT: gl.constexpr, CONTIG: gl.constexpr):
        """One step of a tile group (BT blocks of each of its RT row tiles) into the ring's next slot,
        once its consumers have handed it back; returns the slots issued so far."""
        BYTES: gl.constexpr = RT * BT * (_WORD_ROWS + _TERM_COLS) * 4
        words, terms = _slot_views(ring_w, ring_t, S, RT, BT)
        slot = count % S
        mbarrier.wait(empty.index(slot), ((count // S) & 1) ^ 1)
        mbarrier.expect(full.index(slot), BYTES)
        if CONTIG:  # the weights stored in slot order: one contiguous box a slot
            row = (group * (NB // BT) + step) * (RT * BT)
            tma.async_copy_global_to_shared(w_desc, [row, 0], full.index(slot), ring_w.index(slot))
            tma.async_copy_global_to_shared(t_desc, [row, 0], full.index(slot), ring_t.index(slot))
        else:
            tma.async_copy_global_to_shared(w_desc, [group * RT, step * BT, 0], full.index(slot), words.index(slot))
            tma.async_copy_global_to_shared(t_desc, [group * RT, step * BT, 0], full.index(slot), terms.index(slot))
        return count + 1

    @gluon.jit
    def _produce(w_desc, t_desc, ring_w, ring_t, full, empty, count, ring_w2, ring_t2, full2, empty2, count2,
                 GROUPS: gl.constexpr, K: gl.constexpr, S: gl.constexpr, P: gl.constexpr, RT: gl.constexpr,
                 BT: gl.constexpr, CONTIG: gl.constexpr, PARTS: gl.constexpr):
        """Program p's tile groups of one product (RT row tiles each), step by step, into the rings of
        its consumer partitions (PARTS 2: groups 2p + 2Pj to the first, 2p + 1 + 2Pj to the second,
        their steps interleaved); returns the slots issued so far into each."""
        NB: gl.constexpr = K // 64
        for group in range(PARTS * gl.program_id(0), GROUPS, PARTS * P):
            for step in range(NB // BT):
                count = _issue(w_desc, t_desc, ring_w, ring_t, full, empty, count, group, step, NB, S, RT, BT,
                               CONTIG)
                if PARTS == 2:
                    if group + 1 < GROUPS:
                        count2 = _issue(w_desc, t_desc, ring_w2, ring_t2, full2, empty2, count2, group + 1, step,
                                        NB, S, RT, BT, CONTIG)
        return count, count2

    @gluon.jit
    def _producer(wd1, td1, wd2, td2, wd3, td3, ring_w, ring_t, full, empty, ring_w2, ring_t2, full2, empty2,
                  G1: gl.constexpr, K1: gl.constexpr, RT1: gl.constexpr, KB1: gl.constexpr, G2: gl.constexpr,
                  K2: gl.constexpr, RT2: gl.constexpr, KB2: gl.constexpr, G3: gl.constexpr, K3: gl.constexpr,
                  RT3: gl.constexpr, KB3: gl.constexpr, PHASES: gl.constexpr, S: gl.constexpr, P: gl.constexpr,
                  W: gl.constexpr, ABLATE: gl.constexpr, CONTIG: gl.constexpr, PARTS: gl.constexpr):
        if ABLATE == 2:  # (timing only: the consumers do not wait, nothing is copied)
            return
        count = 0
        count2 = 0
        count, count2 = _produce(wd1, td1, ring_w, ring_t, full, empty, count, ring_w2, ring_t2, full2, empty2,
                                 count2, G1, K1, S, P, RT1, W * KB1, CONTIG, PARTS)
        count, count2 = _produce(wd2, td2, ring_w, ring_t, full, empty, count, ring_w2, ring_t2, full2, empty2,
                                 count2, G2, K2, S, P, RT2, W * KB2, CONTIG, PARTS)
        if PHASES == 3:
            count, count2 = _produce(wd3, td3, ring_w, ring_t, full, empty, count, ring_w2, ring_t2, full2, empty2,
                                     count2, G3, K3, S, P, RT3, W * KB3, CONTIG, PARTS)

    @gluon.jit
    def _take(slots_w, slots_t, full, empty, count, S: gl.constexpr, BT: gl.constexpr, RT: gl.constexpr,
              LW: gl.constexpr, LT: gl.constexpr, LW3: gl.constexpr, LT3: gl.constexpr, WAIT: gl.constexpr = True):
        """The next slot's words [BT, RT, 8, 4, 4] and terms [BT, RT, 8, 2] (LW, LT), once the
        producer's copy has landed; the slot is handed back as soon as they are in registers."""
        slot = count % S
        if WAIT:  # (timing only without: the arithmetic's own pace, on whatever the slot holds)
            mbarrier.wait(full.index(slot), (count // S) & 1)
        words = slots_w.index(slot).load(LW3)
        terms = slots_t.index(slot).load(LT3)
        mbarrier.arrive(empty.index(slot))
        words = gl.convert_layout(gl.reshape(gl.permute(words, (1, 0, 2)), [BT, RT, 8, 4, 4]), LW, assert_trivial=True)
        terms = gl.convert_layout(gl.reshape(gl.permute(terms, (1, 0, 2)), [BT, RT, 8, 2]), LT, assert_trivial=True)
        return words, terms, count + 1

    @gluon.jit
    def _fold(acc, check_w, check_t, words, terms, xi, ones, zero, zero16, zero4, MATH: gl.constexpr,
              DECODE_ASM: gl.constexpr, DT: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, LS: gl.constexpr,
              MMA: gl.constexpr, L4: gl.constexpr):
        """acc [BT, 16*RT, 8] + one step's blocks (MATH), or the words and terms only read (checks)."""
        if MATH:
            # the activations' block sums (every weight row's the same) from one 16-row mma, not one
            # a row tile: the same values, in registers once for all RT tiles
            BT: gl.constexpr = acc.shape[0]
            RT: gl.constexpr = words.shape[1]
            MT: gl.constexpr = acc.shape[2]
            b = qf.activation_operand(xi, DT, LB)
            xs = mma_v2(ones, b, zero16)
            if RT > 1:
                xs = gl.convert_layout(xs, gl.SliceLayout(1, L4), assert_trivial=True)
                xs, _ = gl.broadcast(gl.expand_dims(xs, 1), zero4)
                xs = gl.convert_layout(gl.reshape(xs, [BT, 16 * RT, MT]), MMA, assert_trivial=True)
            acc = qf.block_sums(acc, words, terms, zero, False, DECODE_ASM, DT, LA, LB, LS, b=b, xs=xs,
                                PACKED=True)
        else:  # kept by a store that never happens
            check_w = check_w ^ words
            check_t = check_t ^ terms
        return acc, check_w, check_t

    @gluon.jit
    def _consume(X, Y, M, COUNTER, ring_w, ring_t, full, empty, xsm, count, GROUPS: gl.constexpr,
                 K: gl.constexpr, N: gl.constexpr, SILU: gl.constexpr, S: gl.constexpr, P: gl.constexpr,
                 MATH: gl.constexpr, DECODE_ASM: gl.constexpr, RT: gl.constexpr, KB: gl.constexpr,
                 LOOKAHEAD: gl.constexpr, ABLATE: gl.constexpr, XSMEM: gl.constexpr, Q: gl.constexpr,
                 PARTS: gl.constexpr):
        """Program p's tile groups of one product from the ring: y = x @ W^T (SILU: SiLU(gate) * up of
        each tile's 8 + 8 rows), as quant_frag.frag_sums with FragTiles(KB, W, 1, RT), one step ahead
        on the activations; returns the chunks consumed so far."""
        WS: gl.constexpr = gl.num_warps()
        BT: gl.constexpr = WS * KB  # blocks of each row tile a step
        NB: gl.constexpr = K // 64
        STEPS: gl.constexpr = NB // BT
        MT: gl.constexpr = qf._MAX_ROWS
        DT: gl.constexpr = X.dtype.element_ty
        LW: gl.constexpr = _frag_layout(0, WS, KB, RT)
        LX: gl.constexpr = _frag_layout(1, WS, KB, RT)
        LT: gl.constexpr = _frag_layout(2, WS, KB, RT)
        LW3: gl.constexpr = _slot_layout(0, WS, KB, RT)
        LT3: gl.constexpr = _slot_layout(1, WS, KB, RT)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        LS: gl.constexpr = gl.SliceLayout(2, MMA)
        slots_w, slots_t = _slot_views(ring_w, ring_t, S, RT, BT)
        xb = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LX))))
        xm = gl.arange(0, MT, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LX))))
        xt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LX))))
        xp = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LX))))
        x_block = gl.expand_dims(gl.expand_dims(gl.expand_dims(xb, 1), 2), 3)
        x_row = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.minimum(xm, M - 1), 0), 2), 3)
        x_off = (x_block * 32 + gl.expand_dims(gl.expand_dims(gl.expand_dims(xt, 0), 1), 3) * 8
                 + gl.expand_dims(gl.expand_dims(gl.expand_dims(xp, 0), 1), 2))
        x_ptr = X.to(gl.pointer_type(gl.int32), bitcast=True) + x_row * (K // 2) + x_off
        ones = gl.full([BT, 16, 64], 1.0, DT, layout=LA)
        zero = gl.zeros([BT, 16 * RT, MT], gl.float32, layout=MMA)
        zero16 = gl.zeros([BT, 16, MT], gl.float32, layout=MMA)
        L4: gl.constexpr = _tiled_acc_layout(WS, KB, RT)
        zero4 = gl.zeros([BT, RT, 16, MT], gl.float32, layout=L4)
        # XSMEM (K <= 64 blocks): the activations once into shared memory, in the steps' order and
        # layout (8 rows, those past M repeating row M - 1), for every tile group of the phase
        USE_XSM: gl.constexpr = XSMEM and NB <= xsm.shape[0]
        if USE_XSM:
            xsteps = xsm._reinterpret(gl.int32, [xsm.shape[0] // BT, BT, 8, 4, 8], xsm.layout)  # [step, ...]
            for chunk in gl.static_range(STEPS):
                xsteps.index(chunk).store(gl.load(x_ptr + chunk * (BT * 32)))
            gl.thread_barrier()
        for group in range(PARTS * gl.program_id(0) + Q, GROUPS, PARTS * P):
            acc = gl.zeros([BT, 16 * RT, MT], gl.float32, layout=MMA)
            check_w = gl.zeros([BT, RT, 8, 4, 4], gl.int32, layout=LW)
            check_t = gl.zeros([BT, RT, 8, 2], gl.int32, layout=LT)
            if USE_XSM:
                xi = xsteps.index(0).load(LX)
            else:
                xi = gl.load(x_ptr)
            words, terms, count = _take(slots_w, slots_t, full, empty, count, S, BT, RT, LW, LT, LW3, LT3,
                                        ABLATE != 2)
            # the next step's slot is read before this step's words are used (LOOKAHEAD): its wait and
            # shared-memory latency then overlap this step's arithmetic
            for step in range(STEPS - 1):
                if ABLATE == 1:  # (timing only: every step's activations are the first step's)
                    xi_next = xi
                elif USE_XSM:
                    xi_next = xsteps.index(step + 1).load(LX)
                else:
                    xi_next = gl.load(x_ptr + (step + 1) * (BT * 32))
                if LOOKAHEAD:
                    words_n, terms_n, count = _take(slots_w, slots_t, full, empty, count, S, BT, RT, LW, LT, LW3,
                                                    LT3, ABLATE != 2)
                    acc, check_w, check_t = _fold(acc, check_w, check_t, words, terms, xi, ones, zero, zero16,
                                                  zero4, MATH, DECODE_ASM, DT, LA, LB, LS, MMA, L4)
                    words = words_n
                    terms = terms_n
                else:
                    acc, check_w, check_t = _fold(acc, check_w, check_t, words, terms, xi, ones, zero, zero16,
                                                  zero4, MATH, DECODE_ASM, DT, LA, LB, LS, MMA, L4)
                    words, terms, count = _take(slots_w, slots_t, full, empty, count, S, BT, RT, LW, LT, LW3, LT3,
                                        ABLATE != 2)
                xi = xi_next
            acc, check_w, check_t = _fold(acc, check_w, check_t, words, terms, xi, ones, zero, zero16, zero4, MATH,
                                          DECODE_ASM, DT, LA, LB, LS, MMA, L4)
            if not MATH:
                total = (gl.sum(gl.reshape(check_w, [BT * RT * 128]), 0)
                         + gl.sum(gl.reshape(check_t, [BT * RT * 16]), 0))
                gl.store(COUNTER + 1, total, mask=M < 0)
            y = gl.sum(acc, axis=0)  # [16 * RT, MT]
            if SILU:
                out = qf.silu_gated(y, RT, Y.dtype.element_ty)
                ry = group * 8 * RT + gl.arange(0, 8 * RT, layout=gl.SliceLayout(1, out.type.layout))
                my = gl.arange(0, MT, layout=gl.SliceLayout(0, out.type.layout))
                gl.store(Y + gl.expand_dims(my, 0) * (N // 2) + gl.expand_dims(ry, 1), out.to(Y.dtype.element_ty),
                         mask=(gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N // 2))
            else:
                ry = group * 16 * RT + gl.arange(0, 16 * RT, layout=gl.SliceLayout(1, y.type.layout))
                my = gl.arange(0, MT, layout=gl.SliceLayout(0, y.type.layout))
                gl.store(Y + gl.expand_dims(my, 0) * N + gl.expand_dims(ry, 1), y.to(Y.dtype.element_ty),
                         mask=(gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N))
        return count

    @gluon.jit
    def _consumer(X, A, H, Y, M, COUNTER, ring_w, ring_t, full, empty, xsm, N1: gl.constexpr, K1: gl.constexpr,
                  G1: gl.constexpr, RT1: gl.constexpr, KB1: gl.constexpr, N2: gl.constexpr, K2: gl.constexpr,
                  G2: gl.constexpr, RT2: gl.constexpr, KB2: gl.constexpr, N3: gl.constexpr, K3: gl.constexpr,
                  G3: gl.constexpr, RT3: gl.constexpr, KB3: gl.constexpr, PHASES: gl.constexpr, S: gl.constexpr,
                  P: gl.constexpr, MATH: gl.constexpr, DECODE_ASM: gl.constexpr, LOOKAHEAD: gl.constexpr,
                  ABLATE: gl.constexpr, XSMEM: gl.constexpr, Q: gl.constexpr, PARTS: gl.constexpr):
        wait_for_previous_grid()
        count = 0
        if PHASES == 3:  # o -> gate_up -> down: X -> A -> H -> Y
            count = _consume(X, A, M, COUNTER, ring_w, ring_t, full, empty, xsm, count, G1, K1, N1, False, S, P, MATH,
                             DECODE_ASM, RT1, KB1, LOOKAHEAD, ABLATE, XSMEM, Q, PARTS)
            grid_barrier(COUNTER, PARTS * P)
            count = _consume(A, H, M, COUNTER, ring_w, ring_t, full, empty, xsm, count, G2, K2, N2, True, S, P, MATH,
                             DECODE_ASM, RT2, KB2, LOOKAHEAD, ABLATE, XSMEM, Q, PARTS)
            grid_barrier(COUNTER, PARTS * P)
            count = _consume(H, Y, M, COUNTER, ring_w, ring_t, full, empty, xsm, count, G3, K3, N3, False, S, P, MATH,
                             DECODE_ASM, RT3, KB3, LOOKAHEAD, ABLATE, XSMEM, Q, PARTS)
        else:  # gate_up -> down: X -> H -> Y (phase 1's arguments are gate_up's)
            count = _consume(X, H, M, COUNTER, ring_w, ring_t, full, empty, xsm, count, G1, K1, N1, True, S, P, MATH,
                             DECODE_ASM, RT1, KB1, LOOKAHEAD, ABLATE, XSMEM, Q, PARTS)
            grid_barrier(COUNTER, PARTS * P)
            count = _consume(H, Y, M, COUNTER, ring_w, ring_t, full, empty, xsm, count, G2, K2, N2, False, S, P, MATH,
                             DECODE_ASM, RT2, KB2, LOOKAHEAD, ABLATE, XSMEM, Q, PARTS)

    @gluon.jit
    def _stream_kernel(X, A, H, Y, M, COUNTER, wd1, td1, wd2, td2, wd3, td3,
                       N1: gl.constexpr, K1: gl.constexpr, G1: gl.constexpr, RT1: gl.constexpr, KB1: gl.constexpr,
                       N2: gl.constexpr, K2: gl.constexpr, G2: gl.constexpr, RT2: gl.constexpr, KB2: gl.constexpr,
                       N3: gl.constexpr, K3: gl.constexpr, G3: gl.constexpr, RT3: gl.constexpr, KB3: gl.constexpr,
                       PHASES: gl.constexpr, S: gl.constexpr, P: gl.constexpr, MATH: gl.constexpr,
                       DECODE_ASM: gl.constexpr, SB: gl.constexpr, PRODUCER_REGS_: gl.constexpr,
                       LOOKAHEAD: gl.constexpr, ABLATE: gl.constexpr = 0, XSMEM: gl.constexpr = False,
                       CONTIG: gl.constexpr = False, PARTS: gl.constexpr = 1, CONSUMER_REGS: gl.constexpr = 0):
        W: gl.constexpr = gl.num_warps()
        FLAT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        ring_w = gl.allocate_shared_memory(gl.int32, [S, SB, _WORD_ROWS], FLAT)  # SB blocks a slot
        ring_t = gl.allocate_shared_memory(gl.int32, [S, SB, _TERM_COLS], FLAT)
        XBLOCKS: gl.constexpr = 64 if XSMEM else 1  # activations' 64-value blocks kept in shared memory
        xsm = gl.allocate_shared_memory(gl.int32, [XBLOCKS, 8, 4, 8],
                                        gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
        full = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        # PARTS 2: a second consumer partition of W warps with its own ring and barriers
        S2: gl.constexpr = S if PARTS == 2 else 1
        ring_w2 = gl.allocate_shared_memory(gl.int32, [S2, SB, _WORD_ROWS], FLAT)
        ring_t2 = gl.allocate_shared_memory(gl.int32, [S2, SB, _TERM_COLS], FLAT)
        full2 = gl.allocate_shared_memory(gl.int64, [S2, 1], mbarrier.MBarrierLayout())
        empty2 = gl.allocate_shared_memory(gl.int64, [S2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(S):
            mbarrier.init(full.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for s in gl.static_range(S2):
            mbarrier.init(full2.index(s), count=1)
            mbarrier.init(empty2.index(s), count=1)
        if PARTS == 2:
            gl.warp_specialize([
                (_consumer, (X, A, H, Y, M, COUNTER, ring_w, ring_t, full, empty, xsm, N1, K1, G1, RT1, KB1, N2, K2,
                             G2, RT2, KB2, N3, K3, G3, RT3, KB3, PHASES, S, P, MATH, DECODE_ASM, LOOKAHEAD, ABLATE,
                             False, 0, PARTS)),
                (_consumer, (X, A, H, Y, M, COUNTER, ring_w2, ring_t2, full2, empty2, xsm, N1, K1, G1, RT1, KB1, N2,
                             K2, G2, RT2, KB2, N3, K3, G3, RT3, KB3, PHASES, S, P, MATH, DECODE_ASM, LOOKAHEAD,
                             ABLATE, False, 1, PARTS)),
                (_producer, (wd1, td1, wd2, td2, wd3, td3, ring_w, ring_t, full, empty, ring_w2, ring_t2, full2,
                             empty2, G1, K1, RT1, KB1, G2, K2, RT2, KB2, G3, K3, RT3, KB3, PHASES, S, P, W, ABLATE,
                             CONTIG, PARTS)),
            ], [W, 1], [CONSUMER_REGS, PRODUCER_REGS_])
        else:
            gl.warp_specialize([
                (_consumer, (X, A, H, Y, M, COUNTER, ring_w, ring_t, full, empty, xsm, N1, K1, G1, RT1, KB1, N2, K2,
                             G2, RT2, KB2, N3, K3, G3, RT3, KB3, PHASES, S, P, MATH, DECODE_ASM, LOOKAHEAD, ABLATE,
                             XSMEM, 0, PARTS)),
                (_producer, (wd1, td1, wd2, td2, wd3, td3, ring_w, ring_t, full, empty, ring_w2, ring_t2, full2,
                             empty2, G1, K1, RT1, KB1, G2, K2, RT2, KB2, G3, K3, RT3, KB3, PHASES, S, P, W, ABLATE,
                             CONTIG, PARTS)),
            ], [1], [PRODUCER_REGS_])


_SLOT_ORDER = {}  # (words' data pointer, RT, BT) -> the weights in slot order (kept: TMA reads them)


def _descriptors(fw, rt: int, bt: int, contig: bool = False):
    """TMA descriptors over a product's words [tiles, K/64, 128] and terms [tiles, K/64, 16]
    (int32 views; groups of 64 values: one term row a block), a box of one consumer step: RT row
    tiles x BT blocks. contig: over a copy in slot order ([groups, steps, RT, BT, ...], made once:
    each slot one contiguous box)."""
    blocks = fw.in_features // 64
    words = fw.words.view(-1, blocks, WORD_ROWS)
    terms = fw.terms.view(torch.int32).view(-1, blocks, TERM_COLS)
    if not contig:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
        return (TensorDescriptor.from_tensor(words, [rt, bt, WORD_ROWS], layout),
                TensorDescriptor.from_tensor(terms, [rt, bt, TERM_COLS], layout))
    key = (fw.words.data_ptr(), rt, bt)
    if key not in _SLOT_ORDER:
        def slot_order(t):
            cols = t.shape[-1]
            return t.view(-1, rt, blocks // bt, bt, cols).transpose(1, 2).contiguous().view(-1, cols)
        _SLOT_ORDER[key] = (slot_order(words), slot_order(terms))
    words, terms = _SLOT_ORDER[key]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return (TensorDescriptor.from_tensor(words, [rt * bt, WORD_ROWS], layout),
            TensorDescriptor.from_tensor(terms, [rt * bt, TERM_COLS], layout))


def slot_blocks(plan, warps: int) -> int:
    sizes = {warps * rt * kb for rt, kb in plan}
    if len(sizes) != 1:
        raise ValueError(f"gpu_stream_chain: every product's step must fill one slot (warps x RT x KB): {plan}")
    return sizes.pop()


def constexprs(fws, plan, slots: int, programs: int, warps: int, math: bool, lookahead: bool = True,
               xsmem: bool = False, contig: bool = False, parts: int = 1, consumer_regs: int = 0) -> dict:
    args = {}
    padded = list(zip(fws, plan)) + [(fws[-1], plan[-1])] * (3 - len(fws))
    for i, (fw, (rt, kb)) in enumerate(padded, 1):
        tiles = -(-fw.out_features // (16 * 4)) * 4  # the repacked words' tiles (a multiple of 4)
        args.update({f"N{i}": fw.out_features, f"K{i}": fw.in_features, f"G{i}": tiles // rt, f"RT{i}": rt,
                     f"KB{i}": kb})
    return dict(args, PHASES=len(fws), S=slots, P=programs, MATH=bool(math), ABLATE=max(0, math - 1),
                DECODE_ASM=qf.decode_pairs_asm(False),
                SB=slot_blocks(plan, warps), PRODUCER_REGS_=PRODUCER_REGS, LOOKAHEAD=lookahead, XSMEM=xsmem,
                CONTIG=contig, PARTS=parts, CONSUMER_REGS=consumer_regs)


def compile_offline(fws, plan, slots: int, programs: int, warps: int, math: bool, lookahead: bool = True,
                    maxnreg: int | None = None, xsmem: bool = False, contig: bool = False, parts: int = 1,
                    consumer_regs: int = 0):
    """The kernel compiled for sm_90 without a GPU (offline_sass): registers, spills, shared memory."""
    from verispec.kernels import offline_sass
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2 if contig else 3)
    signature = {name: "*bf16" for name in ("X", "A", "H", "Y")}
    signature.update({"M": "i32", "COUNTER": "*i32"})
    padded = list(plan) + [plan[-1]] * (3 - len(plan))
    for i, (rt, kb) in enumerate(padded, 1):
        box = f"{rt * warps * kb}" if contig else f"{rt}, {warps * kb}"
        signature[f"wd{i}"] = f"tensordesc<i32[{box}, {WORD_ROWS}],{layout!r}>"
        signature[f"td{i}"] = f"tensordesc<i32[{box}, {TERM_COLS}],{layout!r}>"
    return offline_sass.compile_gluon(_stream_kernel, signature,
                                      constexprs(fws, plan, slots, programs, warps, math, lookahead, xsmem, contig,
                                                 parts, consumer_regs),
                                      ("X", "A", "H", "Y"), warps, maxnreg=maxnreg)


def stream_chain(x, a, h, y, fws, plan, counter, programs: int, slots: int, warps: int = 8, math: bool = True,
                 lookahead: bool = True, compile_only: bool = False, maxnreg: int | None = None,
                 xsmem: bool = False, contig: bool = False, parts: int = 1, consumer_regs: int = 0):
    """fws: (gate_up, down) or (o, gate_up, down), groups of 64, with plan: (row tiles, blocks a
    warp a step) for each; x [M, K1] -> y (a, h: the intermediate outputs, contiguous)."""
    if any(fw.group_size != 64 for fw in fws):
        raise ValueError("gpu_stream_chain: groups of 64 only (one term row a block)")
    descs = [d for fw, (rt, kb) in zip(fws, plan) for d in _descriptors(fw, rt, warps * kb, contig)]
    descs += descs[-2:] * (3 - len(fws))
    launch = _stream_kernel.warmup if compile_only else _stream_kernel[(programs,)]
    extra = {"grid": (programs,)} if compile_only else {}
    return launch(x, a, h, y, x.shape[0], counter, *descs,
                  **constexprs(fws, plan, slots, programs, warps, math, lookahead, xsmem, contig, parts,
                               consumer_regs),
                  num_warps=warps, launch_pdl=True, **({"maxnreg": maxnreg} if maxnreg else {}), **extra)


class _Shape:
    def __init__(self, n: int, k: int):
        self.out_features, self.in_features, self.group_size = n, k, 64


def parse_plans(text: str) -> list[dict]:
    """"gate_up=4x1,down=1x4,o=2x2;..." -> [{name: (row tiles, blocks a warp a step)}, ...]."""
    plans = []
    for plan in text.split(";"):
        entries = (item.split("=") for item in plan.split(","))
        plans.append({name: tuple(int(v) for v in value.split("x")) for name, value in entries})
    return plans


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--slots", default="6,8")
    parser.add_argument("--chain", default="mlp,layer")
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--plans", default="gate_up=4x1,down=1x4,o=2x2;gate_up=4x1,down=2x2,o=2x2",
                        help="per product: row tiles x blocks a warp a step (warps x both: the same for all)")
    parser.add_argument("--math", default="1,0")
    parser.add_argument("--lookahead", default="1", help="read the next slot before this step's arithmetic (1/0)")
    parser.add_argument("--xsmem", default="0", help="activations of K <= 4096 in shared memory (1/0)")
    parser.add_argument("--contig", default="0", help="weights copied into slot order, one box a slot (1/0)")
    parser.add_argument("--parts", default="1", help="consumer partitions of --warps warps, each with its own ring")
    parser.add_argument("--consumer-regs", type=int, default=200, help="registers of the second partition's threads")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--maxnreg", type=int, default=0, help="registers a thread at most (0: the compiler's)")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--sass", action="store_true", help="with --compile-only: each kernel's opcode counts too")
    parser.add_argument("--ncu", action="store_true", help="launch the first configuration twice, untimed (for"
                                                           " `ncu -k regex:_stream_kernel --launch-skip 1`)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    slots_list = [int(v) for v in args.slots.split(",")]
    # 1: the products; 0: weights read only; 2: one x a group; 3: no waiting for the copies (timing only)
    maths = [int(v) for v in args.math.split(",")]
    lookaheads = [bool(int(v)) for v in args.lookahead.split(",")]
    xsmems = [bool(int(v)) for v in args.xsmem.split(",")]
    contigs = [bool(int(v)) for v in args.contig.split(",")]
    parts_list = [int(v) for v in args.parts.split(",")]
    plans = parse_plans(args.plans)
    shapes = {"o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    chains = {"mlp": ("gate_up", "down"), "layer": ("o", "gate_up", "down")}
    if args.compile_only:
        for chain, plan, slots, math, ahead, xsmem, contig, parts in itertools.product(
                args.chain.split(","), plans, slots_list, maths, lookaheads, xsmems, contigs, parts_list):
            names = chains[chain]
            c = compile_offline([_Shape(*shapes[n]) for n in names], [plan[n] for n in names], slots, 132,
                                args.warps, math, ahead, args.maxnreg or None, xsmem, contig, parts,
                                args.consumer_regs)
            result = {"chain": chain, "plan": plan, "slots": slots, "math": math, "lookahead": ahead, "xsmem": xsmem,
                      "contig": contig, "parts": parts, "registers": c.registers, "spill_bytes": c.stack,
                      "shared": c.shared}
            if args.sass:
                from verispec.kernels import offline_sass
                result["opcodes"] = dict(offline_sass.opcode_counts(c.sass))
            print(json.dumps(result), flush=True)
        return

    from gpu_persistent_bound import random_frag, resident_per_multiprocessor, synchronize_or_exit
    from gpu_timing import cycle_time_us
    from triton.runtime.errors import OutOfResources
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")
    if args.ncu:
        names = chains[args.chain.split(",")[0]]
        weights = {name: random_frag(*shapes[name]) for name in names}
        m = int(args.rows.split(",")[0])
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        a, y = torch.empty_like(x), torch.empty_like(x)
        h = torch.empty(m, 12288, device="cuda", dtype=torch.bfloat16)
        steps = [plans[0][name] for name in names]
        for _ in range(2):
            stream_chain(x, a, h, y, [weights[n] for n in names], steps, counter, sms, slots_list[0], args.warps,
                         maths[0], lookaheads[0])
            synchronize_or_exit()
        return
    sets = [{name: random_frag(*shape) for name, shape in shapes.items()} for _ in range(args.copies)]
    results = []

    def launched(x, ws, names, tiles_of):
        for name in names:
            x = qf.frag_gemv(x, ws[name], tiles_of(name, x), silu_gate=name == "gate_up")
        return x

    def shipped(name, x):
        return qf.tiles_for(*shapes[name], x.shape[0])

    for chain in args.chain.split(","):
        names = chains[chain]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            a = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
            h = torch.empty(m, 12288, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
            row = {"chain": chain, "rows": m}
            row["launched_shipped_tiles_us"] = round(cycle_time_us(
                [lambda s=s: launched(x, s, names, shipped) for s in sets], 10), 2)
            print(json.dumps(row), flush=True)
            for index, plan in enumerate(plans):
                steps = [plan[n] for n in names]

                def same(name, x, plan=plan):
                    return qf.FragTiles(plan[name][1], args.warps, 1, plan[name][0])

                row[f"plan{index}"] = ",".join(f"{n}={plan[n][0]}x{plan[n][1]}" for n in names)
                row[f"plan{index}_launched_us"] = round(cycle_time_us(
                    [lambda s=s: launched(x, s, names, same) for s in sets], 10), 2)
                ref = launched(x, sets[0], names, same)
                for slots, math, ahead, xsmem, contig, parts in itertools.product(slots_list, maths, lookaheads,
                                                                                  xsmems, contigs, parts_list):
                    fws = [sets[0][name] for name in names]
                    mode = ["_nomath", "", "_onex", "_nowait"][math]
                    label = (f"plan{index}_S{slots}{mode}{'' if ahead else '_noahead'}{'_xsmem' if xsmem else ''}"
                             f"{'_contig' if contig else ''}{f'_parts{parts}' if parts > 1 else ''}")
                    opts = dict(maxnreg=args.maxnreg or None, xsmem=xsmem, contig=contig, parts=parts,
                                consumer_regs=args.consumer_regs)
                    kernel = stream_chain(x, a, h, y, fws, steps, counter, sms, slots, args.warps, math, ahead,
                                          compile_only=True, **opts)
                    try:
                        resident = resident_per_multiprocessor(kernel, kernel.metadata.num_warps)
                    except OutOfResources:  # the ring does not fit in a multiprocessor's shared memory
                        resident = 0
                    if resident < 1:
                        row[f"{label}_resident"] = resident
                        continue
                    programs = sms * resident
                    label += f"_P{programs}"
                    counter.zero_()
                    stream_chain(x, a, h, y, fws, steps, counter, programs, slots, args.warps, math, ahead, **opts)
                    synchronize_or_exit()
                    if math == 1:
                        row[f"{label}_same_bits"] = bool(torch.equal(y, ref))
                        if m > 1:
                            one = torch.empty_like(y[:1])
                            stream_chain(x[:1].contiguous(), a[:1], h[:1], one, fws, steps, counter, programs, slots,
                                         args.warps, math, ahead, **opts)
                            synchronize_or_exit()
                            row[f"{label}_row_alone_same"] = bool(torch.equal(one, y[:1]))
                    row[f"{label}_us"] = round(cycle_time_us(
                        [lambda s=s: stream_chain(x, a, h, y, [s[name] for name in names], steps, counter, programs,
                                                  slots, args.warps, math, ahead, **opts)
                         for s in sets], 10), 2)
                    print(json.dumps({k: v for k, v in row.items() if k.startswith(label)}), flush=True)
            results.append(row)
    if args.out:
        Path(args.out, "stream_chain.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
