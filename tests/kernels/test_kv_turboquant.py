"""The TurboQuant-class codec (kernels/kv_turboquant.py; not served yet): the rotation is orthogonal,
the Lloyd-Max codebook is what the literature gives for these bits, encode/decode against float64
stays within the codebook's bound, packing round-trips, and attention over the codes (query
rotated, keys never un-rotated) equals attention over their decoded copy."""
from __future__ import annotations

import math

import pytest
import torch

from verispec.kernels import kv_turboquant as tq
from verispec.kernels.decode_attention import decode_attention_reference

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
