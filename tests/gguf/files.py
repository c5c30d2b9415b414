"""Tiny GGUF files written with the `gguf` library's own writer, as llama.cpp's converter writes them.

A random-weight transformers model of the architecture (its weights, config and our tiny byte-level
BPE tokenizer) goes into one .gguf file: metadata under `{arch}.*` and `tokenizer.*`, 1-D tensors
(norms, biases) as F32, every matrix in the case's type. llama.cpp's conventions are applied:
llama q/k rows permuted for interleaved RoPE, gemma3 norm weights stored as 1 + w. Types the library
can quantize are quantized from the model's weights; the k-quants (which it cannot quantize) are
random blocks with their float16 scales set so each block has mean ~0 and the weights peak at 0.1 —
what the file then holds is defined by the library's dequantization, which both loaders under test
start from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    # matrices' columns are multiples of 256 so that every type's blocks fit
    "llama": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=10_000.0),
    "qwen2": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=1e6),
    # transformers' GGUF loader takes Qwen3's head_dim from Qwen3Config's default (128)
    "qwen3": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128, rope_theta=1e6),
    # head_dim 256 = transformers' default query_pre_attn_scalar, which its GGUF loader always uses
    "gemma3": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=6, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=256, sliding_window=8, rope_theta=1e6),
    # top-2 of 4 experts renormalised (llama.cpp's qwen3moe always renormalises)
    "qwen3moe": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=128, rope_theta=1e6, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=256, norm_topk_prob=True),
}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
# llama.cpp's quantizer leaves the MoE router in float (ffn_gate_inp), as the files people run have it
FLOAT_MATRICES = ("ffn_gate_inp.weight",)
CHAT_TEMPLATE_MARK = "{# tiny gguf chat template #}"
# (offset of d, offset of dmin or None) in each k-quant block, as gguf.quants lays them out
K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}
WEIGHT_SCALE = 0.1
GEMMA_EMBEDDING_SHRINK = 0.25


@dataclass
class GGUFCase:
    path: Path
    arch: str
    qtype: str
    hf_model: torch.nn.Module = field(repr=False)  # the weights before conversion (F32 files keep them)
    eos_id: int = 0
    chat_template: str = ""


def tensor_names(arch: str) -> dict[str, str]:
    """Hugging Face name (of one layer, {i}) -> GGUF name."""
    names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
    if arch == "gemma3":
        layer.update({"pre_feedforward_layernorm": "ffn_norm", "post_attention_layernorm": "post_attention_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        layer["post_attention_layernorm"] = "ffn_norm"
    for hf, gg in layer.items():
        for kind in ("weight", "bias"):
            names[f"model.layers.{{i}}.{hf}.{kind}"] = f"blk.{{i}}.{gg}.{kind}"
    # transformers' fused expert stacks; gate_up_proj is split into gate and up (gguf_tensors)
    names["model.layers.{i}.mlp.experts.down_proj"] = "blk.{i}.ffn_down_exps.weight"
    names["model.layers.{i}.mlp.experts.gate_up_proj"] = "blk.{i}.ffn_gate_up_exps.weight"
    return names


def gguf_tensors(gguf_name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """What llama.cpp's converter writes for one tensor: the fused gate/up expert stack [E, 2I, H]
    as ffn_gate_exps [E, I, H] and ffn_up_exps."""
    if gguf_name.endswith(".ffn_gate_up_exps.weight"):
        gate, up = w.chunk(2, dim=1)
        return [(gguf_name.replace("gate_up", "gate"), gate), (gguf_name.replace("gate_up", "up"), up)]
    return [(gguf_name, w)]


def build_hf_model(arch: str, vocab_size: int, seed: int, tie: bool, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(MODEL_TYPES[arch], vocab_size=vocab_size, max_position_embeddings=1024,
                                  rms_norm_eps=1e-6, tie_word_embeddings=tie, **SHAPES[arch], **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # away from 1 (and from 0 for Gemma's 1 + w) so a misplaced one shows
                p.copy_(torch.rand(p.shape, generator=gen) + (-0.5 if arch == "gemma3" else 0.5))
            else:
                p.normal_(0.0, 0.08, generator=gen)
        if arch == "gemma3":  # its sqrt(H) = 16x embedding scale would swamp every layer's update
            model.model.embed_tokens.weight.mul_(GEMMA_EMBEDDING_SHRINK)
    return model


def llama_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter: rows of each head from (2, D/2) to (D/2, 2) order."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(array: np.ndarray, qtype: str, gen: np.random.Generator) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
    from gguf.quants import dequantize, quantize

    t = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return array.astype(np.float32), None
    if qtype == "F16":
        return array.astype(np.float16), None
    if qtype not in K_QUANT_SCALES:
        return quantize(array.astype(np.float32), t), t
    block_size, type_size = GGML_QUANT_SIZES[t]
    if array.ndim == 3:  # an expert stack: each expert's matrix as llama.cpp lays them, one after another
        experts, rows, cols = array.shape
        data, t = encode(array.reshape(experts * rows, cols), qtype, gen)
        return data.reshape(experts, rows, -1), t
    rows, cols = array.shape
    blocks = gen.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    d_at, dmin_at = K_QUANT_SCALES[qtype]
    def weights(d: np.ndarray, dmin: np.ndarray | None) -> np.ndarray:  # [blocks, block_size]
        blocks[:, d_at:d_at + 2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
        if dmin_at is not None:
            blocks[:, dmin_at:dmin_at + 2] = dmin.astype(np.float16).reshape(-1, 1).view(np.uint8)
        return dequantize(blocks, t)

    # w = d * A - dmin * B, linear in d and dmin: pick dmin so each block's mean is ~0 (random mins
    # would give every weight the same sign), then scale both to a peak of WEIGHT_SCALE
    ones, zeros = np.ones(len(blocks)), np.zeros(len(blocks))
    a = weights(ones, zeros if dmin_at is not None else None)
    d = ones
    dmin = a.mean(-1) / -weights(zeros, ones).mean(-1) if dmin_at is not None else None
    scale = WEIGHT_SCALE / np.abs(weights(d, dmin)).max()
    weights(d * scale, dmin * scale if dmin is not None else None)
    return blocks.reshape(rows, -1), t


def llama3_rope_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores as `rope_freqs` for Llama 3.x's llama3 RoPE scaling: per
    frequency, 1 (short wavelengths), `factor` (long ones), or in between 1 / ((1 - s) / factor + s)
    with s the position of the wavelength between the two bounds."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    old_len, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (old_len / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, middle))
    return factors.astype(np.float32)


def write_gguf(out_dir: Path, arch: str, qtype: str, hf_tokenizer, seed: int = 0, tie: bool = False,
               llama3_rope: dict | None = None) -> GGUFCase:
    """llama3_rope (llama only): the model uses Llama 3.x RoPE scaling, stored as `rope_freqs`."""
    import gguf

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"tiny-{arch}-{qtype}.gguf"
    vocab = len(hf_tokenizer)
    model = build_hf_model(arch, vocab, seed, tie, **({"rope_scaling": llama3_rope} if llama3_rope else {}))
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(SHAPES[arch]["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)
    if arch == "qwen3moe":
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_vocab_size(vocab)
    eos_id, template = _write_tokenizer(writer, hf_tokenizer, arch)

    if llama3_rope:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(llama3_rope, SHAPES[arch]["rope_theta"], head_dim))
    gen = np.random.default_rng(seed)
    names = tensor_names(arch)
    for hf_name, tensor in model.state_dict().items():
        if tie and hf_name == "lm_head.weight":
            continue
        pattern = hf_name
        layer = None
        if hf_name.startswith("model.layers."):
            layer = hf_name.split(".")[2]
            pattern = hf_name.replace(f"model.layers.{layer}.", "model.layers.{i}.", 1)
        gguf_name = names[pattern].format(i=layer)
        w = tensor.detach().float()
        if arch == "llama" and gguf_name.split(".")[-2] in ("attn_q", "attn_k"):
            w = llama_permute(w, c.num_attention_heads if ".attn_q." in gguf_name else c.num_key_value_heads)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            w = w + 1.0
        for gguf_name, w in gguf_tensors(gguf_name, w):
            if w.dim() == 1 or gguf_name.endswith(FLOAT_MATRICES):
                writer.add_tensor(gguf_name, w.numpy().astype(np.float32))
            else:
                data, raw = encode(w.numpy(), qtype, gen)
                writer.add_tensor(gguf_name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFCase(path, arch, qtype, model, eos_id, template)


def _write_tokenizer(writer, hf_tokenizer, arch: str) -> tuple[int, str]:
    """Our byte-level BPE tokenizer as llama.cpp writes a gpt2-style vocabulary; for gemma3 as a
    sentencepiece ("llama") vocabulary with scores, the form transformers' Gemma GGUF converter reads."""
    tokens = hf_tokenizer.convert_ids_to_tokens(list(range(len(hf_tokenizer))))
    special = set(hf_tokenizer.all_special_ids)
    types = [3 if i in special else 1 for i in range(len(tokens))]  # 3: control
    if arch == "gemma3":
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "smollm")
        merges = json.loads(hf_tokenizer.backend_tokenizer.to_str())["model"]["merges"]
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    writer.add_bos_token_id(hf_tokenizer.convert_tokens_to_ids("<|im_start|>"))
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(hf_tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    template = CHAT_TEMPLATE_MARK + hf_tokenizer.chat_template
    writer.add_chat_template(template)
    return eos, template
