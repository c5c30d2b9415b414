"""Small elementwise ops (norms, RoPE, residual adds, gated activation) as pure functions, and
their fused versions on CUDA.

Eagerly each op is several kernels (an RMSNorm is about eight); in a decode step of a
36-layer model that is ~2000 tiny launches, most of a step's time. `torch.compile` fuses each
function into one Triton kernel. The plain functions are the reference (CPU and tests use them).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from verispec import log


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """x [..., D] -> normalised in float32 statistics, weight applied as HF does ((1 + w) if unit_offset)."""
    dtype = x.dtype
    h = x.to(torch.float32) if dtype != torch.float64 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.to(h.dtype))).to(dtype)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one: returns (x + update, rms_norm(x + update))."""
    summed = x + update
    return summed, rms_norm(summed, weight, eps, unit_offset)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
               unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D], k [B, T, Hkv, D] -> optional per-head RMSNorm, heads first, RoPE:
    [B, Hq, T, D], [B, Hkv, T, D]."""
    from verispec.models.layers.rotary import apply_rotary

    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps, unit_offset), rms_norm(k, k_weight, eps, unit_offset)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def fast_prepare_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                    unit_offset: bool, v: torch.Tensor | None = None,
                    cache_rows=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`prepare_qk` as the fused models run it: our one-launch kernel (kernels/qk_prep.py, whose
    row results do not depend on the pass's width, as speculative == plain greedy needs) where it
    takes the inputs, else the compiled function (why: logged once under VERISPEC_DEBUG=1). With
    `cache_rows` (a kv_write.KVDestination) and v [B, Hkv, T, D], the finished keys and the values
    are in the cache on return (written by the same launch where the kernel runs)."""
    from verispec.kernels import qk_prep

    reason = qk_prep.unsupported_reason(q, k, cos)
    if reason is None:
        return qk_prep.prepare_qk(q, k, cos, sin, q_weight, k_weight, eps, unit_offset, v, cache_rows)
    _log_fallback("queries and keys prepared by the compiled torch function, not kernels/qk_prep.py", reason)
    q, k = compiled(prepare_qk)(q, k, cos, sin, q_weight, k_weight, eps, unit_offset)
    if cache_rows is not None:
        cache_rows.write(k, v)
    return q, k


