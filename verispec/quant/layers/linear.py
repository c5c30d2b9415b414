"""Linear and embedding layers over group-quantized weights, holding the checkpoint's tensors
under the checkpoint's own names (so loading is a copy, no conversion step).

Packed values are int32 buffers (the uint32 bits of the file); scales and offsets are float
parameters, so `next(model.parameters())` still gives the model's dtype. Which kernel a layer's
passes run is decided once per device and dtype (`bind`, by the rule in quant/dispatch.py, see
docs/quantization.md), not per call: `forward` runs the bound kernels. Each format names its
tensors itself (`MLXAffineLinear`: weight / scales / biases; `PackedIntLinear`: compressed-tensors'
weight_packed / weight_scale / weight_zero_point).
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch
import torch.nn.functional as F
from torch import nn

from verispec import host_libc, log
from verispec.errors import UnsupportedModelError
from verispec.quant.kernels import cpu_qdot, dequantize, frag as frag_kernel, frag_dequantize, int4_builtin
from verispec.quant.kernels import mma as mma_kernel
from verispec.quant.packing import pack_rows, packed_words, unpack_rows

QDOT_PACK_VALUES = 1 << 18  # weights converted to the integer-dot blocks at a time (use_qdot): ~2 MiB of temporaries


def drop_tensors(module: nn.Module, names) -> None:
    """Each named tensor of `module` becomes an empty one of its dtype and kind (a parameter stays
    a parameter), so its memory goes once nothing else holds it."""
    for name in names:
        old = getattr(module, name)
        empty = torch.empty(0, dtype=old.dtype, device=old.device)
        setattr(module, name, nn.Parameter(empty, requires_grad=False) if isinstance(old, nn.Parameter) else empty)


def release_converted_rows(words: torch.Tensor, rows: int) -> int:
    """Hands the pages of words[:rows] back to the system (madvise DONTNEED: they read as zeros
    after), where words is the whole of its own contiguous storage on a CPU under Linux; its
    caller never reads those rows again. Returns the bytes handed back."""
    if (words.device.type != "cpu" or not words.is_contiguous() or words.storage_offset()
            or words.untyped_storage().nbytes() != words.numel() * words.element_size()):
        return 0
    libc = host_libc.library() if sys.platform.startswith("linux") else None  # pages read as zeros: Linux's madvise
    if libc is None or not hasattr(libc, "madvise"):
        return 0
    page = mmap.PAGESIZE
    start = -(-words.data_ptr() // page) * page
    end = (words.data_ptr() + rows * words.stride(0) * words.element_size()) // page * page
    if end <= start:
        return 0
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
    return end - start


MADV_DONTNEED = 4  # Linux's



def decode_qdot(blocks: torch.Tensor, bits: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the integer-dot kernel's blocks -> [rows, K] in `dtype`: the values the checkpoint's
    tensors decoded to (a layer without a zero point), once the blocks alone hold the weight."""
    q, scales, offsets = cpu_qdot.unpack(blocks, bits, in_features)
    return dequantize.decode_values(q, scales, offsets, False, dtype)


def debug_once(module: nn.Module, message: str) -> None:
    """A fallback's reason under VERISPEC_DEBUG=1, once per layer (not once per token)."""
    if not getattr(module, "_fallback_logged", False):
        module._fallback_logged = True
        log.debug("%s: %s", type(module).__name__, message)


