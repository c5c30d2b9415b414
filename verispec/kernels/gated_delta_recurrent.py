"""The Gated DeltaNet recurrence over a short pass (decode / verify: T <= 16 tokens) as one Triton
kernel that also writes the SSM state after every position.

Why our own: a verify pass must be able to commit any prefix of its tokens, so it needs the state
after each position. flash-linear-attention's fused recurrent kernel returns the final state only,
so it had to be launched once per token (T launches per layer, measured 1.16x a decode step at
T = 2 on the 27B shape). This kernel runs the T steps in registers in one launch, normalises q/k
itself, maps each value head to its key head (no repeat_interleave copies), and takes the
projections' strided views as they are, so a step is capturable in a CUDA graph.

Per token t and value head h (q, k L2-normalised, q scaled by Dk^-0.5):
    S = S * exp(g_t);   S = S + k_t (x) beta_t * (v_t - S^T k_t);   o_t = S^T q_t
(the definition `gated_delta_net.recurrent_gated_delta_rule` implements in torch, which this is
tested against).
"""
from __future__ import annotations

import torch

from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is used instead
    triton = None
    tl = None

L2_EPS = 1e-6


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    # Neither B nor the strides are specialised: Triton makes B == 1 a constant and a stride's
    # divisibility by 16 part of the compile key, so every pass length compiled for one sequence
    # compiled again for several, whose masked gates are laid out differently (2.2-2.8 s each on
    # the H200, met by a batched prefill's short tails). T is the one compile-time length.
    @triton.jit(do_not_specialize=["B", "stride_qb", "stride_qt", "stride_qh", "stride_qd",
                                   "stride_kb", "stride_kt", "stride_kh", "stride_kd",
                                   "stride_vb", "stride_vt", "stride_vh", "stride_vd",
                                   "stride_gb", "stride_gt", "stride_gh", "stride_bb", "stride_bt", "stride_bh",
                                   "stride_ob", "stride_ot", "stride_oh", "T"])
    def _recurrent_kernel(Q, K, V, G, BETA, S0, OUT, STATES,
                          stride_qb, stride_qt, stride_qh, stride_qd,
                          stride_kb, stride_kt, stride_kh, stride_kd,
                          stride_vb, stride_vt, stride_vh, stride_vd,
                          stride_gb, stride_gt, stride_gh,
                          stride_bb, stride_bt, stride_bh,
                          stride_ob, stride_ot, stride_oh,
                          B, scale, eps, T,
                          H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, ALL_STATES: tl.constexpr):
        pid_v = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // GROUP  # value heads h*GROUP .. share key head hk (consecutive, as in the model)
        offs_k = tl.arange(0, BK)
        offs_v = pid_v * BV + tl.arange(0, BV)
        mask_k = offs_k < DK
        mask_v = offs_v < DV
        mask_s = mask_k[:, None] & mask_v[None, :]
        state_off = (b * H + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
        s = tl.load(S0 + state_off, mask=mask_s, other=0.0).to(tl.float32)  # [BK, BV]
        # one loop body compiled for every pass length (T is not specialised), so a position's
        # arithmetic is the same in a decode step, a verify pass and a prompt chunk
        for t in range(T):
            q = tl.load(Q + b * stride_qb + t * stride_qt + hk * stride_qh + offs_k * stride_qd,
                        mask=mask_k, other=0.0).to(tl.float32)
            k = tl.load(K + b * stride_kb + t * stride_kt + hk * stride_kh + offs_k * stride_kd,
                        mask=mask_k, other=0.0).to(tl.float32)
            v = tl.load(V + b * stride_vb + t * stride_vt + h * stride_vh + offs_v * stride_vd,
                        mask=mask_v, other=0.0).to(tl.float32)
            g = tl.load(G + b * stride_gb + t * stride_gt + h * stride_gh).to(tl.float32)
            beta = tl.load(BETA + b * stride_bb + t * stride_bt + h * stride_bh).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q) + eps) * scale
            k = k * tl.rsqrt(tl.sum(k * k) + eps)
            s = s * tl.exp(g)
            predicted = tl.sum(s * k[:, None], axis=0)  # [BV] = S^T k
            delta = (v - predicted) * beta
            s = s + k[:, None] * delta[None, :]
            out = tl.sum(s * q[:, None], axis=0)
            tl.store(OUT + b * stride_ob + t * stride_ot + h * stride_oh + offs_v, out.to(OUT.dtype.element_ty),
                     mask=mask_v)
            if ALL_STATES:
                tl.store(STATES + t * B * H * DK * DV + state_off, s, mask=mask_s)
        if not ALL_STATES:
            tl.store(STATES + state_off, s, mask=mask_s)


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, all_states: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, Hk, Dk] raw (normalised here; any strides); v [B, T, H, Dv] with H a multiple
    of Hk (value head h reads key head h // (H / Hk)); g, beta [B, T, H]; state [B, H, Dk, Dv]
    float32. Returns out [B, T, H, Dv] in v's dtype and the states after each position
    [T, B, H, Dk, Dv] float32 (all_states False: after the last only, [1, B, H, Dk, Dv], as a prompt
    chunk under exact numerics keeps them)."""
    b, t, hk, dk = q.shape
    h, dv = v.shape[2], v.shape[3]
    if h % hk:
        raise ValueError(f"{h} value heads are not a multiple of {hk} key heads")
    state = state.float().contiguous()
    out = torch.empty(b, t, h, dv, dtype=v.dtype, device=v.device)
    states = torch.empty(t if all_states else 1, b, h, dk, dv, dtype=torch.float32, device=v.device)
    bk = triton.next_power_of_2(dk)
    bv = min(32, triton.next_power_of_2(dv))  # 128 x 32 float32 state tile per program: in registers
    grid = (triton.cdiv(dv, bv), b * h)
    _recurrent_kernel[grid](q, k, v, g, beta, state, out, states,
                            *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
                            out.stride(0), out.stride(1), out.stride(2),
                            b, dk ** -0.5, L2_EPS, t,
                            H=h, GROUP=h // hk, DK=dk, DV=dv, BK=bk, BV=bv, ALL_STATES=all_states)
    return out, states
