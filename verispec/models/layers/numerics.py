"""Where exact numerics holds (docs/serving.md, "Exact numerics"): a token's K/V, logits and sample
do not depend on the pass it is computed in."""
from __future__ import annotations

import torch

# On a CPU torch's float16 and bfloat16 products give a row the same bits at every row count; its
# float32 and float64 ones do not (a one-row product runs another kernel than two rows or more).
CPU_EXACT_DTYPES = (torch.float16, torch.bfloat16)


def exact_numerics_hold(device: torch.device | str, dtype: torch.dtype, recurrent: bool = False) -> bool:
    """CUDA: our row-invariant GEMM and attention kernels; a CPU: float16 and bfloat16, with prompt
    chunks attended row by row as decode steps are (models/layers/attention.py), for models without
    recurrent layers (`recurrent`: a CPU runs their prompt chunks with the chunked recurrence, which
    sums otherwise than the token-by-token one of decode steps)."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and dtype in CPU_EXACT_DTYPES and not recurrent