def float_param(*shape: int) -> nn.Parameter:
    """An uninitialised float parameter (filled by the loader); no shape gives a scalar."""
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W)^T + bias for W [out_features, in_features] stored as b-bit groups.

    Subclasses provide `group_scales()` and `group_offsets()` ([N, K/group_size]),
    `packed_values()` ([N, W] int32) and `zero_point` (False: w = q*s + o; True: w = (q - o)*s)."""

    bits: int
    group_size: int
    zero_point: bool = False
    checkpoint_buffers: tuple[str, ...] = ()  # integer tensors the loader copies in like parameters
    gate_chunk: int = 0  # > 0: a merged [gate; up] layer's rows interleaved in chunks (interleave_gate_up)

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = float_param(out_features) if bias else None
        # tinygemm's layout and its [K/group, N, 2] bfloat16 (scale, zero) pairs, once use_builtin_int4
        # ran; buffers, so .to() moves them and the roofline counts them
        self.register_buffer("int4_packed", None, persistent=False)
        self.register_buffer("int4_scale_zero", None, persistent=False)
        # the CPU integer-dot kernel's blocks (kernels/cpu_qdot.py), once use_qdot ran
        self.register_buffer("qdot_blocks", None, persistent=False)
        # the fragment-order copy of a 4-bit weight (kernels/frag.py), once use_fragment_order ran
        self.register_buffer("frag_words", None, persistent=False)
        self.register_buffer("frag_terms", None, persistent=False)
        self.bound = None  # dispatch.Bound: this layer's kernels for one device and dtype (`bind`)
        self.exact = False  # exact numerics: one summation order at every row count (quant/kernels/exact.py)

    @property
    def frag(self) -> frag_kernel.FragWeights | None:
        """The fragment-order copy as the kernel takes it (None before use_fragment_order): the
        frag_* buffers and this layer's shape and quantization."""
        if self.frag_words is None:
            return None
        return frag_kernel.FragWeights(self.frag_words, self.frag_terms, self.out_features, self.in_features,
                                       self.group_size, self.zero_point)

    # the tensors of one format; overridden per format
    def packed_values(self) -> torch.Tensor:
        raise NotImplementedError

    def group_scales(self) -> torch.Tensor:
        raise NotImplementedError

    def group_offsets(self) -> torch.Tensor:
        raise NotImplementedError

    def finish_loading(self) -> None:
        """Checks and derived tensors once the checkpoint's tensors are in place."""

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        """The packed values, scales and offsets as attributes (released after conversion)."""
        raise NotImplementedError

    def released(self) -> bool:
        """The checkpoint's tensors were dropped for the fragment-order copy (release_checkpoint)."""
        return self.packed_values().numel() == 0

    def checkpoint_bytes(self) -> int:
        return sum(getattr(self, name).numel() * getattr(self, name).element_size()
                   for name in self.checkpoint_tensor_names())

    def use_builtin_int4(self) -> None:
        """Keeps a copy of the weight in tinygemm's layout (kernels/int4_builtin.py) for decode and
        verify passes; wider passes keep the checkpoint's words (tinygemm is slow from 16 rows)."""
        q = unpack_rows(self.packed_values(), self.bits, self.in_features)  # [N, K]
        self.int4_packed = int4_builtin.pack(q)
        self.int4_scale_zero = int4_builtin.scales_and_zeros(self.group_scales(), self.group_offsets(),
                                                             self.zero_point)
        self.bound = None

    def use_qdot(self, discard_checkpoint: bool = False) -> str | None:
        """Keeps a copy of the weight in the CPU integer-dot kernel's blocks (kernels/cpu_qdot.py) for
        every pass; None, or why the weight has no such copy (a scale or offset not a float16).
        discard_checkpoint: the caller releases the checkpoint's words once the blocks are made, so
        their pages go back to the system as the rows are converted (release_converted_rows): a
        vocabulary's two forms are not held whole side by side."""
        packed, scales, offsets = self.packed_values(), self.group_scales(), self.group_offsets()
        if not cpu_qdot.packable(scales, offsets, self.bits, self.zero_point):
            return "scales or offsets that are not exactly float16 (the kernel's blocks keep float16)"
        step = max(1, QDOT_PACK_VALUES // self.in_features)  # rows at a time: a vocabulary's temporaries stay small
        blocks = None
        for start in range(0, self.out_features, step):
            rows = slice(start, start + step)
            q = unpack_rows(packed[rows], self.bits, self.in_features)  # [rows, K]
            piece = cpu_qdot.pack(q, scales[rows], offsets[rows], self.bits, self.group_size, self.zero_point)
            if blocks is None:
                blocks = piece.new_empty(self.out_features, piece.shape[1])
            blocks[rows] = piece
            if discard_checkpoint:
                release_converted_rows(packed, min(start + step, self.out_features))
        self.qdot_blocks = blocks
        self.bound = None
        return None

    def use_fragment_order(self, dtype: torch.dtype) -> None:
        """Keeps a copy of the weight in the fragment-order kernel's layout (kernels/frag.py,
        scales and offsets in `dtype`) for decode and verify passes; wider passes keep the
        checkpoint's words until release_checkpoint."""
        frag = frag_kernel.repack(self.packed_values(), self.group_scales(), self.group_offsets(), self.group_size,
                                  self.zero_point, dtype)
        self.frag_words, self.frag_terms = frag.words, frag.terms
        self.bound = None

    def release_checkpoint(self) -> None:
        """Drops the checkpoint's tensors once a copy that serves every pass holds the weight (the
        fragment-order copy on CUDA, the integer-dot blocks on a CPU; an embedding sharing them
        keeps its own reference)."""
        drop_tensors(self, self.checkpoint_tensor_names())
        self.bound = None

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`, decoded in float32 (float64 for a float64 model); what prefill multiplies by."""
        if self.qdot_blocks is not None and self.released():  # the same values, from the kernel's blocks
            return decode_qdot(self.qdot_blocks, self.bits, self.in_features, dtype)
        if (frag := self.frag) is not None and self.released():
            if frag.words.device.type == "cuda" and frag_dequantize.tl is not None and dtype != torch.float64:
                return frag_dequantize.dequantize_kernel(frag, dtype)
            return frag_dequantize.dequantize(frag, dtype)
        return dequantize.decode(self.packed_values(), self.group_scales(), self.group_offsets(), self.bits,
                                 self.group_size, self.zero_point, dtype)

    def bind(self, device: torch.device, dtype: torch.dtype):
        """Decides this layer's kernels for activations on `device` in `dtype` (quant/dispatch.py)
        and keeps them: forward asks again only for another device or dtype."""
        from verispec.quant import dispatch

        self.bound = dispatch.bind(self, device, dtype)
        return self.bound

    def _kernels_for(self, x: torch.Tensor):
        bound = self.bound
        if bound is None or bound.dtype != x.dtype or bound.device != x.device:
            bound = self.bind(x.device, x.dtype)  # a layer outside the loader's `prepare`, or moved
            if bound.reasons and x.device.type == "cuda":
                debug_once(self, "; ".join(bound.reasons))
        return bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        bound = self._kernels_for(x)
        rows = x.numel() // self.in_features
        run = bound.kernel_for(rows)
        if run is None:  # the dequantized weight, one GEMM (CPU; prefill)
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        y = run(self, x.reshape(rows, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def silu_gated(self, x: torch.Tensor, gated) -> torch.Tensor:  # x: [..., K] -> SiLU(gate) * up [..., N/2]
        """After interleave_gate_up: decode / verify passes in a tensor-core kernel with the
        activation in its epilogue where one is bound; other passes multiply, take the chunks
        apart and apply `gated(gate, up)` (the MLP's own SiLU(gate) * up, as it runs unmerged)."""
        bound = self._kernels_for(x)
        rows = x.numel() // self.in_features
        half = self.out_features // 2
        if bound.gated is not None and rows <= bound.gated_rows:
            return bound.gated(self, x.reshape(rows, self.in_features)).view(*x.shape[:-1], half)
        y = self(x).view(*x.shape[:-1], half // self.gate_chunk, 2, self.gate_chunk)
        gate, up = y[..., 0, :].reshape(*x.shape[:-1], half), y[..., 1, :].reshape(*x.shape[:-1], half)
        return gated(gate, up)

    def gate_chunk_for_kernel(self) -> int:
        """Gate rows (then as many up rows) one program of the decode kernel holds."""
        return frag_kernel.GATE_CHUNK if self.frag is not None else mma_kernel.GATE_CHUNK

    def interleave_gate_up(self) -> None:
        """Reorders the rows of a merged [gate (I rows); up (I rows)] layer into chunks of gate rows,
        the same rows of up, and so on (8 for the fragment-order kernel, 16 for the mma kernel): one
        program of the decode kernel then holds both halves of its outputs and writes SiLU(gate) *
        up (`silu_gated`)."""
        if self.gate_chunk:
            raise RuntimeError("interleave_gate_up: the rows are interleaved already")
        chunk, half = self.gate_chunk_for_kernel(), self.out_features // 2
        order = torch.arange(self.out_features).view(2, half // chunk, chunk).transpose(0, 1).reshape(-1)
        self.reorder_rows(order)
        self.gate_chunk = chunk
        self.bound = None

    def reorder_rows(self, order: torch.Tensor) -> None:
        """Output row i becomes what row order[i] was (words, scales, offsets and bias alike)."""
        if self.released():
            raise RuntimeError("reorder_rows: the checkpoint's words were released (reorder before converting)")
        for name in self.row_tensor_names() + (("bias",) if self.bias is not None else ()):
            old = getattr(self, name)
            new = old[order.to(old.device)].contiguous()
            setattr(self, name, nn.Parameter(new, requires_grad=False) if isinstance(old, nn.Parameter) else new)
        if self.frag_terms is not None:  # the copy follows the rows
            self.use_fragment_order(self.frag_terms.dtype)
        self.bound = None

    def row_tensor_names(self) -> tuple[str, ...]:
        """The [N, ...] tensors that follow the output rows."""
        return self.checkpoint_tensor_names()

    def same_quantization(self, other: "QuantizedLinear") -> bool:
        return (type(self) is type(other) and self.bits == other.bits and self.group_size == other.group_size
                and self.in_features == other.in_features and (self.bias is None) == (other.bias is None))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


class MLXAffineLinear(QuantizedLinear):
    """MLX affine layout (verispec/quant/mlx_affine.py): weight [N, K*bits/32] packed,
    scales and biases [N, K/group_size]; w = scales * q + biases."""

    checkpoint_buffers = ("weight",)

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.bits, self.group_size = bits, group_size
        self.register_buffer("weight", torch.empty(out_features, packed_words(in_features, bits), dtype=torch.int32))
        num_groups = in_features // group_size
        self.scales = float_param(out_features, num_groups)
        self.biases = float_param(out_features, num_groups)

    def packed_values(self) -> torch.Tensor:
        return self.weight

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        return ("weight", "scales", "biases")

    def group_scales(self) -> torch.Tensor:
        return self.scales

    def group_offsets(self) -> torch.Tensor:
        return self.biases

    @classmethod
    def concat_rows(cls, layers: list["MLXAffineLinear"]) -> "MLXAffineLinear":
        """One layer computing several that read the same input (outputs concatenated)."""
        first = layers[0]
        with torch.device("meta"):  # every tensor is replaced below
            merged = cls(first.in_features, sum(l.out_features for l in layers), first.bits, first.group_size,
                         bias=first.bias is not None)
        merged.weight = torch.cat([l.weight for l in layers])
        merged.scales = nn.Parameter(torch.cat([l.scales for l in layers]), requires_grad=False)
        merged.biases = nn.Parameter(torch.cat([l.biases for l in layers]), requires_grad=False)
        if first.bias is not None:
            merged.bias = nn.Parameter(torch.cat([l.bias for l in layers]), requires_grad=False)
        return merged


class PackedIntTensors:
    """compressed-tensors' pack-quantized tensors of a [rows, cols] weight, registered on a module:
    weight_packed [rows, ceil(cols*bits/32)], weight_scale [rows, cols/group], weight_shape [2],
    weight_zero_point [ceil(rows*bits/32), cols/group] (asymmetric only), and the unsigned zero
    points `zeros` [rows, cols/group] derived once loaded (`finish`)."""

    @staticmethod
    def register(module: nn.Module, rows: int, cols: int, bits: int, group_size: int, symmetric: bool) -> None:
        num_groups = cols // group_size
        module.register_buffer("weight_packed", torch.empty(rows, packed_words(cols, bits), dtype=torch.int32))
        module.weight_scale = float_param(rows, num_groups)
        module.register_buffer("weight_shape", torch.empty(2, dtype=torch.int64))
        if not symmetric:
            module.register_buffer("weight_zero_point", torch.empty(packed_words(rows, bits), num_groups,
                                                                    dtype=torch.int32))
        # unsigned zero points in the scales' dtype (exact: integers below 256), derived once loaded
        module.register_buffer("zeros", torch.empty(rows, num_groups), persistent=False)

    @staticmethod
    def finish(module: nn.Module, rows: int, cols: int, what: str) -> None:
        shape = tuple(int(v) for v in module.weight_shape.tolist())
        if shape != (rows, cols):
            raise UnsupportedModelError(f"weight_shape {shape} of a compressed-tensors {what} does not match its "
                                        f"[{rows}, {cols}]")
        module.zeros = unsigned_zero_points(module.weight_scale, getattr(module, "weight_zero_point", None),
                                            module.bits, module.symmetric)


def unsigned_zero_points(scale: torch.Tensor, packed_zero_points: torch.Tensor | None, bits: int,
                         symmetric: bool) -> torch.Tensor:
    """compressed-tensors' zero points as unsigned values [N, G] in the scales' dtype (exact:
    integers below 256): 2**(bits-1) when symmetric, else unpacked from their N-packed words."""
    if symmetric:
        zeros = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        # packed along N: unpack each group's column of zero points
        zeros = unpack_rows(packed_zero_points.T.contiguous(), bits, scale.shape[0]).T
    return zeros.to(device=scale.device, dtype=scale.dtype).contiguous()


class PackedIntLinear(QuantizedLinear):
    """compressed-tensors pack-quantized layout (verispec/quant/compressed_tensors.py):
    weight_packed [N, ceil(K*bits/32)], weight_scale [N, K/group_size], weight_zero_point
    [ceil(N*bits/32), K/group_size] packed along N (asymmetric only), weight_shape [2];
    w = (u - u_z) * scale on the unsigned values u (u_z = 2**(bits-1) when symmetric)."""

    zero_point = True
    checkpoint_buffers = ("weight_packed", "weight_zero_point", "weight_shape")

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, symmetric: bool,
                 bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        PackedIntTensors.register(self, out_features, in_features, bits, group_size, symmetric)

    def packed_values(self) -> torch.Tensor:
        return self.weight_packed

    def checkpoint_tensor_names(self) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale", "zeros") + (() if self.symmetric else ("weight_zero_point",))

    def group_scales(self) -> torch.Tensor:
        return self.weight_scale

    def group_offsets(self) -> torch.Tensor:
        return self.zeros

    def finish_loading(self) -> None:
        PackedIntTensors.finish(self, self.out_features, self.in_features, "layer")

    def row_tensor_names(self) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale", "zeros")  # the N-packed zero points are packed again

    def reorder_rows(self, order: torch.Tensor) -> None:
        super().reorder_rows(order)
        if not self.symmetric:
            self.weight_zero_point = pack_rows(self.zeros.T.to(torch.int64), self.bits).T.contiguous()

    @classmethod
    def concat_rows(cls, layers: list["PackedIntLinear"]) -> "PackedIntLinear":
        """One layer computing several that read the same input (outputs concatenated)."""
        first = layers[0]
        symmetric = all(l.symmetric for l in layers)
        with torch.device("meta"):  # every tensor is replaced below
            merged = cls(first.in_features, sum(l.out_features for l in layers), first.bits, first.group_size,
                         symmetric, bias=first.bias is not None)
        merged.weight_packed = torch.cat([l.weight_packed for l in layers])
        merged.weight_scale = nn.Parameter(torch.cat([l.weight_scale for l in layers]), requires_grad=False)
        merged.weight_shape = torch.tensor([merged.out_features, merged.in_features], device=first.weight_shape.device)
        merged.zeros = torch.cat([l.zeros for l in layers])
        if not symmetric:
            merged.weight_zero_point = pack_rows(merged.zeros.T.to(torch.int64), first.bits).T.contiguous()
        if first.bias is not None:
            merged.bias = nn.Parameter(torch.cat([l.bias for l in layers]), requires_grad=False)
        return merged


class MLXAffineEmbedding(nn.Module):
    """An MLX-quantized embedding table [V, H]: looks up only the rows it needs and decodes them.
    `as_linear()` gives the tied lm_head over the same tensors."""

    checkpoint_buffers = ("weight",)

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, group_size: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.bits, self.group_size = bits, group_size
        self.register_buffer("weight", torch.empty(num_embeddings, packed_words(embedding_dim, bits), dtype=torch.int32))
        num_groups = embedding_dim // group_size
        self.scales = float_param(num_embeddings, num_groups)
        self.biases = float_param(num_embeddings, num_groups)
        self.register_buffer("qdot_blocks", None, persistent=False)  # look_up_in: the tied head's, on a CPU

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        rows = input_ids.reshape(-1)
        if self.qdot_blocks is not None:  # the tied head's integer-dot blocks hold the table alone
            w = cpu_qdot.decode_rows(self.qdot_blocks, rows, self.bits, self.embedding_dim, self.scales.dtype)
        else:
            w = dequantize.decode_torch(self.weight[rows], self.scales[rows], self.biases[rows], self.bits,
                                        self.group_size, False, self.scales.dtype)
        return w.view(*input_ids.shape, self.embedding_dim)

    def look_up_in(self, blocks: torch.Tensor) -> None:
        """Rows are decoded from the tied head's integer-dot blocks (cpu_qdot.unpack: the same
        values), and this table's own tensors are dropped with the head's."""
        self.qdot_blocks = blocks
        drop_tensors(self, ("weight", "scales", "biases"))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole table [V, H] in `dtype`."""
        return self(torch.arange(self.num_embeddings, device=self.weight.device)).to(dtype)

    def as_linear(self) -> MLXAffineLinear:
        """An lm_head sharing this table's tensors (tie_word_embeddings)."""
        with torch.device("meta"):  # its tensors are the table's
            head = MLXAffineLinear(self.embedding_dim, self.num_embeddings, self.bits, self.group_size)
        head.weight = self.weight
        head.scales, head.biases = self.scales, self.biases
        return head

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}"


class PackedIntEmbedding(nn.Module):
    """A compressed-tensors pack-quantized embedding table [V, H] (llm-compressor with an
    `Embedding` target): PackedIntLinear's tensors and decoding, but only the looked-up rows are
    decoded."""

    checkpoint_buffers = ("weight_packed", "weight_zero_point", "weight_shape")

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, group_size: int, symmetric: bool):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        PackedIntTensors.register(self, num_embeddings, embedding_dim, bits, group_size, symmetric)

    def finish_loading(self) -> None:
        PackedIntTensors.finish(self, self.num_embeddings, self.embedding_dim, "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        rows = input_ids.reshape(-1)
        w = dequantize.decode_torch(self.weight_packed[rows], self.weight_scale[rows], self.zeros[rows], self.bits,
                              self.group_size, True, self.weight_scale.dtype)
        return w.view(*input_ids.shape, self.embedding_dim)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole table [V, H] in `dtype`."""
        return self(torch.arange(self.num_embeddings, device=self.weight_packed.device)).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}"
