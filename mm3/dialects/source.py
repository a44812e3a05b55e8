"""One reading interface over the files other tools write: safetensors (ComfyUI's repackaged files)
and GGUF of any architecture (ComfyUI-GGUF conversions, HOT-Step's files).

A `Source` lists its tensors (name -> torch-order shape and stored type) from the header alone and,
once mapped, gives each float or GGML tensor as a `CompressedTensor` whose bytes are a view of the
file's mapping (nothing is read until used), or for a safetensors tensor that is not 64-byte
aligned in the file an aligned copy (`Source.tensor`). Other safetensors dtypes (the tokenizer's uint8 bytes,
int8 weights) are listed with their dtype name and read as raw bytes.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from ..filewatch import closed, watch
from ..formats.gguf.errors import GGUFFormatError
from ..formats.gguf.reader import GGUF_MAGIC, CompressedTensor, GGUFFile

SAFETENSORS_FLOATS = {"F32": GGMLQuantizationType.F32, "F16": GGMLQuantizationType.F16,
                      "BF16": GGMLQuantizationType.BF16}
_MAX_HEADER = 256 * 2**20
ALIGNMENT = 64  # bytes: what a torch allocation guarantees  # a safetensors header beyond this is corrupt, not large


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # torch order
    type: str  # "F32", "BF16", "Q4_0", ... or a safetensors dtype ("U8", "I8", "F8_E4M3")
    ggml: bool = False  # a GGUF tensor: `type` names its GGML type

    @property
    def qtype(self) -> GGMLQuantizationType | None:
        """The GGML type the engine can read it as, None for other dtypes (a safetensors int8)."""
        if self.type in SAFETENSORS_FLOATS:
            return SAFETENSORS_FLOATS[self.type]
        return getattr(GGMLQuantizationType, self.type, None) if self.ggml else None


def file_format(path: str | os.PathLike) -> str | None:
    """"gguf", "safetensors" or None, from the first bytes (never the file name)."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if head[:4] == GGUF_MAGIC:
        return "gguf"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 0 < n <= _MAX_HEADER and head[8:9] == b"{":
            return "safetensors"
    return None


class Source:
    """A tensor file opened for reading (see the module docstring). `header_only`: the listing and
    metadata only, nothing mapped."""

    def __init__(self, path: str | os.PathLike, *, header_only: bool = False):
        self.path = str(path)
        self.mapped = not header_only
        self.derived: dict = {}  # values a dialect computes from the tensors once per open file
        self.format = file_format(path)
        self._gguf: GGUFFile | None = None
        self._map = None
        self._entries: dict[str, tuple[int, int]] = {}  # safetensors: name -> absolute byte range
        if self.format == "gguf":
            self._gguf = GGUFFile(path, header_only=header_only)
            self.metadata: dict = dict(self._gguf.metadata)
            self.infos = {n: TensorInfo(s, q.name, ggml=True) for n, s, q in self._gguf.tensor_infos()}
        elif self.format == "safetensors":
            self.metadata, self.infos = self._read_safetensors_header()  # (its __metadata__ is not used)
            if not header_only:
                with open(self.path, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                    watch(self.path, f.fileno(), self._map)
        else:
            raise GGUFFormatError(f"{self.path}: neither a GGUF nor a safetensors file")

    def _read_safetensors_header(self):
        from ..formats.safetensors_raw import file_entries

        try:
            entries = file_entries(Path(self.path))
        except (ValueError, KeyError, TypeError) as e:
            raise GGUFFormatError(str(e)) from None
        self._entries = {n: (e.start, e.end) for n, e in entries.items()}
        return {}, {n: TensorInfo(e.shape, e.dtype) for n, e in entries.items()}

    # -- access -----------------------------------------------------------------------------------
    def tensor(self, name: str, *, align: bool = True) -> CompressedTensor:
        """A float or GGML tensor as stored (a view of the mapping; read from the file when opened
        for the header only). `align` False: the view even where it is not aligned (for a caller
        that takes a part of it, then `aligned`)."""
        info = self.infos[name]
        if not self.mapped:
            data = self.raw_bytes(name)
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
            return CompressedTensor(name, info.qtype, info.shape, raw)
        if self._gguf is not None:
            return self._gguf.tensors[name]
        if info.type not in SAFETENSORS_FLOATS:
            raise GGUFFormatError(f"{self.path}: tensor {name} is {info.type}, not a float tensor")
        raw = self._view(name)
        return CompressedTensor(name, SAFETENSORS_FLOATS[info.type], info.shape, aligned(raw) if align else raw)

    def int8(self, name: str) -> torch.Tensor:
        """An int8 tensor (ComfyUI's int8 weights) in its shape: a view of the mapping."""
        info = self.infos[name]
        if info.type != "I8":
            raise GGUFFormatError(f"{self.path}: tensor {name} is {info.type}, expected I8")
        raw = self._gguf.tensors[name].raw if self._gguf is not None else self._view(name)
        return raw.view(torch.int8).view(info.shape)

    def strings(self, key: str) -> list[str]:
        """A GGUF string array of the metadata (the tokenizer's tokens)."""
        if self._gguf is None:
            raise GGUFFormatError(f"{self.path}: a safetensors file has no {key}")
        return self._gguf.strings(key)

    def raw_bytes(self, name: str) -> bytes:
        """A tensor's stored bytes, read from the file (small tensors: the tokenizer's JSON)."""
        a, b = self._gguf.tensor_range(name) if self._gguf is not None else self._entries[name]
        with open(self.path, "rb") as f:
            f.seek(a)
            return f.read(b - a)

    def _view(self, name: str) -> torch.Tensor:
        if self._map is None:
            raise GGUFFormatError(f"{self.path}: opened for its header only")
        a, b = self._entries[name]
        if a == b:
            return torch.zeros(0, dtype=torch.uint8)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=b - a, offset=a)

    def close(self):
        self.derived.clear()
        if self._gguf is not None:
            self._gguf.close()
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # views still alive elsewhere keep the mapping; it closes when they go
            else:
                closed(m)  # unmapped: its addresses are no longer this file's


def aligned(raw: torch.Tensor) -> torch.Tensor:
    """`raw`, or an aligned copy where it is not 64-byte aligned. safetensors aligns a tensor only to
    its element size, and a CPU product's last bits can depend on where its weight sits: an aligned
    copy computes what our (aligned) GGUFs do."""
    return raw.clone() if raw.data_ptr() % ALIGNMENT else raw


def is_tensor_file(path: str | os.PathLike) -> bool:
    return Path(path).is_file() and file_format(path) is not None
