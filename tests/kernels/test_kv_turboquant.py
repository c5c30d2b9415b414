"""The TurboQuant-class codec (kernels/kv_turboquant.py): the rotation is orthogonal, the Lloyd-Max
codebook is what the literature gives for these bits, encode/decode against float64 stays within
the codebook's bound, packing round-trips, and attention over the codes (query rotated, keys never
un-rotated) equals attention over their decoded copy. Then the rows as the paged pools store them:
within the same bound, every write path (kv_write's kernel, qk_prep's, the torch path) storing the
same bits, and the split-K and prompt-chunk kernels and the torch reference over tq pools equal to
them over their decoded copy at any split. The kernels run on CUDA, and on the CPU in Triton's
interpreter (tests/conftest.py)."""
from __future__ import annotations

import math

import pytest
import torch

from verispec.kernels import decode_attention as attention
from verispec.kernels import prompt_attention
from verispec.kernels import kv_turboquant as tq
from verispec.kernels import kv_write, qk_prep
from verispec.kernels.decode_attention import decode_attention_reference
from verispec.kernels.kv_write import KVDestination

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
needs_triton = pytest.mark.skipif(tq.triton is None, reason="needs Triton")

# Lloyd-Max mean squared error of a standard normal (Max 1960): what a coordinate gets at large D
GAUSSIAN_DISTORTION = {3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("d", [64, 128])
def test_rotation_is_orthogonal_and_fixed_per_layer(d):
    x = torch.randn(5, d, dtype=torch.float64)
    signs = tq.rotation_signs(3, d)
    assert torch.equal(signs, tq.rotation_signs(3, d)) and not torch.equal(signs, tq.rotation_signs(4, d))
    y = tq.rotate(x, signs)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(tq.unrotate(y, signs), x)
    with pytest.raises(ValueError, match="power-of-two"):
        tq.rotation_signs(0, 96)


@pytest.mark.parametrize("bits", [3, 4])
def test_codebook_is_lloyd_max_for_the_coordinates(bits):
    centroids = tq.codebook(bits, 128)
    assert centroids.shape == (2 ** bits,) and bool((centroids[1:] > centroids[:-1]).all())
    torch.testing.assert_close(centroids, -centroids.flip(0))
    # at D = 128 a coordinate is nearly standard normal: the distortion is close to Max's
    t = torch.randn(400_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    nearest = centroids[torch.bucketize(t, (centroids[1:] + centroids[:-1]) / 2)]
    assert float(((t - nearest) ** 2).mean()) == pytest.approx(GAUSSIAN_DISTORTION[bits], rel=0.05)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_decode_against_float64(bits, dtype):
    d = 128
    gen = torch.Generator().manual_seed(bits)
    x = (torch.randn(2000, d, generator=gen, dtype=torch.float64) * 3 + torch.randn(d, generator=gen)).to(dtype)
    signs = tq.rotation_signs(1, d)
    codes, norms = tq.encode(x, signs, bits)
    assert codes.dtype == torch.uint8 and int(codes.max()) < 2 ** bits
    exact = x.double()
    torch.testing.assert_close(norms.double(), exact.norm(dim=-1), rtol=1e-6, atol=0)
    decoded = tq.decode(codes, norms, signs, bits, torch.float64)
    relative = ((decoded - exact) ** 2).sum(-1) / (exact ** 2).sum(-1)
    # the mean relative squared error is the codebook's distortion per coordinate
    assert float(relative.mean()) <= 1.1 * GAUSSIAN_DISTORTION[bits]
    # and per coordinate (rotated basis, unit scale): within half a cell of its centroid, or past the last one
    centroids = tq.codebook(bits, d)
    unit = tq.rotate(exact, signs) * (math.sqrt(d) / exact.norm(dim=-1))[..., None]
    error = (unit - centroids[codes.long()]).abs()
    half_cell = float((centroids[1:] - centroids[:-1]).max()) / 2
    inside = (unit > centroids[0]) & (unit < centroids[-1])
    assert float(error[inside].max()) <= half_cell + 1e-9


@pytest.mark.parametrize("bits", [3, 4])
def test_packing_round_trips(bits):
    codes = torch.randint(0, 2 ** bits, (3, 2, 64), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    packed = tq.pack(codes, bits)
    assert packed.shape == (3, 2, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(tq.unpack(packed, bits), codes)


@pytest.mark.parametrize("name", ["tq4", "tq3"])
@pytest.mark.parametrize("window", [None, 5])
def test_attention_over_codes_equals_attention_over_their_decoded_copy(name, window):
    fmt = tq.FORMATS[name]
    b, hq, hkv, t, s, d = 2, 4, 2, 3, 20, 64
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(b, hq, t, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64)
    signs = tq.rotation_signs(2, d)
    kc, kn = tq.encode(k, signs, fmt.key_bits)
    vc, vn = tq.encode(v, signs, fmt.value_bits)
    positions = torch.tensor([[10, 11, 12], [17, 18, 19]])
    got = tq.attention_reference(q, kc, kn, vc, vn, signs, fmt, d ** -0.5, positions, window)
    k_copy = tq.decode(kc, kn, signs, fmt.key_bits, torch.float64)
    v_copy = tq.decode(vc, vn, signs, fmt.value_bits, torch.float64)
    want = decode_attention_reference(q, k_copy, v_copy, positions, d ** -0.5, window)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # and near attention over the exact rows
    exact = decode_attention_reference(q, k, v, positions, d ** -0.5, window)
    assert float((got - exact).norm() / exact.norm()) < (0.15 if name == "tq4" else 0.25)


def test_bytes_per_token():
    # head dim 128, 8 kv heads: bfloat16 K and V take 4096 bytes a layer
    assert 4096 / tq.FORMATS["tq4"].bytes_per_token(8, 128) >= 3.5
    assert tq.FORMATS["tq3"].bytes_per_token(8, 128) < tq.FORMATS["tq4"].bytes_per_token(8, 128)


# ---- the rows as the paged pools store them -----------------------------------------------------------
@pytest.mark.parametrize("name", ["tq4", "tq3"])
@pytest.mark.parametrize("d", [16, 128])
def test_pool_rows_within_the_codebook_bound_of_float64(name, d):
    codec = tq.LayerCodec.build(tq.FORMATS[name], 5, d, "cpu")
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(3000, d, generator=gen, dtype=torch.float64) * 3 + torch.randn(d, generator=gen, dtype=torch.float64)
    x[0] = 0
    exact = tq.rotate(x, codec.signs.double())  # the rotated rows the pools decode to
    for code in (codec.key, codec.value):
        packed, scales = tq.encode_rows(x.float(), codec.signs, code, codec.inv_sqrt_d)
        assert packed.shape == (3000, d * code.bits // 8) and scales.dtype == torch.float32
        torch.testing.assert_close(scales.double(), x.norm(dim=-1) / math.sqrt(d), rtol=1e-6, atol=0)
        decoded = tq.decode_rows(packed, scales, code, torch.float64)
        assert not decoded[0].any()  # a zero row stays zero
        relative = ((decoded - exact) ** 2).sum(-1)[1:] / (exact ** 2).sum(-1)[1:]
        bound = GAUSSIAN_DISTORTION[code.bits] * (1.1 if d >= 128 else 1.6)  # small D: a flatter density
        assert float(relative.mean()) <= bound
        # each coordinate within half a cell (of the unit-sphere scale) of its centroid, inside the codebook
        unit = exact[1:] / scales[1:, None].double()
        error = (unit - decoded[1:] / scales[1:, None].double()).abs()
        centroids = code.centroids.double()
        inside = (unit > centroids[0]) & (unit < centroids[-1])
        assert float(error[inside].max()) <= float((centroids[1:] - centroids[:-1]).max()) / 2 + 1e-5


def tq_pools(slots: int, h: int, d: int, name: str, layer: int = 1):
    codec = tq.LayerCodec.build(tq.FORMATS[name], layer, d, DEVICE)
    return (torch.zeros(slots, h, d * codec.key.bits // 8, dtype=torch.uint8, device=DEVICE),
            torch.zeros(slots, h, d * codec.value.bits // 8, dtype=torch.uint8, device=DEVICE),
            torch.zeros(slots, h, dtype=torch.float32, device=DEVICE),
            torch.zeros(slots, h, dtype=torch.float32, device=DEVICE)), codec


def kv_rows(b: int, t: int, h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, H, T, D] as attention hands them over (transposed views), over several magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, t, h, d, generator=gen) * 10.0 ** torch.randint(-3, 3, (b, t, h, 1), generator=gen)
    k[0, 0, 0] = 0
    v = torch.randn(b, t, h, d, generator=gen) * 5
    return k.to(DEVICE, DTYPE).transpose(1, 2), v.to(DEVICE, DTYPE).transpose(1, 2)


@needs_triton
@pytest.mark.parametrize("name", ["tq4", "tq3"])
@pytest.mark.parametrize("b,t", [(1, 1), (2, 3)])
def test_write_kernel_stores_what_the_torch_path_stores(name, b, t):
    h, d, slots = 3, 64, 24
    k, v = kv_rows(b, t, h, d, seed=b * 5 + t)
    where = torch.randperm(slots, generator=torch.Generator().manual_seed(t))[: b * t].to(DEVICE)
    (by_kernel, codec), (by_torch, _) = tq_pools(slots, h, d, name), tq_pools(slots, h, d, name)
    kv_write.write_kv(k, v, *by_kernel[:2], where, 0, None, 1, *by_kernel[2:], codec=codec)
    destination = KVDestination(*by_torch[:2], where, 0, None, 1, *by_torch[2:], codec=codec)
    kv_write.triton, saved = None, kv_write.triton  # the fallback (what a CPU runs)
    try:
        destination.write(k, v)
    finally:
        kv_write.triton = saved
    assert all(torch.equal(x, y) for x, y in zip(by_kernel, by_torch))
    for x, codes, scales, code in ((k, by_torch[0], by_torch[2], codec.key), (v, by_torch[1], by_torch[3], codec.value)):
        want = tq.encode_rows(x.transpose(1, 2).reshape(b * t, h, d), codec.signs, code, codec.inv_sqrt_d)
        assert torch.equal(codes[where], want[0]) and torch.equal(scales[where], want[1])


@needs_triton
def test_qk_prep_with_a_tq_destination_writes_its_finished_keys():
    b, t, hq, hkv, d = 2, 3, 4, 2, 32
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, t, hq, d, generator=gen).to(DEVICE, DTYPE)
    k = torch.randn(b, t, hkv, d, generator=gen).to(DEVICE, DTYPE)
    v = torch.randn(b, t, hkv, d, generator=gen).to(DEVICE, DTYPE).transpose(1, 2)
    emb = torch.arange(5, 5 + t)[:, None].float() * torch.rand(d // 2, generator=gen)
    cos = torch.cat((emb, emb), -1).cos().to(DEVICE, DTYPE)[None].expand(b, t, d)
    sin = torch.cat((emb, emb), -1).sin().to(DEVICE, DTYPE)[None].expand(b, t, d)
    where = torch.randperm(16, generator=gen)[: b * t].to(DEVICE)
    pools, codec = tq_pools(16, hkv, d, "tq3")
    _, keys = qk_prep.prepare_qk(q, k, cos, sin, None, None, 1e-6, False, v=v,
                                 cache_rows=KVDestination(*pools[:2], where, 0, None, 1, *pools[2:], codec=codec))
    for x, codes, scales, code in ((keys, pools[0], pools[2], codec.key), (v, pools[1], pools[3], codec.value)):
        want = tq.encode_rows(x.transpose(1, 2).reshape(b * t, hkv, d), codec.signs, code, codec.inv_sqrt_d)
        assert torch.equal(codes[where], want[0]) and torch.equal(scales[where], want[1])


def paged_case(length: int, batch: int, hq: int, hkv: int, d: int, name: str, seed: int):
    """q [B, Hq, L, D] (rotated, as attention hands it over) and tq pools holding each sequence's L + 8
    keys through shuffled block tables, with their decoded (rotated) copy."""
    gen = torch.Generator().manual_seed(seed)
    block = 16
    blocks = -(-(length + 8) // block)
    tables = (torch.randperm(batch * blocks, generator=gen) + 1).view(batch, blocks).to(DEVICE)
    q = torch.randn(batch, hq, length, d, generator=gen).to(DEVICE, DTYPE)
    pools, codec = tq_pools((batch * blocks + 1) * block, hkv, d, name)
    s = torch.arange(length + 8)
    for b in range(batch):
        where = (tables[b].cpu()[s // block] * block + s % block).to(DEVICE)
        for codes, scales, code in ((pools[0], pools[2], codec.key), (pools[1], pools[3], codec.value)):
            x = (torch.randn(length + 8, hkv, d, generator=gen) * 4).to(DEVICE)
            codes[where], scales[where] = tq.encode_rows(x, codec.signs, code, codec.inv_sqrt_d)
    decoded = [tq.decode_rows(pools[0], pools[2], codec.key, DTYPE), tq.decode_rows(pools[1], pools[3], codec.value, DTYPE)]
    return q, tables, block, pools, codec, decoded


@needs_triton
@pytest.mark.parametrize("name", ["tq4", "tq3"])
@pytest.mark.parametrize("window", [None, 40])
def test_split_k_over_tq_pools_equals_it_over_their_decoded_copy(name, window):
    hq, hkv, d, length = (8, 2, 128, 600) if CUDA else (4, 2, 16, 150)
    q, tables, block, (kc, vc, ks, vs), codec, (k, v) = paged_case(length, 2, hq, hkv, d, name, seed=3)
    for splits in ((None, 3) if CUDA else (1, 2)):
        for t, last in ((1, length - 1), (4, 97)):
            pos = torch.arange(last - t + 1, last + 1, device=DEVICE)[None].expand(2, -1).contiguous()
            qt = q[:, :, last - t + 1:last + 1].contiguous()
            got = attention.paged_decode_attention(qt, kc, vc, tables, block, pos, d ** -0.5, window, splits,
                                                   k_scale=ks, v_scale=vs, codec=codec)
            plain = attention.paged_decode_attention(qt, k, v, tables, block, pos, d ** -0.5, window, splits)
            # tq pools take their own key blocks (decode_attention.split_config): near, not bitwise
            assert _relative(got, plain) < (1e-2 if CUDA else 1e-5), (splits, t)
            ref = attention.paged_decode_attention_reference(qt, kc, vc, tables, block, pos, d ** -0.5, window,
                                                             k_scale=ks, v_scale=vs, codec=codec)
            assert float((got.double() - ref.double()).norm() / ref.double().norm()) < (1e-2 if CUDA else 1e-5)


@needs_triton
@pytest.mark.parametrize("name", ["tq4", "tq3"])
@pytest.mark.parametrize("window", [None, 40])
def test_prompt_chunk_over_tq_pools_equals_it_over_their_decoded_copy(name, window):
    hq, hkv, d, length = (8, 2, 128, 300) if CUDA else (4, 2, 16, 150)
    q, tables, block, (kc, vc, ks, vs), codec, (k, v) = paged_case(length, 2, hq, hkv, d, name, seed=4)
    pos = torch.arange(length, device=DEVICE)[None].expand(2, -1).contiguous()
    for splits in ((None,) if CUDA else (2,)):  # the split path covers one share and two
        got = prompt_attention.paged_chunk_attention(q, kc, vc, tables, block, pos, d ** -0.5, window, num_splits=splits,
                                              k_scale=ks, v_scale=vs, codec=codec)
        plain = prompt_attention.paged_chunk_attention(q, k, v, tables, block, pos, d ** -0.5, window, num_splits=splits)
        assert _relative(got, plain) < (1e-2 if CUDA else 1e-5)
        # exact numerics: a prompt row over tq pools is, bit for bit, the decode step at its position
        # (both kernels; a CPU's decode step runs the torch reference)
        for last in ((0, 37, length - 1) if CUDA else ()):
            step = attention.paged_decode_attention(q[:, :, last:last + 1].contiguous(), kc, vc, tables, block,
                                                    pos[:, last:last + 1].contiguous(), d ** -0.5, window, splits,
                                                    k_scale=ks, v_scale=vs, codec=codec)
            assert torch.equal(got[:, :, last:last + 1], step), last


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("name", ["tq4", "tq3"])
def test_reference_reads_tq_pools_as_their_decoded_copy(name):
    q, tables, block, (kc, vc, ks, vs), codec, (k, v) = paged_case(40, 2, 4, 2, 16, name, seed=5)
    pos = torch.arange(30, 34, device=DEVICE)[None].expand(2, -1).contiguous()
    qt = q[:, :, 30:34].contiguous()
    got = attention.paged_decode_attention_reference(qt, kc, vc, tables, block, pos, 0.25, k_scale=ks, v_scale=vs,
                                                     codec=codec)
    assert torch.equal(got, attention.paged_decode_attention_reference(qt, k, v, tables, block, pos, 0.25))
