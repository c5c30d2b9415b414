"""Which numerics a model runs (docs/serving.md, "Exact numerics"): "exact", where a token's K/V,
logits and sample do not depend on the pass it is computed in (batch, speculation, prompt chunking,
prefix cache, preemption), or "fast"; and why not exact."""
from __future__ import annotations

import torch

from verispec import log

# On a CPU torch's own float16 and bfloat16 products give a row the same bits at every row count; its
# float32 and float64 ones do not (a one-row product runs another kernel than two rows or more).
# oneDNN's do not either: on a CPU with AMX or AVX512-FP16 it takes those products and picks its
# kernel by the row count, so exact numerics on a CPU run without it (keep_cpu_products_row_invariant).
CPU_EXACT_DTYPES = (torch.float16, torch.bfloat16)
CHOICES = ("auto", "exact", "fast")


def why_not_exact(device: torch.device | str, dtype: torch.dtype, recurrent: bool = False,
                        experts: bool = False) -> str | None:
    """Why exact numerics cannot hold for such a model (None: it can). CUDA: our row-invariant GEMM
    and attention kernels; a CPU: float16 and bfloat16, prompt chunks attended row by row as decode
    steps are (models/layers/attention.py)."""
    device = torch.device(device)
    if experts:
        return ("mixture-of-experts layers without row-invariant kernels here (quantized experts, or "
                "float experts on a GPU without Triton: their kernel is chosen by the pass's token count)")
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if dtype in CPU_EXACT_DTYPES:
            return None
        return f"{str(dtype).removeprefix('torch.')} on a CPU (a one-row product sums otherwise than a wider one)"
    return f"device {device.type}"


def keep_cpu_products_row_invariant(numerics: str, device: torch.device | str) -> None:
    """Exact numerics on a CPU: float16/bfloat16 products in torch's own kernels, not oneDNN's. A
    process-wide switch, set as the engine loads (a server's one engine, before any pass runs)."""
    if numerics != "exact" or torch.device(device).type != "cpu" or not torch.backends.mkldnn.enabled:
        return
    torch.backends.mkldnn.enabled = False
    log.debug("exact numerics on a CPU: oneDNN off (on CPUs with AMX or AVX512-FP16 its float16/bfloat16 "
              "products pick a kernel by the row count; torch's own give a row the same bits at every count)")


# A model this small (its weights, dense) spends a step on launches, not on reading weights or on
# sequential work: 1 GiB reads in about a quarter of a millisecond on an H100-class GPU. There `auto`
# takes what exact numerics cost on CUDA: a quantized model's layers decoded to dense at load
# (engine/loading.py, quant/dense.py) and Gated DeltaNet prompt chunks stepped token by token
SMALL_MODEL_BYTES = 1 << 30


def resolve(requested: str, device: torch.device | str, dtype: torch.dtype, *, recurrent: bool = False,
            experts: bool = False, quantized: bool = False, weight_bytes: int = 0,
            float_experts: bool = False, layer_kernel: bool = False) -> tuple[str, str | None]:
    """(the numerics that run, why not exact): "auto" is exact where it holds and costs little, as
    measured (docs/benchmarks.md): dense weights on CUDA; a quantized model's exact product decodes
    several times slower and a CPU's exact prompts prefill 2.5-4.5x slower, so there `--numerics
    exact` asks for it; so does a Gated DeltaNet model over SMALL_MODEL_BYTES, whose exact
    prompt chunks step token by token, and a model with float experts (`float_experts`), whose
    exact prompts and batches run our grouped expert kernel at an unmeasured cost. A CPU model
    whose layers run the CPU layer kernel (`layer_kernel`, quant/layer_stack.py) is exact at no
    cost: that kernel computes every row alone in every pass."""
    if requested == "fast":
        return "fast", "--numerics fast"
    if (reason := why_not_exact(device, dtype, recurrent, experts)) is not None:
        return "fast", reason
    if requested == "auto":
        if torch.device(device).type == "cpu":
            if layer_kernel:
                return "exact", None
            return "fast", "on a CPU exact prompt chunks prefill 2.5-4.5x slower (--numerics exact turns it on)"
        if quantized:
            return "fast", ("quantized layers: their exact product decodes several times slower "
                            "(--numerics exact turns it on)")
        if float_experts:
            return "fast", ("mixture-of-experts layers: exact prompts and batches of more than 16 tokens run "
                            "our grouped expert kernel, not torch's grouped GEMM, at a cost not measured yet "
                            "(--numerics exact turns it on)")
        if recurrent and weight_bytes > SMALL_MODEL_BYTES:
            return "fast", ("Gated DeltaNet layers: exact prompt chunks step token by token instead of the chunked "
                            "algorithm (--numerics exact turns it on)")
    return "exact", None
