"""Integer-dot products for 4-bit and 8-bit group-quantized layers on a CPU (qdot.c beside this file).

The weights stay quantized (GGUF's block layout: a float16 scale and offset and 32 codes a block)
and each activation block of 32 is rounded to int16 with its own scale (max |x| / 32767: finer
than bfloat16's rounding; llama.cpp's int8 activations changed the default model's answers, as
they change llama.cpp's own); the block products are exact integer dot products (AVX2's
`madd` where the CPU has it), summed over K in one order per output whatever the pass's width,
so a row's bits are the same alone, in a batch, in a verify pass and in a prompt chunk
(tests/quant/kernels/test_cpu_qdot.py).

Built at first use by kernels/cpu_build.py (the system's C compiler, -march=native, cached on
disk) into one library with the layer kernel (cpu_library.py); without a compiler the layers run
torch's int4 kernel, the reason logged.
"""
from __future__ import annotations

import torch

from verispec.quant.kernels import cpu_library

BLOCK = 32  # values a block: the activation rounding's and the weight layout's unit
BITS = (4, 8)
BLOCK_BYTES = {4: 4 + 16, 8: 4 + 32}  # float16 scale and offset, then the codes
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


_library = cpu_library.library


def failure() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return _library.failure()


def unsupported_reason(device: torch.device, dtype: torch.dtype, bits: int, group_size: int,
                       in_features: int) -> str | None:
    """Why this layer cannot take the kernel (None: it can)."""
    if device.type != "cpu":
        return f"device {device.type} (a CPU kernel)"
    if dtype not in (torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        return f"activations in {name} (its int16 activation rounding is for float16 / bfloat16 models)"
    if bits not in BITS:
        return f"{bits}-bit weights (it takes 4 and 8)"
    if group_size % BLOCK or in_features % BLOCK:
        return f"group size {group_size}, {in_features} input features (it needs multiples of {BLOCK})"
    if (reason := failure()) is not None:
        return reason
    return None


def _block_scales(scales: torch.Tensor, offsets: torch.Tensor, bits: int, zero_point: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset) a group, float64, as the blocks keep them: a zero point folded into the offset,
    (q - z) * s = q * s - z * s; 8-bit codes signed, the offset re-centred: q*s + o = (q - 128)*s + (o + 128 s)."""
    s, o = scales.double(), offsets.double()
    if zero_point:
        o = -o * s
    if bits == 8:
        o = o + 128 * s
    return s, o


def packable(scales: torch.Tensor, offsets: torch.Tensor, bits: int, zero_point: bool) -> bool:
    """Whether `pack` takes a layer with these scales and offsets (every block's scale and offset,
    as the layout keeps them, exactly a float16)."""
    s, o = _block_scales(scales, offsets, bits, zero_point)
    return torch.equal(s.to(torch.float16).double(), s) and torch.equal(o.to(torch.float16).double(), o)


def pack(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int,
         zero_point: bool) -> torch.Tensor:
    """q [N, K] unsigned codes, scales / offsets [N, K/group_size] (w = q*s + o, or (q - o)*s with a
    zero point) -> the kernel's blocks [N, K/32 * BLOCK_BYTES[bits]] uint8. The caller checks
    `packable` first (once a layer, before any of its rows is converted)."""
    n, k = q.shape
    repeat = group_size // BLOCK
    s, o = (t.repeat_interleave(repeat, dim=1) for t in _block_scales(scales, offsets, bits, zero_point))
    codes = q.to(torch.int16)
    if bits == 8:  # signed codes (the offset re-centred in _block_scales)
        codes = codes - 128
    s16, o16 = s.to(torch.float16), o.to(torch.float16)
    blocks = k // BLOCK
    head = torch.stack([s16, o16], dim=-1).view(torch.uint8).view(n, blocks, 4)
    codes = codes.view(n, blocks, BLOCK)
    if bits == 4:  # byte j: value j in the low nibble, value j + 16 in the high
        codes = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8)
    else:
        codes = codes.to(torch.int8).view(torch.uint8)
    return torch.cat([head, codes], dim=-1).reshape(n, -1).contiguous()


def unpack(blocks: torch.Tensor, bits: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's blocks [N, K/32 * BLOCK_BYTES[bits]] (or some of their rows) -> what `pack` was
    given, for a layer without a zero point, at groups of 32: (q [N, K] uint8, scales, offsets
    [N, K/32] float16), so w = q*s + o decodes as the checkpoint's tensors did (a layer keeps only
    these blocks once they serve every pass)."""
    n, groups = blocks.shape[0], in_features // BLOCK
    rows = blocks.view(n, groups, BLOCK_BYTES[bits])
    head = rows[..., :4].contiguous().view(torch.float16)  # [N, G, 2]: scale, offset
    s, o = head[..., 0], head[..., 1]
    codes = rows[..., 4:]
    if bits == 4:
        q = torch.cat([codes & 0x0F, codes >> 4], dim=-1)
    else:  # signed codes and the re-centred offset back: o = o' - 128 s, exact (pack checked o' was)
        q = (codes.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        o = (o.double() - 128 * s.double()).to(torch.float16)
    return q.reshape(n, in_features), s.contiguous(), o.contiguous()


def decode_rows(packed: torch.Tensor, rows: torch.Tensor, bits: int, in_features: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` [n] (int64) of the kernel's blocks as values [n, K] in `dtype`: the bits
    `unpack` and dequantize.decode_values give them (a tied table's embedding lookup)."""
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), in_features, dtype=dtype)
    if _library.get().qdot_decode_rows(packed.data_ptr(), bits, in_features, packed.shape[0], rows.data_ptr(),
                                       rows.numel(), out.data_ptr(), DTYPE_CODES[dtype]):
        raise IndexError(f"row ids must lie in [0, {packed.shape[0]}): got {rows.tolist()[:8]}")
    return out


def matmul(x: torch.Tensor, packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) -> [M, N] in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=x.dtype)
    code = DTYPE_CODES[x.dtype]
    if _library.get().qdot_linear(x.data_ptr(), code, m, k, packed.data_ptr(), bits, out_features, y.data_ptr(), code,
                                  torch.get_num_threads()):
        raise MemoryError(f"the CPU integer-dot kernel could not allocate its scratch for {m} x {k} activations")
    return y
