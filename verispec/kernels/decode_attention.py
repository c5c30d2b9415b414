"""Split-K ("flash-decoding") attention for decode and verify steps: T <= 8 query tokens.

The KV cache is read in place ([B, Hkv, capacity, D] buffers) and every bound comes from the
device-side `positions` [B, T] (query t sees keys 0..positions[t], minus a sliding window), so a
step has static shapes and can be captured in a CUDA graph. Pass 1 splits each sequence's keys
over NUM_SPLITS programs per kv head; each program handles all G*T query rows that share the kv
head (GQA group x query tokens) as one matrix, so K and V are read once per kv head. Pass 2
combines the partial results with their log-sum-exp.

`decode_attention_reference` (kernels/attention_reference.py) is the plain-torch definition the
kernel is tested against.
"""
from __future__ import annotations

import torch

from verispec.kernels import kv_fp8, kv_turboquant, launch
# the plain-torch definitions the kernels are tested against (and the CPU path runs), named here too
from verispec.kernels.attention_reference import (decode_attention_reference,
                                                  paged_decode_attention_reference)
from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs: the torch reference is used instead
    triton = None
    tl = None

MAX_QUERY_TOKENS = 8
# the kernels' softmax runs in base 2 (exp2 is one instruction, exp a multiply and then it): the
# launchers scale the scores by log2(e) along with the softmax scale
LOG2E = 1.4426950408889634
# A share of a layer with 8 or more kv heads holds at least this many keys, one with fewer heads
# proportionally fewer (read at launch, by the split and prompt kernels alike, so their shares
# agree): a 512-key context decodes as one share per head where 8 heads keep the GPU busy, not 16
# programs' worth of partial sums at 64 sequences; 4 or 2 heads alone would leave it idle
MIN_SHARE_KEYS = 512
# With programmatic launch, each split program of a one-token pass asks L2 for its first key block's
# K and V before it waits for the kernel before it (scripts/gpu_fusion_bounds.py's
# `attention-prefetch-off` sets False)
PREFETCH = True


