"""Tiny tokenizers and random-weight checkpoints, built locally (no model hub needed).

Tests build their fixtures with these, as do scripts/make_tiny_model.py (`make model`) and the
demo build's tokenizer (tools/demo_build). Everything is saved through transformers'
`save_pretrained`, so the files are genuine Hugging Face checkpoints.
"""
from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]


def corpus_text(max_chars: int = 400_000) -> str:
    """The tests' prompt text: the bench's standard-library text (imported when asked: verispec.bench
    loads torch, and the demo build's --help should not wait for it)."""
    from verispec.bench.vocabulary import corpus_text as stdlib_text

    return stdlib_text(max_chars)


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_text()
    chunk = 2000
    tok.train_from_iterator((text[i:i + chunk] for i in range(0, len(text), chunk)), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    hf.add_tokens(THINK_TOKENS)  # not special: they stay in decoded text for the reasoning parser
    hf.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    return hf


def _checkpoint_dir(out_dir: str | Path, tokenizer_dir: str | Path | None):
    """(the created directory, the tokenizer saved in it): a new tiny tokenizer, or `tokenizer_dir`'s."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        return out, build_tokenizer(out)
    hf_tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hf_tok.save_pretrained(str(out))
    return out, hf_tok


def tiny_config(model_type: str, vocab_size: int, **overrides):
    """A small transformers config of the given model_type (llama, qwen2, qwen3, mistral)."""
    from transformers import AutoConfig

    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    if model_type in ("qwen3", "qwen3_moe"):
        base["head_dim"] = 16
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def build_tiny_model(out_dir: str | Path, model_type: str = "qwen3", seed: int = 0,
                     tokenizer_dir: str | Path | None = None, extra_vocab: int = 0,
                     dtype: str = "float32", **config_overrides):
    """Random-weight model + tokenizer + generation_config, saved as a HF checkpoint.

    `extra_vocab` pads the model's vocabulary past the tokenizer's (as real checkpoints do).
    Returns the transformers model (in float32) for use as a test oracle.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out, hf_tok = _checkpoint_dir(out_dir, tokenizer_dir)
    vocab = len(hf_tok) + extra_vocab
    config = tiny_config(model_type, vocab, **config_overrides)
    config.eos_token_id = hf_tok.convert_tokens_to_ids("<|im_end|>")
    config.bos_token_id = None
    config.pad_token_id = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; scaling the head sharpens them so greedy parity tests
    # compare confident choices rather than near-ties.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0) if model_type != "gemma" else p.zero_()
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=[config.eos_token_id, config.pad_token_id],
                     pad_token_id=config.pad_token_id).save_pretrained(str(out))
    return model


def write_random_eagle3(out_dir: str | Path, target_config: dict, draft_vocab_size: int | None = None,
                        layer_type: str = "llama", seed: int = 0, with_embedding: bool = True,
                        d2t_offset_stride: int = 1, aux_layer_ids: list[int] | None = None,
                        norm_before_residual: bool = True, hidden_size: int | None = None,
                        dtype: str = "float32", norm_before_fc: bool = False, fc_norm: bool = False) -> Path:
    """A random-weight EAGLE3 drafter in the speculators format for a target config.

    The draft vocabulary is every `d2t_offset_stride`-th target id (stride > 1 gives non-trivial
    d2t offsets). Tests use it for identity; `verispec bench` for drafter cost at real shapes.
    """
    import json

    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h_t = int(target_config["hidden_size"])
    h = int(hidden_size or h_t)
    vocab = int(target_config["vocab_size"])
    heads = int(target_config["num_attention_heads"])
    kv_heads = int(target_config.get("num_key_value_heads") or heads)
    head_dim = int(target_config.get("head_dim") or h_t // heads)
    inter = int(target_config["intermediate_size"])
    draft_ids = torch.arange(0, vocab, d2t_offset_stride)[: draft_vocab_size or vocab]
    vd = len(draft_ids)
    torch_dtype = getattr(torch, dtype)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.08).to(torch_dtype)

    tensors = {
        "layers.0.hidden_norm.weight": torch.ones(h, dtype=torch_dtype),
        "layers.0.input_layernorm.weight": torch.ones(h, dtype=torch_dtype),
        "layers.0.post_attention_layernorm.weight": torch.ones(h, dtype=torch_dtype),
        "layers.0.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "layers.0.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "layers.0.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "layers.0.self_attn.o_proj.weight": rand(h, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": torch.ones(h, dtype=torch_dtype),
        "lm_head.weight": rand(vd, h),
        "d2t": (draft_ids - torch.arange(vd)).to(torch.long),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True),
    }
    if layer_type == "qwen3":
        tensors["layers.0.self_attn.q_norm.weight"] = torch.ones(head_dim, dtype=torch_dtype)
        tensors["layers.0.self_attn.k_norm.weight"] = torch.ones(head_dim, dtype=torch_dtype)
    num_aux = len(aux_layer_ids) if aux_layer_ids is not None else 3
    tensors["fc.weight"] = rand(h, num_aux * h_t)
    if norm_before_fc:
        tensors["input_norm.weight"] = (1 + rand(num_aux * h_t)).to(torch_dtype)
    if fc_norm:
        for i in range(num_aux):
            tensors[f"fc_norm.{i}.weight"] = (1 + rand(h_t)).to(torch_dtype)
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, h)
    save_file(tensors, str(out / "model.safetensors"))
    layer_config = {
        "model_type": layer_type, "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6), "vocab_size": vocab,
        "rope_theta": 10000.0, "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
        "hidden_act": "silu", "num_hidden_layers": 1,
    }
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer_config, "draft_vocab_size": vd, "target_hidden_size": h_t,
        "norm_before_residual": norm_before_residual, "norm_before_fc": norm_before_fc, "fc_norm": fc_norm,
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": 3}], "verifier": {"name_or_path": None}},
    }
    if aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


