"""mlx-lm's own Qwen3.5 / 3.6 conversions (mlx-community's, dense and MoE): built with mlx-lm's model
classes and written by its save functions, so the files carry its layout (`language_model.model.*`
names, (1 + w) norms stored with the 1 added, conv1d kernels [C, K, 1], experts as
`mlp.switch_mlp.*`, quantized or not). verispec must decode the greedy tokens mlx-lm generates from
the same files on the CPU."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tools.tiny import QWEN3_5_TINY_MOE, QWEN3_5_TINY_TEXT
from verispec.loading.model_loader import load_model
from verispec.models.layers.moe import FusedExperts
from verispec.quant.layers.experts import MLXQuantizedExperts

from tests.quant.conftest import PROMPT, import_mlx, mlx_greedy, mlx_tensors, verispec_greedy

NEW_TOKENS = 16
# every linear's input width a multiple of the 32-group (value heads 4 x 16, shared expert 64)
TEXT = dict(QWEN3_5_TINY_TEXT, linear_value_head_dim=16, full_attention_interval=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25})
MOE = dict(QWEN3_5_TINY_MOE, shared_expert_intermediate_size=64, norm_topk_prob=True)


def save_mlx_qwen3_5(out: Path, tokenizer_dir: Path, moe: bool, bits: int | None, seed: int) -> Path:
    """A random tiny model of mlx-lm's qwen3_5 / qwen3_5_moe classes, saved as mlx_lm.convert saves
    (save_model, save_config), with its norms drawn away from their stored 1 so a missed shift shows."""
    mx = import_mlx()
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3_5, qwen3_5_moe
    from mlx_lm.utils import quantize_model, save_config, save_model
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    text = dict(TEXT, vocab_size=vocab, **(MOE if moe else {}))
    if moe:
        del text["intermediate_size"]
    model_type = "qwen3_5_moe" if moe else "qwen3_5"
    config = {"model_type": model_type, "text_config": dict(text, model_type=f"{model_type}_text"),
              "tie_word_embeddings": False}
    module = qwen3_5_moe if moe else qwen3_5
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):  # stored 1 + w (the GDN output norm: w itself)
            params[name] = mx.random.uniform(0.5, 1.5, p.shape)
        elif name.endswith("A_log"):
            params[name] = mx.log(mx.random.uniform(0.01, 2.0, p.shape))
        else:
            params[name] = 0.08 * mx.random.normal(p.shape)
    model.update(tree_unflatten(list(params.items())))
    if bits is not None:
        model, config = quantize_model(model, config, group_size=32, bits=bits,
                                       quant_predicate=getattr(model, "quant_predicate", None))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, out / path.name)
    return out


CASES = [(False, None), (False, 4), (True, None), (True, 4)]


@pytest.mark.parametrize("moe, bits", CASES, ids=["dense-float", "dense-4bit", "moe-float", "moe-4bit"])
def test_mlx_lm_qwen3_5_conversion_decodes_as_mlx_lm(tmp_path, tokenizer_dir, moe, bits):
    out = save_mlx_qwen3_5(tmp_path / "mlx", tokenizer_dir, moe, bits, seed=11 + 2 * moe + (bits or 0))
    model = load_model(out, torch.float32, torch.device("cpu"))
    if moe:
        experts = MLXQuantizedExperts if bits else FusedExperts  # float stacks fill the fused experts
        assert all(isinstance(layer.mlp.experts, experts) for layer in model.model.layers)
    mlx_model, weights = mlx_tensors(out)
    assert any(k.startswith("language_model.model.") for k in weights)
    assert verispec_greedy(out, NEW_TOKENS) == mlx_greedy(mlx_model, PROMPT, NEW_TOKENS)
