"""GGUF files (llama.cpp / Ollama): config, weights and tokenizer from one file.

Who does what: the `gguf` library (the format's own) reads the file and dequantizes the types we do
not unpack ourselves; quants.py unpacks Q8_0 / Q4_0 / Q4_1 into an affine description (scales,
biases, unsigned q, group 32) that dequantizes bit-identically to the library; config.py turns the
metadata into a Hugging Face config; names.py maps tensor names and undoes the converter's q/k
permutation (llama) and 1 + w norms (gemma3); transformers builds the tokenizer from the metadata
(its converter over the vocabulary reader.py reads for llama-family files, `gguf_file=` for the
others: tokenizer.py), and the chat template comes from `tokenizer.chat_template`.

Entry points: `is_gguf(path)`, `find_gguf(dir)`, `GGUFCheckpoint(path)` with `.config`,
`.tensors(keep_affine=False)` and `.tokenizer()`.
"""
from __future__ import annotations

import mmap
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch

from verispec import log
from verispec.errors import ModelNotFoundError, VerispecError
from verispec.loading.gguf.config import Metadata, hf_config
from verispec.loading.gguf.names import hf_name, restore
from verispec.loading.gguf.quants import AFFINE_BITS, AFFINE_TYPES, GROUP_SIZE, AffineQuantized, dense, logical_shape, \
    read_tensor, tensor_type_name

SUFFIX = ".gguf"
# Kept quantized where a kernel multiplies by them as stored: 4-bit groups of 32 on CUDA in bfloat16
# (torch's int4 kernel), on a CPU in bfloat16 or float16 (the integer-dot kernel, else torch's int4
# kernel; verispec/quant/kernels/cpu_qdot.py). A Q8_0 / Q4 embedding table stays quantized on a CPU
# where the integer-dot kernel runs the tied head over it; elsewhere Q8_0 stays dense: our CUDA 8-bit
# kernel is slower than a bfloat16 GEMM (docs/benchmarks.md).
KEPT_4BIT_TYPES = ("Q4_0", "Q4_1")
KEPT_8BIT_TYPES = ("Q8_0",)  # kept where the CPU integer-dot kernel runs (`keeps_8bit`)
EMBEDDING_TABLE = "model.embed_tokens.weight"
QUANTIZATION_CONFIG = {"group_size": GROUP_SIZE, "bits": 4}  # the MLX-affine form the kept weights take
ROPE_FREQS = "rope_freqs.weight"
# Token ids llama.cpp also ends generation on besides eos (end of turn / end of message)
VOCABULARY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.merges")
END_OF_GENERATION_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    return path.is_file() and path.suffix.lower() == SUFFIX


def find_gguf(directory: Path) -> Path | None:
    """The one .gguf file in a directory (None when there is none); several is an error naming them."""
    files = sorted(p for p in directory.iterdir() if is_gguf(p))
    if len(files) > 1:
        raise ModelNotFoundError(f"{directory} holds {len(files)} GGUF files ({', '.join(p.name for p in files)}); "
                                 "pass the one to load with -m", param="model")
    return files[0] if files else None


def _reader(path: Path):
    try:
        from verispec.loading.gguf.reader import LeanReader
    except ImportError as exc:
        raise VerispecError("reading GGUF files needs the `gguf` package: pip install gguf") from exc
    try:
        return LeanReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct errors on damaged files
        raise VerispecError(f"could not read GGUF file {path}: {exc}") from exc


class GGUFCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = _reader(self.path)
        # the vocabulary arrays are large (reader.py passes over them) and transformers reads them itself
        values = {name: _field_value(name, field) for name, field in self.reader.fields.items()
                  if name not in VOCABULARY_ARRAYS}
        self.meta = Metadata(values, str(self.path))
        self.architecture = self.meta.architecture
        self.tensor_shapes = {t.name: logical_shape(t) for t in self.reader.tensors}
        rope_freqs = next((dense(read_tensor(t)).float().tolist() for t in self.reader.tensors
                           if t.name == ROPE_FREQS), None)
        self.config = hf_config(self.meta, self.tensor_shapes, rope_freqs)

    def tensor_types(self) -> Counter:
        return Counter(tensor_type_name(t) for t in self.reader.tensors)

    def tensors(self, keep_affine: bool = False) -> Iterator[tuple[str, torch.Tensor | AffineQuantized]]:
        """(Hugging Face name, weight) for every tensor our models use. Q8_0 / Q4_0 / Q4_1 come as
        AffineQuantized with keep_affine (for a quantized linear layer), dense float32 otherwise."""
        types = self.tensor_types()
        quantized = sorted(t for t in types if t in AFFINE_TYPES)
        if quantized and not keep_affine:
            log.debug("GGUF %s: %s weights dequantized", self.path.name, ", ".join(quantized))
        skipped = []
        for t in self.reader.tensors:
            if t.name == ROPE_FREQS:  # read into the config's RoPE parameters
                continue
            name = hf_name(t.name, self.architecture)
            if name is None:
                skipped.append(t.name)
                continue
            value = restore(read_tensor(t), t.name, self.architecture, self.config)
            yield name, value if keep_affine else dense(value)
            self._drop_pages(t.data_offset, t.n_bytes)
        if skipped:
            log.debug("GGUF %s: %d tensors not used by the model (e.g. %s)", self.path.name, len(skipped),
                      ", ".join(skipped[:3]))

    def _drop_pages(self, offset: int, size: int) -> None:
        """A tensor's pages, read and copied out, leave this process's resident memory (the page
        cache keeps them; a later read faults them back in): a mapped file counts toward RSS as it
        is read (98 MiB of the default model's load peak)."""
        mapped = getattr(self.reader.data, "_mmap", None)
        if mapped is None or not hasattr(mapped, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE  # madvise takes whole pages
        mapped.madvise(mmap.MADV_DONTNEED, start, min(offset + size, len(mapped)) - start)

    def linear_names(self, types: tuple[str, ...] = KEPT_4BIT_TYPES) -> set[str]:
        """Hugging Face names of the linear weights stored as one of `types` (not the embedding table)."""
        names = set()
        for t in self.reader.tensors:
            name = hf_name(t.name, self.architecture)
            if (name is not None and tensor_type_name(t) in types and len(self.tensor_shapes[t.name]) == 2
                    and name.endswith(".weight") and "embed_tokens" not in name):
                names.add(name)
        return names

    def quantized_table(self) -> str | None:
        """The embedding table's Hugging Face name when the file stores it as Q8_0 / Q4_0 / Q4_1
        (None otherwise): kept quantized where the CPU integer-dot kernel runs a tied head over it."""
        for t in self.reader.tensors:
            if hf_name(t.name, self.architecture) == EMBEDDING_TABLE and tensor_type_name(t) in AFFINE_TYPES:
                return EMBEDDING_TABLE
        return None

    def checkpoint_shapes(self, kept: set[str]) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape as `tensors_for_model(kept)` yields it: a kept b-bit weight [N, K] as
        MLX's packed weight [N, K*b/32] with scales and biases [N, K/32]."""
        from verispec.quant.packing import packed_words

        shapes = {}
        for t in self.reader.tensors:
            name = hf_name(t.name, self.architecture)
            if name is None or t.name == ROPE_FREQS:
                continue
            shape = self.tensor_shapes[t.name]
            if name in kept:
                prefix, (rows, cols) = name[: -len(".weight")], shape
                shapes[name] = (rows, packed_words(cols, AFFINE_BITS[tensor_type_name(t)]))
                shapes[f"{prefix}.scales"] = shapes[f"{prefix}.biases"] = (rows, cols // GROUP_SIZE)
            else:
                shapes[name] = shape
        return shapes

    def tensors_for_model(self, kept: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """As tensors(), with each kept weight as MLX-affine tensors (packed uint32 words as int32,
        scales, biases) that dequantize to exactly the library's values; the rest dense."""
        from verispec.quant.packing import pack_rows

        for name, value in self.tensors(keep_affine=bool(kept)):
            if name in kept:
                prefix = name[: -len(".weight")]
                yield name, pack_rows(value.q, value.bits)
                yield f"{prefix}.scales", value.scales
                yield f"{prefix}.biases", value.biases
            else:
                yield name, dense(value)

    def tokenizer(self):
        from verispec.loading.gguf.tokenizer import gguf_tokenizer

        return gguf_tokenizer(self)

    def describe(self) -> str:
        types = ", ".join(f"{n} x{c}" for n, c in self.tensor_types().most_common())
        return f"{self.path.name}: GGUF {self.architecture}, tensors {types}"


def keeps_4bit(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a GGUF's Q4_0 / Q4_1 weights are dequantized at load on this device and dtype (None:
    they stay quantized, for torch's int4 kernel or, on a CPU, the integer-dot kernel)."""
    from verispec.quant.kernels.int4_builtin import activation_reason

    return activation_reason(device, dtype)


def keeps_8bit(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a GGUF's Q8_0 linear weights are dequantized at load (None: they stay quantized, for the
    CPU integer-dot kernel, at half a float16 weight's bytes)."""
    from verispec.quant.kernels import cpu_qdot

    return cpu_qdot.unsupported_reason(device, dtype, 8, GROUP_SIZE, GROUP_SIZE)


def keeps_table(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a GGUF's quantized embedding table is dequantized at load (None: it stays quantized, and a
    tied head multiplies by it on the CPU integer-dot kernel; lookups decode their rows)."""
    from verispec.quant.kernels import cpu_qdot

    return cpu_qdot.unsupported_reason(device, dtype, 8, GROUP_SIZE, GROUP_SIZE)  # any table's: blocks of 32


def _field_value(name: str, field):
    """A metadata field as a Python value (str, number, bool or list); None for what cannot be read."""
    try:
        return field.contents()
    except Exception as exc:  # a field type this gguf version cannot decode: none of the keys we read
        log.debug("GGUF metadata %s not decoded (%s): ignored", name, exc)
        return None
