"""Attention for prompt chunks of any length, under exact numerics: each prompt row's output is the
bits a decode step or verify pass at its position gives it (kernels/decode_attention.py), so a
token's result does not depend on how its prompt was chunked, cached or batched.

A program holds TQ query tokens of one sequence for one kv head (the GQA group x TQ rows) and sums
each row's keys share by share, as the split-K path's programs sum them (the same block step, the
same key blocks), folding the shares in order as its combine does (`_fold`). Where the tile's rows
split their keys alike (no window, one share size: nearly every tile), one loop walks all of its
key blocks and folds each share as it ends (`_one_walk`), so the loads run on across the shares;
otherwise each share has its own loop (`_share_sums`).
"""
from __future__ import annotations

import torch

from verispec.kernels import decode_attention as split_k
from verispec.kernels import kv_turboquant

# the split path's launch helpers are called through its module, so a setting changed there (a test's
# MIN_SHARE_KEYS, a bench's split_config) reaches both kernels alike: their key blocks must agree
triton = split_k.triton
# whether tiles whose rows split their keys alike take `_one_walk` (False: a loop per share, as
# scripts/attention_kernel_bench.py --share-by-share times it; the bits are the same)
ONE_WALK = True

if triton is not None:
    import triton.language as tl

    # the split path's helpers, called by the kernel below (Triton resolves them as this module's names)
    from verispec.kernels.decode_attention import _attend_block, _finish, _fold, _share_keys, _share_sums

    @triton.jit
    def _close_share(m, l, o, m_i, l_i, acc, has, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """A share's running sums (m_i, l_i, acc) finished and folded into the rows' (m, l, o), for
        the rows that `has` the share (padding, and rows whose keys ended before it, keep theirs),
        and fresh sums for the next share."""
        lse, part = _finish(m_i, l_i, acc)
        m2, l2, o2 = _fold(m, l, o, lse, part)
        return (tl.where(has, m2, m), tl.where(has, l2, l), tl.where(has[:, None], o2, o),
                tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
                tl.zeros([BLOCK_M, BLOCK_D], tl.float32))

    @triton.jit
    def _one_walk(q, k_base, v_base, ks_base, vs_base, stride_sn, BT, b, stride_kn, stride_vn, stride_btb, kv_t,
                   chunk_t, row_valid, offs_d, d_valid, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, IEEE: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
                   FP8: tl.constexpr, KCB, VCB, KBITS: tl.constexpr, VBITS: tl.constexpr):
        """Every share of rows whose shares are alike (keys [0, kv) in shares of `chunk` keys), folded
        as `_share_sums` and `_fold` share by share give them, in one walk over the key blocks: the
        same blocks, masked where a row's keys end, each share's sums folded in when the walk
        crosses into the next share. (m, l, o) as the share-by-share loop leaves them."""
        chunk = tl.max(tl.where(row_valid, chunk_t, 0), 0)
        kv_min = tl.min(tl.where(row_valid, kv_t, 2147483647), 0)
        kv_max = tl.max(tl.where(row_valid, kv_t, 0), 0)
        full_end = tl.where(kv_max > 0, kv_min // BLOCK_N * BLOCK_N, 0)  # blocks every row attends whole
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        share_lo = full_end * 0  # the loop index's type (the positions' integer type)
        for n0 in range(0, full_end, BLOCK_N):
            if n0 - share_lo == chunk:  # a share ends: every row had all of it
                m, l, o, m_i, l_i, acc = _close_share(m, l, o, m_i, l_i, acc, row_valid, BLOCK_M, BLOCK_D)
                share_lo = n0
            offs_n = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend_block(m_i, l_i, acc, q, k_base, v_base, ks_base, vs_base, stride_sn, BT, b,
                                          stride_kn, stride_vn, stride_btb, offs_n, kv_max, offs_n[None, :] >= 0,
                                          offs_d, d_valid, scale, IEEE, PAGED, PAGE, FP8, KCB, VCB, KBITS, VBITS,
                                          MASK=False)
        for n0 in range(full_end, kv_max, BLOCK_N):
            if n0 - share_lo == chunk:  # a share ends inside the rows' last keys: rows that had any of it
                m, l, o, m_i, l_i, acc = _close_share(m, l, o, m_i, l_i, acc, row_valid & (share_lo < kv_t),
                                                      BLOCK_M, BLOCK_D)
                share_lo = n0
            offs_n = n0 + tl.arange(0, BLOCK_N)
            allowed = offs_n[None, :] < kv_t[:, None]
            m_i, l_i, acc = _attend_block(m_i, l_i, acc, q, k_base, v_base, ks_base, vs_base, stride_sn, BT, b,
                                          stride_kn, stride_vn, stride_btb, offs_n, kv_max, allowed, offs_d,
                                          d_valid, scale, IEEE, PAGED, PAGE, FP8, KCB, VCB, KBITS, VBITS)
        m, l, o, _, _, _ = _close_share(m, l, o, m_i, l_i, acc, row_valid & (share_lo < kv_t), BLOCK_M, BLOCK_D)
        return m, l, o

    @triton.jit(do_not_specialize=["stride_pb", "stride_btb", "window", "T", "has_len"],
                do_not_specialize_on_alignment=["POS", "BT", "LEN"])
    def _chunk_kernel(Q, K, V, KS, VS, POS, LEN, OUT, BT, KCB, VCB,
                      stride_qb, stride_qh, stride_qt,
                      stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn,
                      stride_pb, stride_btb, stride_sn,
                      scale, window, T, has_len,
                      G: tl.constexpr, D: tl.constexpr, SHARES: tl.constexpr, TQ: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
                      MIN_KEYS: tl.constexpr = 512, FP8: tl.constexpr = False,
                      KBITS: tl.constexpr = 0, VBITS: tl.constexpr = 0, ONE_WALK: tl.constexpr = True):
        """A prompt chunk: TQ query tokens of one sequence and kv head a program, each row's shares
        summed and folded as the split path does (the same helpers), so a prompt token's output is
        the bits a decode step or verify pass at its position gives it."""
        tiles = tl.cdiv(T, TQ)
        batch = tl.num_programs(0) // tiles
        # the latest tiles (the most keys) first, so the pass does not end on a few long programs
        tile = tiles - 1 - tl.program_id(0) // batch
        b = tl.program_id(0) % batch
        h = tl.program_id(1)
        hq_total = tl.num_programs(1) * G
        offs_m = tl.arange(0, BLOCK_M)
        g = offs_m // TQ
        t = tile * TQ + offs_m % TQ
        in_pass = (offs_m < G * TQ) & (t < T)
        row_valid = in_pass
        # rows padded at their ends (a batched prompt pass, a graph's bucket): the padding is not
        # attended. A run-time flag, not a constexpr: one compiled kernel serves both kinds of pass
        if has_len != 0:
            row_valid = row_valid & (t < tl.load(LEN + b))
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        pos_t = tl.load(POS + b * stride_pb + t, mask=row_valid, other=0)
        if PAGED:
            k_base = K + h * stride_kh
            v_base = V + h * stride_vh
        else:
            k_base = K + b * stride_kb + h * stride_kh
            v_base = V + b * stride_vb + h * stride_vh
        q = tl.load(Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                    mask=row_valid[:, None] & d_valid[None, :], other=0.0)
        # share by share, as the split path's programs sum them and its combine folds them
        kv_t = pos_t + 1
        lo_t = kv_t * 0
        if HAS_WINDOW:
            lo_t = (tl.maximum(pos_t - window + 1, 0) // BLOCK_N) * BLOCK_N
        chunk_t = _share_keys(kv_t, lo_t, SHARES, BLOCK_N, MIN_KEYS)
        shares = tl.max(tl.where(row_valid, tl.cdiv(kv_t - lo_t, chunk_t), 0), 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # the common tile: every row's shares alike (no window, one share size), so all rows fold at
        # the same blocks and one loop walks every share (a loop per share restarted its loads)
        uniform = tl.min(tl.where(row_valid, chunk_t, 2147483647), 0) == tl.max(tl.where(row_valid, chunk_t, 0), 0)
        if ONE_WALK and not HAS_WINDOW:
            if uniform:
                m, l, o = _one_walk(q, k_base, v_base, KS + h, VS + h, stride_sn, BT, b, stride_kn, stride_vn,
                                    stride_btb, kv_t, chunk_t, row_valid, offs_d, d_valid, scale, BLOCK_M, BLOCK_N,
                                    BLOCK_D, IEEE, PAGED, PAGE, FP8, KCB, VCB, KBITS, VBITS)
                shares = shares * 0  # the share-by-share loop below has nothing left to do
        for s in range(0, shares):
            start_t = lo_t + s * chunk_t
            end_t = tl.minimum(start_t + chunk_t, kv_t)
            lse, part = _share_sums(q, k_base, v_base, KS + h, VS + h, stride_sn, BT, b, stride_kn, stride_vn,
                                    stride_btb, start_t, end_t, pos_t, row_valid, offs_d, d_valid, scale, window,
                                    BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW, IEEE, PAGED, PAGE, FP8, KCB, VCB, KBITS,
                                    VBITS, UNMASKED_MIDDLE=True)
            has = row_valid & (start_t < end_t)
            m2, l2, o2 = _fold(m, l, o, lse, part)
            m = tl.where(has, m2, m)
            l = tl.where(has, l2, l)
            o = tl.where(has[:, None], o2, o)
        out = o / tl.where(row_valid, l, 1.0)[:, None]  # padding rows: 0 (o is), stored so they are finite
        # OUT is [B, T, HQ, D], as the split path's. Padding rows are written too: left as the
        # allocation found them they carried NaNs into the next layers, and a recurrent layer's
        # state masks padding by multiplying its gates by 0 (NaN * 0 is NaN)
        dst = (b * T + t).to(tl.int64) * hq_total + h * G + g
        tl.store(OUT + dst[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=in_pass[:, None] & d_valid[None, :])


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                    scale: float, window: int | None = None, lengths: torch.Tensor | None = None,
                    num_splits: int | None = None, query_tile: int | None = None,
                    num_warps: int | None = None) -> torch.Tensor:
    """A prompt chunk of any length over the contiguous cache (its own keys already written): the
    contract of `decode_attention_reference`, with each row's bits those a decode step or verify
    pass at its position gives. `lengths` [B]: rows past a sequence's length are padding."""
    return _launch_chunk(q, k_cache, v_cache, positions, scale, window, None, 0, lengths, num_splits, query_tile,
                         num_warps)


def paged_chunk_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                          block_size: int, positions: torch.Tensor, scale: float, window: int | None = None,
                          lengths: torch.Tensor | None = None, num_splits: int | None = None,
                          query_tile: int | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None,
                          codec: kv_turboquant.LayerCodec | None = None) -> torch.Tensor:
    """`chunk_attention` over the paged pools, through the block tables (fp8 pools with their
    k_scale / v_scale [slots, Hkv]; tq pools with them and their `codec`, q and the result in the
    rotated basis)."""
    return _launch_chunk(q, k_pool, v_pool, positions, scale, window, block_tables, block_size, lengths, num_splits,
                         query_tile, k_scale=k_scale, v_scale=v_scale, codec=codec)


def chunk_launch_config(d: int, element_size: int, group: int, coded: bool = False,
                        query_tile: int | None = None) -> dict:
    """The prompt kernel's tiles for head dim d and `group` query heads a kv head (what
    `_launch_chunk` uses, and tools/sass/offline_sass.py compiles): about 128 rows (kv head group x
    query tokens) a program on 8 warps, the fastest of 16-128 rows on the H200 (docs/benchmarks.md);
    the key blocks the split path's, so every row's sums are the same."""
    config = split_k.split_config(d, element_size, coded)
    # tq tiles decoded in registers: 64 rows on 8 warps (128 rows spilled 64-200 bytes a thread)
    tq = query_tile or max(1, (64 if coded else 128) // group)
    block_m = max(16, triton.next_power_of_2(group * tq))
    # 128 rows of 128-key blocks staged 3 deep need 237,696 bytes of shared memory where an H200 has
    # 232,448; of 64-key blocks, 3 deep were as fast as 4
    stages = (2 if config["BLOCK_N"] >= 128 else 3) if block_m >= 128 else config["num_stages"]
    return dict(BLOCK_N=config["BLOCK_N"], BLOCK_D=config["BLOCK_D"], TQ=tq, BLOCK_M=block_m,
                num_warps=8 if block_m >= 128 or coded else config["num_warps"], num_stages=stages)


def _launch_chunk(q, k_cache, v_cache, positions, scale, window, block_tables, block_size, lengths, num_splits,
                  query_tile, num_warps=None, k_scale=None, v_scale=None, codec=None) -> torch.Tensor:
    b, hq, t, d = q.shape
    paged = block_tables is not None
    hkv = k_cache.shape[1]
    group = hq // hkv
    q = q.contiguous()
    splits = num_splits or split_k.shares_for(hkv, q.device)
    fp8, coded = split_k._check_scales(k_cache, k_scale, v_scale, paged, codec)
    config = chunk_launch_config(d, q.element_size(), group, coded, query_tile)
    out = torch.empty((b, t, hq, d), dtype=q.dtype, device=q.device)
    strides_k, strides_v, table, table_stride = split_k._cache_layout(k_cache, v_cache, block_tables, positions)
    scaled = fp8 or coded
    _chunk_kernel[(b * triton.cdiv(t, config["TQ"]), hkv)](
        q, k_cache, v_cache, k_scale if scaled else k_cache, v_scale if scaled else v_cache, positions,
        lengths if lengths is not None else positions, out, table, *split_k._codebooks(codec, k_cache),
        q.stride(0), q.stride(1), q.stride(2), *strides_k, *strides_v, positions.stride(0), table_stride,
        k_scale.stride(0) if scaled else 0,
        scale * split_k.LOG2E, window or 0, t, int(lengths is not None),
        G=group, D=d, SHARES=splits, TQ=config["TQ"], BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"], BLOCK_D=config["BLOCK_D"], HAS_WINDOW=window is not None,
        IEEE=q.dtype == torch.float32, PAGED=paged, PAGE=max(block_size, 1),
        MIN_KEYS=split_k._min_share_keys(config["BLOCK_N"], hkv), FP8=fp8, **split_k._code_bits(codec),
        ONE_WALK=ONE_WALK, num_warps=num_warps or config["num_warps"], num_stages=config["num_stages"])
    return out.transpose(1, 2)
