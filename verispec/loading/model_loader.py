"""config.json + safetensors -> a verispec model on the chosen device and dtype."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from verispec import log
from verispec.errors import VerispecError
from verispec.loading import host_memory
from verispec.loading.gguf import GGUFCheckpoint, is_gguf
from verispec.loading.parts import check_part_shape, find_part, part_modules
from verispec.loading.weights import checkpoint_files, iter_tensors, tensor_shapes
from verispec.models.base import CausalLM, renamed
from verispec.models.layers.meta import materialize, on_meta
from verispec.models.layers.parallel import Shard
from verispec.models.sharding import check_shardable, shard_model
from verispec.models.registry import model_class

def read_config(model_dir: Path) -> dict:
    """config.json of a checkpoint directory, or the config built from a GGUF file's metadata."""
    if is_gguf(model_dir):
        return GGUFCheckpoint(model_dir).config
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise VerispecError(f"could not read {path}: {exc}") from exc


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               keep_gguf_4bit: bool | None = None, shard: Shard | None = None) -> CausalLM:
    """A checkpoint directory (config.json + safetensors; quantized formats load as stored) or a
    GGUF file (see resolve_model). A GGUF's Q4_0 / Q4_1 linear weights stay quantized where torch's
    int4 kernel runs (CUDA in bfloat16, a CPU in bfloat16 or float16; `keep_gguf_4bit` overrides),
    its Q8_0 ones where the CPU integer-dot kernel does (unless keep_gguf_4bit is False), the rest
    arrive dequantized.
    `shard`: this tensor-parallel rank's share of the model, read alone from the files
    (models/sharding.py; a dense safetensors checkpoint, checked by check_shardable)."""
    from verispec.loading import quantized_shards
    from verispec.loading.gguf import KEPT_8BIT_TYPES, QUANTIZATION_CONFIG, keeps_4bit, keeps_8bit, keeps_table
    from verispec.quant import loading as quant_loading

    if is_gguf(model_dir):
        gguf = GGUFCheckpoint(model_dir)
        log.debug("%s", gguf.describe())
        reason = keeps_4bit(device, dtype)
        keep = reason is None if keep_gguf_4bit is None else keep_gguf_4bit
        four_bit = gguf.linear_names()
        kept = four_bit if keep else set()
        if four_bit and not keep and keep_gguf_4bit is None:
            log.debug("GGUF %s: 4-bit weights dequantized: %s", gguf.path.name, reason)
        if keep_gguf_4bit is not False and (eight_bit := gguf.linear_names(KEPT_8BIT_TYPES)):
            if (why := keeps_8bit(device, dtype)) is None:
                kept = kept | eight_bit
            else:
                log.debug("GGUF %s: Q8_0 weights dequantized: %s", gguf.path.name, why)
        if keep and (table := gguf.quantized_table()) is not None and gguf.config.get("tie_word_embeddings"):
            if (why := keeps_table(device, dtype)) is None:
                kept = kept | {table}
            else:
                log.debug("GGUF %s: the embedding table dequantized: %s", gguf.path.name, why)
        config = dict(gguf.config, quantization=QUANTIZATION_CONFIG) if kept else gguf.config
        tensors = gguf.tensors_for_model(kept)
        shapes = gguf.checkpoint_shapes(kept) if kept else None
    else:
        config = quant_loading.with_sidecar_config(read_config(model_dir), model_dir)
        files = checkpoint_files(model_dir)
        tensors, shapes = iter_tensors(files), tensor_shapes(files)
    cls = model_class(config.get("model_type"))
    with on_meta():
        model = cls(config)
        unwrapped: list[str] = []
        if shard is not None:
            if is_gguf(model_dir):
                raise VerispecError("tensor parallelism reads safetensors checkpoints only (so far), not GGUF files")
            check_shardable(config, shard.world_size)
            parts = shard_model(model, shard)
            # a quantized layer's packed words, scales and biases split as its weight is
            parts, shapes, unwrapped = quantized_shards.split_quantized(model, parts, shapes, shard,
                                                                        lambda name: _our_name(model, name))
            tensors = iter_tensors(files, part_of=lambda name: parts.get(_our_name(model, name)))
        quantized = False
        if shapes is not None:  # quantized checkpoints: their linears / embeddings become quantized layers
            named = {_our_name(model, name): quant_loading.CheckpointTensor(name, shape) for name, shape in shapes.items()}
            quantized = quant_loading.prepare_model(model, config, named) is not None
        if unwrapped:
            quantized_shards.rewrap(model, unwrapped, shard)
    materialize(model, device)
    model.to(dtype)
    _load_weights(model, tensors, dtype, device)
    model.tie_weights()
    if quantized:
        quant_loading.finish_loading(model)
    model.eval()
    model.requires_grad_(False)
    return model


def load_whole_tables(model_dir: Path, target: CausalLM) -> CausalLM:
    """The target's embedding and head read whole from its checkpoint, on its device and dtype
    (models/drafter_tables.py: what a drafter reads on rank 0 of a tensor-parallel group),
    quantized as the checkpoint stores them. Only those tensors are read."""
    from verispec.models.drafter_tables import WholeTables
    from verispec.quant import loading as quant_loading

    config = quant_loading.with_sidecar_config(read_config(model_dir), model_dir)
    files = checkpoint_files(model_dir)
    param = next(p for p in target.parameters() if p.is_floating_point())
    with on_meta():
        tables = WholeTables(target)
        wanted = lambda name: _our_name(tables, name).startswith(("model.embed_tokens.", "lm_head."))  # noqa: E731
        named = {_our_name(tables, name): quant_loading.CheckpointTensor(name, shape)
                 for name, shape in tensor_shapes(files).items() if wanted(name)}
        quantized = quant_loading.prepare_model(tables, config, named) is not None
    tables.to_empty(device=param.device)
    tables.to(param.dtype)
    _load_weights(tables, iter_tensors(files, only=wanted), param.dtype, param.device)
    tables.tie_weights()
    if quantized:
        quant_loading.finish_loading(tables)
    return tables.eval().requires_grad_(False)


