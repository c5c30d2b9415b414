"""Every architecture loads quantized weights: a tiny checkpoint of each family is quantized by
`verispec quantize`, loaded by verispec, and its logits must equal transformers' on the same
(dequantized) weights, which tests the name mapping (wrappers, tied heads, scaled embeddings)
per family. The format itself is tested against its own library in test_mlx_affine.py."""
from __future__ import annotations

import pytest
import torch

from verispec.cli import main
from tools.tiny import build_tiny_gemma4, build_tiny_qwen3_5
from verispec.loading.model_loader import load_model

from tests.quant.conftest import PROMPT, quantized_modules

BUILDERS = {
    "gemma4-text": lambda out, tok: build_tiny_gemma4(out, tokenizer_dir=tok),
    "gemma4-wrapper": lambda out, tok: build_tiny_gemma4(out, wrapper=True, tokenizer_dir=tok),
    "qwen3_5-text": lambda out, tok: build_tiny_qwen3_5(out, tokenizer_dir=tok),
    "qwen3_5-wrapper": lambda out, tok: build_tiny_qwen3_5(out, wrapper=True, tokenizer_dir=tok, tie_word_embeddings=True),
}


def hf_weight(hf, model, path: str) -> torch.Tensor:
    """transformers' weight for our module `path` (wrappers nest the text model one level down)."""
    names = dict(hf.named_parameters())
    candidates = [path + ".weight"] + [src + path[len(dst):] + ".weight"
                                       for src, dst in model.checkpoint_prefix_map.items() if path.startswith(dst)]
    return next(names[n] for n in candidates if n in names)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_logits_equal_transformers_on_dequantized_weights(family, tmp_path, tokenizer_dir):
    hf = BUILDERS[family](tmp_path / "float", tokenizer_dir)
    assert main(["quantize", "-m", str(tmp_path / "float"), "--format", "mlx-8bit", "--group-size", "32",
                 "--out", str(tmp_path / "q8")]) == 0
    ours = load_model(tmp_path / "q8", torch.float32, torch.device("cpu"))
    layers = quantized_modules(ours)
    assert "model.embed_tokens" in layers and any(".mlp." in p for p in layers)
    with torch.no_grad():
        for path, layer in layers.items():
            if path == "lm_head" and ours.settings.tie_word_embeddings:
                continue  # tied: the embedding's table
            hf_weight(hf, ours, path).copy_(layer.dequantized_weight(torch.float32))
        ids = torch.tensor([PROMPT])
        expected = hf(input_ids=ids).logits
        got = ours.logits(ours(ids, torch.arange(len(PROMPT))[None], ours.make_cache(16)).hidden)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
