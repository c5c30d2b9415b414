"""The routed experts of a mixture-of-experts layer on CUDA: routing, the experts' products read in
place, and the weighted sum; a decode / verify pass (up to MAX_TOKENS tokens) in four launches.

- `softmax_top_k`: router logits [T, E] -> the top-k experts of the float32 softmax, renormalised
  and scaled per expert if the family asks, in one program per token (torch's softmax, topk,
  sum, divide and cast were six kernels).
- `union_products`: for pair p = (token t, slot s) with expert e_p, y[p] = W[e_p] @ x_row(p). Each
  program owns one expert and a tile of output rows; the first pair naming an expert computes it
  for every token routed to it, the others exit. So a verify pass or a batch reads the union of
  its experts once, not once per pair. The gate/up form computes both halves and applies the
  activation in the same program (h = act(gate) * up, rounded as transformers rounds them).
- `grouped_products`: the same products for passes of any size (prefill, large batches), the
  pairs sorted by expert and each program a block of one expert's pairs: each expert read once a
  block, and a pair's row the bits `union_products` gives it (exact numerics run both).
- `combine`: out[t] = sum_s weight[t, s] * y[t * K + s], the products rounded to their dtype as
  torch's `h * weights` does, summed in slot order in float32.

The expert ids stay on the device, so a step needs no host sync and is captured in a CUDA graph.
Each expert's tile is a chain of tensor-core products over K in steps fixed by K alone, so a
token's result does not depend on the other tokens in the pass, nor on which kernel ran it.
"""
from __future__ import annotations

import torch

from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch paths are used instead
    triton = None
    tl = None

