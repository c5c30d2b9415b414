"""The exact-numerics kernels on the GPU's own tensor cores, bit for bit: the dense linear's rows are
the same at every row count and with every tile (small-row tensor-core instructions, the warpgroup
ones, the persistent copy-engine kernel), and the prompt-chunk attention gives each token the bits
its decode step and any other chunking give it (bf16, 32 query / 8 kv heads of 128, 4K keys)."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import decode_attention as attention
from verispec.kernels import prompt_attention
from verispec.kernels import linear as lin
from verispec.quant import mlx_affine
from verispec.quant.kernels import exact

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TILES = [lin.Tiles(16, 32, 128, 4, 4), lin.Tiles(16, 16, 64, 2, 3), lin.Tiles(64, 32, 128, 4, 6),
         lin.Tiles(64, 64, 64, 4, 4), lin.Tiles(128, 128, 64, 8, 3), lin.Tiles(128, 256, 64, 8, 3)]
TMA_TILES = [lin.Tiles(128, 128, 64, 4, 4, tma=True, flatten=True), lin.Tiles(128, 256, 64, 8, 3, tma=True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1536, 576), (1000, 200)])
def test_linear_rows_are_the_same_at_every_row_count_and_tile(dtype, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(300, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype)
    alone = torch.cat([lin.linear(x[i:i + 1], w) for i in range(24)])
    if dtype == torch.float32:  # the FMA chain; its tiles are staged in 4-byte values
        tiles = [lin.Tiles(16, 32, 32, 4, 2), lin.Tiles(32, 32, 32, 4, 2), lin.Tiles(64, 64, 32, 4, 2)]
    else:
        tiles = TILES + (TMA_TILES if torch.cuda.get_device_capability()[0] >= 9 else [])
    for t in tiles:
        assert torch.equal(lin.linear(x, w, tiles=t)[:24], alone), t
    for m in (2, 3, 8, 17, 64, 65, 257, 300):
        assert torch.equal(lin.linear(x[:m], w)[:min(m, 24)], alone[:min(m, 24)]), m
    ref = x.double() @ w.double().T
    err = float((alone.double() - ref[:24]).norm() / ref[:24].norm())
    assert err < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("window", [None, 1000])
def test_prompt_attention_is_the_decode_steps_bits(window):
    gen = torch.Generator(device="cuda").manual_seed(0)
    length, hq, hkv, d = 4096, 32, 8, 128
    q = torch.randn(1, hq, length, d, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(1, hkv, length, d, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(1, hkv, length, d, device="cuda", generator=gen).to(torch.bfloat16)
    scale = d ** -0.5

    def chunk(first, n, tile=None):
        pos = torch.arange(first, first + n, device="cuda")[None]
        return prompt_attention.chunk_attention(q[:, :, first:first + n], k, v, pos, scale, window, query_tile=tile)

    whole = chunk(0, length)
    for first, n, tile in ((0, 2048, None), (2048, 2048, 32), (1000, 37, 4), (3000, 1096, 8)):
        assert torch.equal(chunk(first, n, tile), whole[:, :, first:first + n]), (first, n, tile)
    for position in (0, 127, 128, 511, 512, 2047, 2048, 4095):
        pos = torch.tensor([[position]], device="cuda")
        step = attention.decode_attention(q[:, :, position:position + 1].contiguous(), k, v, pos, scale, window)
        assert torch.equal(step, whole[:, :, position:position + 1]), position
        if position >= 3:  # a verify pass ending at this position, and the same row beside 7 other sequences
            pos4 = torch.arange(position - 3, position + 1, device="cuda")[None]
            verify = attention.decode_attention(q[:, :, position - 3:position + 1].contiguous(), k, v, pos4, scale,
                                                window)
            assert torch.equal(verify, whole[:, :, position - 3:position + 1]), position
            batch = attention.decode_attention(q[:, :, position:position + 1].expand(8, -1, -1, -1).contiguous(),
                                               k.expand(8, -1, -1, -1), v.expand(8, -1, -1, -1),
                                               pos.expand(8, -1).contiguous(), scale, window)
            assert torch.equal(batch[3:4], step), position
    ref = attention.decode_attention_reference(q.double(), k.double(), v.double(),
                                               torch.arange(length, device="cuda")[None], scale, window)
    assert float((whole.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (8, 64), (3, 64)])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1536, 576)])
def test_quantized_rows_are_the_same_fused_and_through_the_decoded_weight(bits, group, n, k):
    gen = torch.Generator().manual_seed(n + bits)
    w = (torch.randn(n, k, generator=gen) * 0.02).cuda().to(torch.bfloat16)
    packed, scales, biases = mlx_affine.quantize(w, mlx_affine.AffineSpec(bits, group))
    x = torch.randn(300, k, device="cuda").to(torch.bfloat16)
    alone = torch.cat([exact.exact_linear(x[i:i + 1], packed, scales, biases, bits, group, False) for i in range(8)])
    for m in (2, 8, 9, 16, 33, 64, 65, 129, 300):  # fused up to 64 rows, the decoded weight's GEMM past that
        assert torch.equal(exact.exact_linear(x[:m], packed, scales, biases, bits, group, False)[:min(m, 8)],
                           alone[:min(m, 8)]), m
