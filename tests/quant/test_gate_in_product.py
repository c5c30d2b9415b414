"""SiLU(gate) * up in the merged gate/up product (QuantizedLinear.interleave_gate_up /
silu_gated, quant.dispatch.gate_in_products): the interleaved rows give what the merged layer gave, on
every path that is not the tensor-core kernel (the kernel itself: tests/quant/kernels/test_mma.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.quant.kernels.test_int4_builtin import mlx_layer, zero_point_layer
from verispec.models.layers.mlp import GatedMLP
from verispec.quant import dispatch
from verispec.quant.dispatch import gate_in_product_reason, gate_in_products
from verispec.quant.kernels import mma as quant_mma
from verispec.quant.layers.linear import MLXAffineLinear, PackedIntLinear, unsigned_zero_points
from verispec.quant.layers.mlp import GatedProduct


def merged_gate_up(kind: str):
    if kind == "mlx":
        gate, up = mlx_layer(32), mlx_layer(32)
        up.scales.data = up.scales.data * 1.5  # not a copy of gate
        return MLXAffineLinear.concat_rows([gate, up])
    gate, up = zero_point_layer(False), zero_point_layer(False)
    up.weight_scale.data = up.weight_scale.data * 1.5
    up.finish_loading()
    return PackedIntLinear.concat_rows([gate, up])


def test_interleaved_rows_give_the_merged_layers_activation():
    for kind in ("mlx", "zero_point"):
        layer = merged_gate_up(kind)
        x = torch.randn(3, 5, layer.in_features, dtype=torch.bfloat16)
        gate, up = layer(x).chunk(2, dim=-1)
        expected = F.silu(gate) * up
        layer.interleave_gate_up()
        assert layer.gate_chunk == quant_mma.GATE_CHUNK
        got = layer.silu_gated(x, lambda g, u: F.silu(g) * u)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_interleave_orders_rows_in_chunks_and_keeps_zero_points_consistent():
    layer = merged_gate_up("zero_point")
    half, chunk = layer.out_features // 2, quant_mma.GATE_CHUNK
    before = layer.weight_packed.clone(), layer.weight_scale.clone(), layer.zeros.clone()
    layer.interleave_gate_up()
    for i in range(layer.out_features):
        block, inside = divmod(i, 2 * chunk)
        source = (inside - chunk) + half + block * chunk if inside >= chunk else block * chunk + inside
        assert torch.equal(layer.weight_packed[i], before[0][source])
        assert torch.equal(layer.weight_scale[i], before[1][source])
        assert torch.equal(layer.zeros[i], before[2][source])
    # the N-packed zero points were packed again from the reordered ones
    assert torch.equal(unsigned_zero_points(layer.weight_scale, layer.weight_zero_point, 4, False), layer.zeros)


def test_mlp_takes_the_gated_path_only_where_the_kernel_can(monkeypatch):
    torch.manual_seed(0)
    mlp = GatedMLP(256, 48)
    mlp.gate_proj, mlp.up_proj = mlx_layer(32), mlx_layer(32)
    mlp.up_proj.scales.data = mlp.up_proj.scales.data * 1.5
    mlp.down_proj = torch.nn.Linear(48, 256, bias=False).bfloat16()
    mlp.merge_projections()
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    expected = mlp(x)
    # on a CPU the tensor-core kernel declines, and the MLP keeps its separate activation
    assert "cpu" in gate_in_product_reason(mlp, torch.bfloat16)
    assert gate_in_products(mlp, torch.bfloat16) == 0 and mlp.kernel is None
    # an activation other than SiLU is never fused
    gelu = GatedMLP(256, 48, act="gelu")
    assert "SiLU" in gate_in_product_reason(gelu, torch.bfloat16)
    # the rows interleaved anyway (the kernel's reasons made to pass): the MLP's output does not change
    monkeypatch.setattr(dispatch, "silu_gate_reason", lambda layer, device, dtype: None)
    assert gate_in_products(mlp, torch.bfloat16) == 1 and isinstance(mlp.kernel, GatedProduct)
    # a model prepared twice: nothing more happens
    kernel = mlp.kernel
    assert gate_in_products(mlp, torch.bfloat16) == 0 and mlp.kernel is kernel
    monkeypatch.undo()  # the passes themselves: not the kernel (a CPU), the chunks taken apart
    torch.testing.assert_close(mlp(x), expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="interleaved already"):
        mlp.gate_up_proj.interleave_gate_up()


def test_reasons_name_what_blocks_the_epilogue():
    layer = merged_gate_up("mlx")
    assert "cpu" in dispatch.silu_gate_reason(layer, torch.device("cpu"), torch.bfloat16)
