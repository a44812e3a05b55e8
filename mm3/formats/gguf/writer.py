"""Writing GGUF files: gguf-py's writer, plus what it lacks for our files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import gguf
import numpy as np

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


def write_streaming(writer: gguf.GGUFWriter, tmp: Path, dst: Path, tensor_data: Iterable[np.ndarray]) -> Path:
    """Write a file whose metadata and tensor infos are already added to `writer` (opened on
    `tmp`): the header, then each tensor's data as `tensor_data` yields it (in tensor-info order,
    one at a time, so a file never has to fit in memory). Renamed to `dst` only once complete; on
    any failure or interrupt the partial file is removed."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in tensor_data:
            writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        writer.close()
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(dst)
