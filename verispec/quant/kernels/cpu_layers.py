"""Whole Llama-family decoder layers on a CPU in one call (cpu_layers.c beside this file): the
norms, RoPE, the paged KV write, attention and the gated MLP around integer-dot products over the
layers' quantized blocks (cpu_qdot.py's layout), every layer of a range in one OpenMP region
(cpu_pool.h).

Why: in torch a decode step of the default model (SmolLM2-135M, 30 layers) is ~2,400 small ops of
a few microseconds each (casts, views, norms, RoPE, per-row attention) around 120 products, and
those ops, not the products, held the step to a third of llama.cpp's speed (docs/benchmarks.md).
The layer's arithmetic and its rounding points are the torch layer's (models/llama.py); each row
is computed alone, in one order, so its bits do not depend on the pass it is in.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from verispec.quant.kernels import cpu_library, cpu_qdot

DTYPE_CODES = {torch.float16: cpu_qdot.DTYPE_CODES[torch.float16], torch.bfloat16: cpu_qdot.DTYPE_CODES[torch.bfloat16]}
MAX_HEAD_DIM = 512


class Product(ctypes.Structure):
    _fields_ = [("blocks", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("bits", ctypes.c_int),
                ("n", ctypes.c_int), ("k", ctypes.c_int)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Product), ("o", Product), ("gate_up", Product), ("down", Product),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("window", ctypes.c_int)]


class Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int), ("dtype", ctypes.c_int),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class Pass(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int), ("positions", ctypes.c_void_p), ("write_slots", ctypes.c_void_p),
                ("block_tables", ctypes.c_void_p), ("table_width", ctypes.c_int), ("block_size", ctypes.c_int),
                ("rows_per_sequence", ctypes.c_int), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]


_library = cpu_library.library


def failure() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return _library.failure()


@dataclass
class ProductWeights:
    """One quantized product: its integer-dot blocks (cpu_qdot.pack) and optional bias."""
    blocks: torch.Tensor
    bits: int
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None

    def struct(self) -> Product:
        bias = self.bias.data_ptr() if self.bias is not None else None
        return Product(self.blocks.data_ptr(), bias, self.bits, self.out_features, self.in_features)


@dataclass
class LayerWeights:
    qkv: ProductWeights
    o: ProductWeights
    gate_up: ProductWeights  # [gate; up] rows
    down: ProductWeights
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    window: int | None


@dataclass
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class Layers:
    """A model's decoder layers as the kernel takes them; the pools' addresses are bound per cache."""

    def __init__(self, shape: Shape, layers: list[LayerWeights], dtype: torch.dtype):
        self.shape, self.layers, self.dtype = shape, layers, dtype
        self.dims = Dims(shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate,
                         DTYPE_CODES[dtype], shape.eps, shape.scale)
        self._bound: tuple[list, list, ctypes.Array] | None = None

    def _structs(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> ctypes.Array:
        """The layers' structs with these pools (built once per set of pools). The pools' lists are
        known by identity (held here, so neither can be freed and another take its id): a PagedPools
        keeps its tensors for its life, and reading 60 addresses at each of a step's calls cost more
        than the rest of the call's Python."""
        if self._bound is None or self._bound[0] is not keys or self._bound[1] is not values:
            array = (Layer * len(self.layers))()
            for i, w in enumerate(self.layers):
                array[i] = Layer(w.qkv.struct(), w.o.struct(), w.gate_up.struct(), w.down.struct(),
                                 w.input_norm.data_ptr(), w.post_norm.data_ptr(),
                                 w.q_norm.data_ptr() if w.q_norm is not None else None,
                                 w.k_norm.data_ptr() if w.k_norm is not None else None,
                                 keys[i].data_ptr(), values[i].data_ptr(), w.window or 0)
            self._bound = (keys, values, array)
        return self._bound[2]

    def run(self, start: int, stop: int, x: torch.Tensor, update: torch.Tensor | None, cos: torch.Tensor,
            sin: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, block_tables: torch.Tensor,
            block_size: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers start..stop-1 on x [B, T, H] (the residual stream) and update (the previous
        layer's MLP output not yet added; None before the first layer), at positions [B, T] whose
        keys and values go to pool rows write_slots [B * T], sequence b's keys read through
        block_tables[b]. keys / values: every layer's pools [slots, Hkv, D]. Returns new (x, update)."""
        b, t, _ = x.shape
        x = x.contiguous().clone()
        update_out = update.contiguous().clone() if update is not None else torch.empty_like(x)
        positions = positions.contiguous()
        write_slots, block_tables = write_slots.contiguous(), block_tables.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        structs = self._structs(keys, values)
        layers = ctypes.addressof(structs) + start * ctypes.sizeof(Layer)
        the_pass = Pass(b * t, positions.data_ptr(), write_slots.data_ptr(), block_tables.data_ptr(),
                        block_tables.shape[1], block_size, t, cos.data_ptr(), sin.data_ptr())
        max_keys = max(int(positions.max()) + 1, 1)  # padding rows may sit at negative positions
        status = _library.get().decoder_layers(ctypes.addressof(self.dims), layers, stop - start, ctypes.addressof(the_pass),
                                               x.data_ptr(), update_out.data_ptr(), int(update is not None),
                                               max_keys, torch.get_num_threads())
        if status:
            raise MemoryError(f"the CPU layer kernel could not allocate its scratch for {b * t} rows (status {status})")
        return x, update_out
