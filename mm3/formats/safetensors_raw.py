"""Raw safetensors access for the converter and the dialects: headers, shard indexes and tensor bytes.

The safetensors format is an 8-byte little-endian header length, a JSON header
(`name -> {dtype, shape, data_offsets}`, offsets relative to the end of the header) and the
tensor bytes. Reading it ourselves lets the converter copy BF16 tensors byte for byte (numpy
has no bfloat16) and memory-map one tensor at a time, so a 17 GB component never sits in RAM.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Weight files a diffusers / transformers component folder may hold, in the order we look.
SINGLE_NAMES = ("model.safetensors", "diffusion_pytorch_model.safetensors")
INDEX_SUFFIX = ".safetensors.index.json"

# Bytes per element of the safetensors dtypes we may meet.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

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


def read_header(path: str | Path) -> tuple[dict, int]:
    """Parse a safetensors header. Returns (header without `__metadata__`, absolute data start)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        size = path.stat().st_size
        if n > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n} exceeds file size {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def read_metadata(path: str | Path) -> dict:
    """The header's `__metadata__` (string keys and values; empty when there is none)."""
    path = Path(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        try:
            meta = json.loads(f.read(n)).get("__metadata__") or {}
        except (ValueError, AttributeError):
            return {}
    return meta if isinstance(meta, dict) else {}


def file_entries(path: Path, names: list[str] | None = None) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file (or the `names` among them), checked against its size."""
    header, base = read_header(path)
    size = path.stat().st_size
    out = {}
    for name in header if names is None else names:
        if name not in header:
            raise KeyError(f"{path}: tensor {name!r} is listed in the index but missing from this shard")
        info = header[name]
        dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
        a, b = (int(x) for x in info["data_offsets"])
        want = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES.get(dtype, 0)
        if dtype in DTYPE_SIZES and b - a != want:
            raise ValueError(f"{path}: tensor {name!r} has {b - a} bytes, expected {want} for {dtype} {list(shape)}")
        if base + b > size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated download?)")
        out[name] = TensorEntry(name, path, dtype, shape, base + a, base + b)
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
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError) as e:
        raise ValueError(f"{index}: not a safetensors index (expected a JSON object with 'weight_map': {e})") from None
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