# The token rows one expert tile serves (tl.dot's smallest M): passes with more tokens (prefill,
# large batches) take the grouped GEMM, which reads each expert once for all its rows.
MAX_TOKENS = 16
# Activations the gate/up program applies itself (others run in torch after an ungated product).
FUSED_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E]: how many of `expert_ids` name each expert (histc, not bincount: bincount's output size
    depends on the data, which a CUDA graph cannot capture). Plain torch: CPUs run it too."""
    histogram_input = expert_ids.int() if expert_ids.is_cuda else expert_ids.float()
    return torch.histc(histogram_input, bins=num_experts, min=0, max=num_experts - 1)


if triton is not None:

    @triton.jit
    def _route_kernel(L, SCALE, W, IDS, stride_l, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_SCALE: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        logits = tl.load(L + t * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
        p = tl.exp(logits - tl.max(logits, 0))
        probs = p / tl.sum(p, 0)
        remaining = tl.where(valid, probs, -1.0)
        offs_k = tl.arange(0, BLOCK_K)
        weights = tl.zeros([BLOCK_K], dtype=tl.float32)
        ids = tl.zeros([BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(K):  # K rounds of argmax: the lowest index wins a tie, as torch.topk
            best = tl.max(remaining, 0)
            idx = tl.min(tl.where(remaining == best, offs, BLOCK_E), 0)
            weights = tl.where(offs_k == j, best, weights)
            ids = tl.where(offs_k == j, idx, ids)
            remaining = tl.where(offs == idx, -1.0, remaining)
        in_k = offs_k < K
        if RENORMALIZE:
            weights = weights / tl.sum(tl.where(in_k, weights, 0.0), 0)
        if HAS_SCALE:
            weights = weights * tl.load(SCALE + ids, mask=in_k, other=0.0).to(tl.float32)
        tl.store(W + t * K + offs_k, weights.to(W.dtype.element_ty, fp_downcast_rounding="rtne"), mask=in_k)
        tl.store(IDS + t * K + offs_k, ids.to(tl.int64), mask=in_k)

    @triton.jit
    def _round(v, ty):
        """float32 v rounded to the nearest ty (as torch rounds), back in float32."""
        return v.to(ty, fp_downcast_rounding="rtne").to(tl.float32)

    @triton.jit
    def _activate(g, ACT: tl.constexpr):
        if ACT == 0:  # silu
            return g / (1.0 + tl.exp(-g))
        # gelu, tanh form: tanh(z) = 2 / (1 + exp(-2z)) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * z)))

    @triton.jit
    def _dot(x, w, acc, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        return tl.dot(x, tl.trans(w), acc)

    @triton.jit
    def _expert_tile(x_rows, row_ok, w_rows, mask_n, N, stride_wn, KD, out_ty, ACT: tl.constexpr,
                     GATED: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """[BLOCK_M, BLOCK_N] products of the rows `x_rows` with one expert's rows `w_rows`: a chain
        of tensor-core products over K in BLOCK_K steps (the same chain for any BLOCK_M, so a row's
        bits do not depend on the tile it is in); GATED: the up rows sit N rows below the gate rows
        and the result is act(gate) * up, rounded as torch rounds them."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, KD, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mask_k = k < KD
            x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & mask_k[None, :], other=0.0)
            w_mask = mask_n[:, None] & mask_k[None, :]
            acc = _dot(x, tl.load(w_rows + k[None, :], mask=w_mask, other=0.0), acc, IEEE)
            if GATED:
                acc_up = _dot(x, tl.load(w_rows + N * stride_wn + k[None, :], mask=w_mask, other=0.0), acc_up, IEEE)
        if GATED:  # torch's rounding: gate and up products, then act(gate), then the product
            acc = _round(_activate(_round(acc, out_ty), ACT), out_ty) * _round(acc_up, out_ty)
        return acc

    @triton.jit
    def _expert_rows(X, W, Y, e, pair, x_row, row_ok, pid_n, stride_x, stride_we, stride_wn, stride_y, N, KD,
                     ACT: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Y rows `pair` (where row_ok) = expert e's output tile pid_n over X rows `x_row`."""
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        w_rows = W + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        out_ty = Y.dtype.element_ty
        acc = _expert_tile(X + x_row.to(tl.int64)[:, None] * stride_x, row_ok, w_rows, mask_n, N, stride_wn, KD,
                           out_ty, ACT, GATED, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(Y + pair.to(tl.int64)[:, None] * stride_y + offs_n[None, :],
                 acc.to(out_ty, fp_downcast_rounding="rtne"), mask=row_ok[:, None] & mask_n[None, :])

    @triton.jit
    def _union_kernel(X, W, IDS, Y, stride_x, stride_we, stride_wn, stride_y, T, N, KD,
                      TOP_K: tl.constexpr, X_PER_PAIR: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pid_n = tl.program_id(0)
        p = tl.program_id(1)
        e = tl.load(IDS + p)
        offs_p = tl.arange(0, BLOCK_P)
        earlier = tl.load(IDS + offs_p, mask=offs_p < p, other=-1)
        if tl.sum((earlier == e).to(tl.int32), 0) == 0:  # the first pair naming e computes it
            # every token routed to e, and the pair it is routed by
            offs_t = tl.arange(0, BLOCK_T)
            offs_s = tl.arange(0, BLOCK_S)
            pair_ts = offs_t[:, None] * TOP_K + offs_s[None, :]
            ids_ts = tl.load(IDS + pair_ts, mask=(offs_t[:, None] < T) & (offs_s[None, :] < TOP_K), other=-1)
            hit = ids_ts == e
            routed = tl.max(hit.to(tl.int32), 1) > 0
            pair_t = tl.sum(tl.where(hit, pair_ts, 0), 1)
            if X_PER_PAIR:
                x_row = pair_t
            else:
                x_row = offs_t
            _expert_rows(X, W, Y, e, pair_t, x_row, routed, pid_n, stride_x, stride_we, stride_wn, stride_y, N, KD,
                         ACT, GATED, IEEE, BLOCK_T, BLOCK_N, BLOCK_K)

    @triton.jit
    def _grouped_kernel(X, W, ORDER, BLOCK_EXPERT, BLOCK_START, BLOCK_ROWS, Y, stride_x, stride_we, stride_wn,
                        stride_y, N, KD, TOP_K: tl.constexpr, X_PER_PAIR: tl.constexpr, GATED: tl.constexpr,
                        ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        IEEE: tl.constexpr):
        """Block b of the pairs sorted by expert: up to BLOCK_M pairs of one expert."""
        b = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = tl.load(BLOCK_ROWS + b)
        if rows > 0:
            e = tl.load(BLOCK_EXPERT + b)
            offs_m = tl.arange(0, BLOCK_M)
            row_ok = offs_m < rows
            pair = tl.load(ORDER + tl.load(BLOCK_START + b) + offs_m, mask=row_ok, other=0)
            if X_PER_PAIR:
                x_row = pair
            else:
                x_row = pair // TOP_K
            _expert_rows(X, W, Y, e, pair, x_row, row_ok, pid_n, stride_x, stride_we, stride_wn, stride_y, N, KD,
                         ACT, GATED, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _weighted_sum_kernel(Y, WT, OUT, stride_y, stride_o, H, TOP_K: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                        BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(TOP_K):
            w = tl.load(WT + t * TOP_K + s).to(tl.float32)
            y = tl.load(Y + (t * TOP_K + s) * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
            product = y * w
            if ROUND_PRODUCT:  # torch's `h * weights` in the 16-bit dtype of both
                product = _round(product, Y.dtype.element_ty)
            acc += product
        tl.store(OUT + t * stride_o + offs, acc.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool, expert_scale: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] in `out_dtype` (default: the logits'), expert ids [T, K] int64):
    the top-k of the float32 softmax over all E, divided by their sum if `renormalize`, then times
    `expert_scale[id]` if given."""
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=out_dtype or logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, expert_scale if expert_scale is not None else weights, weights, ids,
                            logits.stride(0), E=e, K=top_k, BLOCK_E=triton.next_power_of_2(e),
                            BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                            HAS_SCALE=expert_scale is not None)
    return weights, ids


def _operands(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, x_per_pair: bool, gated_act: str | None,
              caller: str) -> tuple[int, int, int, int]:
    """(tokens, experts a token, output columns, K) of a products call, its operands checked."""
    t, top_k = ids.shape
    e, n, kd = weight.shape
    if x.shape[-1] != kd or weight.stride(-1) != 1 or x.shape[0] != (t * top_k if x_per_pair else t):
        raise ValueError(f"{caller}: x [{', '.join(map(str, x.shape))}] against weight [{e}, {n}, {kd}] "
                         f"and {t}x{top_k} expert ids (needs x's last dim == K, a contiguous last weight dim "
                         "and one x row per token, or per pair)")
    if gated_act is not None:
        if gated_act not in FUSED_ACTIVATIONS:
            raise ValueError(f"{caller}: activation '{gated_act}' is not fused (fused: {', '.join(FUSED_ACTIVATIONS)})")
        n //= 2
    return t, top_k, n, kd


def _k_tile(kd: int) -> int:
    """The K step of every products kernel: by K alone, so a token's chain of products is the same
    in the union and the grouped kernels at any token count (tiles measured on the H200 at the
    Qwen3-30B-A3B, Qwen3.6-35B-A3B and Gemma 4 26B-A4B shapes)."""
    return min(256 if kd >= 2048 else 128, max(32, triton.next_power_of_2(kd)))


def union_products(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, *, x_per_pair: bool,
                   gated_act: str | None = None, block_n: int = 32, num_warps: int = 4,
                   num_stages: int = 3) -> torch.Tensor:
    """y [T*K, N] with y[p] = W[ids[p]] @ x_row(p): x [T, KD] (row t serves pairs t*K..t*K+K-1), or
    x [T*K, KD] with `x_per_pair`; weight [E, N', KD] (last dim contiguous); ids [T, K]. With
    `gated_act`, weight holds gate rows then up rows (N' = 2N) and y = act(gate) * up."""
    t, top_k, n, kd = _operands(x, weight, ids, x_per_pair, gated_act, "union_products")
    if t > MAX_TOKENS:
        raise ValueError(f"union_products: {t} tokens (at most {MAX_TOKENS}; more take grouped_products)")
    x, ids = x.contiguous(), ids.contiguous()
    y = torch.empty(t * top_k, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), t * top_k)  # BLOCK_P as at MAX_TOKENS: one compile for every token count
    _union_kernel[grid](x, weight, ids, y, x.stride(0), weight.stride(0), weight.stride(1), y.stride(0), t, n, kd,
                        TOP_K=top_k, X_PER_PAIR=x_per_pair, GATED=gated_act is not None,
                        ACT=FUSED_ACTIVATIONS.get(gated_act, 0), BLOCK_T=MAX_TOKENS,
                        BLOCK_S=triton.next_power_of_2(top_k), BLOCK_P=triton.next_power_of_2(MAX_TOKENS * top_k),
                        BLOCK_N=block_n, BLOCK_K=_k_tile(kd),
                        IEEE=x.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    return y


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """The pairs of ids [T, K] sorted by expert and cut into blocks of at most block_m pairs of one
    expert: (order [P]: pair ids by expert, then per block its expert, first index into order and
    pair count), the blocks padded to cdiv(P, block_m) + E with empty ones. Device-side, no host
    sync: capturable."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    counts = expert_counts(flat, num_experts).long()
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    first = torch.cumsum(counts, 0) - counts
    b = torch.arange(triton.cdiv(flat.numel(), block_m) + num_experts, device=flat.device)
    expert = torch.searchsorted(block_end, b, right=True)
    owner = expert.clamp(max=num_experts - 1)
    index_in_expert = b - (block_end[owner] - blocks[owner])
    rows = torch.where(expert < num_experts, (counts[owner] - index_in_expert * block_m).clamp(0, block_m), 0)
    return order, owner, first[owner] + index_in_expert * block_m, rows


# shared memory a grouped program's pipeline stages may take (the H100/H200 give a block 227 KiB)
STAGE_BYTES_BUDGET = 200 * 1024


def grouped_products(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, *, x_per_pair: bool,
                     gated_act: str | None = None, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                     num_stages: int | None = None) -> torch.Tensor:
    """`union_products` for any number of tokens (prefill, large batches): the pairs grouped by
    expert, each expert's weights read once per block of block_m of its pairs. A pair's row gets
    the bits `union_products` gives it (the same chain of products over K)."""
    t, top_k, n, kd = _operands(x, weight, ids, x_per_pair, gated_act, "grouped_products")
    x = x.contiguous()
    order, expert, start, rows = expert_blocks(ids, weight.shape[0], block_m)
    y = torch.empty(t * top_k, n, dtype=x.dtype, device=x.device)
    block_k = _k_tile(kd)
    if num_stages is None:  # as many as fit: x's tile and one (or, gated, two) weight tiles a stage
        stage_bytes = (block_m + block_n * (2 if gated_act else 1)) * block_k * x.element_size()
        num_stages = max(1, min(3, STAGE_BYTES_BUDGET // stage_bytes))
    grid = (rows.numel(), triton.cdiv(n, block_n))
    _grouped_kernel[grid](x, weight, order, expert, start, rows, y, x.stride(0), weight.stride(0), weight.stride(1),
                          y.stride(0), n, kd, TOP_K=top_k, X_PER_PAIR=x_per_pair, GATED=gated_act is not None,
                          ACT=FUSED_ACTIVATIONS.get(gated_act, 0), BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=num_warps,
                          num_stages=num_stages)
    return y


def combine(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y [T*K, H], weights [T, K] -> [T, H] = sum over slots of weights * y, each product in the
    dtype torch would give it, summed in slot order in float32."""
    t, top_k = weights.shape
    h = y.shape[-1]
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    product_dtype = torch.promote_types(y.dtype, weights.dtype)
    block_h = min(1024, triton.next_power_of_2(h))
    _weighted_sum_kernel[(t, triton.cdiv(h, block_h))](y, weights.contiguous(), out, y.stride(0), out.stride(0), h,
                                                  TOP_K=top_k, ROUND_PRODUCT=product_dtype.itemsize == 2
                                                  and product_dtype == y.dtype, BLOCK_H=block_h)
    return out
