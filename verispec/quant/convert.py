"""`verispec quantize`: a float checkpoint -> a quantized one that the format's own library reads.

MLX affine (`mlx-4bit`, `mlx-8bit`, also `mlx-3bit` / `mlx-6bit`): the layout `mlx_lm.convert -q`
writes (verispec/quant/mlx_affine.py), readable by mlx-lm and by verispec. Which tensors are
quantized is decided as mlx-lm does: the weights of linear layers and embeddings (found through
verispec's own model of the architecture) whose input width is a multiple of the group size;
everything else is copied unchanged. Tokenizer, chat template and other sidecar files are copied.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from verispec import log
from verispec.errors import VerispecError
from verispec.quant import detect_format, mlx_affine

SHARD_BYTES = 5 * 2 ** 30  # mlx-lm's default shard size


@dataclass(frozen=True)
class OutputFormat:
    name: str
    bits: int
    default_group_size: int


OUTPUT_FORMATS = {f.name: f for f in (OutputFormat("mlx-4bit", 4, 64), OutputFormat("mlx-8bit", 8, 64),
                                      OutputFormat("mlx-3bit", 3, 64), OutputFormat("mlx-6bit", 6, 64))}


@dataclass
class QuantizeSummary:
    out_dir: Path
    quantized: int  # tensors written quantized
    kept: int  # tensors copied as they were
    bytes_in: int
    bytes_out: int


def parse_format(name: str) -> OutputFormat:
    if name not in OUTPUT_FORMATS:
        raise VerispecError(f"--format '{name}' is not supported (supported: {', '.join(OUTPUT_FORMATS)})",
                            param="format")
    return OUTPUT_FORMATS[name]


def quantizable_weights(config: dict) -> tuple[set[str], dict[str, str]]:
    """Our names of the linear / embedding weights of this architecture, and the model's
    checkpoint prefix map (checkpoint name prefix -> ours)."""
    from verispec.models.registry import model_class

    with torch.device("meta"):
        model = model_class(config.get("model_type"))(config)
    names = {f"{path}.weight" for path, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    return names, dict(model.checkpoint_prefix_map)


def _our_name(prefix_map: dict[str, str], name: str) -> str:
    for src, dst in prefix_map.items():
        if name.startswith(src):
            return dst + name[len(src):]
    return name


def quantize_checkpoint(model: str, format_name: str, out: str | Path, group_size: int | None = None,
                        progress: bool | None = None) -> QuantizeSummary:
    from verispec.loading.model_loader import read_config
    from verispec.loading.resolve import resolve_model
    from verispec.loading.weights import checkpoint_files, iter_tensors, tensor_shapes

    fmt = parse_format(format_name)
    spec = mlx_affine.AffineSpec(fmt.bits, group_size or fmt.default_group_size)
    src = resolve_model(model)
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise VerispecError(f"--out {out_dir} exists and is not empty (choose a new directory)", param="out")
    config = read_config(src)
    if detect_format(config) is not None:
        raise VerispecError(f"{src} is already quantized (config.json declares its quantization)")
    files = checkpoint_files(src)
    targets, prefix_map = quantizable_weights(config)
    tied = bool(config.get("tie_word_embeddings", False) or
                (config.get("text_config") or {}).get("tie_word_embeddings", False))
    num_tensors = len(tensor_shapes(files))

    out_dir.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out_dir)
    summary = QuantizeSummary(out_dir, 0, 0, 0, 0)
    bar = _progress_bar(num_tensors, f"quantizing to {fmt.name}", progress)
    for name, tensor in iter_tensors(files):
        bar.update(1)
        summary.bytes_in += tensor.numel() * tensor.element_size()
        ours = _our_name(prefix_map, name)
        if tied and ours == "lm_head.weight":
            continue  # the tied head is the embedding; mlx-lm drops this copy too
        if ours in targets and tensor.ndim == 2 and tensor.shape[-1] % spec.group_size == 0:
            packed, scales, biases = mlx_affine.quantize(tensor, spec)
            prefix = name[: -len(".weight")]
            writer.add(f"{prefix}.weight", packed.view(torch.uint32))
            writer.add(f"{prefix}.scales", scales)
            writer.add(f"{prefix}.biases", biases)
            summary.quantized += 1
        else:
            if ours in targets:
                log.debug("kept %s %s in float: width %d is not a multiple of group size %d", name,
                          tuple(tensor.shape), tensor.shape[-1], spec.group_size)
            writer.add(name, tensor)
            summary.kept += 1
    bar.close()
    summary.bytes_out = writer.finish()
    quantization = {"group_size": spec.group_size, "bits": spec.bits, "mode": "affine"}
    config.update(quantization=quantization, quantization_config=dict(quantization))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_sidecars(src, out_dir, skip={f.name for f in files})
    return summary


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
