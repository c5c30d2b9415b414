"""GGUF fixtures: one tiny file per (architecture, tensor type), written once per session."""
from __future__ import annotations

import pytest

from tests.gguf.files import GGUFCase, write_gguf

ALL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# llama gets every type (its q/k permutation must survive each); the others the common ones
CASES = [("llama", t) for t in ALL_TYPES] + [
    ("qwen2", "F16"), ("qwen2", "Q8_0"),
    ("qwen3", "BF16"), ("qwen3", "Q4_0"), ("qwen3", "Q6_K"),
    ("gemma3", "F32"), ("gemma3", "Q8_0"), ("gemma3", "Q4_1"), ("gemma3", "Q4_K"),
    # expert stacks [E, I, H] in each kind of block: unpacked by us (Q8_0, Q4_1) or by the library (Q4_K)
    ("qwen3moe", "F32"), ("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_1"), ("qwen3moe", "Q4_K"),
]
# tied embeddings (no output.weight) on qwen2. Not on gemma3: a tied random Gemma repeats its input token
# (the 16x-scaled embedding dominates the stream), which would make greedy parity a weak test.
TIED = {"qwen2"}


class GGUFFiles:
    def __init__(self, root, hf_tokenizer):
        self.root = root
        self.hf_tokenizer = hf_tokenizer
        self._cases: dict[tuple[str, str], GGUFCase] = {}

    def get(self, arch: str, qtype: str) -> GGUFCase:
        key = (arch, qtype)
        if key not in self._cases:
            # a directory per file: transformers and `-m DIR` both want the one .gguf of a directory
            self._cases[key] = write_gguf(self.root / f"{arch}-{qtype}", arch, qtype, self.hf_tokenizer,
                                          seed=len(self._cases) + 7, tie=arch in TIED)
        return self._cases[key]


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory, tokenizer_dir) -> GGUFFiles:
    from transformers import AutoTokenizer

    return GGUFFiles(tmp_path_factory.mktemp("gguf"), AutoTokenizer.from_pretrained(str(tokenizer_dir)))
