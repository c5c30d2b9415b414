"""Which kernel a quantized layer runs, decided once per layer, device and dtype (the measured rule
of docs/quantization.md), and `prepare`, the load-time step that applies it to a model.

The rule for a group-quantized linear's decode and verify passes (up to 8 rows), first that takes
the layer:
1. FRAG: 4-bit, groups of 64 or more, on sm_90+ in bfloat16 / float16: the fragment-order
   tensor-core kernel (kernels/frag.py) on a copy repacked at load; the checkpoint's words are
   then dropped, and passes of 9-32 rows run it 8 rows a launch;
2. MMA: 4-bit, groups of 32: the tensor-core kernel on the checkpoint's words (kernels/mma.py);
3. TINYGEMM: 4-bit layers neither takes (GPUs before sm_90, K not a multiple of 128), bfloat16:
   torch's int4 kernel on a copy in its layout (kernels/int4_builtin.py), the words kept;
4. GEMV: 2 / 4 / 8-bit on CUDA with Gluon: the GEMV on the checkpoint's words (kernels/gemv.py);
then, for wider passes up to 128 rows (and decode passes nothing above took), the dequantizing
Triton product (kernels/matmul.py) on CUDA, and beyond that (prefill) the weight dequantized into
one GEMM. On a CPU one kernel runs every pass of a layer (bfloat16 and float16 activations): QDOT,
our integer-dot kernel on 4 / 8-bit groups of multiples of 32 (GGUF's Q4_0 / Q4_1 / Q8_0 among
them; kernels/cpu_qdot.py), else TINYGEMM on 4-bit groups of 32-256 (no C compiler, scales that
are not float16); other layers dequantize into one GEMM.
Every kernel here sums a row the same way whatever the pass's width, so speculative verify equals
plain decode row by row.

A layer keeps its choice (`Bound`), so a pass costs a row count and a call: forward never asks
the rule again for the same device and dtype. Each fallback's reason is logged under
VERISPEC_DEBUG=1, once per reason.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
from enum import Enum
from typing import Callable

import torch
from torch import nn

from verispec import log
from verispec.quant.kernels import cpu_qdot, exact, frag, gemv, int4_builtin, matmul, mma, stream_mlp
from verispec.quant.layers.linear import MLXAffineEmbedding, QuantizedLinear
from verispec.quant.layers.mlp import GatedProduct, gated_mlps

# passes up to this many rows run the fragment-order kernel 8 rows a launch (each launch reads the
# weight once: 4 launches still beat dequantizing the whole weight for one GEMM); wider ones (prefill)
# dequantize the fragment-order copy
FRAG_CHUNKED_MAX_ROWS = 32


class Kernel(str, Enum):
    FRAG = "frag"  # kernels/frag.py on the fragment-order copy
    MMA = "mma"  # kernels/mma.py on the checkpoint's words
    TINYGEMM = "tinygemm"  # torch's int4 kernel on its own copy (kernels/int4_builtin.py)
    GEMV = "gemv"  # kernels/gemv.py on the checkpoint's words
    TRITON = "triton"  # kernels/matmul.py, dequantizing inside the product
    DEQUANTIZE = "dequantize"  # the whole weight dequantized, one GEMM
    EXACT = "exact"  # kernels/exact.py: one summation order at every row count (exact numerics)
    QDOT = "qdot"  # the CPU integer-dot kernel on its own copy (kernels/cpu_qdot.py)


# ---- the rule -----------------------------------------------------------------------------------
def frag_reason(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this layer does not get a fragment-order copy (None: it does)."""
    return frag.unsupported_reason(device, dtype, layer.bits, layer.group_size, layer.in_features)


