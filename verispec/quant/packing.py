"""Dense little-endian bit packing of b-bit unsigned integers into 32-bit words.

Both MLX (affine mode) and compressed-tensors (pack-quantized) store a row of K b-bit values as
one bitstream: value i occupies bits [i*b, (i+1)*b) counted from bit 0 of word 0, so with b in
{2, 4, 8} no value crosses a word and with b in {3, 5, 6} some do. Packed tensors are kept as
int32 (torch's shifts and Triton both handle it; the bits are the checkpoint's uint32 bits).
"""
from __future__ import annotations

import math
import sys

import torch

POWER_OF_TWO_BITS = (1, 2, 4, 8)


def packed_words(num_values: int, bits: int) -> int:
    """32-bit words holding `num_values` b-bit values."""
    return math.ceil(num_values * bits / 32)


def unpack_rows(packed: torch.Tensor, bits: int, num_values: int) -> torch.Tensor:
    """packed [..., W] int32 (or uint32) -> values [..., num_values] uint8 in [0, 2**bits)."""
    packed = packed.view(torch.int32) if packed.dtype == torch.uint32 else packed
    if bits == 8 and sys.byteorder == "little" and packed.is_contiguous() and packed.shape[-1] * 4 == num_values:
        return packed.view(torch.uint8)  # the words' own bytes, in order (no copy)
    mask = (1 << bits) - 1
    if bits in POWER_OF_TWO_BITS:
        # no value straddles a word: shift each word by every slot's offset at once
        per_word = 32 // bits
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [per_word]
        # an arithmetic shift of int32 copies the sign bit in from the left; the mask removes it
        values = (packed.unsqueeze(-1) >> shifts) & mask  # [..., W, per_word]
        return values.flatten(-2)[..., :num_values].to(torch.uint8)
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [..., W] as unsigned
    bit_start = torch.arange(num_values, device=packed.device, dtype=torch.int64) * bits
    word = bit_start // 32
    shift = bit_start % 32
    low = words[..., word] >> shift
    # the high part of a value that crosses into the next word (shift + bits > 32)
    next_word = torch.clamp(word + 1, max=words.shape[-1] - 1)
    high = words[..., next_word] << (32 - shift)
    crosses = (shift + bits) > 32
    values = torch.where(crosses, low | high, low) & mask
    return values.to(torch.uint8)


PACK_CHUNK_VALUES = 1 << 22  # values packed at a time: the int64 temporaries stay ~100 MiB at most


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values [..., K] integers in [0, 2**bits) -> packed [..., ceil(K*bits/32)] int32. 2-, 4- and
    8-bit rows that fill whole words are packed byte by byte (for 8 bits the words are the values'
    own bytes, shared with `values` when it is contiguous uint8); other rows a chunk at a time
    through int64 temporaries: a whole vocabulary table at once held ~27 bytes a value, the peak of
    a small model's load."""
    if int(values.min()) < 0 or int(values.max()) >= (1 << bits):
        raise ValueError(f"pack_rows: values must lie in [0, {1 << bits}) for {bits} bits")
    k = values.shape[-1]
    if bits in (2, 4, 8) and k % (32 // bits) == 0 and sys.byteorder == "little":
        return _pack_bytes(values, bits)
    rows = values.reshape(-1, k) if values.dim() != 1 else values[None]
    step = max(1, PACK_CHUNK_VALUES // max(k, 1))
    if len(rows) > step:
        out = torch.empty(len(rows), packed_words(k, bits), dtype=torch.int32, device=values.device)
        for start in range(0, len(rows), step):
            out[start:start + step] = _pack(rows[start:start + step], bits)
        return out.reshape(*values.shape[:-1], -1)
    return _pack(values, bits)


def _pack_bytes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The same words where a row fills whole words and no value crosses a byte: each byte holds
    8 / bits values from its low bits up, and four bytes in memory order are one little-endian
    word, so the bytes viewed as int32 are the words (one byte a value of temporaries, no int64)."""
    v = values.to(torch.uint8)
    per_byte = 8 // bits
    if per_byte > 1:
        v = v.reshape(*v.shape[:-1], -1, per_byte)
        packed = v[..., 0].clone()
        for i in range(1, per_byte):
            packed |= v[..., i] << (i * bits)
        v = packed
    v = v.contiguous()
    if v.storage_offset() % 4:  # a view of words must start on a word
        v = v.clone()
    return v.view(torch.int32)


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    k = values.shape[-1]
    num_words = packed_words(k, bits)
    v = values.to(torch.int64)
    bit_start = torch.arange(k, device=values.device, dtype=torch.int64) * bits
    word = bit_start // 32
    shift = bit_start % 32
    out = torch.zeros(*values.shape[:-1], num_words + 1, dtype=torch.int64, device=values.device)
    # disjoint bit fields, so adding them is OR-ing them; the overflow word absorbs the parts
    # of values that cross a word boundary
    out.index_add_(-1, word, (v << shift) & 0xFFFFFFFF)
    crosses = (shift + bits) > 32
    if bool(crosses.any()):
        idx = crosses.nonzero().squeeze(-1)
        out.index_add_(-1, word[idx] + 1, v[..., idx] >> (32 - shift[idx]))
    out = out[..., :num_words]
    # reinterpret the unsigned 32-bit pattern as int32 (two's complement)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)
