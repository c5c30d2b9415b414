"""Quantized checkpoints under tensor parallelism (CPU, gloo, 2 processes): an MLX affine 4-bit and
8-bit checkpoint sharded at load (packed words, scales and biases split with their weights) gives
the output of its unsharded load (greedy tokens and logprobs, seeded samples; float64); a size
that would cut a quantization group is refused in one line naming the group size.
"""
from __future__ import annotations

import pytest
import torch

from tests.engine.test_tensor_parallel import assert_split_gives_whole
from verispec.errors import VerispecError
from verispec.loading.model_loader import load_model, read_config
from verispec.loading.weights import checkpoint_files, iter_tensors, tensor_shapes
from verispec.models.layers.parallel import Shard
from verispec.quant.convert import Source, quantize_checkpoint
from verispec.quant.layers.linear import MLXAffineLinear


def quantized(src, out, fmt: str, group_size: int):
    files = checkpoint_files(src)
    source = Source(src, read_config(src), files, iter_tensors(files), len(tensor_shapes(files)))
    quantize_checkpoint(source, fmt, out, group_size=group_size, progress=False)
    return out


@pytest.fixture(scope="module")
def mlx_dirs(qwen3_dir, tmp_path_factory):
    """qwen3's tiny model (o_proj reads 64 features, 32 a rank at TP 2) in groups of 32 and of 64."""
    root = tmp_path_factory.mktemp("tp-mlx")
    return {name: quantized(qwen3_dir, root / name, fmt, group) for name, fmt, group in
            (("4bit", "mlx-4bit", 32), ("8bit", "mlx-8bit", 32), ("4bit-g64", "mlx-4bit", 64))}


@pytest.mark.parametrize("name", ["4bit", "8bit"])
def test_a_quantized_checkpoint_sharded_at_load_gives_its_unsharded_output(mlx_dirs, name):
    def rank0_holds_half_of_each_group_row(split):
        layer = split.model.model.layers[0]
        assert isinstance(layer.self_attn.o_proj, MLXAffineLinear) and layer.self_attn.o_proj.in_features == 32
        assert layer.mlp.down_proj.scales.shape[1] == 64 // 32  # half of the 128 features' 4 groups

    assert_split_gives_whole(mlx_dirs[name], rank0_holds_half_of_each_group_row)


def test_a_split_that_cuts_a_quantization_group_is_one_line(mlx_dirs):
    with pytest.raises(VerispecError, match="groups of 64 input features at feature 32") as err:
        load_model(mlx_dirs["4bit-g64"], torch.float64, torch.device("cpu"), shard=Shard(0, 2))
    assert "\n" not in str(err.value)