def shares_for(num_kv_heads: int, device: torch.device) -> int:
    """Into how many shares a query row splits its keys: about one program per multiprocessor for a
    one-sequence decode step (a power of two, 1..64; on an H200 16 splits for 8 kv heads beat 32
    and 64 at 4K-128K keys). Fixed per model and device, never by the batch: a row's shares, and so
    its bits, must not depend on who else is in the pass."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, sms // max(num_kv_heads, 1))
    return min(64, 1 << (want.bit_length() - 1))


if triton is not None:

    @triton.jit
    def _key_rows(BT, b, stride_btb, offs_n, valid, PAGED: tl.constexpr, PAGE: tl.constexpr):
        """The cache rows of keys `offs_n` of batch row b: the keys themselves, or (PAGED) their
        slots through the block table (keys not `valid` read table entry 0)."""
        if PAGED:
            block = tl.load(BT + b * stride_btb + offs_n // PAGE, mask=valid, other=0)
            rows = block.to(tl.int64) * PAGE + offs_n % PAGE
        else:
            rows = offs_n
        return rows

    @triton.jit
    def _prefetch_block(k_base, v_base, BT, b, start, end, stride_kn, stride_vn, stride_btb,
                        BLOCK_N: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr, D: tl.constexpr,
                        PAGED: tl.constexpr, PAGE: tl.constexpr):
        """`prefetch.global.L2` of keys [start, start + BLOCK_N) (clamped to end - 1: no address past
        the keys asked for) of one kv head, K and V: LINES lines of LINE values a key."""
        offs_n = tl.minimum(start + tl.arange(0, BLOCK_N), end - 1)
        rows = _key_rows(BT, b, stride_btb, offs_n, offs_n < end, PAGED, PAGE)
        lines = tl.minimum(tl.arange(0, LINES) * LINE, D - 1)  # a key's cache lines (D values)
        _prefetch_l2(k_base + rows[:, None] * stride_kn + lines[None, :])
        _prefetch_l2(v_base + rows[:, None] * stride_vn + lines[None, :])

    @triton.jit
    def _prefetch_l2(ptrs):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    # Arguments that vary between calls of one model and do not speed the kernel up when specialised
    # are not: the positions' row stride (1 when T = 1), the block table's width (1 for a short
    # prompt) and where the positions / table start (a slice may be 8-byte aligned only). Each
    # specialisation is a compile (0.5-1 s on the H200) inside whichever request meets it first.
    @triton.jit
    def _share_keys(kv_t, lo_t, SHARES: tl.constexpr, BLOCK_N: tl.constexpr, MIN_KEYS: tl.constexpr):
        """Keys a share of each row holds: its keys [lo, kv) over SHARES, in whole blocks, at least
        MIN_KEYS (a multiple of BLOCK_N): short contexts take one or two shares, not SHARES
        programs' worth of partial sums, which cost a 64-sequence decode step a quarter of its speed."""
        return tl.maximum(tl.cdiv(tl.cdiv(kv_t - lo_t, SHARES), BLOCK_N) * BLOCK_N, MIN_KEYS)

    @triton.jit
    def _row_share(pos_t, window, s, SHARES: tl.constexpr, BLOCK_N: tl.constexpr, MIN_KEYS: tl.constexpr,
                   HAS_WINDOW: tl.constexpr):
        """[start, end) of share s of each query row's keys: a row splits its own keys [lo, pos]
        into shares of whole blocks by its key count alone, so a row's shares are the same in a
        decode step, a verify pass, a prompt chunk and any batch."""
        kv_t = pos_t + 1
        lo_t = kv_t * 0
        if HAS_WINDOW:  # the window's first key, rounded down to a block (the mask does the rest)
            lo_t = (tl.maximum(pos_t - window + 1, 0) // BLOCK_N) * BLOCK_N
        chunk_t = _share_keys(kv_t, lo_t, SHARES, BLOCK_N, MIN_KEYS)
        start_t = lo_t + s * chunk_t
        return start_t, tl.minimum(start_t + chunk_t, kv_t)

    @triton.jit
    def _row_sums(p, dtype, IEEE: tl.constexpr):
        """Each row of p summed by a matrix product with a column of ones: the tensor cores' chain
        over the keys, whatever the tile's shape and the warps' layout (tl.sum's order follows the
        layout, which changes with the rows a program holds: a prompt tile against a decode step's).
        16-bit tiles sum p in the 16-bit `dtype` the value product takes it in (the weights the
        values are summed with, so they are normalised by their own sum), at the 16-bit rate: the
        float32 (tf32) product cost a prompt pass 6-7%."""
        if IEEE:
            ones = tl.full([p.shape[1], 16], 1.0, p.dtype)
            sums = tl.dot(p, ones, input_precision="ieee")
        else:
            ones = tl.full([p.shape[1], 16], 1.0, dtype)
            sums = tl.dot(p.to(dtype), ones)
        first = tl.arange(0, 16)[None, :] == 0
        return tl.sum(tl.where(first, sums, 0.0), 1)  # one column: adding zeros is exact

    @triton.jit
    def _attend_block(m_i, l_i, acc, q, k_base, v_base, ks_base, vs_base, stride_sn, BT, b, stride_kn, stride_vn,
                      stride_btb, offs_n, end, allowed, offs_d, d_valid, scale, IEEE: tl.constexpr, PAGED: tl.constexpr,
                      PAGE: tl.constexpr, FP8: tl.constexpr, KCB, VCB, KBITS: tl.constexpr, VBITS: tl.constexpr,
                      MASK: tl.constexpr = True):
        """One block of keys `offs_n` added to the rows' running softmax sums (rows attend where
        `allowed`; elsewhere their sums stay bit for bit as they were; not MASK: every row attends
        every key of the block, and `allowed` is not read). FP8: the cache holds e4m3
        codes with a scale exponent per (row, head) at ks_base / vs_base + row * stride_sn, decoded
        here to q's dtype, the bits the torch path's decoded copy holds (kernels/kv_fp8.py). KBITS /
        VBITS > 0: tq rows, packed codes with a float32 scale per (row, head) there, decoded through
        the codebooks KCB / VCB into the rotated basis q was turned into (kernels/kv_turboquant.py)."""
        n_valid = offs_n < end
        kv_mask = n_valid[:, None] & d_valid[None, :]
        rows = _key_rows(BT, b, stride_btb, offs_n, n_valid, PAGED, PAGE)
        if KBITS > 0:
            k = kv_turboquant.decode_tile(k_base, rows * stride_kn, offs_d, kv_mask,
                                     tl.load(ks_base + rows * stride_sn, mask=n_valid, other=0.0), KCB, KBITS, q.dtype)
        else:
            k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            k = kv_fp8.decode(k, tl.load(ks_base + rows * stride_sn, mask=n_valid, other=0), q.dtype)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        # `scale` is the softmax scale times log2(e): the sums run in base 2, one ex2 a score. A row's
        # largest score is scaled once (rounding is monotonic, so it is the largest scaled score).
        # The scores are scaled and shifted by one fused multiply-add, written out: left to the
        # compiler, the product and the subtraction were fused where no mask stood between them and
        # not where one did, so an unmasked block's sums differed in the last bits from a masked one's
        if MASK:
            m_new = tl.maximum(m_i, tl.max(tl.where(allowed, qk, float("-inf")), 1) * scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(tl.fma(qk, scale, -m_safe[:, None]))
        if MASK:
            p = tl.where(allowed, p, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + _row_sums(p, q.dtype, IEEE)
        if VBITS > 0:
            v = kv_turboquant.decode_tile(v_base, rows * stride_vn, offs_d, kv_mask,
                                     tl.load(vs_base + rows * stride_sn, mask=n_valid, other=0.0), VCB, VBITS, q.dtype)
        else:
            v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            v = kv_fp8.decode(v, tl.load(vs_base + rows * stride_sn, mask=n_valid, other=0), q.dtype)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def _share_sums(q, k_base, v_base, ks_base, vs_base, stride_sn, BT, b, stride_kn, stride_vn, stride_btb, start_t,
                    end_t, pos_t, row_valid, offs_d, d_valid, scale, window, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
                    PAGED: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, KCB, VCB, KBITS: tl.constexpr,
                    VBITS: tl.constexpr, UNMASKED_MIDDLE: tl.constexpr = False):
        """Each row's softmax sums over its own share [start_t, end_t): (lse, out = weighted values).
        The program walks the union of its rows' shares in blocks aligned as theirs are and masks
        each row to its own: a block outside it leaves the row's running sums bit for bit as they
        were, so a row's result does not depend on the other rows of its tile. UNMASKED_MIDDLE (a
        prompt tile's many rows): the blocks inside every valid row's share skip the mask, whose
        arithmetic is a tenth of a prompt tile's block (the kept entries are the same products)."""
        start = tl.min(tl.where(row_valid, start_t, 2147483647), 0)
        end = tl.max(tl.where(row_valid, end_t, 0), 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        full_lo = start
        full_hi = start
        if UNMASKED_MIDDLE and not HAS_WINDOW:
            # shares start on whole blocks; a row without this share has end <= start, so then
            # full_hi <= full_lo and every block stays masked
            latest_start = tl.max(tl.where(row_valid, start_t, 0), 0)
            earliest_end = tl.min(tl.where(row_valid, end_t, 2147483647), 0) // BLOCK_N * BLOCK_N
            if latest_start < earliest_end:
                full_lo = latest_start
                full_hi = earliest_end
        for n0 in range(start, full_lo, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            allowed = (offs_n[None, :] >= start_t[:, None]) & (offs_n[None, :] < end_t[:, None])
            m_i, l_i, acc = _attend_block(m_i, l_i, acc, q, k_base, v_base, ks_base, vs_base, stride_sn, BT, b,
                                          stride_kn, stride_vn, stride_btb, offs_n, end, allowed, offs_d, d_valid,
                                          scale, IEEE, PAGED, PAGE, FP8, KCB, VCB, KBITS, VBITS)
        for n0 in range(full_lo, full_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend_block(m_i, l_i, acc, q, k_base, v_base, ks_base, vs_base, stride_sn, BT, b,
                                          stride_kn, stride_vn, stride_btb, offs_n, end, offs_n[None, :] >= 0,
                                          offs_d, d_valid, scale, IEEE, PAGED, PAGE, FP8, KCB, VCB, KBITS, VBITS,
                                          MASK=False)
        for n0 in range(full_hi, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            allowed = (offs_n[None, :] >= start_t[:, None]) & (offs_n[None, :] < end_t[:, None])
            if HAS_WINDOW:
                allowed = allowed & (offs_n[None, :] > pos_t[:, None] - window)
            m_i, l_i, acc = _attend_block(m_i, l_i, acc, q, k_base, v_base, ks_base, vs_base, stride_sn, BT, b,
                                          stride_kn, stride_vn, stride_btb, offs_n, end, allowed, offs_d, d_valid,
                                          scale, IEEE, PAGED, PAGE, FP8, KCB, VCB, KBITS, VBITS)
        return _finish(m_i, l_i, acc)

    @triton.jit
    def _finish(m_i, l_i, acc):
        """A share's running sums as (log-sum-exp in base 2, its weighted values)."""
        has = l_i > 0
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        return lse, acc / tl.where(has, l_i, 1.0)[:, None]

    @triton.jit
    def _fold(m, l, o, lse, part):
        """Adds one share's (lse, part) to the running (max, weight, output) of its rows. Shares are
        folded one at a time in order, by the split path's combine and by the prompt path alike; an
        empty share (lse = -inf, part = 0) leaves the sums as they were."""
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        return m_new, l * a + w, o * a[:, None] + part * w[:, None]

    # Arguments that vary between calls of one model and do not speed the kernel up when specialised
    # are not: the positions' row stride (1 when T = 1), the block table's width (1 for a short
    # prompt) and where the positions / table start (a slice may be 8-byte aligned only). Each
    # specialisation is a compile (0.5-1 s on the H200) inside whichever request meets it first.
    @triton.jit(do_not_specialize=["stride_pb", "stride_btb", "window"],
                do_not_specialize_on_alignment=["POS", "BT"])
    def _split_kernel(Q, K, V, KS, VS, POS, OPART, LSE, BT, KCB, VCB,
                      stride_qb, stride_qh, stride_qt,
                      stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn,
                      stride_pb, stride_btb, stride_sn,
                      scale, window,
                      T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, PAGED: tl.constexpr,
                      PAGE: tl.constexpr, MIN_KEYS: tl.constexpr = 512, PDL: tl.constexpr = False,
                      EARLY: tl.constexpr = False, PREFETCH: tl.constexpr = False, LINE: tl.constexpr = 64,
                      LINES: tl.constexpr = 2, FP8: tl.constexpr = False, KBITS: tl.constexpr = 0,
                      VBITS: tl.constexpr = 0):
        # PAGED: K/V are pools [slots, Hkv, D] and key n of row b sits in slot
        # BT[b, n // PAGE] * PAGE + n % PAGE (stride_kb/stride_vb unused); else [B, Hkv, capacity, D]
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        hq_total = tl.num_programs(1) * G
        offs_m = tl.arange(0, BLOCK_M)
        row_valid = offs_m < G * T
        g = offs_m // T
        t = offs_m % T
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        # the positions (and the block table) are the step's inputs, written before the step began:
        # read before the wait, like the cache rows of earlier steps
        pos_t = tl.load(POS + b * stride_pb + t, mask=row_valid, other=0)
        start_t, end_t = _row_share(pos_t, window, s, NUM_SPLITS, BLOCK_N, MIN_KEYS, HAS_WINDOW)
        if PAGED:
            k_base = K + h * stride_kh
            v_base = V + h * stride_vh
        else:
            k_base = K + b * stride_kb + h * stride_kh
            v_base = V + b * stride_vb + h * stride_vh
        if PREFETCH:
            # The program's first key block into L2 while the kernel before (the q / k preparation,
            # which writes this pass's keys) finishes: the keys of earlier steps do not depend on it,
            # and the loads after the wait read every key, so the result is the same bits. This
            # pass's own keys (from its first position on) are left out. One-token passes only (the
            # launcher's choice): in a 4-token pass the prefetch made the attention ~0.6 us a layer
            # slower, with or without this pass's keys (why is not known).
            start = tl.min(tl.where(row_valid, start_t, 2147483647), 0)
            end = tl.max(tl.where(row_valid, end_t, 0), 0)
            older = tl.minimum(end, tl.min(tl.where(row_valid, pos_t, 2147483647), 0))
            if start < older:
                _prefetch_block(k_base, v_base, BT, b, start, older, stride_kn, stride_vn, stride_btb, BLOCK_N, LINE,
                                LINES, D, PAGED, PAGE)
        if PDL:  # q and this pass's keys were written by the kernel before this one
            gdc_wait()
        if EARLY:
            gdc_launch_dependents()
        row = (b * hq_total + h * G + g) * T + t  # index into [B, Hq, T]
        if tl.max(tl.where(row_valid & (start_t < end_t), 1, 0), 0) == 0:
            # a share no row has: its log-sum-exp says so, and the combine reads no partial sums
            tl.store(LSE + row * NUM_SPLITS + s, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_valid)
            return
        q = tl.load(Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                    mask=row_valid[:, None] & d_valid[None, :], other=0.0)
        lse, out = _share_sums(q, k_base, v_base, KS + h, VS + h, stride_sn, BT, b, stride_kn, stride_vn, stride_btb,
                               start_t, end_t, pos_t, row_valid, offs_d, d_valid, scale, window, BLOCK_M, BLOCK_N,
                               BLOCK_D, HAS_WINDOW, IEEE, PAGED, PAGE, FP8, KCB, VCB, KBITS, VBITS)
        tl.store(LSE + row * NUM_SPLITS + s, lse, mask=row_valid)
        tl.store(OPART + (row * NUM_SPLITS + s)[:, None] * D + offs_d[None, :], out,
                 mask=row_valid[:, None] & d_valid[None, :])

    @triton.jit(do_not_specialize=["T"])
    def _combine_kernel(OPART, LSE, OUT, T, HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
        row = tl.program_id(0)  # (b * HQ + h) * T + t, as the partials lie
        if PDL:
            gdc_wait()
        if EARLY:
            gdc_launch_dependents()
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        one = tl.arange(0, 1)
        m = tl.full([1], float("-inf"), tl.float32)
        l = tl.zeros([1], tl.float32)
        o = tl.zeros([1, BLOCK_D], tl.float32)
        for s in range(NUM_SPLITS):
            lse = tl.load(LSE + row * NUM_SPLITS + s + one)
            # an empty share's partial is 0 (stored so): not read (short contexts leave most empty)
            part = tl.load(OPART + (row * NUM_SPLITS + s + one)[:, None] * D + offs_d[None, :],
                           mask=(lse != float("-inf"))[:, None] & d_valid[None, :], other=0.0)
            m, l, o = _fold(m, l, o, lse, part)
        out = tl.sum(o / l[:, None], 0)
        # OUT is [B, T, HQ, D]: the layout the output projection reads, so no copy between them
        bh = row // T
        t = row % T
        dst = ((bh // HQ) * T + t) * HQ + bh % HQ
        tl.store(OUT + dst.to(tl.int64) * D + offs_d, out.to(OUT.dtype.element_ty), mask=d_valid)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float, window: int | None = None, num_splits: int | None = None,
                     block_n: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """Triton split-K attention; same contract as `decode_attention_reference`.

    q [B, Hq, T, D] with T <= 8; k_cache/v_cache [B, Hkv, capacity, D] (last dim contiguous);
    positions [B, T] increasing, on q's device. The result is the [B, Hq, T, D] view of [B, T, Hq, D]
    memory (what the output projection reads after transpose(1, 2): no copy).
    """
    return _launch(q, k_cache, v_cache, positions, scale, window, None, 0, num_splits, block_n, num_warps, num_stages)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           block_size: int, positions: torch.Tensor, scale: float, window: int | None = None,
                           num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           codec: kv_turboquant.LayerCodec | None = None) -> torch.Tensor:
    """The split-K kernel over the paged pools, reading each row's keys through its block table;
    same contract as `paged_decode_attention_reference`. On CPU tensors the reference runs."""
    if not available(q.device):
        return paged_decode_attention_reference(q, k_pool, v_pool, block_tables, block_size, positions, scale, window,
                                                k_scale, v_scale, codec)
    return _launch(q, k_pool, v_pool, positions, scale, window, block_tables, block_size, num_splits,
                   k_scale=k_scale, v_scale=v_scale, codec=codec)


def split_config(d: int, element_size: int, coded: bool = False) -> dict:
    """The split kernel's tiles and launch options for head dim d in elements of `element_size`
    bytes (what `_launch` uses unless told otherwise, and tools/sass/offline_sass.py compiles).
    `coded`: K/V in tq pools, decoded in registers, which needs 32-key blocks to fit
    sm_90's registers (128-key blocks spilled 96-232 bytes a thread). The prompt kernel
    (prompt_attention.py) takes the same blocks, so a prompt row's sums stay a decode step's."""
    block_d = max(16, triton.next_power_of_2(d))
    if coded:
        return dict(BLOCK_D=block_d, BLOCK_N=32, num_stages=2, num_warps=4, LINE=128 // element_size,
                    LINES=triton.next_power_of_2(triton.cdiv(d, 128 // element_size)))
    # 16-bit, head dim <= 128: 64-key blocks, 4 stages (tuned on an H200: 128-key blocks decoded a
    # sequence 1-1.5 us a layer faster at 2K-8K keys, but the prompt kernel's 128-row tiles of them
    # spilled, 1.3x its time); float32 tiles and larger heads keep smaller blocks so the staged K/V
    # tiles fit in shared memory
    half = element_size <= 2
    line = 128 // element_size  # values a 128-byte cache line holds (the prefetch's unit)
    return dict(BLOCK_D=block_d,
                BLOCK_N=64 if block_d <= 128 else (32 if block_d <= 256 else 16),
                num_stages=4 if half and block_d <= 128 else 2, num_warps=4 if block_d <= 128 else 8,
                LINE=line, LINES=triton.next_power_of_2(triton.cdiv(d, line)))


def _min_share_keys(block_n: int, num_kv_heads: int) -> int:
    keys = MIN_SHARE_KEYS * min(num_kv_heads, 8) // 8
    return max(block_n, keys // block_n * block_n)  # whole blocks


def _cache_layout(k_cache, v_cache, block_tables, positions):
    """(K strides, V strides, the block table and its row stride) as the kernels take them: paged
    pools [slots, Hkv, D] have no batch stride and their rows come from the block table; contiguous
    caches [B, Hkv, capacity, D] need no table (the positions stand in, unread)."""
    if block_tables is not None:
        return ((0, k_cache.stride(1), k_cache.stride(0)), (0, v_cache.stride(1), v_cache.stride(0)),
                block_tables, block_tables.stride(0))
    return (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)), \
        (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)), positions, 0


def _launch(q, k_cache, v_cache, positions, scale, window, block_tables, block_size, num_splits=None,
            block_n=None, num_warps=None, num_stages=None, k_scale=None, v_scale=None, codec=None) -> torch.Tensor:
    b, hq, t, d = q.shape
    paged = block_tables is not None
    hkv = k_cache.shape[1]
    if t > MAX_QUERY_TOKENS:
        raise ValueError(f"decode_attention handles at most {MAX_QUERY_TOKENS} query tokens, got {t}")
    group = hq // hkv
    q = q.contiguous()
    splits = num_splits or shares_for(hkv, q.device)
    block_m = max(16, triton.next_power_of_2(group * t))
    fp8, tq = _check_scales(k_cache, k_scale, v_scale, paged, codec)
    config = split_config(d, q.element_size(), coded=tq)
    block_d = config["BLOCK_D"]
    block_n = block_n or config["BLOCK_N"]
    num_stages = num_stages or config["num_stages"]
    opart = torch.empty((b, hq, t, splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, hq, t, splits), dtype=torch.float32, device=q.device)
    # [B, T, Hq, D] in memory, returned as its [B, Hq, T, D] view: the callers' transpose(1, 2)
    # then reshape to [B, T, Hq * D] is free (a 4-token verify pass copied it: 2.4 us a layer)
    out = torch.empty((b, t, hq, d), dtype=q.dtype, device=q.device)
    strides_k, strides_v, table, table_stride = _cache_layout(k_cache, v_cache, block_tables, positions)
    pdl, early = launch.small_kernel_pdl(q.device)
    scaled = fp8 or tq
    _split_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, k_scale if scaled else k_cache, v_scale if scaled else v_cache, positions, opart, lse,
        table, *_codebooks(codec, k_cache),
        q.stride(0), q.stride(1), q.stride(2),
        *strides_k, *strides_v,
        positions.stride(0), table_stride, k_scale.stride(0) if scaled else 0,
        scale * LOG2E, window or 0,
        T=t, G=group, D=d, NUM_SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=window is not None, IEEE=q.dtype == torch.float32, PAGED=paged, PAGE=max(block_size, 1),
        MIN_KEYS=_min_share_keys(block_n, hkv), num_warps=num_warps or config["num_warps"], num_stages=num_stages,
        PDL=pdl, EARLY=early,
        # tq rows are shorter than the D values a prefetch line count assumes
        PREFETCH=pdl and PREFETCH and t == 1 and not tq, LINE=config["LINE"], LINES=config["LINES"], launch_pdl=pdl,
        FP8=fp8, **_code_bits(codec),
    )
    _combine_kernel[(b * hq * t,)](opart, lse, out, t, HQ=hq, D=d, NUM_SPLITS=splits, BLOCK_D=block_d, PDL=pdl,
                                   EARLY=early, num_warps=4, launch_pdl=pdl)
    return out.transpose(1, 2)


def _check_scales(k_cache, k_scale, v_scale, paged, codec=None) -> tuple[bool, bool]:
    """(fp8, tq): whether the cache holds fp8 codes with [slots, Hkv] scale exponents, or tq codes
    with [slots, Hkv] float32 scales, checking what the kernels assume."""
    if k_scale is None:
        return False, False
    if not paged or v_scale is None or k_scale.stride(1) != 1 or v_scale.stride() != k_scale.stride():
        raise ValueError("compressed attention needs paged pools and both scale pools [slots, Hkv], contiguous heads")
    if codec is not None:
        if k_cache.dtype != torch.uint8 or k_scale.dtype != torch.float32:
            raise ValueError("tq attention needs packed uint8 pools and float32 scales")
        return False, True
    if k_cache.dtype != kv_fp8.CODE_DTYPE:
        raise ValueError("fp8 attention needs paged e4m3 pools and both scale pools [slots, Hkv], contiguous heads")
    return True, False


def _codebooks(codec, fallback) -> tuple:
    """The KCB / VCB kernel arguments: a tq layer's key and value centroids (else any pointer, unread)."""
    return (codec.key.centroids, codec.value.centroids) if codec is not None else (fallback, fallback)


def _code_bits(codec) -> dict:
    return dict(KBITS=codec.key.bits, VBITS=codec.value.bits) if codec is not None else {}


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


__all__ = ["decode_attention", "decode_attention_reference", "paged_decode_attention",
           "paged_decode_attention_reference", "available", "MAX_QUERY_TOKENS"]
