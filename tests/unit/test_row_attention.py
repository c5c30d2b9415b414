"""CPU decode / verify attention row by row (models/layers/attention.per_row_attention): a row's
output is bitwise the same whether it is computed alone (a decode step) or inside a wider pass (a
verify pass, a batch), and it equals masked SDPA, the definition, up to rounding."""
from __future__ import annotations

import pytest
import torch

from verispec.models.layers.attention import attention_mask, per_row_attention, sdpa


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
def test_row_alone_equals_row_in_a_wider_pass(dtype, window):
    torch.manual_seed(0)
    q = torch.randn(2, 6, 4, 16).to(dtype)
    k, v = torch.randn(2, 2, 40, 16).to(dtype), torch.randn(2, 2, 40, 16).to(dtype)
    positions = torch.tensor([[30, 31, 32, 33], [36, 37, 38, 39]])  # ragged: rows end at different positions
    wide = per_row_attention(q, k, v, positions, window, 0.25)
    for b in range(2):
        for t in range(4):
            alone = per_row_attention(q[b:b + 1, :, t:t + 1], k[b:b + 1], v[b:b + 1], positions[b:b + 1, t:t + 1],
                                      window, 0.25)
            assert torch.equal(alone[0, :, 0], wide[b, :, t])
    masked = sdpa(q.double(), k.double(), v.double(), attention_mask(positions, 40, window, ragged=True), 0.25)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert (wide.double() - masked).abs().max() < tolerance

