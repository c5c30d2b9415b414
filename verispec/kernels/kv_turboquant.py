"""TurboQuant-class KV codes (`tq4`, `tq3`; arXiv 2504.19874, its MSE variant): the codec, the
reference attention over the codes, and the rows as the paged pools store them (`LayerCodec`:
packed codes and a float32 scale per row and head, encoded and decoded alike by torch and by the
Triton kernels; docs/serving.md#kv-cache-compression).

A row x [D] (one token's key or value of one kv head) is stored as its norm (float32) and D codes:
the row is turned by a fixed random rotation R = H diag(s) / sqrt(D) (H the Walsh-Hadamard matrix,
s random signs per layer), scaled to the unit sphere times sqrt(D), and each coordinate is rounded
to the nearest centroid of a Lloyd-Max codebook. Why this works: after a random rotation every
coordinate of a unit vector has the same known distribution, density proportional to
(1 - t^2 / D)^((D - 3) / 2) for t in (-sqrt(D), sqrt(D)) at this scale (close to a standard normal),
so one codebook, derived once for that density, is MSE-optimal for every coordinate of every row,
with no per-block scale and nothing that depends on other rows.

Attention never un-rotates keys: q . k = (R q) . (R k), so the query is rotated once and dotted
with the decoded rotated keys; the values are summed in the rotated basis and the output rotated
back once (R is orthogonal).

Formats: tq4 = 4-bit keys and 4-bit values (D/2 + 4 bytes a row); tq3 = 4-bit keys and 3-bit values
(keys get the extra bit: a key's error moves every softmax weight, a value's only its own term; the
issue's peers found keys need more bits than values). Unmeasured on real models so far.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch functions stand in
    triton = None
    tl = None


@dataclass(frozen=True)
class TurboQuantFormat:
    name: str
    key_bits: int
    value_bits: int

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """One layer's K and V of one token: packed codes plus a float32 norm per head and tensor."""
        return num_kv_heads * ((self.key_bits + self.value_bits) * head_dim // 8 + 8)


FORMATS = {"tq4": TurboQuantFormat("tq4", 4, 4), "tq3": TurboQuantFormat("tq3", 4, 3)}


def coordinate_density(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Unnormalised density of one coordinate of a uniform unit vector in R^dim, scaled by sqrt(dim)."""
    inside = (1 - t * t / dim).clamp(min=0)
    return inside ** ((dim - 3) / 2)


@lru_cache(maxsize=None)
def codebook(bits: int, dim: int) -> torch.Tensor:
    """The 2^bits Lloyd-Max centroids (float64, ascending) of `coordinate_density`: alternately
    each boundary the midpoint of its centroids, each centroid its cell's mean, on a fine grid."""
    limit = math.sqrt(dim)
    t = torch.linspace(-min(limit, 8.0), min(limit, 8.0), 200_001, dtype=torch.float64)
    weight = coordinate_density(t, dim)
    levels = 2 ** bits
    # start from the quantiles' midpoints
    cdf = torch.cumsum(weight, 0) / weight.sum()
    centroids = t[torch.searchsorted(cdf, (torch.arange(levels, dtype=torch.float64) + 0.5) / levels)]
    for _ in range(1000):
        bounds = (centroids[1:] + centroids[:-1]) / 2
        cell = torch.bucketize(t, bounds)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight)
        moment = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight * t)
        updated = moment / mass
        updated = (updated - updated.flip(0)) / 2  # the density is even: so is the codebook
        if torch.allclose(updated, centroids, atol=1e-12, rtol=0):
            break
        centroids = updated
    return centroids


