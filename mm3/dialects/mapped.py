"""A foreign file seen as one of our component files: the engine's tensor names and metadata over
another tool's tensors.

A dialect describes each engine tensor by a `Plan`: its name, shape and type, and how to get it
from the source (the same bytes under another name or shape, rows of a fused tensor, rows of
several tensors, or a computed value). `MappedFile` has the reading interface of `GGUFFile`
(`path`, `metadata`, `tensors`, `tensor_infos`, `strings`, `architecture`, `close`), so
`mm3.components` and the model builders take it as they take our files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..formats.gguf.errors import ComponentError, GGUFFormatError
from ..formats.gguf.reader import CompressedTensor, compressed_from_torch
from .source import Source, TensorInfo, aligned


@dataclass(frozen=True)
class Plan:
    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    build: Callable[[Source], CompressedTensor]


def _row_bytes(qtype: GGMLQuantizationType, row: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return row // block * size


def info_of(src: Source, name: str) -> TensorInfo:
    info = src.infos.get(name)
    if info is None:
        raise ComponentError(f"{src.path}: missing tensor {name}")
    return info


def shape_of(src: Source, name: str) -> tuple[int, ...]:
    return info_of(src, name).shape


def sizes(arch: str, values: dict) -> dict:
    """Hyper-parameters as our metadata keys `<arch>.<key>` (integers)."""
    return {f"{arch}.{k}": int(v) for k, v in values.items()}


def _engine_type(src: Source, name: str) -> GGMLQuantizationType:
    info = info_of(src, name)
    qtype = info.qtype
    if qtype is None:
        raise ComponentError(f"{src.path}: tensor {name} is {info.type}, which this engine cannot read as a weight")
    return qtype


def same(src: Source, name: str, source_name: str, shape: tuple[int, ...] | None = None) -> Plan:
    """The source tensor's bytes under our name, optionally seen in another shape of equal size."""
    info = info_of(src, source_name)
    shape = tuple(info.shape if shape is None else shape)
    qtype = _engine_type(src, source_name)
    # Floats take any shape of the same size; quantized rows are blocks of the last dimension.
    last_kept = qtype in _FLOATS or (shape[-1:] == info.shape[-1:])
    if math.prod(shape) != math.prod(info.shape) or not last_kept:
        raise ComponentError(f"{src.path}: tensor {source_name} is {list(info.shape)}, expected {list(shape)}")

    def build(s: Source) -> CompressedTensor:
        t = s.tensor(source_name)
        return CompressedTensor(name, t.qtype, shape, t.raw)

    return Plan(name, shape, qtype, build)


def rows(src: Source, name: str, source_name: str, start: int, stop: int) -> Plan:
    """Rows [start, stop) of a 2-D source tensor (a part of a fused product): a view."""
    info = info_of(src, source_name)
    if len(info.shape) != 2 or not 0 <= start < stop <= info.shape[0]:
        raise ComponentError(f"{src.path}: tensor {source_name} is {list(info.shape)}, which has no rows "
                             f"{start}..{stop}")
    qtype = _engine_type(src, source_name)
    width = _row_bytes(qtype, info.shape[1])

    def build(s: Source) -> CompressedTensor:
        raw = s.tensor(source_name, align=False).raw[start * width:stop * width]  # the part alone is copied
        return CompressedTensor(name, qtype, (stop - start, info.shape[1]), aligned(raw))

    return Plan(name, (stop - start, info.shape[1]), qtype, build)


def stacked(src: Source, name: str, parts: list[tuple[str, int, int] | int]) -> Plan:
    """Rows of several 2-D source tensors one after another; an int part is that many zero rows
    (rows the model never reads). The source tensors must share width and type. A copy."""
    tensors = [p[0] for p in parts if not isinstance(p, int)]
    types = {_engine_type(src, t) for t in tensors}
    widths = {info_of(src, t).shape[-1] for t in tensors}
    if len(types) != 1 or len(widths) != 1:
        raise ComponentError(f"{src.path}: tensors {', '.join(tensors)} differ in type or width and cannot be "
                             f"read as one {name}")
    qtype, width = types.pop(), widths.pop()
    row = _row_bytes(qtype, width)
    n = sum(p if isinstance(p, int) else p[2] - p[1] for p in parts)

    def build(s: Source) -> CompressedTensor:
        out = torch.zeros(n * row, dtype=torch.uint8)
        at = 0
        for p in parts:
            if isinstance(p, int):
                at += p * row  # zero bytes are zeros in every GGML type
                continue
            t, a, b = p
            out[at:at + (b - a) * row] = s.tensor(t, align=False).raw[a * row:b * row]
            at += (b - a) * row
        return CompressedTensor(name, qtype, (n, width), out)

    return Plan(name, (n, width), qtype, build)


def computed(name: str, shape: tuple[int, ...], fn: Callable[[Source], torch.Tensor]) -> Plan:
    """A float32 tensor computed from source tensors (a folded weight norm)."""

    def build(s: Source) -> CompressedTensor:
        value = fn(s).to(torch.float32).contiguous()
        if tuple(value.shape) != tuple(shape):
            raise ComponentError(f"{s.path}: {name} came out {list(value.shape)}, expected {list(shape)}")
        return compressed_from_torch(name, value)

    return Plan(name, tuple(shape), GGMLQuantizationType.F32, build)


def as_float(src: Source, name: str) -> torch.Tensor:
    """A source tensor dequantized to float32 (small tensors: norms, weight-norm parts)."""
    return src.tensor(name).dequantize(torch.float32)


_FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


class MappedFile:
    """The engine's view of one component of a foreign file (module docstring)."""

    def __init__(self, source: Source, arch: str, metadata: dict, plans: list[Plan], dialect: str):
        self.path = source.path
        self.source = source
        self.dialect = dialect  # says what the file is, in messages ("ComfyUI text encoder")
        self.metadata = {"general.architecture": arch, **metadata}
        self._plans = plans
        self.tensors: dict[str, CompressedTensor] = {}
        if source.mapped:
            self.tensors = {p.name: p.build(source) for p in plans}
            source.derived.clear()  # what the plans shared while building is in the tensors now

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def strings(self, key: str) -> list[str]:
        v = self.metadata.get(key)
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise GGUFFormatError(f"{self.path}: no string array {key} ({self.dialect})")

    def tensor_infos(self) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
        return [(p.name, p.shape, p.qtype) for p in self._plans]

    def close(self):
        self.tensors = {}
        self.source.close()