QWEN3_5_TINY_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
QWEN3_5_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, num_position_embeddings=16)


QWEN3_5_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48)


def build_tiny_qwen3_5(out_dir: str | Path, wrapper: bool = False, seed: int = 0,
                       tokenizer_dir: str | Path | None = None, tie_word_embeddings: bool = False,
                       moe: bool = False, **text_overrides):
    """A random-weight Qwen3.5 checkpoint: `qwen3_5_text` (Qwen3_5ForCausalLM), or with `wrapper`
    the multimodal `qwen3_5` layout (Qwen3_5ForConditionalGeneration with a one-block vision tower).
    With `moe`, the MoE model types (`qwen3_5_moe_text` / `qwen3_5_moe`): QWEN3_5_TINY_MOE's
    experts and shared expert in every layer, saved one linear per expert as transformers writes them.

    Weights are drawn so that no term hides: (1 + w) norms get w in [-0.5, 0.5), the GDN output
    norm w in [0.5, 1.5), A_log spans slow to fast decays and dt_bias is non-zero.
    Returns the transformers model (float32) for use as a test oracle.
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    config_cls, text_config_cls = getattr(transformers, f"{kind}Config"), getattr(transformers, f"{kind}TextConfig")
    out, hf_tok = _checkpoint_dir(out_dir, tokenizer_dir)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    pad = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    text = dict(QWEN3_5_TINY_TEXT, vocab_size=len(hf_tok), eos_token_id=eos, pad_token_id=pad,
                tie_word_embeddings=tie_word_embeddings)
    if moe:
        del text["intermediate_size"]
        text.update(QWEN3_5_TINY_MOE)
    text.update(text_overrides)
    torch.manual_seed(seed)
    if wrapper:
        config = config_cls(text_config=text, vision_config=dict(QWEN3_5_TINY_VISION),
                            tie_word_embeddings=tie_word_embeddings)
        model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)
    else:
        model = getattr(transformers, f"{kind}ForCausalLM")(text_config_cls(**text))
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "norm" in name and name.endswith(".weight"):
                p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 2.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.normal_(0.0, 0.08, generator=gen)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad).save_pretrained(str(out))
    return model


def random_mtp_head(text_config: dict, seed: int = 0, scale: float = 0.08, stacked_experts: bool = True) -> dict:
    """Random weights of a Qwen3.5 MTP head for a text config, named as in Hugging Face checkpoints
    (`mtp.fc.weight`, ...), norms zero-centred (HF convention, applied as 1 + w). Norm weights are
    multiples of 2^-8 in [-0.5, 0.5), so 1 + w is exact in float32 and the HF and MLX forms of the
    same head compute identical numbers. An MoE config (`num_experts`) gets the MoE MLP: router,
    experts (stacked as the releases ship them, or with `stacked_experts=False` one linear each)
    and the gated shared expert."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h = int(text_config["hidden_size"])
    heads = int(text_config.get("num_attention_heads", 16))
    kv_heads = int(text_config.get("num_key_value_heads") or heads)
    head_dim = int(text_config.get("head_dim") or 256)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * scale

    def norm(dim):
        return (torch.randint(-128, 128, (dim,), generator=gen) / 256.0).float()

    layer = {
        "input_layernorm.weight": norm(h), "post_attention_layernorm.weight": norm(h),
        "self_attn.q_proj.weight": rand(heads * head_dim * 2, h), "self_attn.k_proj.weight": rand(kv_heads * head_dim, h),
        "self_attn.v_proj.weight": rand(kv_heads * head_dim, h), "self_attn.o_proj.weight": rand(h, heads * head_dim),
        "self_attn.q_norm.weight": norm(head_dim), "self_attn.k_norm.weight": norm(head_dim),
    }
    if text_config.get("num_experts"):
        e, inter, shared = (int(text_config[k]) for k in ("num_experts", "moe_intermediate_size",
                                                            "shared_expert_intermediate_size"))
        layer.update({"mlp.gate.weight": rand(e, h), "mlp.shared_expert_gate.weight": rand(1, h),
                      "mlp.shared_expert.gate_proj.weight": rand(shared, h),
                      "mlp.shared_expert.up_proj.weight": rand(shared, h),
                      "mlp.shared_expert.down_proj.weight": rand(h, shared)})
        gate_up, down = rand(e, 2 * inter, h), rand(e, h, inter)
        if stacked_experts:
            layer.update({"mlp.experts.gate_up_proj": gate_up, "mlp.experts.down_proj": down})
        else:
            for i in range(e):
                layer.update({f"mlp.experts.{i}.gate_proj.weight": gate_up[i, :inter].clone(),
                              f"mlp.experts.{i}.up_proj.weight": gate_up[i, inter:].clone(),
                              f"mlp.experts.{i}.down_proj.weight": down[i].clone()})
    else:
        inter = int(text_config["intermediate_size"])
        layer.update({"mlp.gate_proj.weight": rand(inter, h), "mlp.up_proj.weight": rand(inter, h),
                      "mlp.down_proj.weight": rand(h, inter)})
    tensors = {"mtp.fc.weight": rand(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": norm(h),
               "mtp.pre_fc_norm_hidden.weight": norm(h), "mtp.norm.weight": norm(h)}
    tensors.update({f"mtp.layers.0.{k}": v for k, v in layer.items()})
    return tensors


def write_mtp_sidecar(path: str | Path, tensors: dict, mlx: bool = False) -> Path:
    """Save an MTP head (HF-convention tensors as random_mtp_head returns) as a sidecar file. With
    `mlx`, as MLX conversions write it: norm weights stored as 1 + w, metadata {"format": "mlx"}."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mlx:
        tensors = {k: (1.0 + v if v.ndim == 1 else v) for k, v in tensors.items()}  # every 1-D head tensor is a norm
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "mlx" if mlx else "pt"})
    return path


GEMMA4_TINY_TEXT = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0, final_logit_softcapping=5.0, max_position_embeddings=1024, rms_norm_eps=1e-6,
)
GEMMA4_TINY_MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24)
GEMMA4_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                          position_embedding_size=64)


def build_tiny_gemma4(out_dir: str | Path, moe: bool = False, wrapper: bool = False, seed: int = 0,
                      tokenizer_dir: str | Path | None = None, tie_word_embeddings: bool = True,
                      **text_overrides):
    """A random-weight Gemma 4 checkpoint: `gemma4_text` (Gemma4ForCausalLM), or with `wrapper` the
    multimodal `gemma4` layout (Gemma4ForConditionalGeneration with a one-block vision tower).

    The default text config has the 31B's structure at toy size: 8-token sliding window, sliding
    layers 2 kv heads x 16, full layers 1 kv head x 32 with k_eq_v and proportional RoPE, final
    logit softcapping (at 5, so that it matters for these logits); `moe` adds the 26B-A4B's routed
    experts (8, top-2) beside the dense MLP. E-series features come through `text_overrides`
    (hidden_size_per_layer_input, num_kv_shared_layers, use_double_wide_mlp).
    Weights are drawn so that no term hides: weight-only norms, layer_scalar, the router's scale
    and per_expert_scale uniform in [0.5, 1.5); the rest normal(0, 0.08).
    Returns the transformers model (float32) for use as a test oracle.
    """
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, \
        Gemma4TextConfig, GenerationConfig

    out, hf_tok = _checkpoint_dir(out_dir, tokenizer_dir)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    pad = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    text = dict(GEMMA4_TINY_TEXT, vocab_size=len(hf_tok), eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
                tie_word_embeddings=tie_word_embeddings)
    if moe:
        text.update(GEMMA4_TINY_MOE)
    text.update(text_overrides)
    text.setdefault("vocab_size_per_layer_input", text["vocab_size"])
    torch.manual_seed(seed)
    if wrapper:
        config = Gemma4Config(text_config=text, vision_config=dict(GEMMA4_TINY_VISION),
                              tie_word_embeddings=tie_word_embeddings)
        model = Gemma4ForConditionalGeneration(config)
    else:
        model = Gemma4ForCausalLM(Gemma4TextConfig(**text))
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "router.per_expert_scale")):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.normal_(0.0, 0.08, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # a buffer in transformers, saved with the weights
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad).save_pretrained(str(out))
    return model


def build_tiny_gemma4_assistant(out_dir: str | Path, target_config: dict, seed: int = 0, hidden_size: int = 32,
                                num_hidden_layers: int = 4, ordered_embeddings: bool = False,
                                num_centroids: int = 2, centroid_top_k: int = 1, **text_overrides):
    """A random-weight Gemma 4 assistant drafter (`gemma4_assistant`, transformers'
    Gemma4AssistantForCausalLM) for a Gemma 4 target config (gemma4 or gemma4_text): its layers
    take the target's head dims and kv-head counts per layer type (they read the target's K/V),
    the last layer is full attention, the rest sliding. `ordered_embeddings` adds the centroid-
    masked lm_head (num_centroids must divide the vocabulary) with a random token ordering.
    Weights drawn as in build_tiny_gemma4. Returns the transformers model (float32)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    from verispec.models.gemma4 import Gemma4Settings, LayerType

    target_text = target_config.get("text_config") or target_config
    s = Gemma4Settings(target_text)
    sliding, full = s.layer_types.index(LayerType.SLIDING), s.layer_types.index(LayerType.FULL)
    text = dict(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads[sliding], head_dim=s.head_dims[sliding],
        global_head_dim=s.head_dims[full], num_global_key_value_heads=s.num_kv_heads[full], attention_k_eq_v=True,
        sliding_window=s.sliding_window, layer_types=["sliding_attention"] * (num_hidden_layers - 1) + ["full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, vocab_size=s.vocab_size,
        max_position_embeddings=s.max_position_embeddings, rms_norm_eps=s.rms_norm_eps,
    )
    if target_text.get("rope_parameters"):
        text["rope_parameters"] = target_text["rope_parameters"]
    text.update(text_overrides)
    extra = dict(use_ordered_embeddings=True, num_centroids=num_centroids,
                 centroid_intermediate_top_k=centroid_top_k) if ordered_embeddings else {}
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=s.hidden_size, **extra)
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layer_scalar")):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.normal_(0.0, 0.08, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            elif name.endswith("token_ordering"):
                b.copy_(torch.randperm(s.vocab_size, generator=gen))
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return model


