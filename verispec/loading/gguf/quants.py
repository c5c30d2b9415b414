"""GGUF tensor data -> torch: dense types as they are, the 32-block quants as an affine description
(what the quantized-weights layer can take over), every other supported quant through the `gguf`
library's own dequantization.

Affine form (MLX's): w[r, c] = scales[r, g] * q[r, c] + biases[r, g] with g = c // group_size and q
unsigned. GGUF's 32-blocks map onto it exactly:
- Q8_0: w = d * s (s int8)            -> q = s + 128 (8 bits), scale d, bias -128 d;
- Q4_0: w = d * (n - 8) (n a nibble)  -> q = n (4 bits), scale d, bias -8 d;
- Q4_1: w = d * n + m                 -> q = n (4 bits), scale d, bias m.
With d and m float16 values (exact in float32) and q of at most 8 bits, scales * q and the bias are
exact in float32, so `dequantize()` reproduces the library's float32 values bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verispec.errors import UnsupportedModelError

DENSE_TYPES = ("F32", "F16", "BF16")
AFFINE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}  # the types unpacked here, and their codes' width
AFFINE_TYPES = tuple(AFFINE_BITS)
# dequantized with gguf.quants.dequantize (numpy), then used as dense weights
LIBRARY_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = DENSE_TYPES + AFFINE_TYPES + LIBRARY_TYPES
GROUP_SIZE = 32  # the block size of Q8_0 / Q4_0 / Q4_1


@dataclass
class AffineQuantized:
    """A weight [rows, cols] (or an expert stack [E, rows, cols]) in MLX's affine form (module
    docstring), unpacked: one q value per byte in natural column order, so a quantized linear layer
    can pack it as its kernel wants."""

    q: torch.Tensor  # [..., rows, cols] uint8, values in [0, 2**bits)
    scales: torch.Tensor  # [..., rows, cols // group_size] float32 (float16 values from the file)
    biases: torch.Tensor  # [..., rows, cols // group_size] float32
    bits: int
    group_size: int = GROUP_SIZE

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """[..., rows, cols] float32."""
        *lead, cols = self.q.shape
        groups = self.q.view(*lead, cols // self.group_size, self.group_size).to(torch.float32)
        w = groups * self.scales[..., None] + self.biases[..., None]
        return w.reshape(self.q.shape)

    def take_rows(self, index: torch.Tensor) -> "AffineQuantized":
        """The same weight with its rows reordered (index [rows]): groups run along columns, so a
        row permutation moves q, scales and biases alike."""
        return AffineQuantized(self.q[index], self.scales[index], self.biases[index], self.bits, self.group_size)


def tensor_type_name(tensor) -> str:
    return tensor.tensor_type.name


def logical_shape(tensor) -> tuple[int, ...]:
    """The torch shape of a GGUF tensor (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def read_tensor(tensor) -> torch.Tensor | AffineQuantized:
    """A gguf ReaderTensor -> a float tensor (dense and library-dequantized types, float32 except
    F16 / BF16 which keep their dtype) or an AffineQuantized (Q8_0 / Q4_0 / Q4_1)."""
    name = tensor_type_name(tensor)
    shape = logical_shape(tensor)
    data = np.asarray(tensor.data)
    if name == "F32":
        return torch.from_numpy(data.astype(np.float32, copy=True)).reshape(shape)
    if name == "F16":
        return torch.from_numpy(data.astype(np.float16, copy=True)).reshape(shape)
    if name == "BF16":
        raw = np.ascontiguousarray(data).view(np.int16).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    if name in AFFINE_TYPES:
        return _affine(name, data, shape)
    if name in LIBRARY_TYPES:
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(data, tensor.tensor_type).copy()).reshape(shape)
    raise UnsupportedModelError(f"GGUF tensor {tensor.name} has type {name}, which is not supported "
                                f"(supported: {', '.join(SUPPORTED_TYPES)})")


def dense(value: torch.Tensor | AffineQuantized) -> torch.Tensor:
    return value.dequantize() if isinstance(value, AffineQuantized) else value


def _affine(name: str, data: np.ndarray, shape: tuple[int, ...]) -> AffineQuantized:
    """Unpack Q8_0 / Q4_0 / Q4_1 blocks (data [..., rows, bytes per row] uint8) into the affine form;
    an expert stack [E, rows, cols] is unpacked as E * rows rows, since blocks never cross a row."""
    if len(shape) not in (2, 3):
        raise UnsupportedModelError(f"a {name} tensor of shape {shape} is neither a matrix nor an expert stack "
                                    f"(2-D and 3-D {name} are supported)")
    if len(shape) == 3:
        experts, rows, cols = shape
        flat = _affine(name, np.ascontiguousarray(data).reshape(experts * rows, -1), (experts * rows, cols))
        return AffineQuantized(*(t.reshape(experts, rows, -1) for t in (flat.q, flat.scales, flat.biases)), flat.bits)
    rows, cols = shape
    num_groups = cols // GROUP_SIZE
    blocks = np.ascontiguousarray(data).reshape(rows, num_groups, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, groups]
    if name == "Q8_0":
        # int8 code c stored as c + 128 in a byte: flipping the sign bit, in place on one copy (a
        # vocabulary table's int16 temporaries were most of a small model's load peak)
        q = blocks[..., 2:34].copy().view(np.uint8)
        np.bitwise_xor(q, np.uint8(0x80), out=q)
        bits, bias = 8, -128.0 * d
    else:
        if name == "Q4_0":
            packed, bias = blocks[..., 2:18], -8.0 * d
        else:  # Q4_1
            packed = blocks[..., 4:20]
            bias = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        # byte j of a block holds element j in its low nibble and element j + 16 in its high one
        q, bits = np.concatenate([packed & 0x0F, packed >> 4], axis=-1), 4
    return AffineQuantized(torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols)),
                           torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(bias, dtype=np.float32)), bits)
