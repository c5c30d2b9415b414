"""GGUF weights: every tensor type reads to exactly the `gguf` library's own dequantization, and
the loaded state (names mapped, llama's q/k permutation and gemma3's 1 + w norms undone) is exactly
what transformers' GGUF loader builds from the same file."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from verispec.loading.gguf import GGUFCheckpoint
from verispec.loading.gguf.quants import AFFINE_TYPES, AffineQuantized, dense, read_tensor

from tests.gguf.conftest import ALL_TYPES, CASES, TIED
from tests.models.test_checkpoints import our_logits


def hf_from_gguf(path):
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names with each layer's gate and up expert stacks side by side in transformers' fused
    `gate_up_proj` [E, 2I, H] (as FusedExperts.checkpoint_part places them at load)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts.up_proj"):
            continue
        if name.endswith(".experts.gate_proj"):
            prefix = name[: -len("gate_proj")]
            name, t = f"{prefix}gate_up_proj", torch.cat([t, tensors[f"{prefix}up_proj"]], dim=1)
        out[name] = t
    return out


@pytest.mark.parametrize("arch, qtype", CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_tensors_equal_library_dequantization(gguf_files, arch, qtype):
    from gguf.quants import dequantize

    case = gguf_files.get(arch, qtype)
    checkpoint = GGUFCheckpoint(case.path)
    types = {t.tensor_type.name for t in checkpoint.reader.tensors}
    assert types == ({"F32", qtype} if qtype != "F32" else {"F32"})  # the file has the case's type
    for t in checkpoint.reader.tensors:
        ours = dense(read_tensor(t))
        ref = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))
        assert ours.shape == ref.shape, t.name
        assert torch.equal(ours.float(), ref), f"{t.name} ({t.tensor_type.name})"


@pytest.mark.parametrize("arch, qtype", CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_weights_equal_transformers_gguf_loading(gguf_files, arch, qtype):
    case = gguf_files.get(arch, qtype)
    ours = fused_experts(dict(GGUFCheckpoint(case.path).tensors()))
    ref = hf_from_gguf(case.path).state_dict()
    tied = arch in TIED
    assert set(ref) - set(ours) == ({"lm_head.weight"} if tied else set())
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), ref[name]), name


def test_unquantized_file_round_trips_the_original_weights(gguf_files):
    """F32 llama: permuting q/k (the writer, as llama.cpp) and unpermuting (the reader) is the
    identity; gemma3's 1 + w norms come back to w up to float32 rounding of the +1 / -1; qwen3moe's
    gate and up expert stacks, split by the writer, come back to transformers' fused stack."""
    for arch in ("llama", "gemma3", "qwen3moe"):
        case = gguf_files.get(arch, "F32")
        original = case.hf_model.state_dict()
        for name, tensor in fused_experts(dict(GGUFCheckpoint(case.path).tensors())).items():
            if arch == "llama" or not name.endswith("norm.weight"):
                assert torch.equal(tensor, original[name]), name
            else:
                torch.testing.assert_close(tensor, original[name], atol=1e-7, rtol=0)


@pytest.mark.parametrize("qtype", AFFINE_TYPES)
def test_affine_description(gguf_files, qtype):
    """Q8_0 / Q4_0 / Q4_1 stay describable as affine 8/4-bit with group 32 (what a quantized
    linear layer takes): unsigned q below 2**bits, one scale and bias per 32 columns, and the q/k
    permutation applied to it the same as to the dense weight."""
    case = gguf_files.get("llama", qtype)
    checkpoint = GGUFCheckpoint(case.path)
    dense_weights = dict(checkpoint.tensors())
    described = dict(checkpoint.tensors(keep_affine=True))
    bits = 8 if qtype == "Q8_0" else 4
    matrices = [n for n, v in described.items() if isinstance(v, AffineQuantized)]
    assert "model.layers.0.self_attn.q_proj.weight" in matrices and len(matrices) == 7 * 2 + 2
    for name in matrices:
        a = described[name]
        rows, cols = a.shape
        assert a.bits == bits and a.group_size == 32 and a.q.dtype == torch.uint8
        assert int(a.q.max()) < 2 ** bits and a.scales.shape == a.biases.shape == (rows, cols // 32)
        assert torch.equal(a.dequantize(), dense_weights[name]), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_expert_stack_affine_description(gguf_files, qtype):
    """A 3-D expert stack [E, I, H] unpacks expert by expert into the same affine form (scales and
    biases [E, I, H/32]) as a matrix, dequantizing to the dense load's values."""
    checkpoint = GGUFCheckpoint(gguf_files.get("qwen3moe", qtype).path)
    dense_weights = dict(checkpoint.tensors())
    stacks = {n: v for n, v in checkpoint.tensors(keep_affine=True) if ".experts." in n}
    assert len(stacks) == 3 * 2
    for name, a in stacks.items():
        experts, rows, cols = a.shape
        assert a.scales.shape == a.biases.shape == (experts, rows, cols // 32)
        assert torch.equal(a.dequantize(), dense_weights[name]), name


def test_all_types_covered():
    assert {t for a, t in CASES if a == "llama"} == set(ALL_TYPES)


@pytest.mark.parametrize("arch, qtype", [("llama", "Q4_1"), ("qwen3", "Q4_0"), ("gemma3", "Q4_1"), ("qwen3moe", "Q4_1")])
def test_4bit_weights_kept_quantized_compute_what_the_dense_load_does(gguf_files, arch, qtype):
    """Q4_0 / Q4_1 linears loaded as quantized layers (what CUDA in bfloat16 gets, for torch's int4
    kernel) dequantize to the library's values: in float32 on the CPU the logits equal the dense load's."""
    from verispec.loading.model_loader import load_model
    from verispec.quant.layers.linear import MLXAffineLinear

    case = gguf_files.get(arch, qtype)
    dense = load_model(case.path, torch.float32, torch.device("cpu"))
    kept = load_model(case.path, torch.float32, torch.device("cpu"), keep_gguf_4bit=True)
    layers = [m for m in kept.modules() if isinstance(m, MLXAffineLinear)]
    assert layers and all(m.bits == 4 and m.group_size == 32 for m in layers)
    assert not any(isinstance(m, MLXAffineLinear) for m in dense.modules())
    ids = [3, 17, 42, 99, 7, 250, 11, 64]
    with torch.inference_mode():
        torch.testing.assert_close(our_logits(kept, ids), our_logits(dense, ids), atol=1e-5, rtol=1e-5)
