"""A chain of 4-bit products as one persistent kernel whose weights never stop streaming (Gluon,
sm_90; the engine runs a gated MLP's gate_up -> down on it for decode and verify passes, see
stream_mlp.py; measured in docs/benchmarks.md).

One program a multiprocessor, warp specialized:
- a producer warp copies each of its program's tile groups, step by step (the words and group
  terms of RT row tiles x BT 64-value blocks), into a ring of shared-memory slots by TMA, with a
  full / empty mbarrier pair a slot. It runs ahead of the consumers across the grid barriers
  between products: the weights do not depend on the activations, so the next product's first
  slots are already on the multiprocessor when its activations are ready;
- PARTS consumer partitions of W warps multiply from the slots as `frag.frag_sums` does
  (`frag.block_sums`): a tile group's K split across the partition's warps, block b of a step
  on warp b % W, the warps' sums added in a fixed order, so a result equals `frag.frag_gemv`
  with FragTiles(KB, W, 1, RT) bit for bit whatever the rows (M <= 8). With two partitions, each has
  its own ring and takes alternate tile groups: Gluon's mbarrier wait / arrive bring a
  partition-wide barrier a step, and one partition of 8 warps then stepped in lockstep;
- between products the consumers of all programs meet at a grid barrier (kernels/grid_sync.py;
  all programs resident: the launcher takes the program count from the driver's occupancy query);
- a consumer hands a slot back only after a proxy fence: its reads are ordinary shared loads and
  the producer's next write to the slot is a TMA copy (without the fence, a producer running ahead
  into the next product overwrote slots still being read).

The chain: gate_up (SiLU(gate) * up in its epilogue) -> down, or o -> gate_up -> down, with (NORM)
the residual add + RMSNorm between o and gate_up inside, at no barrier of its own: o's epilogue
adds its output to the residual (the new residual, bit for bit the engine's add + RMSNorm kernel's),
stores it times the norm's weight for gate_up, and each group's share of each row's sum of squares;
gate_up scales its sums by each row's 1 / RMS from those shares, before SiLU(gate) * up. That is
RMSNorm with the 1 / RMS moved past the product (rounded once less than the launched norm; the
shares added in one fixed order, so rows stay independent). Where every consumer partition
normalized every row into its own copy the norm cost ~2.4 us a row; one partition a row and a
second barrier ~3.4 us at any width; in this form the whole layer only equals o and the norm
launched before the streamed MLP, so the engine runs the MLP alone. Groups
of 64 values only (one term row a block). MODE 1 computes the products; 0 only reads the words and terms from the slots (the copies'
own pace) and 2 only computes (nothing copied, the slots' contents whatever they hold: the
arithmetic's own pace).
"""
from __future__ import annotations

import torch

from verispec.kernels.launch import gl, gluon
from verispec.quant.kernels import frag as qf

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import constexpr_function

    from verispec.kernels.launch import wait_for_previous_grid
    from verispec.quant.kernels.grid_sync import grid_barrier

WORD_ROWS = 128  # int32 words of one 16-row tile's 64-value block
TERM_COLS = 16  # int32 words of one group's terms (8 rows g x (s_g, s_g+8), (o_g, o_g+8))
PRODUCER_REGS = 40


def _powers(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


def tma_layout():
    """The shared layout of a TMA box [RT, BT, words] of int32, unswizzled: the descriptors', the
    slots' and the offline compile's."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def smem_layouts(warps: int, blocks: int, row_tiles: int):
    """Register layouts for a slot's words [RT, W*KB, 128] and terms [RT, W*KB, 16] (int32; RT
    row tiles of W*KB blocks each, as TMA writes them) whose permutation to [W*KB, RT, ...]
    reshapes to frag.py's LW [W*KB, RT, 8, 4, 4] and LT [W*KB, RT, 8, 2] (block b of a step on
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


