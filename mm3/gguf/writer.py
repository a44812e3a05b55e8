"""Writing GGUF files: gguf-py's writer, plus what it lacks for our files."""

from __future__ import annotations

import gguf

from .reader import GGUFFile, StringArray


class Writer(gguf.GGUFWriter):
    """GGUFWriter that also writes empty typed arrays (a byte-level tokenizer has no merges;
    gguf-py refuses an empty array because it infers the element type from the first item)."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def copy_metadata(writer: gguf.GGUFWriter, src: GGUFFile, skip=()) -> None:
    """Every metadata entry of `src` with its original value types (the writer sets the
    architecture and alignment itself)."""
    for key, value in src.metadata.items():
        if key in skip or key in ("general.architecture", "general.alignment"):
            continue
        vtype, etype = src.value_types[key]
        if isinstance(value, StringArray):
            value = src.strings(key)
        writer.add_key_value(key, value, vtype, sub_type=etype)
