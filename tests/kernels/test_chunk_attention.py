"""A prompt chunk's causal attention with its queries aligned to the last keys (models/layers/
attention.py `sdpa(causal=True)`: flash attention on CUDA, no mask, no per-shape cuDNN plan)
against an explicit float64 mask, with grouped K/V heads, on the CPU and (marked gpu) on CUDA."""
from __future__ import annotations

import pytest
import torch

from verispec.models.layers.attention import attention_mask, sdpa

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("start,length", [(0, 1), (0, 40), (37, 9), (37, 16), (600, 100), (5, 300)])
def test_lower_right_causal_chunk(device, head_dim, start, length):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(start * 1000 + length)
    s = start + length
    q = torch.randn(1, 6, length, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, s, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, s, head_dim, generator=gen, dtype=torch.float64)
    positions = torch.arange(start, s)[None]
    mask = attention_mask(positions, s, None, ragged=True)
    scale = head_dim ** -0.5
    ref = sdpa(q, k, v, mask if mask is not None else None, scale)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        if device == "cpu" and dtype == torch.bfloat16:
            continue
        args = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
        got = sdpa(*args, None, scale, causal=True)
        torch.testing.assert_close(got.double().cpu(), ref, atol=tol, rtol=tol)
