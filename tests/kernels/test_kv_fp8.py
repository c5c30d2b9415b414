"""The fp8 KV cache (kernels/kv_fp8.py): the codec against a float64 reference (within e4m3's
rounding bound), every write path (kv_write, qk_prep's fused write, the torch fallback) storing the
same codes and scales, and attention over fp8 pools (the split-K kernel, the prompt-chunk kernel,
the torch reference) equal to attention over their decoded copy. Runs on CUDA, and on the CPU in
Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import decode_attention as attention
from verispec.kernels import prompt_attention
from verispec.kernels import kv_fp8, kv_write, qk_prep
from verispec.kernels.kv_write import KVDestination

pytestmark = pytest.mark.skipif(kv_fp8.triton is None, reason="needs Triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# the interpreter's attention case is small, in float32, with 2 shares of 64-key blocks
DTYPE = torch.bfloat16 if CUDA else torch.float32


def rows(n: int, h: int, d: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """n x h rows of d values over many magnitudes (1e-6 .. 1e4), a zero row and a row with an outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=gen, dtype=torch.float64)
    x *= 10.0 ** torch.randint(-6, 5, (n, h, 1), generator=gen)
    x[0, 0] = 0
    x[-1, -1, 3] = 1e4
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_codec_within_e4m3_rounding_of_float64(dtype):
    x = rows(64, 3, 72, seed=1)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    codes, exponents = kv_fp8.encode_reference(x)
    assert codes.dtype == kv_fp8.CODE_DTYPE and exponents.shape == x.shape[:-1]
    exact = x.double()
    scale = torch.pow(2.0, exponents.double() - 127)[..., None]
    amax = exact.abs().amax(-1, keepdim=True)
    nonzero = amax > 0
    # the scale is the smallest power of two that fits the row into e4m3's range
    assert bool(((amax <= 448 * scale) & ((amax > 224 * scale) | ~nonzero)).all())
    decoded = kv_fp8.decode_reference(codes, exponents, torch.float64)
    # e4m3: 3 mantissa bits (a half-ulp of 2^-4 relative); subnormals below 2^-6: steps of 2^-9 x scale
    bound = torch.maximum(exact.abs() * 2.0 ** -4, scale * 2.0 ** -10)
    assert bool(((decoded - exact).abs() <= bound).all())
    # decoding to the activations' dtype is exact (4 significant bits times a power of two)
    if dtype != torch.float16:
        assert torch.equal(kv_fp8.decode_reference(codes, exponents, dtype).double(), decoded)


def fp8_pools(slots: int, h: int, d: int):
    return (torch.zeros(slots, h, d, dtype=kv_fp8.CODE_DTYPE, device=DEVICE),
            torch.zeros(slots, h, d, dtype=kv_fp8.CODE_DTYPE, device=DEVICE),
            torch.zeros(slots, h, dtype=kv_fp8.SCALE_DTYPE, device=DEVICE),
            torch.zeros(slots, h, dtype=kv_fp8.SCALE_DTYPE, device=DEVICE))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("b,t", [(1, 1), (3, 2)])
def test_kv_write_kernel_encodes_as_the_reference(b, t):
    h, d, slots = 3, 72, 40
    gen = torch.Generator().manual_seed(b + t)
    k = rows(b * t, h, d, seed=b * 7 + t, dtype=torch.bfloat16).view(b, t, h, d).transpose(1, 2).to(DEVICE)
    v = (torch.randn(b, t, h, d, generator=gen) * 50).to(DEVICE, torch.bfloat16).transpose(1, 2)
    where = torch.randperm(slots, generator=gen)[: b * t].to(DEVICE)
    kc, vc, ks, vs = fp8_pools(slots, h, d)
    kv_write.write_kv(k, v, kc, vc, where, row_dim=0, batch_dim=None, head_dim=1, k_scale=ks, v_scale=vs)
    for x, codes, scales in ((k, kc, ks), (v, vc, vs)):
        want_codes, want_scales = kv_fp8.encode_reference(x.transpose(1, 2).reshape(b * t, h, d))
        assert same_bits(codes[where], want_codes) and torch.equal(scales[where], want_scales)


def test_torch_write_path_stores_what_the_kernel_stores():
    h, d, slots, b, t = 2, 64, 24, 2, 3
    k = rows(b * t, h, d, seed=5).view(b, t, h, d).transpose(1, 2).to(DEVICE)
    v = rows(b * t, h, d, seed=6).view(b, t, h, d).transpose(1, 2).to(DEVICE)
    where = torch.tensor([3, 9, 4, 17, 1, 20], device=DEVICE)
    by_kernel, by_torch = fp8_pools(slots, h, d), fp8_pools(slots, h, d)
    kv_write.write_kv(k, v, *by_kernel[:2], where, 0, None, 1, *by_kernel[2:])
    destination = KVDestination(*by_torch[:2], where, 0, None, 1, *by_torch[2:])
    kv_write.triton, saved = None, kv_write.triton  # the fallback (what a CPU runs)
    try:
        destination.write(k, v)
    finally:
        kv_write.triton = saved
    assert all(same_bits(x, y) for x, y in zip(by_kernel, by_torch))


