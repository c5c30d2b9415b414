"""The engine's one-time choices for quantized layers on CUDA, after loading and merging: which
decode kernel each layer takes (and the copy of its weight that kernel reads), SiLU(gate) * up in
the gate/up product's epilogue, and dropping checkpoint words a copy has replaced. Each choice's
reasons are logged once under VERISPEC_DEBUG=1."""
from __future__ import annotations

import torch
from torch import nn

from verispec import log
from verispec.config import env
from verispec.errors import UnsupportedModelError
from verispec.models.layers.quant_linear import QUANT_KERNEL_ENV, QUANT_KERNELS, QuantizedLinear


def convert_for_builtin_int4(root: nn.Module, dtype: torch.dtype) -> int:
    """Gives every 4-bit layer under `root` that the fragment-order kernel (kernels/quant_frag.py:
    groups of 64 or more) takes its copy in that kernel's layout, and every eligible one the
    tensor-core kernels do not take torch's int4 kernel (kernels/int4_builtin.py) for decode
    and verify passes; the others take the Gluon GEMV (kernels/quant_gemv.py) or the Triton kernel,
    each reason logged once under VERISPEC_DEBUG=1. VERISPEC_QUANT_KERNEL picks: auto (default)
    runs 4-bit layers on the fragment-order kernel, else on quant_mma's (sm_90+, bfloat16 / float16;
    mma: quant_mma's only, keeping no copy), else
    on tinygemm, keeping the checkpoint's words too for wider passes (batches, prefill), at twice
    the quantized weights' memory; builtin gives every 4-bit layer tinygemm and drops the words
    (every pass on tinygemm, which is slow from 16 rows: see docs/benchmarks.md); gemv converts
    nothing and runs 4-bit layers on the GEMV too; triton converts nothing and uses neither the
    GEMV nor tinygemm. Returns how many layers were converted."""
    choice = env().quant_kernel
    if choice not in QUANT_KERNELS:
        raise UnsupportedModelError(f"{QUANT_KERNEL_ENV}={choice!r}: accepted values are {', '.join(QUANT_KERNELS)}")
    if choice in ("gemv", "triton"):
        _log_gemv_reasons(root, dtype)
        return 0
    eligible = [m for m in root.modules() if isinstance(m, QuantizedLinear) and m.int4_packed is None
                and m.frag is None]
    on_frag = _choose(eligible, lambda m: m.frag_reason(m.packed_values().device, dtype), "the fragment-order "
                      "kernel takes decode / verify passes of %d quantized layers", "quantized layers with %s do "
                      "not take the fragment-order kernel")
    for module in on_frag:
        module.use_fragment_order(dtype)
    eligible = [m for m in eligible if m.frag is None]
    on_mma = _choose(eligible, lambda m: m.mma_reason(m.packed_values().device, dtype), "the tensor-core kernel "
                     "takes decode / verify passes of %d quantized layers", "quantized layers with %s do not take "
                     "the tensor-core kernel")
    taken = {id(m) for m in on_mma}
    eligible = [m for m in eligible if id(m) not in taken]
    chosen = _choose(eligible, lambda m: m.builtin_int4_reason(dtype), "torch's int4 kernel (tinygemm) takes %d "
                     "quantized layers", "quantized layers with %s are not given torch's int4 kernel")
    for module in chosen:
        module.use_builtin_int4(release=choice == "builtin")
    _log_gemv_reasons(root, dtype)
    return len(chosen)


def release_converted_checkpoints(root: nn.Module) -> int:
    """Drops the checkpoint's words of every layer under `root` that holds a fragment-order copy
    (after gate_in_products, which reorders rows through them): the copy serves every pass, so the
    quantized weights take their memory once. Returns how many layers were released."""
    layers = [m for m in root.modules() if isinstance(m, QuantizedLinear) and m.frag is not None
              and not m.released()]
    for layer in layers:
        layer.release_checkpoint()
    if layers:
        log.debug("the fragment-order copy alone holds %d quantized layers' weights", len(layers))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # before the KV cache is sized from the free memory
    return len(layers)


def gate_in_products(root: nn.Module, dtype: torch.dtype) -> int:
    """Every gated MLP under `root` whose merged quantized gate/up the tensor-core kernel can
    finish with SiLU(gate) * up takes that path (GatedMLP.gate_in_product: one kernel fewer a
    layer); under VERISPEC_DEBUG=1, how many did and why others did not. Returns the count."""
    # not twice: engines built one after another on one model (a plain and a speculative one) each
    # call this, and a second interleave would scramble the rows
    mlps = [m for m in root.modules() if hasattr(m, "gate_in_product") and not m.gated_product]
    chosen = _choose(mlps, lambda m: m.gate_in_product_reason(dtype), "SiLU(gate) * up runs in the gate/up "
                     "product's epilogue for %d MLPs", "MLPs with %s keep SiLU(gate) * up as its own kernel")
    for mlp in chosen:
        mlp.gate_in_product()
    return len(chosen)


def stream_mlps(root: nn.Module, dtype: torch.dtype) -> int:
    """Every gated MLP under `root` whose 4-bit gate/up (SiLU in its epilogue) and down the
    streaming kernel can run takes it for decode and verify passes (GatedMLP.use_stream: one
    persistent launch for both products, kernels/stream_mlp.py); under VERISPEC_DEBUG=1, how many
    did and why others did not. After the rows are interleaved and the checkpoints released: the
    kernel's descriptors hold the final copies' addresses. Returns the count."""
    mlps = [m for m in root.modules() if hasattr(m, "use_stream") and m.stream is None]
    chosen = _choose(mlps, lambda m: m.stream_reason(dtype), "gate/up -> down runs as one streaming kernel for "
                     "%d MLPs' decode / verify passes", "MLPs with %s keep gate/up and down as two launches")
    for mlp in chosen:
        mlp.use_stream(dtype)
    return len(chosen)


def _log_gemv_reasons(root: nn.Module, dtype: torch.dtype) -> None:
    """Under VERISPEC_DEBUG=1: how many layers run decode / verify passes on the Gluon GEMV, and
    why the others do not (once per reason). Layers tinygemm or the tensor-core kernel took are not
    counted."""
    layers = [m for m in root.modules() if isinstance(m, QuantizedLinear) and m.int4_packed is None
              and m.mma_reason(m.packed_values().device, dtype) is not None]
    _choose(layers, lambda m: m.gemv_reason(m.packed_values().device, dtype), "the Gluon GEMV takes decode / "
            "verify passes of %d quantized layers", "quantized layers with %s keep the Triton dequant-matmul "
            "kernel for decode passes")


def _choose(layers: list[QuantizedLinear], reason_of, taken: str, refused: str) -> list[QuantizedLinear]:
    """The layers `reason_of` has no objection to; under VERISPEC_DEBUG=1, their count (`taken`)
    and each objection once (`refused`)."""
    chosen, reasons = [], set()
    for layer in layers:
        reason = reason_of(layer)
        if reason is None:
            chosen.append(layer)
        elif reason not in reasons:
            reasons.add(reason)
            log.debug(refused, reason)
    if chosen:
        log.debug(taken, len(chosen))
    return chosen
