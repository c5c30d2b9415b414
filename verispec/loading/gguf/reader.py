"""The gguf library's reader, passing over the items of large metadata arrays.

Why: `gguf.GGUFReader` parses every item of every array one at a time (a numpy view each), and a
GGUF's vocabulary is four arrays of ~50,000 items (tokens, scores, types, merges): 5-7 s a file
on the CPUs we start on, paid by the engine process for the weights and again for the tokenizer,
and by the server for its tokenizer, while the transformers tokenizer comes from our cache in 0.3 s
(tokenizer.py). Those arrays are skipped over (their sizes walked, their items not read): their
fields keep the item type and count, no values. Small arrays, the tensors and everything else are
the library's own parsing. `array` reads a passed-over array when a tokenizer is first built
(tokenizer.py).
"""
from __future__ import annotations

import struct
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType

LARGE_ARRAY = 1024  # items: arrays this long are passed over (metadata arrays we read are a few)


class LeanReader(GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        itype, items = GGUFValueType(int(raw_itype[0])), orig_offs + 12
        size = self._items_size(items, itype, int(count[0]))
        if size is None:
            return super()._get_field_parts(orig_offs, raw_type)
        return items + size - orig_offs, [raw_itype, count], [], [GGUFValueType.ARRAY, itype]

    def array(self, name: str) -> list:
        """The items of metadata array `name` (str, int or float), a passed-over one included: what a
        tokenizer build needs of the vocabulary, read in one walk rather than a view an item."""
        field = self.fields[name]
        if field.data or len(field.types) != 2:  # parsed by the library (a short array)
            return field.contents()
        itype, count = field.types[1], int(field.parts[4][0])  # parts: key length, key, type, item type, count
        items = field.offset + 8 + len(name.encode()) + 4 + 12  # key length, key, value type, item type, count
        scalar = self.gguf_scalar_to_np.get(itype)
        if scalar is not None:
            return np.frombuffer(self.data, dtype=scalar, count=count, offset=items).tolist()
        view, end, out = memoryview(self.data), items, []
        for _ in range(count):
            size = struct.unpack_from("<Q", view, end)[0]
            out.append(bytes(view[end + 8:end + 8 + size]).decode("utf-8"))
            end += 8 + size
        return out

    def _items_size(self, offs: int, itype: GGUFValueType, count: int) -> int | None:
        """Bytes of `count` items of `itype` from offs; None where the library should parse them
        (a short array, nested arrays)."""
        if count < LARGE_ARRAY:
            return None
        scalar = self.gguf_scalar_to_np.get(itype)
        if scalar is not None:
            return count * np.dtype(scalar).itemsize
        if itype != GGUFValueType.STRING:
            return None
        view, end = memoryview(self.data), offs
        for _ in range(count):  # each string: a u64 length, then its bytes
            end += 8 + struct.unpack_from("<Q", view, end)[0]
        return end - offs
