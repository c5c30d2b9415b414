"""`verispec quantize`: a float checkpoint -> a quantized one that the format's own library reads.

- `mlx-4bit`, `mlx-8bit` (also `mlx-3bit` / `mlx-6bit`): MLX affine, the layout `mlx_lm.convert -q`
  writes (verispec/quant/mlx_affine.py); readable by mlx-lm. Linear and embedding weights whose
  input width is a multiple of the group size are quantized, as mlx-lm does.
- `fp8`: compressed-tensors float-quantized FP8 E4M3 with per-channel scales, weights only
  (W8A16); readable by compressed-tensors (and so transformers / vLLM).
- `nvfp4`: compressed-tensors nvfp4-pack-quantized, weights only (NVFP4A16).
For the compressed-tensors formats linear weights are quantized and lm_head is kept in float,
as llm-compressor's recipes do. MoE experts are quantized in the MLX formats only, as mlx-lm's
stacks (`switch_mlp` / `switch_glu`); experts stored one linear each are stacked first
(quant/expert_stacks.py). Layers are found through verispec's own model of the
architecture; everything else is copied unchanged, with the tokenizer and other sidecar files.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file
from torch import nn

from verispec import log
from verispec.errors import VerispecError
from verispec.models.base import renamed
from verispec.quant import compressed_tensors, detect_format, mlx_affine, nvfp4
from verispec.quant.expert_stacks import CompletedStack, ExpertStacker

SHARD_BYTES = 5 * 2 ** 30  # mlx-lm's default shard size


class MLXAffineWriter:
    """Linear and embedding weights -> weight (uint32) / scales / biases; config 'quantization'."""

    def __init__(self, bits: int, group_size: int | None):
        self.spec = mlx_affine.AffineSpec(bits, group_size or 64)  # 64: mlx-lm's default

    def skip_reason(self, our_name: str, kind: str, shape: tuple[int, ...]) -> str | None:
        if shape[-1] % self.spec.group_size:
            return f"width {shape[-1]} is not a multiple of group size {self.spec.group_size}"
        return None

    def quantize(self, prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scales, biases = mlx_affine.quantize(weight, self.spec)
        return {f"{prefix}.weight": packed.view(torch.uint32), f"{prefix}.scales": scales,
                f"{prefix}.biases": biases}

    def quantize_experts(self, prefix: str, kind: str, stack: torch.Tensor) -> dict[str, torch.Tensor]:
        """A FusedExperts stack (`gate_up_proj` [E, 2I, H] or `down_proj` [E, H, I]) -> mlx-lm's
        SwitchGLU stacks `<experts>.switch_glu.<proj>.{weight,scales,biases}` [E, ...]."""
        experts = prefix.rpartition(".")[0]
        parts = dict(zip(("gate_proj", "up_proj"), stack.chunk(2, dim=1))) if kind == "experts-gate-up" \
            else {"down_proj": stack}
        out = {}
        for proj, w in parts.items():
            e, n, k = w.shape
            for name, t in self.quantize(f"{experts}.switch_glu.{proj}", w.reshape(e * n, k)).items():
                out[name] = t.reshape(e, n, -1)
        return out

    def config_update(self, quantized: list[str]) -> dict:
        quantization = {"group_size": self.spec.group_size, "bits": self.spec.bits, "mode": "affine"}
        return {"quantization": quantization, "quantization_config": dict(quantization)}


class CompressedTensorsWriter:
    """Linear weights (not lm_head) -> FP8 (weight, weight_scale) or NVFP4 (weight_packed,
    weight_scale, weight_global_scale); config 'quantization_config' naming those layers."""

    def __init__(self, kind: str):
        self.kind = kind

    def skip_reason(self, our_name: str, kind: str, shape: tuple[int, ...]) -> str | None:
        if kind != "linear":
            return "compressed-tensors quantizes linear layers only"
        if our_name == "lm_head.weight":
            return "lm_head stays in float (as llm-compressor's recipes keep it)"
        if self.kind == "nvfp4" and shape[-1] % nvfp4.GROUP_SIZE:
            return f"width {shape[-1]} is not a multiple of {nvfp4.GROUP_SIZE}"
        return None

    def quantize(self, prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.kind == "fp8":
            q, scale = compressed_tensors.quantize_fp8_channel(weight)
            return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale}
        packed, block_scales, global_scale = nvfp4.quantize(weight)
        return {f"{prefix}.weight_packed": packed, f"{prefix}.weight_scale": block_scales,
                f"{prefix}.weight_global_scale": global_scale}

    def config_update(self, quantized: list[str]) -> dict:
        if self.kind == "fp8":
            weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                       "strategy": "channel", "dynamic": False}
            fmt = "float-quantized"
        else:
            weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": nvfp4.GROUP_SIZE,
                       "strategy": "tensor_group", "dynamic": False}
            fmt = "nvfp4-pack-quantized"
        return {"quantization_config": compressed_tensors.scheme_config(fmt, weights, quantized)}


@dataclass(frozen=True)
class OutputFormat:
    name: str
    make_writer: object = field(repr=False)  # group_size -> writer
    takes_group_size: bool = True


OUTPUT_FORMATS = {f.name: f for f in (
    OutputFormat("mlx-4bit", lambda g: MLXAffineWriter(4, g)),
    OutputFormat("mlx-8bit", lambda g: MLXAffineWriter(8, g)),
    OutputFormat("mlx-3bit", lambda g: MLXAffineWriter(3, g)),
    OutputFormat("mlx-6bit", lambda g: MLXAffineWriter(6, g)),
    OutputFormat("fp8", lambda g: CompressedTensorsWriter("fp8"), takes_group_size=False),
    OutputFormat("nvfp4", lambda g: CompressedTensorsWriter("nvfp4"), takes_group_size=False),
)}


@dataclass
class QuantizeSummary:
    out_dir: Path
    quantized: int  # tensors written quantized
    kept: int  # tensors copied as they were
    bytes_in: int
    bytes_out: int


@dataclass
class Source:
    """A float checkpoint as the loader reads it (the command opens it with verispec/loading)."""
    directory: Path
    config: dict
    files: list[Path]  # its weight files (every other file is copied beside the output)
    tensors: Iterable[tuple[str, torch.Tensor]]  # (checkpoint name, tensor), read once
    num_tensors: int


def parse_format(name: str, group_size: int | None = None) -> OutputFormat:
    """The output format `name`, checked with the group size asked for (before anything is read)."""
    if name not in OUTPUT_FORMATS:
        raise VerispecError(f"--format '{name}' is not supported (supported: {', '.join(OUTPUT_FORMATS)})",
                            param="format")
    fmt = OUTPUT_FORMATS[name]
    if group_size is not None and not fmt.takes_group_size:
        raise VerispecError(f"--group-size does not apply to --format {fmt.name} (its groups are fixed)",
                            param="group_size")
    return fmt


def meta_model(config: dict) -> nn.Module:
    """Our model of the architecture on the meta device: its layers tell what gets quantized."""
    from verispec.models.registry import model_class

    with torch.device("meta"):
        return model_class(config.get("model_type"))(config)


def quantizable_weights(model: nn.Module) -> tuple[dict[str, str], dict[str, str], tuple[tuple[str, str], ...]]:
    """Our names of this architecture's linear / embedding weights -> "linear" | "embedding"
    (expert stacks: "experts-gate-up" | "experts-down"), the model's checkpoint prefix map
    (checkpoint name prefix -> ours) and its checkpoint renames."""
    from verispec.models.layers.moe import FusedExperts

    kinds = {}
    for path, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            kinds[f"{path}.weight"] = "linear" if isinstance(m, nn.Linear) else "embedding"
        elif isinstance(m, FusedExperts):
            kinds[f"{path}.gate_up_proj"] = "experts-gate-up"
            kinds[f"{path}.down_proj"] = "experts-down"
    return kinds, dict(model.checkpoint_prefix_map), tuple(model.checkpoint_renames)


def _our_name(prefix_map: dict[str, str], name: str) -> str:
    for src, dst in prefix_map.items():
        if name.startswith(src):
            return dst + name[len(src):]
    return name


def quantize_checkpoint(source: Source, format_name: str, out: str | Path, group_size: int | None = None,
                        progress: bool | None = None) -> QuantizeSummary:
    """Writes `source` in `format_name` to the new directory `out` (`verispec quantize`)."""
    fmt = parse_format(format_name, group_size)
    writer = fmt.make_writer(group_size)
    src, config, files, num_tensors = source.directory, dict(source.config), source.files, source.num_tensors
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise VerispecError(f"--out {out_dir} exists and is not empty (choose a new directory)", param="out")
    if detect_format(config) is not None:
        raise VerispecError(f"{src} is already quantized (config.json declares its quantization)")
    model = meta_model(config)
    kinds, prefix_map, renames = quantizable_weights(model)
    stacker = ExpertStacker(model) if hasattr(writer, "quantize_experts") else None
    # written names in the architecture's MLX layout (Qwen MoE experts: mlp.switch_mlp.*), as mlx-lm reads them
    mlx_names = tuple((ours, theirs) for theirs, ours in renames)
    tied = bool(config.get("tie_word_embeddings", False) or
                (config.get("text_config") or {}).get("tie_word_embeddings", False))

    out_dir.mkdir(parents=True, exist_ok=True)
    shards = _ShardWriter(out_dir)
    summary = QuantizeSummary(out_dir, 0, 0, 0, 0)
    quantized_layers = []
    bar = _progress_bar(num_tensors, f"quantizing to {fmt.name}", progress)
    for name, tensor in source.tensors:
        bar.update(1)
        summary.bytes_in += tensor.numel() * tensor.element_size()
        ours = _our_name(prefix_map, name)
        if tied and ours == "lm_head.weight":
            continue  # the tied head is the embedding; mlx-lm drops this copy too
        completed = stacker.add(name, ours, tensor) if stacker is not None else None
        if completed is not None:  # one expert's matrix: written once its whole stack has arrived
            for stack in completed:
                _write_stack(stack, writer, kinds, shards, mlx_names, summary, quantized_layers)
            continue
        reason = "not a linear or embedding weight"
        experts = kinds.get(ours, "").startswith("experts")
        if experts and not hasattr(writer, "quantize_experts"):
            reason = f"MoE experts are written quantized in the MLX formats only (not {fmt.name})"
        elif ours in kinds and tensor.ndim == (3 if experts else 2) and tensor.is_floating_point():
            reason = writer.skip_reason(ours, kinds[ours], tuple(tensor.shape))
        if reason is None:
            prefix = name if experts else name[: -len(".weight")]
            written = writer.quantize_experts(prefix, kinds[ours], tensor) if experts else writer.quantize(prefix, tensor)
            for out_name, out_tensor in written.items():
                shards.add(renamed(out_name, mlx_names), out_tensor)
            quantized_layers.append(prefix)
            summary.quantized += 1
        else:
            if ours in kinds:
                log.debug("kept %s %s in float: %s", name, tuple(tensor.shape), reason)
            shards.add(name, tensor)
            summary.kept += 1
    bar.close()
    leftover = stacker.leftover() if stacker is not None else []
    if leftover:
        log.debug("kept %d per-expert tensors in float: their expert stacks are incomplete (e.g. %s)",
                  len(leftover), leftover[0][0])
    for name, tensor in leftover:
        shards.add(name, tensor)
        summary.kept += 1
    summary.bytes_out = shards.finish()
    config.update(writer.config_update(quantized_layers))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_sidecars(src, out_dir, skip={f.name for f in files})
    return summary


def _write_stack(stack: CompletedStack, writer, kinds: dict[str, str], shards: "_ShardWriter",
                 mlx_names: tuple[tuple[str, str], ...], summary: QuantizeSummary, quantized_layers: list[str]) -> None:
    """A stack assembled from per-expert parts: quantized as one, or (when the writer cannot take
    its width) its parts written unchanged."""
    kind = kinds[stack.our_name]
    reason = writer.skip_reason(stack.our_name, kind, tuple(stack.tensor.shape))
    if reason is not None:
        log.debug("kept %s's %d expert parts in float: %s", stack.checkpoint_name, len(stack.parts), reason)
        for name, part in stack.parts:
            shards.add(name, part)
            summary.kept += 1
        return
    for out_name, out_tensor in writer.quantize_experts(stack.checkpoint_name, kind, stack.tensor).items():
        shards.add(renamed(out_name, mlx_names), out_tensor)
    quantized_layers.append(stack.checkpoint_name)
    summary.quantized += 1


def _copy_sidecars(src: Path, out_dir: Path, skip: set[str]) -> None:
    """Tokenizer, chat template, generation config, an MTP sidecar (unquantized) and the like:
    every file but the weights, their index and config.json."""
    skip = skip | {"config.json", "model.safetensors.index.json"}
    for path in src.iterdir():
        if path.is_file() and path.name not in skip and not path.name.startswith("."):
            shutil.copy2(path, out_dir / path.name)


class _ShardWriter:
    """Collects tensors into safetensors shards of at most SHARD_BYTES, named as mlx-lm names them."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.shards: list[dict[str, torch.Tensor]] = [{}]
        self.sizes = [0]

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.sizes[-1] and self.sizes[-1] + size > SHARD_BYTES:
            self._flush_last()
            self.shards.append({})
            self.sizes.append(0)
        self.shards[-1][name] = tensor.contiguous()
        self.sizes[-1] += size

    def _flush_last(self) -> None:
        index = len(self.shards) - 1
        save_file(self.shards[index], str(self.out_dir / f".shard-{index}.safetensors"), metadata={"format": "mlx"})
        self.shards[index] = {name: None for name in self.shards[index]}  # names kept for the index

    def finish(self) -> int:
        self._flush_last()
        count = len(self.shards)
        weight_map = {}
        for i, shard in enumerate(self.shards):
            final = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.out_dir / f".shard-{i}.safetensors").rename(self.out_dir / final)
            weight_map.update({name: final for name in shard})
        total = sum(self.sizes)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return total


def _progress_bar(total: int, desc: str, enabled: bool | None):
    """A tqdm bar on a terminal (tqdm comes with huggingface_hub); silent otherwise."""
    enabled = sys.stderr.isatty() if enabled is None else enabled
    try:
        from tqdm import tqdm
    except ImportError:
        if enabled:
            log.debug("tqdm is not installed: quantizing without a progress bar")
        return _NoBar()
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