def tiled_acc_layout(warps: int, blocks: int, row_tiles: int):
    """The mma accumulator's layout [BT, 16*RT, 8] seen as [BT, RT, 16, 8] (the row tile apart)."""
    regs = [[0, 0, 0, 1], [0, 0, 8, 0]] + [[0, r, 0, 0] for r in _powers(row_tiles)]
    regs += [[warps * b, 0, 0, 0] for b in _powers(blocks)]
    lanes = [[0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [[b, 0, 0, 0] for b in _powers(warps)], [],
                                      [warps * blocks, row_tiles, 16, 8])


def partials_layout(groups: int, warps: int):
    """A register layout for o's partial sums [groups, 8] (groups a power of two >= 32) whose
    reduction over the groups stays inside each warp (lanes and registers; every warp holds all of
    it): no shared memory and no barrier before gate_up's first step."""
    regs = [[0, 1], [0, 2], [0, 4]] + [[1 << i, 0] for i in range(5, groups.bit_length() - 1)]
    lanes = [[1 << i, 0] for i in range(5)]
    return gl.DistributedLinearLayout(regs, lanes, [[0, 0]] * (warps.bit_length() - 1), [], [groups, 8])


if gluon is not None:
    _WORD_ROWS = gl.constexpr(WORD_ROWS)
    _TERM_COLS = gl.constexpr(TERM_COLS)

    # the host functions the layouts come from (in a dict: Triton's dependency check refuses plain
    # callables referenced by a constexpr function)
    _HOST_LAYOUTS = {"frag": qf._layouts, "slot": smem_layouts, "tiled": tiled_acc_layout,
                     "partials": partials_layout, "tma": tma_layout}

    @constexpr_function
    def _frag_layout(which, warps, blocks, row_tiles):
        return _HOST_LAYOUTS["frag"](int(warps), int(blocks), int(row_tiles))[int(which)]

    @constexpr_function
    def _slot_layout(which, warps, blocks, row_tiles):
        return _HOST_LAYOUTS["slot"](int(warps), int(blocks), int(row_tiles))[int(which)]

    @constexpr_function
    def _tiled_layout(warps, blocks, row_tiles):
        return _HOST_LAYOUTS["tiled"](int(warps), int(blocks), int(row_tiles))

    @constexpr_function
    def _partials_groups(n):
        return max(32, 1 << (int(n) - 1).bit_length())

    @constexpr_function
    def _partials_layout(groups, warps):
        return _HOST_LAYOUTS["partials"](int(groups), int(warps))

    @constexpr_function
    def _tma_layout():
        return _HOST_LAYOUTS["tma"]()

    @gluon.jit
    def _slot_views(ring_w, ring_t, S: gl.constexpr, RT: gl.constexpr, BT: gl.constexpr):
        """The rings as one product's slots: [S, RT, BT, 128] words and [S, RT, BT, 16] terms."""
        words = ring_w._reinterpret(gl.int32, [S, RT, BT, _WORD_ROWS], _tma_layout())
        terms = ring_t._reinterpret(gl.int32, [S, RT, BT, _TERM_COLS], _tma_layout())
        return words, terms

    @gluon.jit
    def _issue(w_desc, t_desc, ring_w, ring_t, full, empty, count, group, step, S: gl.constexpr,
               RT: gl.constexpr, BT: gl.constexpr):
        """One step of a tile group (BT blocks of each of its RT row tiles) into the ring's next slot,
        once its consumers have handed it back; returns the slots issued so far."""
        BYTES: gl.constexpr = RT * BT * (_WORD_ROWS + _TERM_COLS) * 4
        words, terms = _slot_views(ring_w, ring_t, S, RT, BT)
        slot = count % S
        mbarrier.wait(empty.index(slot), ((count // S) & 1) ^ 1)
        mbarrier.expect(full.index(slot), BYTES)
        tma.async_copy_global_to_shared(w_desc, [group * RT, step * BT, 0], full.index(slot), words.index(slot))
        tma.async_copy_global_to_shared(t_desc, [group * RT, step * BT, 0], full.index(slot), terms.index(slot))
        return count + 1

    @gluon.jit
    def _produce(w_desc, t_desc, ring_w, ring_t, full, empty, count, ring_w2, ring_t2, full2, empty2, count2,
                 GROUPS: gl.constexpr, K: gl.constexpr, S: gl.constexpr, P: gl.constexpr, RT: gl.constexpr,
                 BT: gl.constexpr, PARTS: gl.constexpr):
        """Program p's tile groups of one product, step by step, into its consumer partitions' rings
        (PARTS 2: groups 2p + 2Pj to the first, 2p + 1 + 2Pj to the second, their steps
        interleaved); returns the slots issued so far into each."""
        for group in range(PARTS * gl.program_id(0), GROUPS, PARTS * P):
            for step in range(K // 64 // BT):
                count = _issue(w_desc, t_desc, ring_w, ring_t, full, empty, count, group, step, S, RT, BT)
                if PARTS == 2:
                    if group + 1 < GROUPS:
                        count2 = _issue(w_desc, t_desc, ring_w2, ring_t2, full2, empty2, count2, group + 1, step, S,
                                        RT, BT)
        return count, count2

    @gluon.jit
    def _producer(wd1, td1, wd2, td2, wd3, td3, ring_w, ring_t, full, empty, ring_w2, ring_t2, full2, empty2,
                  K1: gl.constexpr, G1: gl.constexpr, RT1: gl.constexpr, KB1: gl.constexpr, K2: gl.constexpr,
                  G2: gl.constexpr, RT2: gl.constexpr, KB2: gl.constexpr, K3: gl.constexpr, G3: gl.constexpr,
                  RT3: gl.constexpr, KB3: gl.constexpr, PHASES: gl.constexpr, S: gl.constexpr, P: gl.constexpr,
                  W: gl.constexpr, MODE: gl.constexpr, PARTS: gl.constexpr):
        if MODE != 2:  # (MODE 2 times the arithmetic alone: nothing is copied)
            count = 0
            count2 = 0
            count, count2 = _produce(wd1, td1, ring_w, ring_t, full, empty, count, ring_w2, ring_t2, full2, empty2,
                                     count2, G1, K1, S, P, RT1, W * KB1, PARTS)
            count, count2 = _produce(wd2, td2, ring_w, ring_t, full, empty, count, ring_w2, ring_t2, full2, empty2,
                                     count2, G2, K2, S, P, RT2, W * KB2, PARTS)
            if PHASES == 3:
                _produce(wd3, td3, ring_w, ring_t, full, empty, count, ring_w2, ring_t2, full2, empty2, count2, G3,
                         K3, S, P, RT3, W * KB3, PARTS)

    @gluon.jit
    def _take(slots_w, slots_t, full, empty, count, S: gl.constexpr, BT: gl.constexpr, RT: gl.constexpr,
              LW: gl.constexpr, LT: gl.constexpr, LW3: gl.constexpr, LT3: gl.constexpr, WAIT: gl.constexpr):
        """The next slot's words [BT, RT, 8, 4, 4] and terms [BT, RT, 8, 2] (LW, LT), once the
        producer's copy has landed; the slot is handed back as soon as they are in registers."""
        slot = count % S
        if WAIT:
            mbarrier.wait(full.index(slot), (count // S) & 1)
        words = slots_w.index(slot).load(LW3)
        terms = slots_t.index(slot).load(LT3)
        # the slot's reads (generic proxy) ordered before the producer's next TMA write to it (async
        # proxy): without this fence a program whose producer runs ahead into the next product had
        # its slots overwritten while still being read (wrong, varying results
        # in up to 58 of 60 runs of a short product followed by a longer one; none with it)
        fence_async_shared()
        mbarrier.arrive(empty.index(slot))
        words = gl.convert_layout(gl.reshape(gl.permute(words, (1, 0, 2)), [BT, RT, 8, 4, 4]), LW, assert_trivial=True)
        terms = gl.convert_layout(gl.reshape(gl.permute(terms, (1, 0, 2)), [BT, RT, 8, 2]), LT, assert_trivial=True)
        return words, terms, count + 1

    @gluon.jit
    def _fold(acc, check_w, check_t, words, terms, xi, ones, zero, zero16, zero4, MODE: gl.constexpr,
              DECODE_ASM: gl.constexpr, DT: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, LS: gl.constexpr,
              MMA: gl.constexpr, L4: gl.constexpr):
        """acc [BT, 16*RT, 8] + one step's blocks, or (MODE 0) the words and terms only read."""
        if MODE != 0:
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
            acc = qf.block_sums(acc, words, terms, zero, False, DECODE_ASM, DT, LA, LB, LS, b=b, xs=xs, PACKED=True)
        else:  # kept by a store that never happens
            check_w = check_w ^ words
            check_t = check_t ^ terms
        return acc, check_w, check_t

    @gluon.jit
    def _consume(X, Y, M, COUNTER, ring_w, ring_t, full, empty, count, K: gl.constexpr, N: gl.constexpr,
                 GROUPS: gl.constexpr, RT: gl.constexpr, KB: gl.constexpr, SILU: gl.constexpr, S: gl.constexpr,
                 P: gl.constexpr, MODE: gl.constexpr, DECODE_ASM: gl.constexpr, Q: gl.constexpr,
                 PARTS: gl.constexpr, R, RN, NW, PART, EPS, NORM_STAGE: gl.constexpr, NG: gl.constexpr):
        """Consumer partition Q's tile groups of one product (RT row tiles each) from its ring: y = x @
        W^T (SILU: SiLU(gate) * up of each tile's 8 + 8 rows), one step ahead on the activations;
        returns the slots consumed so far. NORM_STAGE 1 (o): `_norm_out`'s epilogue; 2 (gate_up):
        y scaled by each row's 1 / RMS from the NG partial sums `_norm_out` left in PART."""
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
        L4: gl.constexpr = _tiled_layout(WS, KB, RT)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        LS: gl.constexpr = gl.SliceLayout(2, MMA)
        slots_w, slots_t = _slot_views(ring_w, ring_t, S, RT, BT)
        x_ptr, _ = qf.activation_pointers(X, M, K, BT, LX)  # as frag.frag_sums loads them
        ones = gl.full([BT, 16, 64], 1.0, DT, layout=LA)
        zero = gl.zeros([BT, 16 * RT, MT], gl.float32, layout=MMA)
        zero16 = gl.zeros([BT, 16, MT], gl.float32, layout=MMA)
        zero4 = gl.zeros([BT, RT, 16, MT], gl.float32, layout=L4)
        if NORM_STAGE == 2:
            rstd = _row_rstd(PART, EPS, K, NG, gl.SliceLayout(0, gl.SliceLayout(0, MMA)))
        for group in range(PARTS * gl.program_id(0) + Q, GROUPS, PARTS * P):
            if NORM_STAGE == 1:  # the residual's tile, loaded before the K loop hides its latency
                r = _residual_tile(R, M, group, N, RT, gl.SliceLayout(0, MMA))
            acc = gl.zeros([BT, 16 * RT, MT], gl.float32, layout=MMA)
            check_w = gl.zeros([BT, RT, 8, 4, 4], gl.int32, layout=LW)
            check_t = gl.zeros([BT, RT, 8, 2], gl.int32, layout=LT)
            xi = gl.load(x_ptr)
            for step in range(STEPS - 1):
                xi_next = gl.load(x_ptr + (step + 1) * (BT * 32))
                words, terms, count = _take(slots_w, slots_t, full, empty, count, S, BT, RT, LW, LT, LW3, LT3,
                                            MODE != 2)
                acc, check_w, check_t = _fold(acc, check_w, check_t, words, terms, xi, ones, zero, zero16, zero4,
                                              MODE, DECODE_ASM, DT, LA, LB, LS, MMA, L4)
                xi = xi_next
            words, terms, count = _take(slots_w, slots_t, full, empty, count, S, BT, RT, LW, LT, LW3, LT3, MODE != 2)
            acc, check_w, check_t = _fold(acc, check_w, check_t, words, terms, xi, ones, zero, zero16, zero4, MODE,
                                          DECODE_ASM, DT, LA, LB, LS, MMA, L4)
            if MODE == 0:
                total = (gl.sum(gl.reshape(check_w, [BT * RT * 128]), 0)
                         + gl.sum(gl.reshape(check_t, [BT * RT * 16]), 0))
                gl.store(COUNTER + 1, total, mask=M < 0)
            y = gl.sum(acc, axis=0)  # [16 * RT, MT]: the (warp, block) shares, added in a fixed order
            if NORM_STAGE == 2:
                y = y * gl.expand_dims(rstd, 0)
            if SILU:
                out = qf.silu_gated(y, RT, Y.dtype.element_ty)
                ry = group * 8 * RT + gl.arange(0, 8 * RT, layout=gl.SliceLayout(1, out.type.layout))
                my = gl.arange(0, MT, layout=gl.SliceLayout(0, out.type.layout))
                gl.store(Y + gl.expand_dims(my, 0) * (N // 2) + gl.expand_dims(ry, 1), out.to(Y.dtype.element_ty),
                         mask=(gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N // 2))
            elif NORM_STAGE == 1:
                _norm_out(y, r, Y, RN, NW, PART, M, group, N, RT)
            else:
                ry = group * 16 * RT + gl.arange(0, 16 * RT, layout=gl.SliceLayout(1, y.type.layout))
                my = gl.arange(0, MT, layout=gl.SliceLayout(0, y.type.layout))
                gl.store(Y + gl.expand_dims(my, 0) * N + gl.expand_dims(ry, 1), y.to(Y.dtype.element_ty),
                         mask=(gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N))
        return count

    @gluon.jit
    def _residual_tile(R, M, group, N: gl.constexpr, RT: gl.constexpr, LAYOUT: gl.constexpr):
        """R's [16*RT, 8] tile of o's group (columns n x rows m, as o's sums lie), in float32."""
        MT: gl.constexpr = qf._MAX_ROWS
        ry = group * 16 * RT + gl.arange(0, 16 * RT, layout=gl.SliceLayout(1, LAYOUT))
        my = gl.arange(0, MT, layout=gl.SliceLayout(0, LAYOUT))
        mask = (gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N)
        return gl.load(R + gl.expand_dims(my, 0) * N + gl.expand_dims(ry, 1), mask=mask, other=0.0).to(gl.float32)

    @gluon.jit
    def _norm_out(y, r, U, RN, NW, PART, M, group, N: gl.constexpr, RT: gl.constexpr):
        """o's epilogue with the residual add and RMSNorm after it: for y [16*RT, 8] (o's columns n of
        this group x rows m), h = R + y (y rounded to the activations' dtype first, as o's output is
        stored, the sum rounded too: the engine's add + RMSNorm kernel's residual, bit for bit) into
        RN; U = w * h rounded, what gate_up multiplies (the RMS is applied to gate_up's sums, see
        `_row_rstd`); PART [group, m] = this group's share of row m's sum of squares. r: R's tile
        (`_residual_tile`)."""
        MT: gl.constexpr = y.shape[1]
        DT: gl.constexpr = U.dtype.element_ty
        ry = group * 16 * RT + gl.arange(0, 16 * RT, layout=gl.SliceLayout(1, y.type.layout))
        my = gl.arange(0, MT, layout=gl.SliceLayout(0, y.type.layout))
        mask = (gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N)
        offsets = gl.expand_dims(my, 0) * N + gl.expand_dims(ry, 1)
        h = (y.to(DT).to(gl.float32) + r).to(DT)
        gl.store(RN + offsets, h, mask=mask)
        hf = gl.where(mask, h.to(gl.float32), 0.0)
        w = gl.load(NW + ry, mask=ry < N, other=0.0).to(gl.float32)
        gl.store(U + offsets, (gl.expand_dims(w, 1) * hf).to(DT), mask=mask)
        gl.store(PART + group * MT + my, gl.sum(hf * hf, axis=0), mask=my < M)

    @gluon.jit
    def _row_rstd(PART, EPS, H: gl.constexpr, NG: gl.constexpr, LAYOUT: gl.constexpr):
        """Each row's 1 / RMS from o's NG groups' partial sums of squares PART [NG, 8], added in one
        fixed order whatever the rows are (inside each warp: `partials_layout`): [8] in LAYOUT
        (rows past M: whatever PART holds, never stored)."""
        MT: gl.constexpr = qf._MAX_ROWS
        NGP: gl.constexpr = _partials_groups(NG)
        LP: gl.constexpr = _partials_layout(NGP, gl.num_warps())
        pg = gl.arange(0, NGP, layout=gl.SliceLayout(1, LP))
        pm = gl.arange(0, MT, layout=gl.SliceLayout(0, LP))
        parts = gl.load(PART + gl.expand_dims(pg, 1) * MT + gl.expand_dims(pm, 0), mask=gl.expand_dims(pg, 1) < NG,
                        other=0.0)
        rstd = 1.0 / gl.sqrt(gl.sum(parts, axis=0) / H + EPS)
        return gl.convert_layout(rstd, LAYOUT)

    @gluon.jit
    def _consumer(X, A, H, Y, M, COUNTER, ring_w, ring_t, full, empty, R, RN, NW, XS, EPS, N1: gl.constexpr,
                  K1: gl.constexpr,
                  G1: gl.constexpr, RT1: gl.constexpr, KB1: gl.constexpr, N2: gl.constexpr, K2: gl.constexpr,
                  G2: gl.constexpr, RT2: gl.constexpr, KB2: gl.constexpr, N3: gl.constexpr, K3: gl.constexpr,
                  G3: gl.constexpr, RT3: gl.constexpr, KB3: gl.constexpr, PHASES: gl.constexpr, S: gl.constexpr,
                  P: gl.constexpr, MODE: gl.constexpr, DECODE_ASM: gl.constexpr, Q: gl.constexpr,
                  PARTS: gl.constexpr, NORM: gl.constexpr):
        wait_for_previous_grid()
        count = 0
        if PHASES == 3:  # o -> gate_up -> down: X -> A -> H -> Y (NORM: A = w * (R + o), see _norm_out)
            count = _consume(X, A, M, COUNTER, ring_w, ring_t, full, empty, count, K1, N1, G1, RT1, KB1, False, S, P,
                             MODE, DECODE_ASM, Q, PARTS, R, RN, NW, XS, EPS, NORM * 1, G1)
            grid_barrier(COUNTER, PARTS * P)
            count = _consume(A, H, M, COUNTER, ring_w, ring_t, full, empty, count, K2, N2, G2, RT2, KB2, True, S,
                             P, MODE, DECODE_ASM, Q, PARTS, R, RN, NW, XS, EPS, NORM * 2, G1)
            grid_barrier(COUNTER, PARTS * P)
            _consume(H, Y, M, COUNTER, ring_w, ring_t, full, empty, count, K3, N3, G3, RT3, KB3, False, S, P, MODE,
                     DECODE_ASM, Q, PARTS, R, RN, NW, XS, EPS, 0, G1)
        else:  # gate_up -> down: X -> H -> Y (phase 1's arguments are gate_up's)
            count = _consume(X, H, M, COUNTER, ring_w, ring_t, full, empty, count, K1, N1, G1, RT1, KB1, True, S, P,
                             MODE, DECODE_ASM, Q, PARTS, R, RN, NW, XS, EPS, 0, G1)
            grid_barrier(COUNTER, PARTS * P)
            _consume(H, Y, M, COUNTER, ring_w, ring_t, full, empty, count, K2, N2, G2, RT2, KB2, False, S, P, MODE,
                     DECODE_ASM, Q, PARTS, R, RN, NW, XS, EPS, 0, G1)

    @gluon.jit
    def _stream_kernel(X, A, H, Y, M, COUNTER, wd1, td1, wd2, td2, wd3, td3, R, RN, NW, XS, EPS,
                       N1: gl.constexpr, K1: gl.constexpr, G1: gl.constexpr, RT1: gl.constexpr, KB1: gl.constexpr,
                       N2: gl.constexpr, K2: gl.constexpr, G2: gl.constexpr, RT2: gl.constexpr, KB2: gl.constexpr,
                       N3: gl.constexpr, K3: gl.constexpr, G3: gl.constexpr, RT3: gl.constexpr, KB3: gl.constexpr,
                       PHASES: gl.constexpr, S: gl.constexpr, P: gl.constexpr, MODE: gl.constexpr,
                       DECODE_ASM: gl.constexpr, SB: gl.constexpr, PARTS: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PRODUCER_REGS_: gl.constexpr, NORM: gl.constexpr):
        W: gl.constexpr = gl.num_warps()
        FLAT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        ring_w = gl.allocate_shared_memory(gl.int32, [S, SB, _WORD_ROWS], FLAT)  # SB blocks a slot
        ring_t = gl.allocate_shared_memory(gl.int32, [S, SB, _TERM_COLS], FLAT)
        full = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        # the second consumer partition's ring and barriers (a token slot when there is none)
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
                (_consumer, (X, A, H, Y, M, COUNTER, ring_w, ring_t, full, empty, R, RN, NW, XS, EPS, N1, K1, G1,
                             RT1, KB1, N2, K2, G2, RT2, KB2, N3, K3, G3, RT3, KB3, PHASES, S, P, MODE, DECODE_ASM, 0,
                             PARTS, NORM)),
                (_consumer, (X, A, H, Y, M, COUNTER, ring_w2, ring_t2, full2, empty2, R, RN, NW, XS, EPS, N1, K1,
                             G1, RT1, KB1, N2, K2, G2, RT2, KB2, N3, K3, G3, RT3, KB3, PHASES, S, P, MODE, DECODE_ASM,
                             1, PARTS, NORM)),
                (_producer, (wd1, td1, wd2, td2, wd3, td3, ring_w, ring_t, full, empty, ring_w2, ring_t2, full2,
                             empty2, K1, G1, RT1, KB1, K2, G2, RT2, KB2, K3, G3, RT3, KB3, PHASES, S, P, W, MODE,
                             PARTS)),
            ], [W, 1], [CONSUMER_REGS, PRODUCER_REGS_])
        else:
            gl.warp_specialize([
                (_consumer, (X, A, H, Y, M, COUNTER, ring_w, ring_t, full, empty, R, RN, NW, XS, EPS, N1, K1, G1,
                             RT1, KB1, N2, K2, G2, RT2, KB2, N3, K3, G3, RT3, KB3, PHASES, S, P, MODE, DECODE_ASM, 0,
                             PARTS, NORM)),
                (_producer, (wd1, td1, wd2, td2, wd3, td3, ring_w, ring_t, full, empty, ring_w2, ring_t2, full2,
                             empty2, K1, G1, RT1, KB1, K2, G2, RT2, KB2, K3, G3, RT3, KB3, PHASES, S, P, W, MODE,
                             PARTS)),
            ], [1], [PRODUCER_REGS_])


def _descriptors(fw, rt: int, bt: int):
    """TMA descriptors over a product's words [tiles, K/64, 128] and terms [tiles, K/64, 16]
    (int32 views; groups of 64 values: one term row a block), a box of one consumer step: RT row
    tiles x BT blocks."""
    layout = tma_layout()
    blocks = fw.in_features // 64
    words = fw.words.view(-1, blocks, WORD_ROWS)
    terms = fw.terms.view(torch.int32).view(-1, blocks, TERM_COLS)
    return (TensorDescriptor.from_tensor(words, [rt, bt, WORD_ROWS], layout),
            TensorDescriptor.from_tensor(terms, [rt, bt, TERM_COLS], layout))


def slot_blocks(plan, warps: int) -> int:
    """Blocks a slot holds: warps x row tiles x blocks a warp, the same for every product."""
    sizes = {warps * rt * kb for rt, kb in plan}
    if len(sizes) != 1:
        raise ValueError(f"stream_chain: every product's step must fill one slot (warps x RT x KB): {plan}")
    return sizes.pop()


def constexprs(fws, plan, slots: int, programs: int, warps: int, mode: int = 1, parts: int = 2,
               consumer_regs: int = 200, norm: bool = False, half: bool = False) -> dict:
    """The kernel's compile-time arguments: fws the products' weights (or anything with
    out_features / in_features), plan their (row tiles, blocks a warp a step); half: float16
    activations (else bfloat16)."""
    args = {}
    padded = list(zip(fws, plan)) + [(fws[-1], plan[-1])] * (3 - len(fws))
    for i, (fw, (rt, kb)) in enumerate(padded, 1):
        tiles = -(-fw.out_features // (16 * qf.MAX_ROW_TILES)) * qf.MAX_ROW_TILES  # the repacked words' tiles
        args.update({f"N{i}": fw.out_features, f"K{i}": fw.in_features, f"G{i}": tiles // rt, f"RT{i}": rt,
                     f"KB{i}": kb})
    return dict(args, PHASES=len(fws), S=slots, P=programs, MODE=mode, DECODE_ASM=qf.decode_pairs_asm(half),
                SB=slot_blocks(plan, warps), PARTS=parts, CONSUMER_REGS=consumer_regs, PRODUCER_REGS_=PRODUCER_REGS,
                NORM=norm)


def descriptors(fws, plan, warps: int) -> list:
    """The TMA descriptors of each product's words and terms, as `stream_chain` takes them."""
    descs = [d for fw, (rt, kb) in zip(fws, plan) for d in _descriptors(fw, rt, warps * kb)]
    return descs + descs[-2:] * (3 - len(fws))


def stream_chain(x, a, h, y, fws, plan, counter, programs: int, slots: int, warps: int, compile_only: bool = False,
                 norm=None, descs=None, pdl: bool = True, **options):
    """fws: (gate_up, down) or (o, gate_up, down), groups of 64, plan: (row tiles, blocks a warp a
    step) for each; x [M, K1] (M <= 8, bfloat16 / float16) -> y, through a and h (the intermediate
    outputs, contiguous); counter: int64 (grid_sync.counter_for(device, parts * programs)). norm
    (o -> gate_up -> down only): (residual [M, H], residual out [M, H], RMSNorm weight [H], partial
    sums float32 [o's tile groups, 8], eps): gate_up then takes RMSNorm(residual + o) (a holds the
    weighted sum), and residual out gets the sum. descs: `descriptors(fws, plan, warps)`, made once
    by a caller that launches often; pdl: launched with programmatic dependent launch (the
    producer's copies start while the kernel before finishes; the consumers wait for it)."""
    if any(fw.group_size != 64 for fw in fws):
        raise ValueError("stream_chain: groups of 64 only (one term row a block)")
    if norm is not None and len(fws) != 3:
        raise ValueError("stream_chain: the norm sits between o and gate_up (three products)")
    residual, residual_out, norm_weight, scratch, eps = norm if norm is not None else (x, x, x, x, 1e-6)
    descs = descriptors(fws, plan, warps) if descs is None else descs
    launch = _stream_kernel.warmup if compile_only else _stream_kernel[(programs,)]
    extra = {"grid": (programs,)} if compile_only else {}
    return launch(x, a, h, y, x.shape[0], counter, *descs, residual, residual_out, norm_weight, scratch, eps,
                  **constexprs(fws, plan, slots, programs, warps, norm=norm is not None,
                                 half=x.dtype == torch.float16, **options), num_warps=warps,
                  launch_pdl=pdl, **extra)
