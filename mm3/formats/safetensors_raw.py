"""Raw safetensors access for the converter and the dialects: headers, shard indexes and tensor bytes.

The safetensors format is an 8-byte little-endian header length, a JSON header
(`name -> {dtype, shape, data_offsets}`, offsets relative to the end of the header) and the
tensor bytes. Reading it ourselves lets the converter copy BF16 tensors byte for byte (numpy
has no bfloat16) and memory-map one tensor at a time, so a 17 GB component never sits in RAM.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..bounded import loads

# Weight files a diffusers / transformers component folder may hold, in the order we look.
SINGLE_NAMES = ("model.safetensors", "diffusion_pytorch_model.safetensors")
INDEX_SUFFIX = ".safetensors.index.json"

# Bytes per element of the safetensors dtypes we may meet.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}

_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live: `path`, absolute byte range [start, end), dtype and shape."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def raw(self) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 memory map (nothing is read until used)."""
        if self.nbytes == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.start, shape=(self.nbytes,))

    def to_torch(self) -> torch.Tensor:
        """The tensor as a torch tensor in its own dtype (a copy; meant for small tensors)."""
        if self.dtype not in _TORCH_DTYPES:
            raise ValueError(f"{self.path}: tensor {self.name} has dtype {self.dtype}, expected one of "
                             f"{sorted(_TORCH_DTYPES)}")
        data = bytearray(self.raw().tobytes())
        flat = torch.frombuffer(data, dtype=_TORCH_DTYPES[self.dtype]) if data else torch.zeros(
            0, dtype=_TORCH_DTYPES[self.dtype])
        return flat.reshape(self.shape)


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own bound on the JSON header


def _parse(path: Path) -> tuple[dict, int]:
    """The whole header (`__metadata__` included), checked as the safetensors library checks it: a
    JSON object (nesting and numbers bounded, `mm3.bounded`) of tensor entries `{dtype, shape,
    data_offsets}` with known dtypes, sizes that match the shapes, and ranges that tile the data
    section in order; `__metadata__` maps strings to strings. Returns (header, data start)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        size = path.stat().st_size
        if n > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n} exceeds file size {size})")
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (header length {n}, at most {MAX_HEADER_BYTES})")
        try:
            header = loads(f.read(n), "the safetensors header")
        except ValueError as e:  # BoundError, JSONDecodeError and UnicodeDecodeError
            raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is a JSON {type(header).__name__}, expected an object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError(f"{path}: safetensors __metadata__ must map strings to strings")
    _check_entries(path, {k: v for k, v in header.items() if k != "__metadata__"}, size - 8 - n)
    return header, 8 + n


def _check_entries(path: Path, entries: dict, data_bytes: int) -> None:
    ranges = []
    for name, info in entries.items():
        what = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ValueError(f"{what} is a JSON {type(info).__name__}, expected {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise ValueError(f"{what} has dtype {dtype!r}, expected one of {', '.join(DTYPE_SIZES)}")
        if not _ints(shape) or len(shape) > 8:
            raise ValueError(f"{what} has shape {shape!r}, expected at most 8 non-negative integers")
        if not _ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise ValueError(f"{what} has data_offsets {offsets!r}, expected [start, end] with start <= end")
        want = math.prod(shape) * DTYPE_SIZES[dtype]
        if offsets[1] - offsets[0] != want:
            raise ValueError(f"{what} has {offsets[1] - offsets[0]} bytes, expected {want} for {dtype} {shape}")
        ranges.append((offsets[0], offsets[1], name))
    end = 0
    for start, stop, name in sorted(ranges):
        if start != end:
            raise ValueError(f"{path}: tensor {name!r} starts at data byte {start}, expected {end} (the tensors' "
                             "ranges must follow each other without gaps or overlaps)")
        end = stop
    if end > data_bytes:
        raise ValueError(f"{path}: the tensors need {end} data bytes, the file holds {data_bytes} (truncated "
                         "download?)")


def _ints(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def read_header(path: str | Path) -> tuple[dict, int]:
    """Parse a safetensors header. Returns (header without `__metadata__`, absolute data start)."""
    header, base = _parse(Path(path))
    header.pop("__metadata__", None)
    return header, base


def read_metadata(path: str | Path) -> dict:
    """The header's `__metadata__` (string keys and values; empty when there is none)."""
    return _parse(Path(path))[0].get("__metadata__") or {}


def file_entries(path: Path, names: list[str] | None = None) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file (or the `names` among them), checked against its size."""
    header, base = read_header(path)
    out = {}
    for name in header if names is None else names:
        if name not in header:
            raise KeyError(f"{path}: tensor {name!r} is listed in the index but missing from this shard")
        info = header[name]
        a, b = info["data_offsets"]
        out[name] = TensorEntry(name, path, info["dtype"], tuple(info["shape"]), base + a, base + b)
    return out


def find_weight_files(folder: str | Path) -> tuple[list[Path], Path | None]:
    """The safetensors files of a component folder: ([single file], None) or (shards, index path)."""
    folder = Path(folder)
    for name in SINGLE_NAMES:
        if (folder / name).is_file():
            return [folder / name], None
    indexes = sorted(folder.glob("*" + INDEX_SUFFIX))
    if indexes:
        index = indexes[0]
        weight_map = _load_index(index)
        return [folder / s for s in sorted(set(weight_map.values()))], index
    raise FileNotFoundError(f"{folder}: no {' / '.join(SINGLE_NAMES)} and no *{INDEX_SUFFIX} found")


def _load_index(index: Path) -> dict[str, str]:
    try:
        weight_map = loads(index.read_bytes(), "the index")["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index (expected a JSON object with 'weight_map': {e})") from None
    if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
        raise ValueError(f"{index}: its weight_map must map tensor names to shard file names")
    return weight_map


def load_entries(folder: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of a component folder (single file or sharded), by name."""
    folder = Path(folder)
    files, index = find_weight_files(folder)
    if index is None:
        return file_entries(files[0])
    by_shard: dict[str, list[str]] = {}
    for name, shard in _load_index(index).items():
        by_shard.setdefault(shard, []).append(name)
    out: dict[str, TensorEntry] = {}
    for shard, names in sorted(by_shard.items()):
        path = folder / shard
        if not path.is_file():
            raise FileNotFoundError(f"{index}: shard {shard} is missing from {folder}")
        out.update(file_entries(path, names))
    return out
