"""The tokenizer of a GGUF file, built by transformers from the file's vocabulary (`gguf_file=`).

What we take from the metadata ourselves: the chat template (`tokenizer.chat_template`, set on the
tokenizer whatever transformers did with it) and the ids that end generation. transformers' llama
converter swaps bos and eos on the tokenizer it builds, so its eos_token is not used; the ids are
eos / eot / eom from the metadata plus, as llama.cpp does, the vocabulary's end-of-turn markers.

transformers builds it (for llama-family files, its converter over the vocabulary our reader
reads: `converted`), and its class costs the process memory and imports. So the built tokenizer is
saved once (tokenizer.json and its settings) under the verispec cache (VERISPEC_CACHE_DIR, by default
~/.cache/verispec), keyed by the file's path, size and modification time and the transformers
version, and read from there in 0.3 s after that.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from verispec import log
from verispec.config import env
from verispec.errors import VerispecError
from verispec.loading.tokenizer import Tokenizer

# GGUF architectures whose tokenizer `converted` builds (the converter transformers picks for them),
# AutoTokenizer's class for them being TokenizersBackend; the others go through AutoTokenizer
BUILT_HERE = {"llama": "llama"}
END_OF_TURN_MARKERS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


def gguf_tokenizer(checkpoint) -> Tokenizer:
    """checkpoint: a GGUFCheckpoint."""
    from verispec.loading.gguf import END_OF_GENERATION_KEYS

    path = checkpoint.path
    cached = _cache_dir(path)
    if cached is not None and (cached / "tokenizer.json").is_file():
        hf = _read_cached(cached)
    else:
        try:
            hf = converted(checkpoint) if checkpoint.architecture in BUILT_HERE else _auto_tokenizer(path)
        except Exception as exc:  # transformers raises many types; the user needs the path + cause
            raise VerispecError(f"could not build a tokenizer from GGUF file {path}: {exc}") from exc
        if cached is not None:
            _save(hf, cached)
    # GGUF has no such setting and llama.cpp never cleans up; transformers' GGUF converter turns on this
    # WordPiece clean-up (spaces before punctuation stripped), which 5.17 ignores for BPE with a warning
    # at every start. Off, the text is what the file's vocabulary spells (and decoding takes the fast path)
    hf.clean_up_tokenization_spaces = False
    values = checkpoint.meta.values
    template = values.get("tokenizer.chat_template")
    if template:
        hf.chat_template = template
    else:
        log.debug("GGUF %s has no tokenizer.chat_template: chat requests will be refused", path.name)
    eos = [int(values[k]) for k in END_OF_GENERATION_KEYS if values.get(k) is not None]
    vocab = hf.get_vocab()
    markers = [vocab[m] for m in END_OF_TURN_MARKERS if m in vocab]
    if not eos:
        log.debug("GGUF %s names no eos token; ending generation on %s only", path.name, markers or "max_tokens")
    return Tokenizer(hf, eos + markers)


def converted(checkpoint):
    """What AutoTokenizer builds from a llama-family GGUF (`gguf_file=`): transformers' own converter
    and class, over the vocabulary our reader reads. AutoTokenizer reads the file twice (the config,
    then the tokenizer) with the gguf library's reader, an item at a time: 10-14 s of a first start
    for SmolLM2's 49,152 tokens, where the conversion itself takes 0.1 s. Held to AutoTokenizer's
    saved files by tests/gguf/test_gguf_tokenizer.py."""
    from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from verispec.loading.gguf import VOCABULARY_ARRAYS

    values = {name: checkpoint.reader.array(name) if name in VOCABULARY_ARRAYS else checkpoint.meta.values.get(name)
              for name in checkpoint.reader.fields if name.startswith("tokenizer.")}
    sections = {section: {key: values[f"tokenizer.{gguf_key}"] for gguf_key, key in renames.items()
                          if f"tokenizer.{gguf_key}" in values}
                for section, renames in GGUF_TOKENIZER_MAPPING.items()}
    backend, settings = convert_gguf_tokenizer(BUILT_HERE[checkpoint.architecture], sections["tokenizer"])
    settings = {**sections["tokenizer_config"], **settings}
    # where the converter leaves it unset, AutoTokenizer's load records False
    settings["add_prefix_space"] = settings.get("add_prefix_space") or False
    return TokenizersBackend(tokenizer_object=backend, **settings)


def _auto_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _read_cached(cached: Path):
    """The saved tokenizer: read with the `tokenizers` library where its class adds nothing to the
    backend (loading/saved_tokenizer.py: transformers' classes cost the process ~50 MiB more), else
    by the class its settings name (what AutoTokenizer would pick), imported by name: AutoTokenizer's
    own module imports transformers' model and generation code, dynamo with it."""
    import json

    from verispec.loading import saved_tokenizer

    if saved_tokenizer.readable(cached):
        return saved_tokenizer.SavedTokenizer(cached)
    import transformers

    try:
        named = json.loads((cached / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    cls = getattr(transformers, named, None) if isinstance(named, str) and named.endswith(
        ("Tokenizer", "TokenizerFast", "TokenizersBackend")) else None
    if cls is None:
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(cached))


def _cache_dir(path: Path) -> Path | None:
    from importlib.metadata import version  # importing transformers for its version alone costs 27 MiB

    try:
        stat = path.stat()
    except OSError:
        return None
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version('transformers')}"
    return Path(env().verispec_cache()) / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _save(hf, cached: Path) -> None:
    """Writes the tokenizer whole or not at all (a concurrent start may write the same one)."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=cached.parent))
        hf.save_pretrained(str(staging))
        try:
            os.replace(staging, cached)
        except OSError:  # another process saved it first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        log.debug("GGUF tokenizer not cached in %s (%s): it is built again at the next start", cached, exc)
