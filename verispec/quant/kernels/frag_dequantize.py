"""The fragment-order 4-bit weights (frag.py's `repack`) back to values: the inverse of the
word order, and the dequantized matrix in torch (tests, CPUs) or in one Triton kernel (CUDA; the
interpreter on the CPU) for passes too wide for the tensor-core product (prefill), once the
checkpoint's words are released.
"""
from __future__ import annotations

import torch

from verispec.kernels.launch import triton
from verispec.kernels.triton_import import require_triton
from verispec.quant.kernels.frag import BLOCK, TILE_ROWS, FragWeights, fragment_positions

try:  # the dequantizing kernel is plain Triton (it runs in the CPU interpreter too)
    require_triton()
    import triton.language as tl
except ImportError:
    tl = None


def unpack_fragments(fw: FragWeights) -> torch.Tensor:
    """The inverse of `repack`'s word order: values [N, K] uint8 (for tests and the large-M path)."""
    tiles, blocks = fw.words.shape[:2]
    words = fw.words.view(tiles, blocks, 8, 4, 4, 1).to(torch.int64) & 0xFFFFFFFF
    values = (words >> (4 * torch.arange(8, device=words.device))) & 15  # [T, B, g, t, c, j]
    row, position = (p.to(words.device) for p in fragment_positions())
    q = torch.zeros(tiles, blocks, TILE_ROWS, BLOCK, dtype=torch.int64, device=words.device)
    q[:, :, row, position] = values
    return q.transpose(1, 2).reshape(tiles * TILE_ROWS, blocks * BLOCK)[:fw.out_features].to(torch.uint8)


def dequantize(fw: FragWeights, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] in dtype: s*q + o (affine) or (q - z)*s (zero point), computed in float32 with the
    multiply and the add rounded separately, as kernels/dequantize.py computes the checkpoint's
    form (torch here; `dequantize_kernel` on CUDA)."""
    q = unpack_fragments(fw).float()
    n, k = q.shape

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [T, K/group, 8, 2] -> [N, K]
        t = t.permute(0, 3, 2, 1).reshape(-1, t.shape[1])[:n].float()  # row 8h + g of each tile
        return t.repeat_interleave(fw.group_size, dim=1)

    s, o = per_row(fw.terms[..., :2]), per_row(fw.terms[..., 2:])
    return ((q - o) * s if fw.zero_point else q * s + o).to(dtype)


if tl is not None and triton is not None:

    @triton.jit
    def _dequantize_kernel(WQ, T, OUT, N, K: tl.constexpr, GROUP: tl.constexpr, ZERO_POINT: tl.constexpr):
        """One program per (16-row tile, 64-value block): its 128 words -> 1024 values."""
        tile = tl.program_id(0)
        block = tl.program_id(1)
        NB: tl.constexpr = K // 64
        idx = tl.arange(0, 128)  # word: lane 4g + t, word c
        words = tl.load(WQ + (tile.to(tl.int64) * NB + block) * 128 + idx)
        g = idx // 16
        t = idx // 4 % 4
        c = idx % 4
        terms = T + ((tile.to(tl.int64) * (K // GROUP) + block * 64 // GROUP) * 8 + g) * 4
        for j in tl.static_range(8):
            row = g + 8 * (j % 2)
            position = 16 * t + 4 * c + 2 * (j % 4 // 2) + j // 4
            q = ((words >> (4 * j)) & 15).to(tl.float32)
            s = tl.load(terms + j % 2).to(tl.float32)
            o = tl.load(terms + 2 + j % 2).to(tl.float32)
            if ZERO_POINT:
                value = (q - o) * s
            else:
                value = q * s + o
            rows = tile * 16 + row
            tl.store(OUT + rows.to(tl.int64) * K + block * 64 + position, value.to(OUT.dtype.element_ty),
                     mask=rows < N)


def dequantize_kernel(fw: FragWeights, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize` in one Triton kernel (CUDA; the interpreter on the CPU): what wide passes
    (prefill) multiply by once the checkpoint's words are released."""
    out = torch.empty(fw.out_features, fw.in_features, dtype=dtype, device=fw.words.device)
    tiles = -(-fw.out_features // TILE_ROWS)
    _dequantize_kernel[(tiles, fw.in_features // BLOCK)](fw.words, fw.terms, out, fw.out_features,
                                                         K=fw.in_features, GROUP=fw.group_size,
                                                         ZERO_POINT=fw.zero_point, enable_fp_fusion=False)
    return out