def resolve_numerics(model: CausalLM, requested: str) -> tuple[str, str | None]:
    """The numerics `model` runs for --numerics `requested` on its device, and why not exact
    (models/layers/numerics.py `resolve`, told which kinds of layers the model has)."""
    from verispec.kernels import expert_gemv
    from verispec.models.layers import numerics
    from verispec.models.layers.gated_delta_net import GatedDeltaNet
    from verispec.models.layers.moe import FusedExperts
    from verispec.quant import dense
    from verispec.quant.layers.experts import MLXQuantizedExperts, QuantizedExpertStack
    from verispec.quant.layers.linear import QuantizedLinear

    param = next(model.parameters())
    modules = list(model.modules())
    float_experts = any(isinstance(m, FusedExperts) for m in modules)
    return numerics.resolve(
        requested, param.device, param.dtype, recurrent=any(isinstance(m, GatedDeltaNet) for m in modules),
        experts=any(isinstance(m, (MLXQuantizedExperts, QuantizedExpertStack)) for m in modules)
        or (float_experts and param.device.type != "cpu" and not expert_gemv.available(param.device)),
        quantized=any(isinstance(m, QuantizedLinear) for m in modules),
        float_experts=float_experts, layer_kernel=getattr(model, "layer_stack", None) is not None,
        weight_bytes=dense.dense_bytes(model, param.dtype))


def prepare_for_device(model: CausalLM, fuse_small_ops: bool = True, numerics: str = "fast") -> None:
    """The model rewrites made once for its device, after loading and before an engine sizes its
    KV cache, in this order: q/k/v and gate/up merged into one GEMM each, and on CUDA the small ops
    compiled (`fuse_small_ops`); then each quantized layer bound to its kernel (verispec.quant.prepare,
    which converts a merged layer once); under exact numerics (`numerics`, as resolve_numerics
    gave it) on CUDA, every linear layer bound to its row-invariant kernel. Calling it again
    changes nothing."""
    from verispec import quant
    from verispec.kernels import decode_attention

    device = next(model.parameters()).device
    if fuse_small_ops and hasattr(model, "fuse_small_ops"):
        if device.type != "cuda":
            # merged projections only (q/k/v and gate/up as one GEMM each): on a CPU a decode
            # step's time is largely per-call overhead of small matrix products
            model.fuse_small_ops(compile=False)
        elif decode_attention.triton is None:
            log.debug("small-op fusion off: Triton is not installed")
        else:
            model.fuse_small_ops()  # compiled on first use: prewarm pays for it
    if device.type == "cpu":  # what the merges freed, before the kernels' copies are made beside the weights
        host_memory.release_free_pages()
    quant.prepare(model, exact_numerics=numerics == "exact" and device.type == "cuda")
    if numerics == "exact" and device.type == "cuda":
        from verispec.models.layers.exact import use_row_invariant_experts, use_row_invariant_linears

        use_row_invariant_linears(model)
        use_row_invariant_experts(model)


def _our_name(model: CausalLM, ckpt_name: str) -> str:
    for src, dst in model.checkpoint_prefix_map.items():
        if ckpt_name.startswith(src):
            ckpt_name = dst + ckpt_name[len(src):]
            break
    return renamed(ckpt_name, model.checkpoint_renames)


def _load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                  device: torch.device) -> None:
    from verispec.quant.loading import loadable_tensors

    params = dict(model.named_parameters())
    params.update(loadable_tensors(model))  # quantized layers' packed integer buffers
    parts = part_modules(model)
    covered: dict[str, int] = {}  # elements written per parameter (a part fills a slice)
    ignored: list[str] = []
    for ckpt_name, tensor in tensors:
        name, index = _our_name(model, ckpt_name), ()
        if name not in params:
            part = find_part(parts, name)
            if part is None:
                ignored.append(ckpt_name)
                continue
            name, index = part
        param = params[name]
        dest = param[index] if index else param
        tensor = model.checkpoint_tensor(ckpt_name, tensor)
        check_part_shape(ckpt_name, tensor, dest)
        with torch.no_grad():
            dest.copy_(as_stored(ckpt_name, tensor, param, dtype).to(device=device))
        covered[name] = covered.get(name, 0) + tensor.numel()
    loaded = {name for name, count in covered.items() if count >= params[name].numel()}
    tied_names = {n for n in params if n.startswith("lm_head.")}  # a quantized head has several tensors
    tied = tied_names if getattr(getattr(model, "settings", None), "tie_word_embeddings", False) else set()
    missing = sorted(set(params) - loaded - tied)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise VerispecError(f"checkpoint is missing weights: {shown}")
    if ignored:
        log.debug("ignored %d checkpoint tensors not used by %s (e.g. %s)", len(ignored),
                  type(model).__name__, ", ".join(ignored[:3]))


def as_stored(ckpt_name: str, tensor: torch.Tensor, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float tensors in the model's dtype. A quantized layer's integer buffers keep the stored bits
    (uint32 words as int32, FP8 codes as uint8, float32 global scales as int32), so that casting
    the model to its dtype leaves them alone."""
    if param.is_floating_point():
        return tensor.to(dtype=dtype)
    if tensor.element_size() != param.element_size():
        raise VerispecError(f"weight {ckpt_name} is {tensor.dtype}, verispec expects {param.dtype} there")
    return tensor.view(param.dtype) if tensor.dtype != param.dtype else tensor
