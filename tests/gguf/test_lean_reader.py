"""The GGUF reader that passes over large metadata arrays (verispec/loading/gguf/reader.py) against
the gguf library's own reader on the same file: every other field's value, every tensor's name,
type, shape, offset and data, and the large arrays' item types and counts."""
from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFWriter

from verispec.loading.gguf.reader import LARGE_ARRAY, LeanReader


def write(path) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("tokenizer.chat_template", "{{ messages }} ✓")
    writer.add_array("llama.attention.head_count_kv", [2, 2])  # a small array: read as the library reads it
    words = ["".join(chr(c) for c in rng.integers(32, 0x24F, size=int(n))) for n in rng.integers(0, 12, size=3000)]
    writer.add_array("tokenizer.ggml.tokens", words)
    writer.add_array("tokenizer.ggml.scores", rng.standard_normal(LARGE_ARRAY + 5).astype(np.float32).tolist())
    writer.add_array("tokenizer.ggml.merges", [f"{a} {b}" for a, b in zip(words, words[1:])])
    writer.add_uint32("after.the.arrays", 7)  # read at the right offset after them
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 32)).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_lean_reader_reads_what_the_library_reads_but_the_large_arrays_items(tmp_path):
    path = tmp_path / "lean.gguf"
    write(path)
    ours, theirs = LeanReader(str(path)), GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    large = {"tokenizer.ggml.tokens": 3000, "tokenizer.ggml.scores": LARGE_ARRAY + 5, "tokenizer.ggml.merges": 2999}
    for name, field in theirs.fields.items():
        if name in large:
            assert int(ours.fields[name].parts[4][0]) == large[name] == len(field.data)
            assert ours.fields[name].types == field.types
            assert ours.fields[name].data == []  # passed over: no item read
        else:
            assert ours.fields[name].contents() == field.contents(), name
    assert ours.fields["after.the.arrays"].contents() == 7
    assert ours.fields["llama.attention.head_count_kv"].contents() == [2, 2]
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(a.data, b.data)
