"""The engine's CUDA-only steps for 4-bit layers, run on the CPU with the fragment-order kernel
replaced by what it computes (torch): an MLX 4-bit model written by mlx_lm.convert takes the
fragment-order copy in every eligible layer, its merged gate/up is interleaved in chunks of 8
(the copy follows the rows), the checkpoint's words are dropped, and then prefill (through the
copy's dequantization, and 8 rows a launch), decode and speculative verify give the tokens the
unconverted model gives."""
from __future__ import annotations

import torch

from verispec.engine.engine import load_engine
from verispec.quant import dispatch
from verispec.quant.dispatch import gate_in_products, make_copies, release_converted_checkpoints, stream_mlps
from verispec.quant.kernels import frag as quant_frag, frag_dequantize, stream_mlp
from verispec.quant.layers.linear import QuantizedLinear

from tests.quant.conftest import mlx_convert
from tests.spec.conftest import TARGET_SHAPE, ReplayProposer, greedy, spec_engine

NEW_TOKENS = 24


def frag_gemv_in_torch(x, fw, tiles=None, silu_gate=False):
    """frag.frag_gemv's result, computed by torch in x's dtype."""
    y = x @ frag_dequantize.dequantize(fw, x.dtype).T
    if not silu_gate:
        return y
    tiles_of = y.view(x.shape[0], -1, 2, quant_frag.GATE_CHUNK)
    return torch.nn.functional.silu(tiles_of[:, :, 0].flatten(1)) * tiles_of[:, :, 1].flatten(1)


PROMPTS = [list(range(5, 60)), list(range(7, 27))]  # one pass of 55 rows; one of 20


def reference_and_engine(tiny_models, tmp_path):
    """An MLX 4-bit Llama written by mlx_lm.convert: the unconverted model's greedy tokens for
    PROMPTS, and a second engine of its own on the checkpoint (the first one's prompt cache would
    skip the prefills)."""
    src = tiny_models.get("frag-llama", "llama", **TARGET_SHAPE)
    path = mlx_convert(src, tmp_path / "llama-4bit", q_bits=4, q_group_size=64)
    reference = load_engine(str(path), dtype="float32", device="cpu", prefill_step_size=64)
    plain = [reference.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in PROMPTS]
    return plain, load_engine(str(path), dtype="float32", device="cpu", prefill_step_size=64)


def test_converted_and_released_layers_give_the_same_tokens(tiny_models, tmp_path, monkeypatch):
    plain, engine = reference_and_engine(tiny_models, tmp_path)

    widths, gated = [], []

    def fake(x, fw, tiles=None, silu_gate=False):
        widths.append(x.shape[0])
        gated.append(silu_gate)
        return frag_gemv_in_torch(x, fw, tiles, silu_gate)

    monkeypatch.setattr(dispatch, "frag_reason", lambda layer, device, dtype: None)
    monkeypatch.setattr(quant_frag, "frag_gemv", fake)
    model = engine.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert make_copies(model, torch.float32) == len(layers)
    assert all(m.frag is not None and m.int4_packed is None for m in layers)  # no tinygemm copy
    assert gate_in_products(model, torch.float32) == TARGET_SHAPE["num_hidden_layers"]
    assert release_converted_checkpoints(model) == len(layers)
    assert all(m.released() for m in layers)

    for ids, want in zip(PROMPTS, plain):
        assert engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids == want
    assert max(widths) <= quant_frag.MAX_ROWS and 1 in widths and any(gated)
    # the 20-row prompt: 8 + 8 + 4 rows a launch in each decoder layer's 4 products (the head: last row)
    assert widths.count(4) >= 4 * TARGET_SHAPE["num_hidden_layers"]
    # verify passes of 4 rows on the copy: speculative == plain
    for ids, want in zip(PROMPTS, plain):
        spec = spec_engine(engine, ReplayProposer(want, model.vocab_size, right_at=lambda j: j % 3 != 1), 3)
        assert spec.generate_all(ids, greedy(NEW_TOKENS)).token_ids == want


def test_a_second_engine_on_the_same_model_converts_nothing_twice(tiny_models, tmp_path, monkeypatch):
    src = tiny_models.get("frag-llama", "llama", **TARGET_SHAPE)
    path = mlx_convert(src, tmp_path / "llama-4bit", q_bits=4, q_group_size=64)
    engine = load_engine(str(path), dtype="float32", device="cpu")
    monkeypatch.setattr(dispatch, "frag_reason", lambda layer, device, dtype: None)
    model = engine.model
    make_copies(model, torch.float32)
    gate_in_products(model, torch.float32)
    count = release_converted_checkpoints(model)
    assert count > 0
    words = {id(m): m.frag.words for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert make_copies(model, torch.float32) == 0
    assert gate_in_products(model, torch.float32) == 0
    assert release_converted_checkpoints(model) == 0
    assert all(m.frag.words is words[id(m)] for m in model.modules() if isinstance(m, QuantizedLinear))


def test_mlps_take_the_streaming_kernel_for_decode_and_verify_passes(tiny_models, tmp_path, monkeypatch):
    """quant/kernels/stream_mlp.py's StreamMLP replaced by what it computes: every MLP of the converted
    model takes it (quant.dispatch.stream_mlps) for passes of up to 32 rows, wider prefills keep the
    two products, and plain and speculative decoding give the unconverted model's tokens."""
    plain, engine = reference_and_engine(tiny_models, tmp_path)
    widths = []

    class TorchStreamMLP:
        def __init__(self, gate_up, down, dtype):
            self.gate_up, self.down, self.dtype = gate_up, down, dtype

        def __call__(self, x):
            widths.append(x.shape[0])
            return frag_gemv_in_torch(frag_gemv_in_torch(x, self.gate_up, silu_gate=True), self.down)

    monkeypatch.setattr(dispatch, "frag_reason", lambda layer, device, dtype: None)
    monkeypatch.setattr(quant_frag, "frag_gemv", frag_gemv_in_torch)
    monkeypatch.setattr(stream_mlp, "unsupported_reason", lambda *args: None)
    monkeypatch.setattr(stream_mlp, "StreamMLP", TorchStreamMLP)
    model = engine.model
    make_copies(model, torch.float32)
    gate_in_products(model, torch.float32)
    release_converted_checkpoints(model)
    layers = TARGET_SHAPE["num_hidden_layers"]
    assert stream_mlps(model, torch.float32) == layers
    assert stream_mlps(model, torch.float32) == 0  # a second engine on the model: nothing twice

    for ids, want in zip(PROMPTS, plain):
        assert engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids == want
    assert max(widths) == 20 and widths.count(20) == layers  # the 55-row prefill kept the products
    assert widths.count(1) >= layers * (NEW_TOKENS - 1)
    for ids, want in zip(PROMPTS, plain):
        spec = spec_engine(engine, ReplayProposer(want, model.vocab_size, right_at=lambda j: j % 3 != 1), 3)
        assert spec.generate_all(ids, greedy(NEW_TOKENS)).token_ids == want
    assert 4 in widths  # verify passes of 4 rows
