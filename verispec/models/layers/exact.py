"""Exact numerics: every dense linear layer of a model on CUDA runs kernels/linear.py, whose rows
are summed the same way at every row count, instead of cuBLAS, which picks its kernel (and so a
row's summation order) by the pass's shape; routed experts run kernels/expert_gemv.py's union and
grouped kernels, which give a token the same bits in any pass, instead of torch's grouped GEMM.
With the norms, the q/k preparation and the attention kernels (also a row's bits whatever its
pass), a token's logits do not depend on the batch, the speculation width, the prompt chunking or
the prefix cache (docs/serving.md, "Exact numerics")."""
from __future__ import annotations

import types

import torch
from torch import nn

from verispec import log
from verispec.kernels import linear as kernel
from verispec.models.layers.moe import FusedExperts
from verispec.models.layers.parallel import RowParallelLinear


def _row_invariant_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return kernel.linear(x, self.weight, self.bias)


def use_row_invariant_linears(model: nn.Module) -> int:
    """Binds every plain nn.Linear whose weight the kernel takes to it (once; again is a no-op) and
    returns how many; the others keep torch's product, each reason logged once under
    VERISPEC_DEBUG=1 (their rows may then depend on the pass)."""
    bound, reasons = 0, set()
    for module in model.modules():
        if type(module) is not nn.Linear and not isinstance(module, RowParallelLinear):
            continue
        reason = kernel.weight_reason(module.weight)
        if reason is None and isinstance(module, RowParallelLinear):
            module.product = kernel.linear  # its all-reduce sums each row's two halves the same way at any width
            bound += 1
        elif reason is None:
            module.forward = types.MethodType(_row_invariant_forward, module)
            bound += 1
        elif reason not in reasons:
            reasons.add(reason)
            log.debug("a linear layer keeps torch's product under exact numerics: %s", reason)
    return bound


def use_row_invariant_experts(model: nn.Module) -> int:
    """Every FusedExperts of the model on its row-invariant kernels for passes of any size; returns
    how many."""
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    for module in experts:
        module.exact = True
    return len(experts)
