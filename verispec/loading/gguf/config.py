"""GGUF metadata -> the Hugging Face config dict our model classes read.

llama.cpp's converters write `{arch}.*` keys; what they leave out, llama.cpp's loader fills with
per-architecture rules, which we follow where they decide the arithmetic:
- gemma3: sliding layers exist when `attention.sliding_window` is set, 5 sliding then 1 full,
  the sliding layers' RoPE base 1e4 (`rope.freq_base_swa` when written); the attention scale is
  head_dim^-0.5 except on the 27B (62 layers), where it is (hidden / heads)^-0.5 — what the released
  configs' query_pre_attn_scalar says (256 on 1B-12B = head_dim, 168 on the 27B).
- llama: `rope.dimension_count` is the head dim; llama.cpp's q/k row permutation is undone by
  the tensor reader (names.py); Llama 3.x's RoPE scaling comes as the `rope_freqs` tensor
  (a factor per frequency pair that llama.cpp divides the frequency by).
- qwen3moe: Qwen3's decoder with a sparse MoE MLP; llama.cpp always renormalises the top-k
  routing weights (norm_topk_prob) and wants a router (`ffn_gate_inp`) in every layer; a layer
  without one is read as a dense MLP layer (`mlp_only_layers`).
"""
from __future__ import annotations

from verispec.errors import UnsupportedModelError

# GGUF general.architecture -> our model_type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
                 "qwen3moe": "qwen3_moe"}
MIXTURE_OF_EXPERTS = ("qwen3moe",)
SUPPORTED_ROPE_SCALING = ("none", "linear")
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_27B_LAYERS = 62
GEMMA3_LOCAL_ROPE_BASE = 10_000.0


class Metadata:
    """The file's key/value metadata with `{arch}.` lookups and errors that name the key."""

    def __init__(self, values: dict, path: str):
        self.values = values
        self.path = path
        self.architecture = values.get("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture '{self.architecture}' in {path} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})")

    def arch(self, key: str, default=...):
        full = f"{self.architecture}.{key}"
        if full in self.values:
            return self.values[full]
        if default is ...:
            raise UnsupportedModelError(f"GGUF file {self.path} has no '{full}' metadata, which is required")
        return default

    def uniform(self, key: str, default=...):
        """A per-model value that some converters write per layer (an array): one value or an error."""
        value = self.arch(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"GGUF '{self.architecture}.{key}' varies by layer ({sorted(set(value))}); "
                                            "only one value for all layers is supported")
            value = value[0]
        return value


def hf_config(meta: Metadata, tensor_shapes: dict[str, tuple[int, ...]],
              rope_freqs: list[float] | None = None) -> dict:
    """The config dict for models/registry.py's classes. tensor_shapes: GGUF name -> torch shape;
    rope_freqs: the `rope_freqs.weight` tensor's values when the file has one."""
    arch = meta.architecture
    if rope_freqs is not None and arch != "llama":
        raise UnsupportedModelError(f"GGUF file {meta.path} carries rope_freqs (per-frequency RoPE factors) on a "
                                    f"{arch} model; they are supported on llama files only")
    if meta.arch("expert_count", 0) and arch not in MIXTURE_OF_EXPERTS:
        raise UnsupportedModelError(f"GGUF file {meta.path} is a mixture-of-experts {arch} model, which is not "
                                    f"supported from GGUF (mixture-of-experts: {', '.join(MIXTURE_OF_EXPERTS)})")
    hidden = int(meta.arch("embedding_length"))
    heads = int(meta.uniform("attention.head_count"))
    kv_heads = int(meta.uniform("attention.head_count_kv", heads))
    head_dim = meta.arch("attention.key_length", None)
    if head_dim is None and arch == "llama":
        head_dim = meta.arch("rope.dimension_count", None)
    head_dim = int(head_dim or hidden // heads)
    if "token_embd.weight" not in tensor_shapes:
        raise UnsupportedModelError(f"GGUF file {meta.path} has no token_embd.weight tensor")
    config = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(meta.arch("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        # MoE files need it only for dense layers (qwen3moe has none unless a layer lacks a router)
        "intermediate_size": int(meta.uniform("feed_forward_length", 0 if arch in MIXTURE_OF_EXPERTS else ...)),
        # the embedding's rows, not {arch}.vocab_size: the weights decide what the model computes
        "vocab_size": int(tensor_shapes["token_embd.weight"][0]),
        "max_position_embeddings": int(meta.arch("context_length", 4096)),
        "rms_norm_eps": float(meta.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
    }
    full_rope = _rope(meta, default_theta=1_000_000.0 if arch == "gemma3" else 10_000.0)
    if arch in MIXTURE_OF_EXPERTS:
        config.update(_qwen3_moe(meta, config, tensor_shapes))
    if arch == "gemma3":
        config.update(_gemma3(meta, config, full_rope))
    else:
        config["rope_parameters"] = full_rope
        if rope_freqs is not None:
            if full_rope["rope_type"] != "default":
                raise UnsupportedModelError(f"GGUF file {meta.path} has both rope_freqs and "
                                            f"{full_rope['rope_type']} RoPE scaling; one of them is supported")
            # Llama 3.x's llama3 scaling, as llama.cpp's converter stores it: theta_i / factor_i
            full_rope["frequency_factors"] = list(rope_freqs)
        if arch == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
            config["mlp_bias"] = "blk.0.ffn_gate.bias" in tensor_shapes
    return config


def _rope(meta: Metadata, default_theta: float) -> dict:
    params = {"rope_type": "default", "rope_theta": float(meta.arch("rope.freq_base", default_theta))}
    scaling = meta.arch("rope.scaling.type", "none")
    if scaling not in SUPPORTED_ROPE_SCALING:
        raise UnsupportedModelError(f"GGUF RoPE scaling '{scaling}' in {meta.path} is not supported "
                                    f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)})")
    factor = float(meta.arch("rope.scaling.factor", 1.0) or 1.0)
    if scaling == "linear" and factor != 1.0:
        params.update(rope_type="linear", factor=factor)
    return params


def _qwen3_moe(meta: Metadata, config: dict, tensor_shapes: dict[str, tuple[int, ...]]) -> dict:
    layers = range(config["num_hidden_layers"])
    dense = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes]
    sparse = [i for i in layers if i not in dense]
    # the expert width from the stacks themselves when the converter left it out ([E, I, H])
    stack = tensor_shapes.get(f"blk.{sparse[0]}.ffn_gate_exps.weight") if sparse else None
    expert_width = meta.arch("expert_feed_forward_length", None) or (stack[1] if stack else 0)
    return {
        "num_experts": int(meta.arch("expert_count")),
        "num_experts_per_tok": int(meta.arch("expert_used_count")),
        "moe_intermediate_size": int(expert_width),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _gemma3(meta: Metadata, config: dict, full_rope: dict) -> dict:
    layers, window = config["num_hidden_layers"], meta.arch("attention.sliding_window", None)
    if window:
        layer_types = ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                       for i in range(layers)]
    else:
        layer_types = ["full_attention"] * layers
    if layers == GEMMA3_27B_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    local_base = float(meta.arch("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
    return {
        "layer_types": layer_types,
        "sliding_window": int(window) if window else None,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": meta.arch("final_logit_softcapping", None),
        "attn_logit_softcapping": meta.arch("attn_logit_softcapping", None),
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {"full_attention": full_rope,
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_base}},
    }
