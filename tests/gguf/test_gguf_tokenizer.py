"""A llama-family GGUF's tokenizer, converted from the vocabulary our reader reads
(loading/gguf/tokenizer.py `converted`), against AutoTokenizer's build from the same file
(`gguf_file=`): the same saved files (tokenizer.json, its settings, the template) and the same ids.
The default model's real vocabulary in tests/gguf/test_smollm2.py's slow tests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from verispec.loading.gguf import VOCABULARY_ARRAYS, GGUFCheckpoint
from verispec.loading.gguf.tokenizer import BUILT_HERE, converted

# how the tokenizer was loaded, not what it is: from_pretrained records them, a constructor does not
LOAD_FLAGS = ("is_local", "local_files_only")


def saved_files(hf, directory: Path) -> dict[str, object]:
    hf.save_pretrained(str(directory))
    files = {}
    for path in sorted(directory.iterdir()):
        text = path.read_text()
        files[path.name] = json.loads(text) if path.suffix == ".json" else text
    for flag in LOAD_FLAGS:
        files["tokenizer_config.json"].pop(flag, None)
    return files


def assert_converted_is_autotokenizers(path: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = converted(GGUFCheckpoint(path))
    assert type(ours) is type(theirs)
    assert saved_files(ours, tmp_path / "ours") == saved_files(theirs, tmp_path / "theirs")
    for text in ("hello world", "def f(x):\n    return x  # ünïcode 漢字 🙂", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == theirs.encode(text)


@pytest.mark.parametrize("qtype", ["F16", "Q4_1"])
def test_a_llama_gguf_tokenizer_is_what_autotokenizer_builds(gguf_files, tmp_path, qtype):
    assert "llama" in BUILT_HERE
    assert_converted_is_autotokenizers(gguf_files.get("llama", qtype).path, tmp_path)


@pytest.mark.parametrize("passed_over", [True, False], ids=["passed-over", "parsed"])
@pytest.mark.parametrize("arch,qtype", [("llama", "F16"), ("gemma3", "F32")])  # gemma3's has float scores
def test_the_vocabulary_arrays_read_as_the_gguf_library_reads_them(gguf_files, monkeypatch, passed_over, arch, qtype):
    """Arrays the reader passed over (as a real vocabulary's are: the tests' is short, so the
    threshold comes down to it) and arrays the library parsed."""
    from gguf import GGUFReader

    from verispec.loading.gguf import reader

    if passed_over:
        monkeypatch.setattr(reader, "LARGE_ARRAY", 8)
    path = gguf_files.get(arch, qtype).path
    ours, theirs = reader.LeanReader(str(path)), GGUFReader(str(path))
    read = [name for name in VOCABULARY_ARRAYS if name in theirs.fields]
    assert "tokenizer.ggml.tokens" in read and ("tokenizer.ggml.merges" in read or "tokenizer.ggml.scores" in read)
    for name in read:
        assert bool(ours.fields[name].data) is not passed_over
        assert ours.array(name) == theirs.fields[name].contents(), name


def test_other_architectures_stay_with_autotokenizer(gguf_files, tmp_path, monkeypatch):
    """A qwen3 file's tokenizer is AutoTokenizer's own build (its class is Qwen2Tokenizer there)."""
    from verispec.loading.gguf import tokenizer as gguf_tokenizer_module

    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(gguf_tokenizer_module, "converted", lambda checkpoint: calls.append(checkpoint))
    tok = GGUFCheckpoint(gguf_files.get("qwen3", "Q4_0").path).tokenizer()
    assert not calls and type(tok.hf).__name__ == "Qwen2Tokenizer"
