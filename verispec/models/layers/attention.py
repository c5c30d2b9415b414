"""Multi-head attention with GQA over the KV cache, and the masks it needs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from verispec.cache.kv import KVCache
from verispec.cache.paged import BatchCache
from verispec.kernels import decode_attention as split_k
from verispec.kernels import prompt_attention
from verispec.kernels.kv_write import KVDestination


def attention_mask(positions: torch.Tensor, num_keys: int, window: int | None,
                   ragged: bool = False) -> torch.Tensor | None:
    """Boolean mask [B, 1, T, S] (True = attend) for queries at `positions` [B, T].

    Key s sits at position s (one cache row per position). Returns None when every query may
    see every key (a single decode token without a window, all rows of one length), so SDPA
    takes its fast path. `ragged`: rows of a batch end at different positions (paged cache).
    """
    t = positions.shape[1]
    if t == 1 and (window is None or num_keys <= window) and not (ragged and positions.shape[0] > 1):
        return None
    key_pos = torch.arange(num_keys, device=positions.device)
    q = positions[:, :, None]
    allowed = key_pos[None, None, :] <= q
    if window is not None:
        allowed &= key_pos[None, None, :] > q - window
    return allowed[:, None]


_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _causal_lower_right(num_queries: int, num_keys: int):
    """torch's lower-right causal bias, imported where first used: its module imports dynamo
    (and sympy), ~40 MiB that a server running the CPU layer kernel never needs."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(num_queries, num_keys)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float, causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with GQA: q [B, Hq, T, D], k/v [B, Hkv, S, D] -> [B, Hq, T, D].
    On a CPU, float16 inputs are attended in float32: torch's CPU kernel for float16 ran 2.5-3.5x
    slower than float32's at decode shapes (1 query, 200-4000 keys, measured on the CI machine),
    and float32 is at least as accurate. bfloat16 is left to torch's own kernel (1.5-2.3x slower
    there too), whose results transformers' bf16 models reproduce bit for bit (tests/models).

    causal: the T queries are the last T of the S keys, each seeing the keys up to its own (a
    prompt chunk; S == T for a prompt's first chunk), so no mask is needed, and on CUDA the call
    goes to the flash kernel (lower-right aligned when S > T): with a mask torch picks cuDNN's,
    which builds an execution plan for each new shape (13-50 ms, the first in a process 0.6-0.9 s
    on the H200) and ran a 16K causal prompt in 14.3 ms against flash's 6.7 (docs/benchmarks.md).
    Masked calls (sliding windows, verify passes over the
    gathered cache) stay on cuDNN: the memory-efficient kernel needs no plan but takes no grouped
    K/V heads, and with them expanded it ran 16 queries over 16K keys in 1.0 ms against cuDNN's 0.38."""
    gqa = q.shape[1] != k.shape[1]
    if causal:
        t, s = q.shape[2], k.shape[2]
        bias = None if s == t else _causal_lower_right(t, s)
        # not cuDNN, which torch picks first on Hopper even for an unmasked causal call, and which
        # plans per shape (a batched prefill's per-sequence slices are new shapes every time)
        with sdpa_kernel(_NO_CUDNN):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None, scale=scale,
                                                  enable_gqa=gqa)
    if q.device.type == "cpu" and q.dtype == torch.float16:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                             enable_gqa=gqa)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] (new rows) -> out [B, Hq, T, D]."""
    k_all, v_all = cache.append(layer, k, v)
    return sdpa(q, k_all, v_all, mask, scale)


class AttentionInputs:
    """Per-forward attention context shared by all layers: positions, and masks built once per
    window size. Short passes (decode / verify, T <= 8) on a cache that enables it use the
    split-K kernel, which reads the cache in place with bounds from `positions` (CUDA-graph safe)."""

    def __init__(self, positions: torch.Tensor, cache: KVCache | BatchCache):
        self.positions = positions  # [B, T]
        self.cache = cache
        num_tokens = positions.shape[1]
        self.paged = isinstance(cache, BatchCache)
        if self.paged:
            self.use_kernel = cache.use_kernel and num_tokens <= split_k.MAX_QUERY_TOKENS
            self.num_keys = cache.num_keys
        else:
            self.use_kernel = cache.use_decode_kernel and num_tokens <= split_k.MAX_QUERY_TOKENS
            self.num_keys = cache.length + num_tokens
        self._masks: dict[int | None, torch.Tensor | None] = {}

    def kv_destination(self, layer: int) -> KVDestination | None:
        """Where this pass's new keys and values go in `layer`'s cache, for a kernel that writes
        them itself (then `attend(..., written=True)`): every paged pass, and the passes that
        attend in place on the contiguous cache (decode / verify); None for prompt passes on the
        contiguous cache, which append through `cache.append`. The rows count as written."""
        if self.paged:
            return self.cache.kv_destination(layer)
        if self.use_kernel:
            return self.cache.kv_destination(layer, self.positions)
        return None

    def mask(self, window: int | None) -> torch.Tensor | None:
        if window not in self._masks:
            num_keys = self.cache.num_keys if self.paged else self.num_keys  # the paged cache gathers that many
            self._masks[window] = attention_mask(self.positions, num_keys, window, ragged=self.paged)
        return self._masks[window]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, layer: int,
           window: int | None, scale: float, written: bool = False) -> torch.Tensor:
    """q [B, Hq, T, D], new k/v [B, Hkv, T, D] -> out [B, Hq, T, D]; writes k/v into the cache,
    unless `written` (they went to inputs.kv_destination(layer) already)."""
    cache = inputs.cache
    if inputs.paged:
        if not written:
            cache.write(layer, k, v)
        return paged_attention(q, inputs, layer, window, scale)
    if inputs.use_kernel:
        if not written:
            cache.write_at(layer, k, v, inputs.positions)
        # the torch reference stands in off-GPU, so the in-place path is testable on CPU
        kernel = split_k.decode_attention if split_k.available(q.device) else split_k.decode_attention_reference
        return kernel(q, cache.keys[layer], cache.values[layer], inputs.positions, scale, window)
    return cached_attention(q, k, v, cache, layer, inputs.mask(window), scale)


def attend_cached(q: torch.Tensor, inputs: AttentionInputs, layer: int, window: int | None,
                  scale: float) -> torch.Tensor:
    """Query-only attention over the rows already in `layer`'s cache, this pass's included (the
    layer that owns them ran earlier in the pass): q [B, Hq, T, D] -> out [B, Hq, T, D]; writes
    nothing. For layers that share another layer's K/V (Gemma 4's num_kv_shared_layers)."""
    cache = inputs.cache
    if inputs.paged:
        return paged_attention(q, inputs, layer, window, scale)
    keys, values = cache.keys[layer], cache.values[layer]
    if inputs.use_kernel:
        kernel = split_k.decode_attention if split_k.available(q.device) else split_k.decode_attention_reference
        return kernel(q, keys, values, inputs.positions, scale, window)
    k, v = keys[:, :, :inputs.num_keys], values[:, :, :inputs.num_keys]
    return sdpa(q, k, v, inputs.mask(window), scale)


def paged_attention(q: torch.Tensor, inputs: AttentionInputs, layer: int, window: int | None,
                    scale: float) -> torch.Tensor:
    """q [B, Hq, T, D] over `layer`'s K/V in the paged pools (this pass's rows already written)
    -> out [B, Hq, T, D]. Short passes on CUDA read the pools in place through the block tables
    (split-K kernel, graph-capturable); otherwise the rows are gathered and SDPA runs masked.
    tq pools hold rotated rows: the query is rotated once, attends there (q . k = Rq . Rk, values
    summed rotated) and the output is rotated back once; keys are never un-rotated."""
    codec = inputs.cache.pools.codecs[layer]
    if codec is None:
        return _paged_attention(q, inputs, layer, window, scale)
    return codec.unrotate(_paged_attention(codec.rotate(q), inputs, layer, window, scale))


def _paged_attention(q: torch.Tensor, inputs: AttentionInputs, layer: int, window: int | None,
                     scale: float) -> torch.Tensor:
    cache: BatchCache = inputs.cache
    pools = cache.pools
    # fp8 / tq pools: the kernels decode codes in registers, the gather below decodes a copy, alike
    scales = dict(k_scale=pools.key_scales[layer], v_scale=pools.value_scales[layer])
    if pools.codecs[layer] is not None:
        scales["codec"] = pools.codecs[layer]
    if inputs.use_kernel:
        return split_k.paged_decode_attention(q, pools.keys[layer], pools.values[layer], cache.block_tables,
                                              pools.block_size, inputs.positions, scale, window, **scales)
    exact_prompt = cache.prompt_pass and cache.prompt_kernel
    if exact_prompt and q.is_cuda:
        # exact numerics: each prompt token's rows are the bits its decode step gives it
        return prompt_attention.paged_chunk_attention(q, pools.keys[layer], pools.values[layer], cache.block_tables,
                                             pools.block_size, inputs.positions, scale, window,
                                             cache.padded_row_lengths(), **scales)
    k, v = cache.gather(layer)
    if cache.row_lengths is not None:
        # prompt chunks (one sequence's, or several padded at their ends): each sequence attends
        # with the call it makes alone (its own queries, keys and mask), so its rows do not depend
        # on the batch; its queries are the last of its keys, which a causal kernel can take
        if q.shape[0] == 1 and cache.row_lengths[0] == q.shape[2]:
            return _attend_chunk(q, k, v, inputs.positions, cache.row_starts[0], window, scale, exact_prompt)
        out = torch.zeros_like(q)  # padding rows stay finite (recurrent layers multiply them by 0)
        for b, (start, n) in enumerate(zip(cache.row_starts, cache.row_lengths)):
            out[b:b + 1, :, :n] = _attend_chunk(q[b:b + 1, :, :n], k[b:b + 1, :, :start + n], v[b:b + 1, :, :start + n],
                                                inputs.positions[b:b + 1, :n], start, window, scale, exact_prompt)
        return out
    if q.device.type == "cpu" and q.shape[2] <= split_k.MAX_QUERY_TOKENS:
        return per_row_attention(q, k, v, inputs.positions, window, scale)
    return sdpa(q, k, v, inputs.mask(window), scale)


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, start: int,
                  window: int | None, scale: float, exact: bool = False) -> torch.Tensor:
    """One sequence's prompt chunk: q [1, Hq, T, D] at positions start..start+T-1 over its gathered
    k/v [1, Hkv, start+T, D] -> [1, Hq, T, D]. On CUDA without a window the chunk is causal with
    the queries aligned to the last keys, which flash attention runs with no mask (head dims to
    256): a masked call goes to cuDNN, which builds an execution plan for every new shape, 13-19 ms
    a call on the H200, so the tail of every prompt of a new length paid ~0.2 s.
    `exact` (exact numerics on a CPU): every row attends alone, as its decode step would, so its
    bits do not depend on the chunk it is in."""
    if q.device.type == "cpu" and (exact or q.shape[2] <= split_k.MAX_QUERY_TOKENS):
        return per_row_attention(q, k, v, positions, window, scale)
    if q.is_cuda and window is None and q.shape[-1] <= 256:
        return sdpa(q, k, v, None, scale, causal=True)
    return sdpa(q, k, v, attention_mask(positions, start + q.shape[2], window, ragged=True), scale)


def per_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      window: int | None, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D] at `positions` [B, T] over gathered k/v [B, Hkv, S, D] -> [B, Hq, T, D]:
    each query row attends over exactly the keys it sees, unmasked — the very call a one-token
    decode of that row makes. A masked pass over T rows sums differently from one row over its
    own keys (torch's CPU kernels block by shape; 1e-7 apart in float32), which flips near-ties:
    a verify pass then disagrees with plain decoding (SmolLM2 in float16: 2-4 of 16 prompts).
    Per row, a row's result depends on neither the pass's width nor the batch. CPU only: short
    passes (decode / verify), and prompt chunks under exact numerics; CUDA has its kernels."""
    if q.dtype == torch.float16:
        k, v = k.float(), v.float()  # once, not per row (sdpa attends float16 in float32 on a CPU)
    out = torch.empty_like(q)
    for b, row_positions in enumerate(positions.tolist()):
        for t, position in enumerate(row_positions):
            end = max(position + 1, 1)  # padding rows of a ragged batch: any key, output unused
            start = max(0, end - window) if window is not None else 0
            out[b, :, t] = sdpa(q[b:b + 1, :, t:t + 1], k[b:b + 1, :, start:end], v[b:b + 1, :, start:end],
                                None, scale)[0, :, 0]
    return out
