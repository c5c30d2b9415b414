"""quant_frag's 4-bit product with its loads in a ring of shared-memory stages (`FragTiles.stages`):
each thread copies its own words, activation pairs and group terms with cp.async (no registers
held while in flight), `stages - 1` steps ahead of the one it multiplies.

Why: the register pipeline holds at most two steps' loads in flight, and the small layers' products
wait on memory with under half a wave of programs (docs/benchmarks.md, "Sixteenth session"). Here
the bytes in flight grow with the stages at no register cost, and the first `stages - 1` steps'
weights are requested before the kernel waits for the previous one (programmatic launch).

A thread reads back exactly what it copied (the copies and the loads use one layout), so the only
ordering needed is cp.async.wait_group's. The arithmetic is `quant_frag._accumulate`'s, in the same
order, so the results are the register pipeline's bit for bit.
"""
from __future__ import annotations

from verispec.kernels import quant_frag
from verispec.kernels.quant_gemv import gl, gluon

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from verispec.kernels.quant_frag import _accumulate, _MAX_ROWS, _operand_pointers, _store
    from verispec.kernels.quant_gemv import wait_for_previous_grid

    @gluon.jit
    def _copy_weights(w_slot, t_slot, w_ptr, t_ptr, w_block, t_block, step, NB: gl.constexpr, GROUP: gl.constexpr):
        BT: gl.constexpr = w_slot.shape[0]
        b0 = step * BT
        async_copy.async_copy_global_to_shared(w_slot, w_ptr + b0 * 128, mask=w_block + b0 < NB)
        async_copy.async_copy_global_to_shared(t_slot, t_ptr + ((t_block + b0) * 64 // GROUP) * 16,
                                               mask=t_block + b0 < NB)

    @gluon.jit
    def _copy_acts(x_slot, x_ptr, x_block, x_live, step, NB: gl.constexpr):
        # rows past the pass's are not copied (zeros): copying row M-1 again for each of them made
        # one-row passes several times slower (every lane of a row group asking for one address)
        BT: gl.constexpr = x_slot.shape[0]
        b0 = step * BT
        async_copy.async_copy_global_to_shared(x_slot, x_ptr + b0 * 32, mask=(x_block + b0 < NB) & x_live)

    @gluon.jit
    def _frag_ring_kernel(X, WQ, T, Y, M, N, stride_xm, stride_ym,
                          K: gl.constexpr, GROUP: gl.constexpr, ZERO_POINT: gl.constexpr, KB: gl.constexpr,
                          GRID_WAIT: gl.constexpr, DECODE_ASM: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr,
                          LT: gl.constexpr, STAGES: gl.constexpr, SILU_GATE: gl.constexpr, RT: gl.constexpr):
        WS: gl.constexpr = gl.num_warps()
        BT: gl.constexpr = WS * KB
        NB: gl.constexpr = K // 64
        STEPS: gl.constexpr = (NB + BT - 1) // BT
        MT: gl.constexpr = _MAX_ROWS
        DT: gl.constexpr = X.dtype.element_ty
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        LS: gl.constexpr = gl.SliceLayout(2, MMA)
        tile = gl.program_id(0)
        w_ptr, w_block, x_ptr, x_block, t_ptr, t_block, x_live = _operand_pointers(
            X, WQ, T, M, stride_xm, tile, K, GROUP, BT, RT, LW, LX, LT)

        # a ring's layout is its slots' (unswizzled: a thread reads back only its own copies)
        flat5: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [4, 3, 2, 1, 0])
        flat4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BT, RT, 8, 4, 4], flat5)
        x_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BT, MT, 4, 8], flat4)
        t_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BT, RT, 8, 2], flat4)

        ones = gl.full([BT, 16 * RT, 64], 1.0, DT, layout=LA)
        zero = gl.zeros([BT, 16 * RT, MT], gl.float32, layout=MMA)
        acc = gl.zeros([BT, 16 * RT, MT], gl.float32, layout=MMA)

        # the first stages' weights are requested before the wait for the previous kernel; the
        # copies made before a commit join its group, so group s holds step s's activations and,
        # in the first one, every early weight copy: step i's data is in group i, for every i
        for s in gl.static_range(STAGES - 1):
            _copy_weights(w_ring.index(s), t_ring.index(s), w_ptr, t_ptr, w_block, t_block, s, NB, GROUP)
        if GRID_WAIT:
            wait_for_previous_grid()
        for s in gl.static_range(STAGES - 1):
            _copy_acts(x_ring.index(s), x_ptr, x_block, x_live, s, NB)
            async_copy.commit_group()
        for i in range(STEPS):
            ahead = i + STAGES - 1  # into the slot step i - 1 used (this thread has read it)
            slot = ahead % STAGES
            _copy_weights(w_ring.index(slot), t_ring.index(slot), w_ptr, t_ptr, w_block, t_block, ahead, NB, GROUP)
            _copy_acts(x_ring.index(slot), x_ptr, x_block, x_live, ahead, NB)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)  # step i's group and those before it are done
            here = i % STAGES
            words = w_ring.index(here).load(LW)
            xi = x_ring.index(here).load(LX)
            terms = t_ring.index(here).load(LT)
            acc = _accumulate(acc, words, xi, terms, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
        async_copy.wait_group(0)  # the copies past the last step (masked off) before the ring goes
        _store(acc, Y, M, N, stride_ym, tile, SILU_GATE, RT, MMA)


def launch(x, fw, y, tiles, blocks: int, layouts, decode_asm: str, pdl: bool, silu_gate: bool) -> None:
    """frag_gemv's launch for tiles with stages (the checks and the layouts are frag_gemv's)."""
    words_layout, acts_layout, terms_layout = layouts
    m, k = x.shape
    _frag_ring_kernel[(fw.words.shape[0] // tiles.row_tiles,)](
        x, fw.words, fw.terms, y, m, fw.out_features, x.stride(0), y.stride(0),
        K=k, GROUP=fw.group_size, ZERO_POINT=fw.zero_point, KB=blocks, GRID_WAIT=pdl,
        DECODE_ASM=decode_asm, LW=words_layout, LX=acts_layout, LT=terms_layout,
        STAGES=tiles.stages, SILU_GATE=silu_gate, RT=tiles.row_tiles, num_warps=tiles.num_warps, launch_pdl=pdl)


__all__ = ["launch", "quant_frag"]
