"""Fast, memory-mapped GGUF reading.

gguf-py's `GGUFReader` builds a numpy view per array element, which takes seconds for the LM file's
300k tokenizer strings. This parser reads the header with `struct` from one mmap, decodes string
arrays only when asked, and exposes tensors as `CompressedTensor`s: raw block bytes (a view of the
mapping, never a copy), the GGML type and the logical torch shape.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ...filecache import FileCache
from ...filewatch import closed, watch
from .errors import GGUFFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # gguf spec default when `general.alignment` is absent
MAX_ARRAY_DEPTH = 8  # arrays of arrays: ggml's own reader takes none, gguf-py any; a few are plenty

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
_VALUE_TYPE_IDS = {int(v) for v in GGUFValueType}
_NUMPY_OF = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.FLOAT64: "<f8",
    GGUFValueType.BOOL: "?",
}


@dataclass(frozen=True)
class StringArray:
    """A GGUF string array left undecoded: `count` strings starting at `offset` in the file."""

    path: str
    offset: int
    count: int
    nbytes: int
    key: str = "an array"  # the metadata key, for error messages

    def decode(self, buf) -> list[str]:
        out, pos, end = [], self.offset, self.offset + self.nbytes
        unpack = struct.Struct("<Q").unpack_from
        for i in range(self.count):
            (n,) = unpack(buf, pos)
            if pos + 8 + n > end:
                raise GGUFFormatError(f"{self.path}: {self.key}[{i}] runs past the end of the array")
            try:
                out.append(bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8"))
            except UnicodeDecodeError as e:
                raise GGUFFormatError(f"{self.path}: {self.key}[{i}] is not valid UTF-8 ({e})") from None
            pos += 8 + n
        return out

    def __len__(self):
        return self.count


@dataclass
class CompressedTensor:
    """One tensor as stored: raw GGML block bytes (uint8) plus its type and logical torch shape."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order ([out, in] for a Linear weight)
    raw: torch.Tensor  # uint8, flat; a view of the file mapping until moved

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def dequantize(self, dtype=torch.float32, device=None) -> torch.Tensor:
        from .quants import dequantize

        raw = self.raw if device is None else self.raw.to(device)
        return dequantize(raw, self.qtype, self.shape, dtype)

    def __repr__(self):
        return f"CompressedTensor({self.name!r}, {self.qtype.name}, {list(self.shape)})"


def compressed_from_torch(name: str, tensor: torch.Tensor) -> CompressedTensor:
    """Wrap an F32/F16/BF16 torch tensor as a `CompressedTensor` (models built without a file)."""
    qtype = {torch.float32: GGMLQuantizationType.F32, torch.float16: GGMLQuantizationType.F16,
             torch.bfloat16: GGMLQuantizationType.BF16}.get(tensor.dtype)
    if qtype is None:
        raise ValueError(f"{name}: dtype {tensor.dtype} has no GGUF float type")
    flat = tensor.detach().contiguous().reshape(-1)
    return CompressedTensor(name, qtype, tuple(tensor.shape), flat.view(torch.uint8))