def rotation_signs(layer: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """The layer's fixed random signs s [D] (+-1, float32): the same for every row of the layer."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"TurboQuant codes need a power-of-two head dim, got {head_dim}")
    gen = torch.Generator().manual_seed(seed * 100_003 + layer)
    return torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the unnormalised Walsh-Hadamard matrix H (entries +-1), in x's dtype: log2(D)
    stages of sums and differences of pairs h apart, the order the Triton `_butterfly` adds in."""
    d = x.shape[-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(x.shape)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the orthonormal Walsh-Hadamard matrix H / sqrt(D) (symmetric, its own inverse)."""
    return butterfly(x) / math.sqrt(x.shape[-1])


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R x = H (s * x) / sqrt(D) along the last dim."""
    return hadamard(x * signs.to(x.dtype))


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R^T y = s * (H y) / sqrt(D)."""
    return hadamard(y) * signs.to(y.dtype)


def encode(x: torch.Tensor, signs: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] uint8 in 0..2^bits-1, norms [...] float32)."""
    d = x.shape[-1]
    xf = x.double()
    norms = xf.norm(dim=-1)
    unit = rotate(xf, signs) * (math.sqrt(d) / torch.where(norms > 0, norms, 1.0))[..., None]
    centroids = codebook(bits, d)
    codes = torch.bucketize(unit, (centroids[1:] + centroids[:-1]) / 2)
    return codes.to(torch.uint8), norms.float()


def decode_rotated(codes: torch.Tensor, norms: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows still in the rotated basis (what attention reads): centroid x norm / sqrt(D)."""
    d = codes.shape[-1]
    centroids = codebook(bits, d).to(dtype)
    return centroids[codes.long()] * (norms.to(dtype) / math.sqrt(d))[..., None]


def decode(codes: torch.Tensor, norms: torch.Tensor, signs: torch.Tensor, bits: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., D], norms [...] -> the rows [..., D] in `dtype`."""
    return unrotate(decode_rotated(codes, norms, bits, dtype), signs)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] (D a multiple of 8) -> bytes [..., D * bits / 8], little-endian bit order."""
    d = codes.shape[-1]
    groups = codes.long().reshape(*codes.shape[:-1], d // 8, 8)
    word = (groups << (torch.arange(8, device=codes.device) * bits)).sum(-1)  # 8 codes in 8 * bits bits
    out = torch.stack([(word >> (8 * i)) & 0xFF for i in range(bits)], dim=-1)
    return out.reshape(*codes.shape[:-1], d * bits // 8).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack`: bytes [..., D * bits / 8] -> codes [..., D] uint8."""
    groups = packed.long().reshape(*packed.shape[:-1], -1, bits)
    word = (groups << (torch.arange(bits, device=packed.device) * 8)).sum(-1)
    codes = (word[..., None] >> (torch.arange(8, device=packed.device) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def attention_reference(q: torch.Tensor, key_codes: torch.Tensor, key_norms: torch.Tensor, value_codes: torch.Tensor,
                        value_norms: torch.Tensor, signs: torch.Tensor, fmt: TurboQuantFormat, scale: float,
                        positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] at positions [B, T] over one layer's coded rows (codes [B, Hkv, S, D], norms
    [B, Hkv, S]): the query rotated once, scores against the rotated keys, values summed rotated and
    the output rotated back once. -> [B, Hq, T, D] in q's dtype (float32 at least inside)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // key_codes.shape[1]
    keys = decode_rotated(key_codes, key_norms, fmt.key_bits, compute).repeat_interleave(group, dim=1)
    values = decode_rotated(value_codes, value_norms, fmt.value_bits, compute).repeat_interleave(group, dim=1)
    scores = torch.einsum("bhtd,bhsd->bhts", rotate(q.to(compute), signs), keys) * scale
    key_pos = torch.arange(keys.shape[2], device=q.device)
    allowed = key_pos[None, None, :] <= positions[:, :, None]
    if window is not None:
        allowed &= key_pos[None, None, :] > positions[:, :, None] - window
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bhts,bhsd->bhtd", scores.softmax(-1), values)
    return unrotate(out, signs).to(q.dtype)


# ---- the rows as the paged pools store them -------------------------------------------------------
# A pool row is the packed codes (D * bits / 8 bytes) and one float32 scale = |x| / sqrt(D), so a
# decoded coordinate is centroid x scale: one float32 product, rounded once to the activations'
# dtype, the same in torch and in a kernel's registers. Encoding is float32 with every sum in a
# fixed order (the butterfly's stages; the squared norm as the first output of a butterfly over the
# squares, a pairwise tree) and no division (a coordinate's cell is found by comparing H s x with
# boundary x |x|), so the torch path and the write kernels store the same bits.


@dataclass(frozen=True, eq=False)
class RowCode:
    """One tensor's (keys' or values') code: its bits and float32 tables on the pools' device."""
    bits: int
    centroids: torch.Tensor  # [2^bits] ascending
    bounds: torch.Tensor  # [2^bits - 1] the midpoints between centroids


@dataclass(frozen=True, eq=False)
class LayerCodec:
    """What writing or reading one layer's tq rows takes: the format, the layer's signs [D] and the
    key and value codes."""
    fmt: TurboQuantFormat
    signs: torch.Tensor  # [D] float32 +-1
    key: RowCode
    value: RowCode
    head_dim: int = field(default=0)

    @classmethod
    def build(cls, fmt: TurboQuantFormat, layer: int, head_dim: int, device: torch.device | str) -> LayerCodec:
        if head_dim % 8:
            raise ValueError(f"TurboQuant codes need a head dim that is a multiple of 8, got {head_dim}")
        signs = rotation_signs(layer, head_dim).to(device)

        def code(bits: int) -> RowCode:
            centroids = codebook(bits, head_dim)
            return RowCode(bits, centroids.float().to(device), ((centroids[1:] + centroids[:-1]) / 2).float().to(device))
        return cls(fmt, signs, code(fmt.key_bits), code(fmt.value_bits), head_dim)

    @property
    def inv_sqrt_d(self) -> float:
        """1 / sqrt(D) as the float32 that scales are multiplied by."""
        return float(torch.tensor(1 / math.sqrt(self.head_dim), dtype=torch.float32))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """R x in float32 (a query before attention over the rotated rows), back in x's dtype."""
        return rotate(x.float(), self.signs).to(x.dtype)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """R^T y in float32 (attention's output, summed in the rotated basis), back in y's dtype."""
        return unrotate(y.float(), self.signs).to(y.dtype)


def encode_rows(x: torch.Tensor, signs: torch.Tensor, code: RowCode, inv_sqrt_d: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed codes [..., D * bits / 8] uint8, scales [...] float32): the torch path of
    the write kernels (`encode_tile` below), bit for bit."""
    xf = x.float() * signs
    y = butterfly(xf)  # sqrt(D) R x
    # rounded once from float64: torch's float32 sqrt on a CPU is not always correctly rounded (Triton's sqrt_rn is)
    norm = butterfly(xf * xf)[..., 0].double().sqrt().float()
    codes = (y[..., None] > code.bounds * norm[..., None, None]).sum(-1)
    return pack(codes, code.bits), norm * inv_sqrt_d


def decode_rows(packed: torch.Tensor, scales: torch.Tensor, code: RowCode, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows -> R x in `dtype` [..., D] (still rotated): what the kernels decode in registers."""
    codes = unpack(packed, code.bits)
    return (code.centroids[codes.long()] * scales[..., None]).to(dtype)


if triton is not None:

    @triton.jit
    def _stage(x, M: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
        """One butterfly stage: each pair (j, j + H) of every 2H-long run becomes (a + b, a - b)."""
        y = tl.permute(tl.reshape(x, (M, D // (2 * H), 2, H)), (0, 1, 3, 2))
        a, b = tl.split(y)
        return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (M, D))

    @triton.jit
    def _butterfly(x, M: tl.constexpr, D: tl.constexpr):
        """x [M, D] times H along its rows, the stages of the torch `butterfly` (head dims up to
        1024; spelled out because a compiled loop cannot rebind a constexpr stage width)."""
        tl.static_assert(D <= 1024)
        if D > 1:
            x = _stage(x, M, D, 1)
        if D > 2:
            x = _stage(x, M, D, 2)
        if D > 4:
            x = _stage(x, M, D, 4)
        if D > 8:
            x = _stage(x, M, D, 8)
        if D > 16:
            x = _stage(x, M, D, 16)
        if D > 32:
            x = _stage(x, M, D, 32)
        if D > 64:
            x = _stage(x, M, D, 64)
        if D > 128:
            x = _stage(x, M, D, 128)
        if D > 256:
            x = _stage(x, M, D, 256)
        if D > 512:
            x = _stage(x, M, D, 512)
        return x

    @triton.jit
    def encode_tile(x, SIGNS, BOUNDS, inv_sqrt_d, M: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
        """Rows x [M, D] -> (codes [M, D] int32, scales [M] float32), bit for bit `encode_rows`."""
        d = tl.arange(0, D)
        xf = x.to(tl.float32) * tl.load(SIGNS + d)[None, :]
        y = _butterfly(xf, M, D)
        squares = _butterfly(xf * xf, M, D)
        norm = tl.sqrt_rn(tl.sum(tl.where(d[None, :] == 0, squares, 0.0), 1))  # column 0 alone: exact
        codes = tl.zeros([M, D], tl.int32)
        for j in tl.static_range(0, (1 << BITS) - 1):
            codes += (y > tl.load(BOUNDS + j) * norm[:, None]).to(tl.int32)
        return codes, norm * inv_sqrt_d

    @triton.jit
    def store_packed(dst, codes, mask, M: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
        """codes [M, D] packed as `pack` packs them: row m's bytes from dst[m] ([M] pointers) on."""
        groups = tl.reshape(codes, (M, D // 8, 8)).to(tl.int64)
        word = tl.sum(groups << (tl.arange(0, 8) * BITS)[None, None, :], 2)  # disjoint bits: exact
        g = tl.arange(0, D // 8)
        for i in tl.static_range(0, BITS):
            tl.store(dst[:, None] + g[None, :] * BITS + i, ((word >> (8 * i)) & 0xFF).to(tl.uint8),
                     mask=mask[:, None])

    @triton.jit
    def decode_tile(base, offsets, offs_d, mask, scales, CENTROIDS, BITS: tl.constexpr, dtype: tl.constexpr):
        """Packed rows at base + offsets [N] -> their coordinates offs_d [BD] in `dtype` ([N, BD];
        0 where not `mask`), the bits of `decode_rows`: centroid x scale [N] in float32."""
        bit = offs_d * BITS
        shift = bit % 8
        ptrs = base + offsets[:, None] + (bit // 8)[None, :]
        word = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        if 8 % BITS != 0:  # a code may run into the next byte
            word |= tl.load(ptrs + 1, mask=mask & (shift[None, :] > 8 - BITS), other=0).to(tl.int32) << 8
        codes = (word >> shift[None, :]) & ((1 << BITS) - 1)
        return tl.where(mask, tl.load(CENTROIDS + codes) * scales[:, None], 0.0).to(dtype)