def mma_reason(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this layer's decode / verify passes cannot take the tensor-core kernel on its words."""
    return mma.unsupported_reason(device, dtype, layer.bits, layer.group_size, layer.in_features)


def tinygemm_reason(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this layer does not get a copy for torch's int4 kernel (None: it does)."""
    return int4_builtin.unsupported_reason(device, dtype, layer.bits, layer.group_size, layer.out_features,
                                           layer.in_features)


def qdot_reason(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this layer does not get a copy for the CPU integer-dot kernel (None: it does)."""
    return cpu_qdot.unsupported_reason(device, dtype, layer.bits, layer.group_size, layer.in_features)


def gemv_reason(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this layer's decode / verify passes cannot take the Gluon GEMV."""
    return gemv.unsupported_reason(device, dtype, layer.bits, layer.group_size)


def triton_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why passes of up to 128 rows cannot take the dequantizing Triton product."""
    if not matmul.available(device):
        return f"device {device.type}" if device.type != "cuda" else "Triton is not installed"
    if dtype == torch.float64:
        return "float64 activations"
    return None


def choose(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> tuple[Kernel, list[str]]:
    """The kernel the rule gives this layer's decode and verify passes on `device` in `dtype`, and
    why each kernel ahead of it did not take the layer."""
    reasons = []
    rule = ((Kernel.FRAG, frag_reason), (Kernel.MMA, mma_reason), (Kernel.TINYGEMM, tinygemm_reason),
            (Kernel.GEMV, gemv_reason))
    if device.type == "cpu":
        rule = ((Kernel.QDOT, qdot_reason),) + rule
    for kernel, reason_of in rule:
        reason = reason_of(layer, device, dtype)
        if reason is None:
            return kernel, reasons
        reasons.append(f"not {kernel.value}: {reason}")
    reason = triton_reason(device, dtype)
    if reason is None:
        return Kernel.TRITON, reasons
    reasons.append(f"not triton: {reason}")
    return Kernel.DEQUANTIZE, reasons


def silu_gate_reason(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this merged [gate; up] layer's decode / verify passes cannot apply SiLU(gate) * up in a
    tensor-core kernel's epilogue (None: they can, once interleave_gate_up ran)."""
    if layer.frag is None and (reason := mma_reason(layer, device, dtype)):
        return reason
    if layer.bias is not None:
        return "a bias (added before the activation)"
    if layer.int4_packed is not None:
        return "a tinygemm copy of the weight"
    chunk = layer.gate_chunk_for_kernel()
    if layer.out_features % (2 * chunk):
        return f"{layer.out_features // 2} intermediate features (not a multiple of {chunk})"
    return None


# ---- binding: the kernels a layer keeps ---------------------------------------------------------
def _frag(layer, x):
    return frag.frag_gemv(x, layer.frag)


def _frag_pieces(layer, x):
    # 8 rows a launch; a row's result does not depend on the launch's other rows
    return torch.cat([frag.frag_gemv(part, layer.frag) for part in x.split(frag.MAX_ROWS)])


def _frag_gated(layer, x):
    return frag.frag_gemv(x, layer.frag, silu_gate=True)


def _mma(layer, x):
    return mma.mma_gemv(x, layer.packed_values(), layer.group_scales(), layer.group_offsets(), layer.bits,
                        layer.group_size, layer.zero_point)


def _mma_gated(layer, x):
    return mma.mma_gemv(x, layer.packed_values(), layer.group_scales(), layer.group_offsets(), layer.bits,
                        layer.group_size, layer.zero_point, silu_gate=True)


def _tinygemm(layer, x):
    return int4_builtin.matmul(x.contiguous(), layer.int4_packed, layer.group_size, layer.int4_scale_zero)


def _qdot(layer, x):
    return cpu_qdot.matmul(x, layer.qdot_blocks, layer.bits, layer.out_features)


def _gemv(layer, x):
    return gemv.gemv(x, layer.packed_values(), layer.group_scales(), layer.group_offsets(), layer.bits,
                     layer.group_size, layer.zero_point)


def _exact(layer, x):
    return exact.exact_linear(x, layer.packed_values(), layer.group_scales(), layer.group_offsets(), layer.bits,
                              layer.group_size, layer.zero_point)


def _triton(layer, x):
    return matmul.dequant_matmul(x, layer.packed_values(), layer.group_scales(), layer.group_offsets(), layer.bits,
                                 layer.group_size, layer.zero_point)


Run = Callable[[QuantizedLinear, torch.Tensor], torch.Tensor]  # (layer, x [M, K]) -> y [M, N]


@dataclasses.dataclass(frozen=True)
class Bound:
    """A layer's kernels for activations on `device` in `dtype`: a pass of M rows runs the first
    step whose width is at least M, a wider one (prefill) the dequantized weight in one GEMM;
    `gated` (up to `gated_rows`) writes SiLU(gate) * up of an interleaved gate/up layer."""
    device: torch.device
    dtype: torch.dtype
    steps: tuple[tuple[int, Kernel, Run], ...]  # (widest pass, kernel, its call), narrowest first
    gated: Run | None = None
    gated_rows: int = 0
    reasons: tuple[str, ...] = ()  # why faster kernels did not take the layer

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        """The kernels by pass width, the dequantized GEMM last."""
        return tuple(kernel for _, kernel, _ in self.steps) + (Kernel.DEQUANTIZE,)

    def kernel_for(self, rows: int) -> Run | None:
        """The call for a pass of `rows` rows; None: the dequantized weight's GEMM."""
        for widest, _, run in self.steps:
            if rows <= widest:
                return run
        return None


def bind(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> Bound:
    """The kernels `layer` keeps for activations on `device` in `dtype`, from the copies `prepare`
    made (a tinygemm or fragment-order copy) and, for a layer without one, the rule's kernels that
    read the checkpoint's words (MMA, GEMV). A layer marked `exact` (exact numerics) runs
    kernels/exact.py at every row count where it can."""
    steps, reasons = [], []
    if layer.exact and not layer.released():
        if (reason := exact.unsupported_reason(device, dtype, layer.bits)) is None:
            return Bound(device, dtype, ((sys.maxsize, Kernel.EXACT, _exact),))
        reasons.append(f"not exact: {reason}")
    copy = layer.frag if layer.frag_terms is not None and layer.frag_terms.dtype == dtype else None
    if layer.qdot_blocks is not None and qdot_reason(layer, device, dtype) is None:
        return Bound(device, dtype, ((sys.maxsize, Kernel.QDOT, _qdot),))  # every pass: row invariant
    if layer.int4_packed is not None and int4_builtin.activation_reason(device, dtype) is None:
        if device.type == "cpu":  # every pass: row invariant at every width, and the fastest at each
            return Bound(device, dtype, ((int4_builtin.max_rows(device), Kernel.TINYGEMM, _tinygemm),))
        steps.append((int4_builtin.MAX_ROWS, Kernel.TINYGEMM, _tinygemm))
    elif copy is not None:
        steps += [(frag.MAX_ROWS, Kernel.FRAG, _frag), (FRAG_CHUNKED_MAX_ROWS, Kernel.FRAG, _frag_pieces)]
    elif layer.released():  # only a fragment-order copy in another dtype holds the weight
        terms = layer.frag_terms.dtype if layer.frag_terms is not None else None
        reasons.append(f"the fragment-order copy's terms are {terms}, the activations {dtype}")
    elif (reason := mma_reason(layer, device, dtype)) is None:
        steps.append((mma.MAX_ROWS, Kernel.MMA, _mma))
    elif (reason_gemv := gemv_reason(layer, device, dtype)) is None:
        reasons.append(f"not mma: {reason}")
        steps.append((gemv.MAX_ROWS, Kernel.GEMV, _gemv))
    else:
        reasons += [f"not mma: {reason}", f"not gemv: {reason_gemv}"]
    if not layer.released():
        if (reason := triton_reason(device, dtype)) is None:
            steps.append((matmul.FUSED_MAX_ROWS, Kernel.TRITON, _triton))
        else:
            reasons.append(f"not triton: {reason}")
    gated, gated_rows = None, 0
    if layer.gate_chunk:
        if copy is not None:
            gated, gated_rows = _frag_gated, frag.MAX_ROWS
        elif layer.frag_words is None and silu_gate_reason(layer, device, dtype) is None:
            # mma's epilogue expects its own chunks of 16, not the fragment-order copy's 8
            gated, gated_rows = _mma_gated, mma.MAX_ROWS
    return Bound(device, dtype, tuple(steps), gated, gated_rows, tuple(reasons))


# ---- prepare: the load-time step ----------------------------------------------------------------
def prepare(model: nn.Module, dtype: torch.dtype | None = None, exact_numerics: bool = False) -> None:
    """Applies the rule to every quantized layer of `model` (after loading and after the model's
    projections were merged, so one copy serves a merged layer), before the KV cache is sized from
    the free memory. On a CPU: the copies for TINYGEMM layers, which then run every pass (so
    exact numerics hold with them too). On CUDA, in this order: the copies for FRAG and TINYGEMM
    layers, SiLU(gate) * up in merged gate/up products (the rows interleaved through the copy),
    the checkpoint's words a fragment-order copy replaced dropped, gate/up -> down as one
    streaming launch where it runs (its descriptors hold the final copies' addresses); then every
    layer binds its kernels. Safe to
    call again on the same model: nothing is converted twice. With `exact_numerics` every layer
    keeps the checkpoint's words and binds kernels/exact.py (no copies: their kernels sum in their
    own orders)."""
    param = next(model.parameters(), None)
    if param is None:
        return
    device, dtype = param.device, dtype or param.dtype
    logged: set[str] = set()  # each fallback's reason once
    if exact_numerics:
        for layer in _quantized_linears(model):
            layer.exact = True
    if device.type == "cpu":
        make_copies(model, dtype, logged)  # row invariant at every width: exact numerics hold too
    elif device.type == "cuda" and not exact_numerics:
        make_copies(model, dtype, logged)
        gate_in_products(model, dtype)
        release_converted_checkpoints(model)
        stream_mlps(model, dtype)
    bind_all(model, device, dtype, logged)


def _quantized_linears(root: nn.Module) -> list[QuantizedLinear]:
    return [m for m in root.modules() if isinstance(m, QuantizedLinear)]


def make_copies(root: nn.Module, dtype: torch.dtype, logged: set[str] | None = None) -> int:
    """Gives every layer the rule puts on FRAG its fragment-order copy, every one it puts on
    TINYGEMM tinygemm's copy and every one it puts on QDOT that kernel's blocks (layers that have
    one are left alone). Returns how many copies."""
    made, logged = collections.Counter(), set() if logged is None else logged
    tables = _untied_tables(root)
    # the largest first: a copy coexists with its checkpoint until that is released, and a CPU
    # load's peak is the vocabulary table's two forms beside everything else (the smaller layers'
    # freed words stay in glibc's heap, so converting them first raised the floor under it)
    for layer in sorted(_quantized_linears(root), key=lambda m: m.checkpoint_bytes(), reverse=True):
        if layer.int4_packed is not None or layer.frag is not None or layer.qdot_blocks is not None:
            continue
        device = layer.packed_values().device
        kernel, reasons = choose(layer, device, dtype)
        # a vocabulary tied to a table: its words go as its blocks are made (release_for_qdot drops
        # them after; the table then looks its rows up in the blocks)
        tied = not layer.zero_point and bool(_sharing(layer, tables))
        if kernel is Kernel.QDOT and (reason := layer.use_qdot(discard_checkpoint=tied)) is not None:
            reasons.append(f"not {Kernel.QDOT.value}: {reason}")
            kernel = Kernel.TINYGEMM if tinygemm_reason(layer, device, dtype) is None else Kernel.DEQUANTIZE
        elif kernel is Kernel.QDOT:
            release_for_qdot(layer, tables)
        if device.type == "cpu":  # the CUDA kernels' reasons say nothing there
            reasons = [r for r in reasons if r.startswith((f"not {Kernel.QDOT.value}", f"not {Kernel.TINYGEMM.value}"))]
        _log_once(logged, reasons)
        if kernel is Kernel.FRAG:
            layer.use_fragment_order(dtype)
        elif kernel is Kernel.TINYGEMM:
            layer.use_builtin_int4()
        elif kernel is not Kernel.QDOT:  # QDOT's copy was made above
            continue
        made[kernel] += 1
    for kernel, count in made.items():
        log.debug("%d quantized layers take a copy for the %s kernel", count, kernel.value)
    return sum(made.values())


def _untied_tables(root: nn.Module) -> list[MLXAffineEmbedding]:
    """The MLX-affine embedding tables under `root` that still hold their own tensors."""
    return [m for m in root.modules() if isinstance(m, MLXAffineEmbedding) and m.qdot_blocks is None]


def release_for_qdot(layer: QuantizedLinear, tables: list[MLXAffineEmbedding]) -> None:
    """Drops the checkpoint's tensors of a layer whose integer-dot blocks now serve every pass (a
    CPU) as soon as they are made, so the weights take their memory once and the load's peak holds
    one layer's two forms at most; a table tied to it (one of `tables`) then looks its rows up in
    the blocks. A layer with a zero point keeps its tensors (its blocks fold the zero point into
    the offset, which decodes in another order)."""
    if layer.zero_point or layer.released():
        return
    for table in _sharing(layer, tables):
        table.look_up_in(layer.qdot_blocks)
    layer.release_checkpoint()


def _sharing(layer: QuantizedLinear, tables: list[MLXAffineEmbedding]) -> list[MLXAffineEmbedding]:
    """The tables (of `tables`) that hold `layer`'s words as their own (a tied vocabulary)."""
    words = layer.packed_values().data_ptr()
    return [t for t in tables if t.qdot_blocks is None and t.weight.numel() and t.weight.data_ptr() == words]


def release_converted_checkpoints(root: nn.Module) -> int:
    """Drops the checkpoint's words of every layer under `root` that holds a fragment-order copy
    (after gate_in_products, which reorders rows through them): the copy serves every pass, so the
    quantized weights take their memory once. Returns how many layers were released."""
    layers = [m for m in _quantized_linears(root) if m.frag is not None and not m.released()]
    for layer in layers:
        layer.release_checkpoint()
    if layers:
        log.debug("the fragment-order copy alone holds %d quantized layers' weights", len(layers))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # before the KV cache is sized from the free memory
    return len(layers)


def gate_in_product_reason(mlp: nn.Module, dtype: torch.dtype) -> str | None:
    """Why a gated MLP's SiLU(gate) * up cannot run in its merged gate/up product's kernel (None: it can)."""
    layer = mlp.gate_up_proj
    if mlp.act is not torch.nn.functional.silu:
        return "an activation other than SiLU"
    if not isinstance(layer, QuantizedLinear):
        return "no merged quantized gate/up projection"
    return silu_gate_reason(layer, layer.packed_values().device, dtype)


def gate_in_products(root: nn.Module, dtype: torch.dtype) -> int:
    """Every gated MLP under `root` whose merged quantized gate/up a tensor-core kernel can finish
    with SiLU(gate) * up takes that path (one kernel fewer a layer: +2-6% on Qwen3-8B 4-bit
    decode): its rows are interleaved and the MLP runs a GatedProduct. Returns the count."""
    # a model prepared twice keeps its rows: a second interleave would scramble them
    mlps = [m for m in gated_mlps(root) if m.kernel is None]
    chosen = _choose(mlps, lambda m: gate_in_product_reason(m, dtype), "SiLU(gate) * up runs in the gate/up "
                     "product's epilogue for %d MLPs", "MLPs with %s keep SiLU(gate) * up as its own kernel")
    for mlp in chosen:
        mlp.gate_up_proj.interleave_gate_up()
        mlp.kernel = GatedProduct(mlp)
    return len(chosen)


def stream_reason(mlp: nn.Module, dtype: torch.dtype) -> str | None:
    """Why a gated MLP's gate_up -> down cannot run as one launch of the streaming kernel (None: it can)."""
    if not isinstance(mlp.kernel, GatedProduct):
        return "SiLU(gate) * up outside the gate/up product"
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    frags = [getattr(layer, "frag", None) for layer in (gate_up, down)]
    if any(f is None for f in frags):
        return "a gate/up or down projection without a 4-bit fragment-order copy"
    if gate_up.bias is not None or down.bias is not None:
        return "biases"
    if getattr(down, "shard", None) is not None:  # its forward all-reduces; the kernel would skip that
        return "a row-parallel down projection (tensor parallelism)"
    if any(f.terms.dtype != dtype for f in frags):
        return "fragment-order copies in another dtype than the activations'"
    return stream_mlp.unsupported_reason(*frags, frags[0].words.device, dtype)


def stream_mlps(root: nn.Module, dtype: torch.dtype) -> int:
    """Every gated MLP under `root` whose 4-bit gate/up (SiLU in its epilogue) and down the
    streaming kernel can run takes it for decode and verify passes (one persistent launch for both
    products, quant/kernels/stream_mlp.py: +4.3% on Qwen3-8B 4-bit decode). After the rows are
    interleaved and the checkpoints released: the kernel's descriptors hold the final copies'
    addresses. Returns the count."""
    # a model prepared twice keeps its streams (their descriptors hold the copies' addresses)
    mlps = [m for m in gated_mlps(root) if not (isinstance(m.kernel, GatedProduct) and m.kernel.stream is not None)]
    chosen = _choose(mlps, lambda m: stream_reason(m, dtype), "gate/up -> down runs as one streaming kernel for "
                     "%d MLPs' decode / verify passes", "MLPs with %s keep gate/up and down as two launches")
    for mlp in chosen:
        mlp.kernel.stream = stream_mlp.StreamMLP(mlp.gate_up_proj.frag, mlp.down_proj.frag, dtype)
    return len(chosen)


def bind_all(root: nn.Module, device: torch.device, dtype: torch.dtype,
             logged: set[str] | None = None) -> collections.Counter:
    """Binds every quantized linear under `root`; under VERISPEC_DEBUG=1, how many layers each
    decode kernel took and each reason a layer fell back, once. Returns the counts by kernel."""
    counts, logged = collections.Counter(), set() if logged is None else logged
    for layer in _quantized_linears(root):
        bound = layer.bind(device, dtype)
        counts[bound.kernels[0]] += 1
        if device.type == "cuda":  # on a CPU make_copies logged why a layer has no copy
            _log_once(logged, bound.reasons)
    if counts:
        log.debug("quantized layers' decode / verify kernels: %s",
                  ", ".join(f"{kernel.value} x{count}" for kernel, count in counts.items()))
    return counts


def _log_once(logged: set, reasons) -> None:
    for reason in reasons:
        if reason not in logged:
            logged.add(reason)
            log.debug("quantized layers fall back: %s", reason)


def _choose(items: list, reason_of, taken: str, refused: str) -> list:
    """The items `reason_of` has no objection to; under VERISPEC_DEBUG=1, their count (`taken`)
    and each objection once (`refused`)."""
    chosen, reasons = [], set()
    for item in items:
        reason = reason_of(item)
        if reason is None:
            chosen.append(item)
        elif reason not in reasons:
            reasons.add(reason)
            log.debug(refused, reason)
    if chosen:
        log.debug(taken, len(chosen))
    return chosen