def fast_add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float,
                      unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` as the fused models run it: our kernel (kernels/rms_norm.py: a program per
    row, so a row's bits do not depend on the pass's width; programmatic launch on sm_90) where it
    takes the inputs, else the compiled function (why: logged once under VERISPEC_DEBUG=1)."""
    from verispec.kernels import rms_norm as kernel

    reason = kernel.unsupported_reason(x, weight)
    if reason is None:
        return kernel.add_rms_norm(x, update, weight, eps, unit_offset)
    _log_fallback("residual add + RMSNorm by the compiled torch function, not kernels/rms_norm.py", reason)
    return compiled(add_rms_norm)(x, update, weight, eps, unit_offset)


def fast_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """`rms_norm` as the fused models run it: the norm alone of kernels/rms_norm.py (a program per
    row) where it takes the inputs, else the compiled function (why: logged once under VERISPEC_DEBUG=1)."""
    from verispec.kernels import rms_norm as kernel

    reason = kernel.unsupported_reason(x, weight)
    if reason is None:
        return kernel.add_rms_norm(x, None, weight, eps, unit_offset)[1]
    _log_fallback("RMSNorm by the compiled torch function, not kernels/rms_norm.py", reason)
    return compiled_rows(rms_norm)(x, weight, eps, unit_offset)


def fast_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` as the fused models run it: kernels/silu_mul.py where it takes the inputs, else
    the compiled function (why: logged once under VERISPEC_DEBUG=1)."""
    from verispec.kernels import silu_mul as kernel

    reason = kernel.unsupported_reason(gate, up)
    if reason is None:
        return kernel.silu_mul(gate, up)
    _log_fallback("silu(gate) * up by the compiled torch function, not kernels/silu_mul.py", reason)
    return compiled_rows(silu_mul)(gate, up)


def _log_fallback(what: str, reason: str) -> None:
    if (what, reason) not in _logged_fallbacks:
        _logged_fallbacks.add((what, reason))
        from verispec import log
        log.debug("%s: %s", what, reason)


_logged_fallbacks: set[tuple[str, str]] = set()  # (what, why): each logged once


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's attention output gate: x * sigmoid(gate)."""
    return x * torch.sigmoid(gate)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet's output norm: rmsnorm(x) * w (plain weight) * silu(gate), statistics in
    float32 (float64 stays); x, gate [..., D]."""
    dtype = x.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    h = x.to(compute)
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (h * F.silu(gate.to(compute))).to(dtype)


def causal_conv_silu(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution + SiLU, written as K shifted multiply-adds (one elementwise
    kernel when compiled, where F.conv1d is a separate library call): window [B, C, K-1+T]
    (the last K-1 inputs before this pass, then its T inputs), weight [C, K] -> [B, C, T]."""
    kernel = weight.shape[-1]
    t = window.shape[-1] - kernel + 1
    compute = torch.float64 if window.dtype == torch.float64 else torch.float32
    w, win = weight.to(compute), window.to(compute)
    out = win[..., 0:t] * w[:, 0:1]
    for j in range(1, kernel):
        out = out + win[..., j:j + t] * w[:, j:j + 1]
    return F.silu(out).to(window.dtype)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's write strength beta = sigmoid(b) and log decay g = -exp(A_log) *
    softplus(a + dt_bias), g in float32 (in half precision -exp(A_log) can overflow; float64 stays);
    b, a [B, T, H]."""
    compute = torch.promote_types(a.dtype, torch.float32)
    return b.sigmoid(), -a_log.to(compute).exp() * F.softplus(a.to(compute) + dt_bias)


def gdn_gates_rounded(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_gates` computed in float64 and rounded, for exact numerics on a CPU: torch's CPU kernels
    take the last few elements of a tensor (the tail of the vector loop) through scalar exp /
    softplus / sigmoid, whose last bit differs from the vector path's, so in float32 a token's gates
    depended on where it sat in the pass (its row's state then did, and a batched request's text).
    Rounded from float64 the two paths agree; the tensors are B x T x heads, so it costs nothing."""
    beta, g = gdn_gates(b.to(torch.float64), a.to(torch.float64), a_log, dt_bias)
    return beta.to(b.dtype), g.to(torch.promote_types(a.dtype, torch.float32))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def merged_linear(*linears: torch.nn.Module) -> torch.nn.Module:
    """One Linear computing several that read the same input (outputs concatenated): one GEMM
    instead of several smaller ones, which read the weights closer to full bandwidth. Other
    layers (quantized ones) merge through their own `concat_rows` where their `same_quantization`
    allows, else run side by side (ConcatLinear)."""
    first = linears[0]
    if not all(type(lin) is torch.nn.Linear for lin in linears):
        return merged_rows(list(linears))
    has_bias = first.bias is not None
    out_features = sum(lin.out_features for lin in linears)
    merged = torch.nn.utils.skip_init(torch.nn.Linear, first.in_features, out_features, bias=has_bias,
                                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        merged.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if has_bias:
            merged.bias.copy_(torch.cat([lin.bias for lin in linears]))
    merged.requires_grad_(False)
    return merged


def merged_rows(layers: list[torch.nn.Module]) -> torch.nn.Module:
    """Layers that are not plain Linears (quantized ones, verispec/quant/layers), merged by their
    class's `concat_rows` when they share one quantization, else side by side."""
    first = layers[0]
    if hasattr(type(first), "concat_rows") and all(first.same_quantization(l) for l in layers[1:]):
        return type(first).concat_rows(layers)
    log.debug("merging %s projections with different quantization: running them side by side",
              ", ".join(type(l).__name__ for l in layers))
    return ConcatLinear(layers)


class ConcatLinear(torch.nn.Module):
    """Several linears reading the same input, outputs concatenated: what merged projections
    become when their quantization differs (mlx-lm per-layer overrides), so no single packed
    matrix can hold them."""

    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.parts = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., sum N]
        return torch.cat([part(x) for part in self.parts], dim=-1)


@functools.cache
def compiled_rows(fn):
    """`compiled(fn)` for a function of rows (each output row reads its own input row, over the last
    dimension): x and every tensor argument shaped like it are flattened to [rows, last] first.
    Why: torch.compile specialises each dimension on being 1 or not, so [B, T, D] inputs compiled
    up to four variants, and the first request to meet an uncompiled one (a drafter's first batch of
    several sequences) stalled every client 0.3-1 s; flattened, rows = 1 and rows > 1 remain, and
    prewarm meets both."""
    fused = compiled(fn)

    def call(x: torch.Tensor, *args):
        lead = x.shape[:-1]
        if len(lead) == 1 or any(isinstance(a, torch.Tensor) and a.dim() > 1 and a.shape[:-1] != lead for a in args):
            return fused(x, *args)
        flat = [a.reshape(-1, a.shape[-1]) if isinstance(a, torch.Tensor) and a.dim() > 1 else a for a in args]
        out = fused(x.reshape(-1, x.shape[-1]), *flat)
        return out.reshape(*lead, out.shape[-1])

    return call


@functools.cache
def compiled(fn):
    """The fused (compiled) version of one of the functions above; built once per function.
    dynamic=True: one compilation serves every shape (hidden vs per-head norms, 1..k+1 tokens,
    prefill chunks) instead of one per shape, which would exhaust dynamo's recompile limit."""
    import torch._dynamo

    # Each model/dtype a process runs adds variants; past the limit dynamo falls back to eager for
    # that call (never an error: fullgraph=False), so raise it well above one server's needs.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=True)