@pytest.mark.parametrize("b,t", [(1, 1), (2, 3)])
def test_qk_prep_fused_write_encodes_its_keys_and_values(b, t):
    hq, hkv, d = 4, 2, 64
    gen = torch.Generator().manual_seed(11 * b + t)
    qkv = (torch.randn(b, t, (hq + 2 * hkv) * d, generator=gen) * 3).to(DEVICE, DTYPE)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, t, hq, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d).transpose(1, 2)
    emb = torch.arange(7, 7 + t)[:, None].float() * torch.rand(d // 2, generator=gen)
    cos, sin = (torch.cat((emb, emb), -1).cos().to(DEVICE, DTYPE)[None].expand(b, t, d),
                torch.cat((emb, emb), -1).sin().to(DEVICE, DTYPE)[None].expand(b, t, d))
    qw, kw = (torch.rand(d, generator=gen) + 0.5).to(DEVICE, DTYPE), (torch.rand(d, generator=gen) + 0.5).to(DEVICE, DTYPE)
    where = torch.randperm(32, generator=gen)[: b * t].to(DEVICE)
    kc, vc, ks, vs = fp8_pools(32, hkv, d)
    destination = KVDestination(kc, vc, where, 0, None, 1, ks, vs)
    _, keys = qk_prep.prepare_qk(q, k, cos, sin, qw, kw, 1e-6, False, v=v, cache_rows=destination)
    for x, codes, scales in ((keys, kc, ks), (v, vc, vs)):
        want_codes, want_scales = kv_fp8.encode_reference(x.transpose(1, 2).reshape(b * t, hkv, d))
        assert same_bits(codes[where], want_codes) and torch.equal(scales[where], want_scales)


def paged_case(length: int, batch: int, hq: int, hkv: int, d: int, seed: int):
    """q [B, Hq, L, D] and fp8 pools holding each sequence's L + 8 keys through shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    block = 16
    blocks = -(-(length + 8) // block)
    tables = (torch.randperm(batch * blocks, generator=gen) + 1).view(batch, blocks).to(DEVICE)
    q = torch.randn(batch, hq, length, d, generator=gen).to(DEVICE, DTYPE)
    slots = (batch * blocks + 1) * block
    pools = fp8_pools(slots, hkv, d)
    s = torch.arange(length + 8)
    for b in range(batch):
        where = (tables[b].cpu()[s // block] * block + s % block).to(DEVICE)
        for codes, scales in ((pools[0], pools[2]), (pools[1], pools[3])):
            c, e = kv_fp8.encode_reference(torch.randn(length + 8, hkv, d, generator=gen) * 4)
            codes[where], scales[where] = c.to(DEVICE), e.to(DEVICE)
    decoded = [kv_fp8.decode_reference(pools[i], pools[i + 2], DTYPE) for i in (0, 1)]
    return q, tables, block, pools, decoded


@pytest.mark.parametrize("window", [None, 40])
def test_split_k_over_fp8_pools_equals_it_over_their_decoded_copy(window):
    hq, hkv, d, length = (8, 2, 128, 600) if CUDA else (4, 2, 16, 150)
    q, tables, block, (kc, vc, ks, vs), (k, v) = paged_case(length, 2, hq, hkv, d, seed=3)
    splits = None if CUDA else 2
    for t, last in ((1, length - 1), (4, 97)):
        pos = torch.arange(last - t + 1, last + 1, device=DEVICE)[None].expand(2, -1).contiguous()
        qt = q[:, :, last - t + 1:last + 1].contiguous()
        got = attention.paged_decode_attention(qt, kc, vc, tables, block, pos, d ** -0.5, window, splits,
                                               k_scale=ks, v_scale=vs)
        plain = attention.paged_decode_attention(qt, k, v, tables, block, pos, d ** -0.5, window, splits)
        if CUDA and window is not None and t > 1:
            # decoded in registers, the tile may reach the tensor cores otherwise than loaded from a bf16
            # copy: seen on the H200 to move the last bits here; exactness needs fp8 against itself only
            assert float((got.double() - plain.double()).norm() / plain.double().norm()) < 1e-2, t
        else:
            assert torch.equal(got, plain), t
        ref = attention.paged_decode_attention_reference(qt, kc, vc, tables, block, pos, d ** -0.5, window,
                                                         k_scale=ks, v_scale=vs)
        assert float((got.double() - ref.double()).norm() / ref.double().norm()) < (1e-2 if CUDA else 1e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_prompt_chunk_over_fp8_pools_equals_it_over_their_decoded_copy(window):
    hq, hkv, d, length = (8, 2, 128, 300) if CUDA else (4, 2, 16, 150)
    q, tables, block, (kc, vc, ks, vs), (k, v) = paged_case(length, 2, hq, hkv, d, seed=4)
    splits = None if CUDA else 2
    pos = torch.arange(length, device=DEVICE)[None].expand(2, -1).contiguous()
    got = prompt_attention.paged_chunk_attention(q, kc, vc, tables, block, pos, d ** -0.5, window, num_splits=splits,
                                          k_scale=ks, v_scale=vs)
    assert torch.equal(got, prompt_attention.paged_chunk_attention(q, k, v, tables, block, pos, d ** -0.5, window,
                                                            num_splits=splits))


def test_reference_reads_fp8_pools_as_their_decoded_copy():
    q, tables, block, (kc, vc, ks, vs), (k, v) = paged_case(40, 2, 4, 2, 16, seed=5)
    pos = torch.arange(30, 34, device=DEVICE)[None].expand(2, -1).contiguous()
    qt = q[:, :, 30:34].contiguous()
    got = attention.paged_decode_attention_reference(qt, kc, vc, tables, block, pos, 0.25, k_scale=ks, v_scale=vs)
    assert torch.equal(got, attention.paged_decode_attention_reference(qt, k, v, tables, block, pos, 0.25))
