"""Decode-time matrix products and packed weights (fused QKV, gate/up, LM-head candidate rows).

Decoding multiplies a handful of rows (the CFG pair of each song) by large weights, so its speed is
the speed of reading the weights. Two things matter in pure torch:

* On the CPU, MKL runs `x @ w.T` with 2-4 rows (what `F.linear` calls) at ~10 GB/s of weights on
  the AMD EPYC we measured, but the same product as `w @ x.T` (weight-major) at 25-40 GB/s (the AR
  stage of `python -m mm3 bench --config medium` reads 1.4 GB per frame at ~33 GB/s this way).
  `decode_linear` picks that form on the CPU for up to DECODE_MAX_ROWS rows; accelerators keep
  `F.linear` (cuBLAS handles both forms alike).
* A `PackedWeight` holds the rows of several GGUF layers as one matrix, so the three attention
  projections, or gate and up, are one product. Same-type layers are packed into one buffer and
  each layer's slot is rebound to its view (`WeightSlots.rebind`): the packed copy replaces the
  originals, and the plain model code keeps working on the same bytes. Quantized blocks stay
  compressed; each product dequantizes into a reused scratch buffer, unless `cache(dtype)` kept
  a dequantized copy (a memory budget decides, see `mm3.fast.ar`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..gguf.ops import FLOAT_TYPES, Embedding, Linear
from ..gguf.quants import dequantize

DECODE_MAX_ROWS = 16  # beyond this the weight-major form stops paying on the CPU (measured up to 16)


def decode_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K].T -> [..., N], in the fastest form for a few rows on x's device."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows > DECODE_MAX_ROWS:
        return F.linear(x, w)
    y = torch.mm(w, x.reshape(rows, x.shape[-1]).T)  # [N, rows]: MKL's weight-major GEMM
    return y.T.contiguous().view(*x.shape[:-1], w.shape[0])


class Scratch:
    """One reusable flat buffer per dtype for per-call dequantization on the CPU, where a fresh
    allocation of a large weight means page faults on every product. Accelerators allocate from
    their caching allocators instead (and a compiled step must not share a buffer between calls)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor | None:
        if self.device.type != "cpu":
            return None
        n = math.prod(shape)
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < n:
            buf = self._buffers[dtype] = torch.empty(n, dtype=dtype, device=self.device)
        return buf[:n].view(shape)


class _Segment:
    """Rows of one GGML type: a float tensor [n, K] or raw blocks [n, row_bytes] (uint8)."""

    def __init__(self, qtype, data: torch.Tensor, rows: int, cols: int):
        self.qtype, self.data, self.rows, self.cols = qtype, data, rows, cols
        self.cached: torch.Tensor | None = None

    def weight(self, dtype: torch.dtype, scratch: Scratch | None) -> torch.Tensor:
        if self.cached is not None and self.cached.dtype == dtype:
            return self.cached
        if self.qtype in FLOAT_TYPES:
            return self.data if self.data.dtype == dtype else self.data.to(dtype)
        out = scratch.take((self.rows, self.cols), dtype) if scratch is not None else None
        return dequantize(self.data, self.qtype, (self.rows, self.cols), dtype, out=out)

    def cost(self, dtype: torch.dtype) -> int:
        """Bytes a dequantized copy in `dtype` would take (0 if the data already is one)."""
        if self.qtype in FLOAT_TYPES and FLOAT_TYPES[self.qtype] == dtype:
            return 0
        return self.rows * self.cols * torch.empty(0, dtype=dtype).element_size()


class PackedWeight:
    """A weight [N, K] made of row segments; `linear(x, dtype)` is x @ W.T in `dtype`.

    Built by `pack_linears` (whole layers) or `pack_rows` (row ranges of a head or table)."""

    def __init__(self, segments: list[_Segment], scratch: Scratch | None):
        self.segments, self.scratch = segments, scratch
        self.out_features = sum(s.rows for s in segments)
        self.splits = [s.rows for s in segments]

    def linear(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        parts = [decode_linear(x, s.weight(dtype, self.scratch)) for s in self.segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def cost(self, dtype: torch.dtype) -> int:
        return sum(s.cost(dtype) for s in self.segments)

    def cache(self, dtype: torch.dtype) -> int:
        """Keep every segment dequantized in `dtype`; returns the bytes this took."""
        used = 0
        for s in self.segments:
            if s.cost(dtype) and (s.cached is None or s.cached.dtype != dtype):
                s.cached = s.weight(dtype, None)  # a new tensor: a cast or a dequantization
            used += s.cost(dtype)
        return used

    def release(self):
        for s in self.segments:
            s.cached = None


def _adjacent(tensors: list[torch.Tensor]) -> bool:
    """True when the tensors are consecutive contiguous pieces of one storage (packed before)."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset or t.dtype != first.dtype):
            return False
        offset += t.numel()
    return True


def _rows_view(layer: Linear) -> torch.Tensor:
    """The weight slot as [out_features, K] floats or [out_features, row_bytes] raw blocks."""
    w = layer.weight
    return w if layer.qtype("weight") in FLOAT_TYPES else w.view(layer.out_features, -1)


def pack_linears(layers: list[Linear], scratch: Scratch | None = None) -> PackedWeight:
    """The weights of `layers` (same in_features, no bias) stacked by rows, in order. Layers of one
    GGML type share one buffer (copied once, then each slot is rebound to its view; a second call
    finds them adjacent and copies nothing); mixed types stay separate segments."""
    k = layers[0].in_features
    for layer in layers:
        if layer.in_features != k or layer.has_bias:
            raise ValueError(f"cannot pack linear layers of in_features {layer.in_features} (expected {k}) "
                             f"or with a bias ({layer.has_bias})")
    qtypes = {layer.qtype("weight") for layer in layers}
    if len(qtypes) != 1:
        return PackedWeight([_Segment(layer.qtype("weight"), _rows_view(layer), layer.out_features, k)
                             for layer in layers], scratch)
    (qtype,) = qtypes
    views = [_rows_view(layer) for layer in layers]
    n = sum(layer.out_features for layer in layers)
    if len(layers) == 1:
        return PackedWeight([_Segment(qtype, views[0], n, k)], scratch)
    if _adjacent([layer.weight for layer in layers]):
        first = views[0]
        packed = first.as_strided((n, first.shape[1]), (first.shape[1], 1), first.storage_offset())
    else:
        packed = torch.cat(views)
        start = 0
        for layer, v in zip(layers, views):
            piece = packed[start:start + v.shape[0]]
            layer.rebind("weight", piece if qtype in FLOAT_TYPES else piece.reshape(layer.weight.shape))
            start += v.shape[0]
    return PackedWeight([_Segment(qtype, packed, n, k)], scratch)


def pack_rows(table: Linear | Embedding, ranges: list[tuple[int, int]], scratch: Scratch | None = None) -> PackedWeight:
    """Row ranges [start, stop) of a Linear weight or an Embedding table as one PackedWeight
    (views, nothing copied): the LM-head rows of the sampler's candidates."""
    qtype = table.qtype("weight")
    if isinstance(table, Linear):
        n_rows, k = table.out_features, table.in_features
    else:
        n_rows, k = table.num_embeddings, table.embedding_dim
    rows = table.weight if qtype in FLOAT_TYPES else table.weight.view(n_rows, -1)
    return PackedWeight([_Segment(qtype, rows[a:b], b - a, k) for a, b in ranges], scratch)
