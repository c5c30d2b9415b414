"""Gated DeltaNet, the "linear attention" mixer of Qwen3.5 / Qwen3.6 (HF weight names `linear_attn.*`).

Per token t and value head h, with q and k L2-normalised and q scaled by Dk^-0.5:
    S = S * exp(g_t);   S = S + k_t (x) beta_t * (v_t - S^T k_t);   o_t = S^T q_t
where S [Dk, Dv] is the float32 SSM state, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias),
and q/k/v come from a depthwise causal convolution (+ SiLU) over the last `kernel` projected inputs.

Two torch implementations of the recurrence sit side by side, and a flash-linear-attention (`fla`)
path used on CUDA when it is installed:
- `recurrent_gated_delta_rule`: token by token, keeping the state after every position (decode and
  verify passes: commit(n) of the cache then selects the state after n tokens);
- `chunked_gated_delta_rule`: chunk-parallel (UT transform inside a chunk, scan across chunks),
  final state only (prefill chunks, which are committed whole).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from verispec import log
from verispec.config import env
from verispec.cache.kv import KVCache, RecurrentLayerSpec
from verispec.kernels import gated_delta_recurrent as recurrent_kernel
from verispec.models.layers.fused import (causal_conv_silu, compiled, compiled_rows, gated_rms_norm, gdn_gates,
                                          gdn_gates_rounded, merged_linear)
from verispec.models.layers.mlp import activation

L2_EPS = 1e-6  # as transformers and fla normalise q and k
DEFAULT_CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain recurrence, in float32.

    q, k [B, T, H, Dk] (normalised, q scaled); v [B, T, H, Dv]; g, beta [B, T, H]; state [B, H, Dk, Dv].
    Returns out [B, T, H, Dv] and the state after each position [T, B, H, Dk, Dv].
    """
    t_len = q.shape[1]
    decay = g.exp()
    outs, states = [], []
    s = state
    for t in range(t_len):
        s = s * decay[:, t, :, None, None]
        k_t = k[:, t]  # [B, H, Dk]
        predicted = torch.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v[:, t] - predicted) * beta[:, t, :, None]  # [B, H, Dv]
        s = s + k_t[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
        states.append(s)
    return torch.stack(outs, dim=1), torch.stack(states)


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence computed chunk by chunk, in float32. Shapes as in
    `recurrent_gated_delta_rule`; returns out [B, T, H, Dv] and the final state [B, H, Dk, Dv].

    Inside a chunk starting from state S0, with G_t the cumulative log decay and u_j the delta
    written at j (S_t = e^{G_t} S0 + sum_{j<=t} e^{G_t - G_j} k_j u_j^T):
        u_t + beta_t sum_{j<t} e^{G_t - G_j} (k_t . k_j) u_j = beta_t (v_t - e^{G_t} S0^T k_t)
    a unit lower-triangular system solved for all t at once; then
        o_t = e^{G_t} S0^T q_t + sum_{j<=t} e^{G_t - G_j} (q_t . k_j) u_j.
    """
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t_len) % chunk_size
    # padded steps have k = 0 and g = 0: they neither decay nor write the state
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t_len + pad) // chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.reshape(b, n, chunk_size, h, *x.shape[3:])
        return x.movedim(3, 1)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(dim=-1)  # [B, H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))
    pair_decay = diff.exp()  # e^{G_t - G_j} for j <= t, else 0
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    system = system.masked_fill(~causal.tril(-1), 0.0) + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    u_free = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_state = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pair_decay  # [B, H, N, C, C]
    q_decayed = q * cum.exp()[..., None]
    last = cum[..., -1:]  # [B, H, N, 1]
    k_to_end = k * (last - cum).exp()[..., None]
    chunk_decay = last.exp()[..., None]  # [B, H, N, 1, 1]

    s = state
    out = torch.empty(b, h, n, chunk_size, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        u = u_free[:, :, i] - u_state[:, :, i] @ s  # [B, H, C, Dv]
        out[:, :, i] = q_decayed[:, :, i] @ s + attn[:, :, i] @ u
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = out.reshape(b, h, n * chunk_size, dv)[:, :, :t_len].transpose(1, 2)
    return out, s


def torch_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, per_position: bool, exact: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, H, Dk] raw (normalised here); v [B, T, H, Dv]; g [B, T, H] float32; beta [B, T, H];
    state [B, H, Dk, Dv] float32. Returns out [B, T, H, Dv] in v's dtype and the states
    [T, B, H, Dk, Dv] (per_position) or [1, B, H, Dk, Dv] (final only), float32 (float64 stays
    float64: a float64 model's state must not round at prefill-chunk edges)."""
    dtype = v.dtype
    compute = torch.promote_types(dtype, torch.float32)
    q = l2_normalize(q.to(compute)) * q.shape[-1] ** -0.5
    k = l2_normalize(k.to(compute))
    v, g, beta, state = v.to(compute), g.to(compute), beta.to(compute), state.to(compute)
    if per_position or exact:  # exact: a prompt chunk steps token by token as decode does (final state kept)
        out, states = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        if not per_position:
            states = states[-1:]
    else:
        out, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
        states = final[None]
    return out.to(dtype), states


def fla_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor, per_position: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_gated_delta_rule` with flash-linear-attention's Triton kernels (CUDA only).

    Per-position states come from stepping the fused recurrent kernel one token at a time
    (such passes have at most KVCache.max_tracked_positions tokens); long passes use the chunked
    kernel. q/k are L2-normalised inside the kernels (use_qk_l2norm_in_kernel), as the model does.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    dtype = v.dtype
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g, state = g.float().contiguous(), state.float().contiguous()
    if not per_position:
        b, t = q.shape[:2]
        varlen = {}
        if b > 1:
            # several sequences' prompt chunks (engine/scheduler.py `prefill_groups`) as one variable-length call, a
            # sequence per row: fla autotunes and compiles its cumsum kernel per batch size, which
            # stalled the first batched prefills 0.3-1.2 s each on the H200; at B = 1 it never varies
            q, k, v, g, beta = (x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta))
            bounds = torch.arange(0, (b + 1) * t, t)
            varlen = {"cu_seqlens": bounds.to(q.device), "cu_seqlens_cpu": bounds}
        out, final = chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=state,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True, **varlen)
        return out.reshape(b, t, *out.shape[2:]).to(dtype), final[None]
    outs, states = [], []
    for t in range(q.shape[1]):
        step = slice(t, t + 1)
        q_t, k_t, v_t, g_t, beta_t = (x[:, step].contiguous() for x in (q, k, v, g, beta))
        out, state = fused_recurrent_gated_delta_rule(q=q_t, k=k_t, v=v_t, g=g_t, beta=beta_t, initial_state=state,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(out)
        states.append(state)
    return torch.cat(outs, dim=1).to(dtype), torch.stack(states)


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    """Whether flash-linear-attention's gated delta rule kernels import (checked once; the reason
    for falling back to torch on CUDA is logged once under VERISPEC_DEBUG)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: F401
    except Exception as exc:  # ImportError, or a Triton/CUDA mismatch raised at import
        log.debug("Gated DeltaNet on CUDA uses the torch reference: flash-linear-attention (fla) is not "
                  "usable (%s: %s)", type(exc).__name__, exc)
        return False
    return True


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, per_position: bool, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch. q, k [B, T, Hk, Dk] may have fewer heads than v [B, T, H, Dv] (value head h reads
    key head h // (H / Hk)). On CUDA: short passes (per-position states) run our Triton recurrent
    kernel (one launch, graph-capturable), long ones fla's chunked kernel when installed; else the
    torch reference. `exact` (exact numerics): every pass steps token by token, long ones keeping
    the final state only, so a position's state is the same bits in a prompt chunk as in a decode
    step. Results as in `torch_gated_delta_rule`."""
    if q.is_cuda and (per_position or exact) and recurrent_kernel.available(q.device):
        return recurrent_kernel.gated_delta_recurrent(q, k, v, g, beta, state, all_states=per_position)
    groups = v.shape[2] // q.shape[2]
    if groups > 1:  # each key head serves `groups` consecutive value heads
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    if q.is_cuda and fla_enabled() and fla_available() and not exact:
        return fla_gated_delta_rule(q, k, v, g, beta, state, per_position)
    return torch_gated_delta_rule(q, k, v, g, beta, state, per_position, exact)


def fla_enabled() -> bool:
    """VERISPEC_FLA=0 turns fla off — for training on Hopper, where fla 0.6's backward refuses
    Triton < 3.7.1 (incorrect gradients, fla issue #640); the forward kernels are unaffected."""
    if env().use_fla:
        return True
    _log_fla_off()
    return False


@functools.lru_cache(maxsize=None)
def _log_fla_off() -> None:
    log.debug("Gated DeltaNet on CUDA uses the torch reference: VERISPEC_FLA=0")


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * w * silu(gate) (`fused.gated_rms_norm`): a plain weight (not 1 + w), statistics
    in float32 (float64 stays). SiLU whatever the config's hidden_act, as transformers' gated norm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.impl = gated_rms_norm

    def fuse(self) -> None:
        self.impl = compiled_rows(gated_rms_norm)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # x, gate: [..., dim]
        return self.impl(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """The mixer of a linear-attention layer. `layer_idx` is its index in the cache it is given."""

    def __init__(self, hidden_size: int, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_kernel: int, eps: float, layer_idx: int, act: str = "silu"):
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"linear_num_value_heads ({num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_key_heads})")
        self.layer_idx = layer_idx
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.key_dim = num_key_heads * key_head_dim
        self.value_dim = num_value_heads * value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_value_heads))
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads))
        self.norm = GatedRMSNorm(value_head_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.act = activation(act)
        self.in_proj: nn.Linear | None = None  # set by merge_projections()
        self.gates = gdn_gates
        self.conv = self._conv_act

    def cache_spec(self) -> RecurrentLayerSpec:
        return RecurrentLayerSpec(self.conv_dim, self.conv_kernel, self.num_value_heads,
                                  self.key_head_dim, self.value_head_dim)

    def merge_projections(self) -> None:
        """The four input projections (qkv, z, b, a) as one GEMM: b and a are tiny (one row per
        head) and, alone, mostly launch overhead. The separate weights are released."""
        if self.in_proj is None:
            self.in_proj = merged_linear(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
            del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def fuse(self) -> None:
        self.gates = compiled(gdn_gates)
        if self.act is F.silu:
            self.conv = compiled(causal_conv_silu)

    def _conv_act(self, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The reference: the library convolution (as transformers computes it), then the activation."""
        return self.act(F.conv1d(window, weight[:, None, :], groups=self.conv_dim))

    def forward(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:  # x: [B, T, H]
        b, t, _ = x.shape
        hv = self.num_value_heads
        if self.in_proj is not None:
            mixed, z, b_in, a_in = self.in_proj(x).split([self.conv_dim, self.value_dim, hv, hv], dim=-1)
        else:
            mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
            b_in, a_in = self.in_proj_b(x), self.in_proj_a(x)
        conv_state, ssm_state = cache.recurrent_state(self.layer_idx)
        # [B, C, K-1+T]: the committed conv state, then this pass's pre-conv inputs
        window = torch.cat([conv_state.to(x.dtype), mixed.transpose(1, 2)], dim=-1)
        conv = self.conv(window, self.conv1d.weight[:, 0, :])  # [B, C, T]
        q, k, v = conv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.num_key_heads, self.key_head_dim)
        k = k.reshape(b, t, self.num_key_heads, self.key_head_dim)
        v = v.reshape(b, t, hv, self.value_head_dim)
        exact = bool(getattr(cache, "prompt_kernel", False))  # exact numerics (engine.py)
        gates = gdn_gates_rounded if exact and x.device.type == "cpu" else self.gates
        beta, g = gates(b_in, a_in, self.A_log, self.dt_bias)  # [B, T, Hv]; g float32
        valid = getattr(cache, "valid_rows", None)  # [B, T]: a padded prompt pass of several sequences
        if valid is not None:  # padding neither decays nor writes the state: each row ends in its own
            beta, g = beta * valid[..., None], g * valid[..., None]
        per_position = t <= cache.max_tracked_positions
        out, states = gated_delta_rule(q, k, v, g, beta, ssm_state, per_position, exact)
        cache.set_recurrent_pending(self.layer_idx, window, states, per_position)
        out = self.norm(out, z.reshape(b, t, hv, self.value_head_dim)).reshape(b, t, self.value_dim)
        return self.out_proj(out)
