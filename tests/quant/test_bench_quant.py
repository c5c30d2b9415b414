"""`verispec bench --quant`: the random-weight target is quantized on its device before measuring
(its numbers exist and count the quantized bytes; speed is never asserted)."""
from __future__ import annotations

import json

import torch

from verispec.bench.build import random_target
from verispec.bench.roofline import weight_bytes
from verispec.bench.shapes import SHAPES
from verispec.cli import main
from verispec.quant.layers.linear import MLXAffineEmbedding, MLXAffineLinear
from verispec.quant.in_memory import quantize_model_


def test_quantized_random_target_counts_packed_bytes():
    model = random_target("tiny", SHAPES["tiny"].config, torch.device("cpu"), torch.bfloat16).model
    float_bytes = weight_bytes(model)
    x = torch.tensor([[1, 2, 3]])
    before = model.logits(model(x, torch.arange(3)[None], model.make_cache(8)).hidden)
    assert quantize_model_(model, "mlx-8bit") == 2 * 7 + 2  # 7 linears per layer, embedding, lm_head
    assert isinstance(model.lm_head, MLXAffineLinear) and isinstance(model.model.embed_tokens, MLXAffineEmbedding)
    after = model.logits(model(x, torch.arange(3)[None], model.make_cache(8)).hidden)
    assert float((after.float() - before.float()).norm() / before.float().norm()) < 0.05  # 8-bit is close
    # bf16 weights of 2 bytes -> 1 byte + a bf16 scale and bias per 64 weights
    assert weight_bytes(model) < 0.6 * float_bytes


def test_bench_quant_offline(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "--shape", "tiny", "--device", "cpu", "--quant", "mlx-4bit", "--contexts", "8",
               "--gen-tokens", "4", "--repeats", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads((out / "bench.json").read_text())
    assert report["meta"]["target"] == "tiny (mlx-4bit)"
    assert report["rows"][0]["decode_tok_s"] > 0
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--quant", "int3", "--contexts", "8"]) == 2
    assert "--quant 'int3' is not supported (supported: mlx-4bit, mlx-8bit" in capsys.readouterr().err