def tensor_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...], what: str) -> int:
    """Bytes of a tensor of `shape` (torch order) in `qtype`; errors if rows do not fill whole blocks."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    row = shape[-1] if shape else 1
    if row % block:
        raise GGUFFormatError(
            f"{what}: row length {row} is not a multiple of the {qtype.name} block size {block}")
    n = 1
    for d in shape:
        n *= d
    return n // block * block_bytes


class _Cursor:
    """Sequential little-endian reads over a buffer, with a clear error past its end."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def need(self, n: int, what: str):
        if self.pos + n > self.size:
            raise GGUFFormatError(
                f"{self.path}: truncated GGUF header while reading {what} "
                f"(needs {self.pos + n} bytes, the file has {self.size})")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{self.path}: {what} is not valid UTF-8 ({e})") from None

    def value_type(self, what: str) -> GGUFValueType:
        t = self.scalar("<I", what)
        try:
            return GGUFValueType(t)
        except ValueError:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {t} for {what}") from None

    def value(self, vtype: GGUFValueType, key: str, depth: int = 0):
        if vtype == GGUFValueType.STRING:
            return self.string(key)
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], key)
        if vtype != GGUFValueType.ARRAY:
            raise GGUFFormatError(f"{self.path}: unsupported value type {vtype} for {key}")
        etype = self.value_type(key)
        count = self.scalar("<Q", key)
        if etype == GGUFValueType.ARRAY and depth + 1 >= MAX_ARRAY_DEPTH:
            raise GGUFFormatError(f"{self.path}: metadata {key} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        if etype == GGUFValueType.STRING:
            start = self.pos
            skip = struct.Struct("<Q").unpack_from
            for i in range(count):
                self.need(8, f"{key}[{i}]")
                (n,) = skip(self.buf, self.pos)
                self.pos += 8 + n
            self.need(0, key)
            if self.pos > self.size:
                raise GGUFFormatError(f"{self.path}: truncated GGUF header inside {key}")
            return StringArray(self.path, start, count, self.pos - start, key)
        if etype in _NUMPY_OF:
            dt = np.dtype(_NUMPY_OF[etype])
            self.need(dt.itemsize * count, key)
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
            self.pos += dt.itemsize * count
            return arr.tolist()
        if count * 12 > self.size - self.pos:  # an element array's type and count alone take 12 bytes
            self.need(count * 12, key)
        return [self.value(etype, f"{key}[{i}]", depth + 1) for i in range(count)]


class GGUFFile:
    """A GGUF file, memory-mapped copy-on-write (the file itself is never written).

    `metadata` maps keys to Python values (string arrays stay `StringArray` until `strings(key)`);
    `tensors` maps names to `CompressedTensor`s whose bytes are views of the mapping.
    """

    def __init__(self, path: str | os.PathLike, *, header_only: bool = False):
        self.path = str(path)
        p = Path(path)
        if not p.is_file():
            raise GGUFFormatError(f"{self.path}: no such file")
        size = p.stat().st_size
        if size < 24:
            raise GGUFFormatError(f"{self.path}: not a GGUF file ({size} bytes, too short for a header)")
        with open(p, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            watch(self.path, f.fileno(), self._map)  # a rewrite in place is then an error, not a fault
        self.file_size = size
        try:
            self._parse(header_only)
        except BaseException:
            self.close()
            raise

    # -- parsing --------------------------------------------------------------------------------
    def _parse(self, header_only: bool):
        c = _Cursor(self._map, self.path)
        magic = bytes(self._map[:4])
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        c.pos = 4
        self.version = c.scalar("<I", "version")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {self.version} is not supported (expected 2 or 3)")
        n_tensors = c.scalar("<Q", "tensor count")
        n_kv = c.scalar("<Q", "metadata count")
        if n_tensors > self.file_size or n_kv > self.file_size:
            raise GGUFFormatError(
                f"{self.path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata entries "
                f"in a {self.file_size}-byte file)")
        self.metadata: dict[str, object] = {}
        self.value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.value_type(key)
            etype = None
            if vtype == GGUFValueType.ARRAY:
                c.need(4, key)
                raw_etype = struct.unpack_from("<I", self._map, c.pos)[0]
                etype = GGUFValueType(raw_etype) if raw_etype in _VALUE_TYPE_IDS else None
            self.metadata[key] = c.value(vtype, key)
            self.value_types[key] = (vtype, etype)
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor name #{i}")
            n_dims = c.scalar("<I", name)
            if n_dims > 8:
                raise GGUFFormatError(f"{self.path}: tensor {name} has {n_dims} dimensions (at most 8 expected)")
            ne = [c.scalar("<Q", name) for _ in range(n_dims)]
            t = c.scalar("<I", name)
            try:
                qtype = GGMLQuantizationType(t)
            except ValueError:
                raise GGUFFormatError(f"{self.path}: tensor {name} has unknown GGML type {t}") from None
            offset = c.scalar("<Q", name)
            infos.append((name, tuple(reversed(ne)), qtype, offset))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"{self.path}: general.alignment {align!r} is not a power of two")
        self.alignment = align
        self.data_offset = (c.pos + align - 1) // align * align
        self.tensors: dict[str, CompressedTensor] = {}
        self._infos = infos
        self._map_tensors(view=not header_only)

    def _map_tensors(self, view: bool = True):
        """Check every tensor's type and extent (so a header-only open also finds a file truncated in
        its tensor data) and the layout ggml's loader demands: each tensor's data where the one
        before it ends, padded to the alignment, so no two overlap and each one's size is its type's
        and shape's (a type id changed so that a tensor still fits moves every later offset). With
        `view`, expose each as a CompressedTensor over the mapping."""
        base = torch.frombuffer(self._map, dtype=torch.uint8) if self.file_size and view else None
        seen = set()
        expected, before = 0, "the data section's start"
        for name, shape, qtype, offset in self._infos:
            if qtype not in GGML_QUANT_SIZES:
                raise GGUFFormatError(f"{self.path}: tensor {name} has GGML type {qtype.name} with no known block size")
            nbytes = tensor_nbytes(qtype, shape, f"{self.path}: tensor {name}")
            if offset != expected:
                raise GGUFFormatError(
                    f"{self.path}: tensor {name} is at data offset {offset}, expected {expected} (where {before} "
                    f"ends): the tensors' data must follow each other in table order, each padded to "
                    f"{self.alignment} bytes (a damaged tensor table, or a tensor's type or shape changed)")
            expected += (nbytes + self.alignment - 1) // self.alignment * self.alignment
            before = f"tensor {name} ({qtype.name} {list(shape)})"
            start = self.data_offset + offset
            if start + nbytes > self.file_size:
                raise GGUFFormatError(
                    f"{self.path}: truncated: tensor {name} needs bytes {start}..{start + nbytes}, "
                    f"the file has {self.file_size}")
            if name in seen:
                raise GGUFFormatError(f"{self.path}: tensor {name} appears twice")
            seen.add(name)
            if view:
                self.tensors[name] = CompressedTensor(name, qtype, shape, base[start:start + nbytes])

    # -- access ---------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFFormatError(f"{self.path}: no general.architecture key")
        return arch

    def strings(self, key: str) -> list[str]:
        """Decode a string array (e.g. `tokenizer.ggml.tokens`)."""
        v = self.metadata.get(key)
        if isinstance(v, StringArray):
            return v.decode(self._map)
        if v is None:
            raise GGUFFormatError(f"{self.path}: missing metadata key {key}")
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise GGUFFormatError(f"{self.path}: metadata {key} is not a string array")

    def tensor_infos(self) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
        return [(n, s, q) for n, s, q, _ in self._infos]

    def tensor_range(self, name: str) -> tuple[int, int]:
        """Absolute byte range [start, end) of a tensor's data in the file."""
        for n, shape, qtype, offset in self._infos:
            if n == name:
                start = self.data_offset + offset
                return start, start + tensor_nbytes(qtype, shape, f"{self.path}: tensor {n}")
        raise KeyError(name)

    def close(self):
        self.tensors = {}
        m, self._map = getattr(self, "_map", None), None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # tensors still alive elsewhere keep the mapping; it closes when they go
            else:
                closed(m)  # unmapped: its addresses are no longer this file's

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_architecture(path: str | os.PathLike) -> str:
    """Only `general.architecture`: reads metadata until that key (writers put it first), so a
    folder scan never walks the LM's tokenizer arrays. Cached by path, size and mtime."""
    return _ARCHITECTURES.get(path, lambda st: _scan_architecture(str(path), st.st_size))


_ARCHITECTURES = FileCache(1024)


def _scan_architecture(path: str, size: int) -> str:
    if size < 24:
        raise GGUFFormatError(f"{path}: not a GGUF file ({size} bytes, too short for a header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if bytes(m[:4]) != GGUF_MAGIC:
            raise GGUFFormatError(f"{path}: not a GGUF file (magic {bytes(m[:4])!r}, expected b'GGUF')")
        c = _Cursor(m, path)
        c.pos = 4
        version = c.scalar("<I", "version")
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (expected 2 or 3)")
        c.scalar("<Q", "tensor count")
        n_kv = c.scalar("<Q", "metadata count")
        for i in range(min(n_kv, size)):
            key = c.string(f"metadata key #{i}")
            value = c.value(c.value_type(key), key)
            if key == "general.architecture":
                if not isinstance(value, str):
                    break
                return value
    raise GGUFFormatError(f"{path}: no general.architecture key")
