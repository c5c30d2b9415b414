"""A CPU kernel's row invariance: a row's bits whatever the pass's width, its place in it and the thread count."""
from __future__ import annotations

import torch


def assert_rows_do_not_depend_on_the_pass(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """x [40, K]: every row of a prompt-chunk-wide pass equals the row in narrower passes (decode,
    verify passes and batches of them), alone, as [B, T, K] and on one thread."""
    wide = layer(x)
    for rows in range(1, 9):
        assert torch.equal(layer(x[:rows]), wide[:rows]), rows
        assert torch.equal(layer(x[rows:rows + 1]), wide[rows:rows + 1]), rows  # the row alone
    assert torch.equal(layer(x.view(2, 20, -1)), wide.view(2, 20, -1))  # [B, T, K] as the models pass it
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(layer(x[:3]), wide[:3])
    finally:
        torch.set_num_threads(previous)