GEMMA3_TINY_TEXT = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, query_pre_attn_scalar=24, sliding_window=8, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                     "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0}},
    final_logit_softcapping=5.0,
)
GEMMA3_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          image_size=16, patch_size=4)


def build_tiny_gemma3(out_dir: str | Path, wrapper: bool = False, seed: int = 0,
                      tokenizer_dir: str | Path | None = None, tie_word_embeddings: bool = True, **text_overrides):
    """A random-weight Gemma 3 checkpoint: `gemma3_text` (Gemma3ForCausalLM), or with `wrapper` the
    multimodal `gemma3` layout (Gemma3ForConditionalGeneration with a one-block vision tower).

    The default text config: 5 sliding layers (8-token window) then a full one, each type with its
    own RoPE base (100 vs 1e4, linear x4 on full layers, so that a swapped base shows on short
    prompts), query_pre_attn_scalar 24 != head_dim 16, final logit softcapping at 5. Norm weights
    are drawn in [-0.5, 0.5) (applied as 1 + w), the rest normal(0, 0.08).
    Returns the transformers model (float32) for use as a test oracle.
    """
    import torch
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, \
        Gemma3TextConfig, GenerationConfig

    out, hf_tok = _checkpoint_dir(out_dir, tokenizer_dir)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    pad = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    text = dict(GEMMA3_TINY_TEXT, vocab_size=len(hf_tok), eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
                tie_word_embeddings=tie_word_embeddings)
    text.update(text_overrides)
    torch.manual_seed(seed)
    if wrapper:
        config = Gemma3Config(text_config=text, vision_config=dict(GEMMA3_TINY_VISION), mm_tokens_per_image=4,
                              tie_word_embeddings=tie_word_embeddings)
        model = Gemma3ForConditionalGeneration(config)
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**text))
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
            else:
                p.normal_(0.0, 0.08, generator=gen)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad).save_pretrained(str(out))
    return model


def stack_expert_tensors(model_dir: str | Path) -> None:
    """Rewrite a checkpoint's per-expert MoE weights (`<experts>.{e}.{gate,up,down}_proj.weight`, as
    transformers saves Qwen MoE models) as the stacked tensors the Qwen3.5 / 3.6 releases ship:
    `<experts>.gate_up_proj` [E, 2I, H] (gate rows first) and `<experts>.down_proj` [E, H, I]."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(path))
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if match is None:
            out[name] = t
        else:
            per_expert.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = t
    for prefix, projs in per_expert.items():
        ids = sorted(projs["down_proj"])
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([projs["gate_proj"][e], projs["up_proj"][e]])
                                                     for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in ids])
    save_file(out, str(path), metadata={"format": "pt"})
