"""A gated MLP's 4-bit gate_up -> down as one launch of the streaming kernel
(verispec/quant/kernels/stream_mlp.py). On the CPU: which MLPs can take it and why others cannot, the
plans' steps, and the MLP's routing (up to 32 rows through it, wider passes not). On CUDA (sm_90,
Gluon; on the device: `python3 -m pytest tests/quant/kernels/test_stream_mlp.py`): against the float64
reference, bit-identical to the two launched products with the same tiles, a row's result the same
whatever the pass's other rows (alone, in a verify pass, in a batch launched 8 rows at a time)."""
from __future__ import annotations

import copy

import pytest
import torch

from verispec.models.layers.mlp import GatedMLP
from verispec.quant import dispatch
from verispec.quant.kernels import frag as quant_frag, stream_mlp
from verispec.quant.kernels.matmul import dequantize_reference
from verispec.quant.layers.mlp import GatedProduct

from tests.quant.kernels.test_frag import layer_order, operands

cuda = torch.device("cuda")
gpu = pytest.mark.skipif(not torch.cuda.is_available() or stream_mlp.gluon is None
                         or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU and Gluon")


def frag_weights(n: int, k: int, seed: int, device="cpu", dtype=torch.bfloat16, group: int = 64):
    q, packed, scales, offsets = operands(n, k, group, False, dtype, seed, device)
    return quant_frag.repack(packed, scales, offsets, group), (packed, scales, offsets)


def test_the_plan_takes_only_the_measured_steps():
    assert stream_mlp.plan_for(4096, 12288) == ((2, 2), (1, 4))  # Qwen3-8B
    assert stream_mlp.plan_for(5120, 17408) == ((2, 2), (1, 4))  # Qwen3.6-27B
    assert stream_mlp.plan_for(2560, 9728) is None  # Qwen3-4B: 152 blocks, not whole steps of 16
    assert stream_mlp.plan_for(768, 1024) is None
    for steps in stream_mlp.PLAN:  # every step fills one slot of the ring
        assert stream_mlp.WARPS * steps[0] * steps[1] == 16


def test_reasons_name_what_cannot_stream():
    gate_up, _ = frag_weights(512, 512, 1)
    down, _ = frag_weights(512, 256, 2)
    assert "cpu" in stream_mlp.unsupported_reason(gate_up, down, torch.device("cpu"), torch.bfloat16)
    mlp = GatedMLP(64, 128)
    assert "SiLU(gate) * up outside" in dispatch.stream_reason(mlp, torch.bfloat16)
    with pytest.raises(ValueError, match="cpu"):
        stream_mlp.StreamMLP(gate_up, down, torch.bfloat16)


class TorchStream:
    """What StreamMLP computes, in torch, recording each call's rows."""

    def __init__(self, calls: list):
        self.calls, self.dtype = calls, torch.float32

    def __call__(self, x):
        self.calls.append(x.shape)
        return x[:, :3].repeat(1, 2)  # any function of x: the routing is what is checked


class UnfusedGateUp(torch.nn.Module):
    """A merged gate/up whose `silu_gated` is the plain MLP's activation of its product (what an
    interleaved quantized layer's unfused path computes)."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def silu_gated(self, x, gated):
        gate, up = self.linear(x).chunk(2, dim=-1)
        return gated(gate, up)


def test_the_mlp_routes_decode_and_verify_passes_to_the_stream():
    plain = GatedMLP(6, 8)
    plain.merge_projections()
    mlp = copy.deepcopy(plain)
    mlp.gate_up_proj = UnfusedGateUp(mlp.gate_up_proj)
    calls = []
    mlp.kernel = GatedProduct(mlp)
    mlp.kernel.stream = TorchStream(calls)
    x = torch.randn(2, 16, 6)
    assert torch.equal(mlp(x), x[..., :3].repeat(1, 1, 2)) and calls == [(32, 6)]
    wide = torch.randn(3, 11, 6)  # 33 rows: the products as before
    assert torch.equal(mlp(wide), plain(wide)) and len(calls) == 1
    mlp.kernel.stream.dtype = torch.bfloat16  # activations in another dtype than the kernel's: not through it
    assert torch.equal(mlp(x), plain(x)) and len(calls) == 1


def reference_mlp(x, gate_up_q, down_q):
    """SiLU(gate) * up -> down in float64 from the dequantized checkpoint values (gate_up's rows
    interleaved in chunks of 8, as the fragment-order copy holds them), each product rounded to x's
    dtype as the kernel stores it."""
    w1 = dequantize_reference(*gate_up_q, 4, 64, False).double()
    w2 = dequantize_reference(*down_q, 4, 64, False).double()
    y1 = (x.double() @ w1.T).to(x.dtype).double()
    tiles = y1.view(x.shape[0], -1, 2, quant_frag.GATE_CHUNK)
    gate, up = tiles[:, :, 0].flatten(1), tiles[:, :, 1].flatten(1)
    h = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    return (h.double() @ w2.T).to(x.dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden,intermediate", [(1024, 2048), (512, 1024), (1536, 3072)])
def test_matches_reference_launched_products_and_rows_are_independent(dtype, hidden, intermediate):
    gate_up, gate_up_q = frag_weights(2 * intermediate, hidden, 3, cuda, dtype)
    down, down_q = frag_weights(hidden, intermediate, 4, cuda, dtype)
    stream = stream_mlp.StreamMLP(gate_up, down, dtype)
    (rt1, kb1), (rt2, kb2) = stream.plan
    x = torch.randn(stream_mlp.MAX_ROWS, hidden, generator=torch.Generator().manual_seed(5)).to(cuda, dtype)
    y = stream(x)
    assert y.shape == (stream_mlp.MAX_ROWS, hidden) and y.dtype == dtype
    # the same tiles launched as two products give the same bits (8 rows a launch)
    h = torch.cat([quant_frag.frag_gemv(p, gate_up, quant_frag.FragTiles(kb1, 4, 1, rt1), silu_gate=True)
                   for p in x.split(8)])
    launched = torch.cat([quant_frag.frag_gemv(p, down, quant_frag.FragTiles(kb2, 4, 1, rt2)) for p in h.split(8)])
    assert torch.equal(y, launched)
    ref = reference_mlp(x, gate_up_q, down_q).double()
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < (2e-2 if dtype == torch.bfloat16 else 4e-3), err
    for rows in (1, 3, 8, 9, 20):
        assert torch.equal(stream(x[:rows]), y[:rows]), rows
    assert torch.equal(stream(x[5:6]), y[5:6])
    with pytest.raises(ValueError, match="33 rows"):
        stream(torch.zeros(33, hidden, device=cuda, dtype=dtype))


@gpu
def test_refuses_shapes_and_formats_it_cannot_take():
    gate_up, _ = frag_weights(2 * 1536, 512, 1, cuda)
    down, _ = frag_weights(512, 1536, 2, cuda)  # 24 blocks: not whole steps of 16
    assert "1536" in stream_mlp.unsupported_reason(gate_up, down, cuda, torch.bfloat16)
    wide, _ = frag_weights(1024, 512, 3, cuda, group=128)
    assert "groups of 128" in stream_mlp.unsupported_reason(wide, down, cuda, torch.bfloat16)
    assert "float32" in stream_mlp.unsupported_reason(gate_up, down, cuda, torch.float32)
