"""Tensor parallelism per family (CPU, gloo, 2 processes): the Qwen3.5 hybrid (Gated DeltaNet heads
and their recurrent states split), Gemma 4 dense and MoE (every expert's features split) and
Gemma 3, Qwen3-MoE and the Qwen3.5 MoE hybrid (every expert's and the shared expert's features
split), each split over two ranks, give the whole model's output (greedy tokens and logprobs,
seeded samples; float64) in a mixed batch that hits the prefix cache (for the hybrid, its
recurrent-state snapshots too); the Qwen3.5 MTP head drafts on rank 0 for a split target.
"""
from __future__ import annotations

import json

import pytest

from tests.engine.test_tensor_parallel import assert_split_gives_whole
from tests.engine.test_tensor_parallel_spec import speculate_whole_and_split
from tools.tiny import (build_tiny_gemma3, build_tiny_gemma4, build_tiny_model, build_tiny_qwen3_5, random_mtp_head,
                        write_mtp_sidecar)

# what rank 0 holds of its first layer: half of each split part
HALF_OF = {
    "qwen3_5": lambda layer: layer.linear_attn.num_value_heads == 2 and layer.mlp.down_proj.in_features == 64,
    "gemma4": lambda layer: layer.self_attn.num_heads == 2 and layer.mlp.down_proj.in_features == 48,
    "gemma4-moe": lambda layer: layer.experts.gate_up_proj.shape[1] == 24 and layer.experts.down_proj.shape[2] == 12,
    "gemma3": lambda layer: layer.self_attn.num_kv_heads == 1 and layer.mlp.down_proj.in_features == 48,
    "qwen3_moe": lambda layer: layer.mlp.experts.gate_up_proj.shape[1] == 32 and layer.mlp.experts.down_proj.shape[2] == 16,
    "qwen3_5_moe": lambda layer: (layer.linear_attn.num_value_heads == 2 and layer.mlp.experts.down_proj.shape[2] == 16
                                  and layer.mlp.shared_expert.down_proj.in_features == 24),
}
BUILDERS = {
    # the multimodal layout (text under model.language_model.*, tied head): the released files'
    "qwen3_5": lambda out, tok: build_tiny_qwen3_5(out, wrapper=True, seed=31, tokenizer_dir=tok,
                                                   tie_word_embeddings=True),
    "gemma4": lambda out, tok: build_tiny_gemma4(out, seed=32, tokenizer_dir=tok),
    "gemma4-moe": lambda out, tok: build_tiny_gemma4(out, moe=True, seed=33, tokenizer_dir=tok),
    "gemma3": lambda out, tok: build_tiny_gemma3(out, seed=34, tokenizer_dir=tok),
    "qwen3_moe": lambda out, tok: build_tiny_model(out, "qwen3_moe", seed=36, tokenizer_dir=tok, num_hidden_layers=4,
                                                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2]),
    "qwen3_5_moe": lambda out, tok: build_tiny_qwen3_5(out, moe=True, seed=37, tokenizer_dir=tok),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("tp-families")
    return {name: (build(root / name, tokenizer_dir), root / name)[1] for name, build in BUILDERS.items()}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_two_ranks_give_the_whole_models_output(family_dirs, family):
    def holds_half_of_the_first_layer(split):
        assert HALF_OF[family](split.model.model.layers[0])

    stats = assert_split_gives_whole(family_dirs[family], holds_half_of_the_first_layer)
    if family == "qwen3_5":
        assert stats["snapshots"] > 0  # recurrent states restored from snapshots


@pytest.fixture(scope="module")
def qwen3_5_with_mtp(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("tp-mtp") / "m"
    build_tiny_qwen3_5(out, seed=35, tokenizer_dir=tokenizer_dir)
    write_mtp_sidecar(out / "mtp.safetensors", random_mtp_head(json.loads((out / "config.json").read_text()), seed=7))
    return out


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_the_mtp_head_drafts_for_a_split_hybrid(qwen3_5_with_mtp):
    speculate_whole_and_split(qwen3_5_with_mtp, {"mtp": dict(mtp=True)}, {"suffix": dict(suffix=True)})
