"""A Gated DeltaNet token's gates under exact numerics on a CPU (models/layers/fused.py
`gdn_gates_rounded`) are the same bits wherever the token sits in a pass: alone, last in a prompt
chunk, or beside other sequences' rows. On a CPU torch runs the last elements of a tensor through
scalar exp/softplus/sigmoid, whose last bit can differ from the vector loop's; in float32 that
moved a row's recurrent state with the batch."""
from __future__ import annotations

import torch

from verispec.models.layers.fused import gdn_gates_rounded

HEADS = 6


def test_gates_do_not_depend_on_a_tokens_place_in_the_pass():
    gen = torch.Generator().manual_seed(0)
    a_log = torch.randn(HEADS, generator=gen)
    dt_bias = torch.randn(HEADS, generator=gen)
    batch, length = 16, 40
    b = torch.randn(batch, length, HEADS, generator=gen).to(torch.bfloat16)
    a = (torch.randn(batch, length, HEADS, generator=gen) * 4).to(torch.bfloat16)
    beta_all, g_all = gdn_gates_rounded(b, a, a_log, dt_bias)
    assert g_all.dtype == torch.float32 and beta_all.dtype == torch.bfloat16
    for row in range(batch):
        for n in range(1, length + 1):  # the row's first n tokens as a pass of their own
            beta, g = gdn_gates_rounded(b[row:row + 1, :n], a[row:row + 1, :n], a_log, dt_bias)
            assert torch.equal(g[0], g_all[row, :n]), (row, n)
            assert torch.equal(beta[0], beta_all[row, :n]), (row, n)
