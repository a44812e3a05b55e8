"""The device layout of a quantized weight: its GGUF blocks rearranged into planes a GPU kernel
reads with 16-byte loads, bit for bit reversible.

A row of K values is cut into chunks of 256 (the last padded with zeros; K-quant rows are whole
chunks already). Value `32 i + j` of a chunk (i = 0..7, j = 0..31) is lane j of slice i, so a kernel
works on one slice at a time: [rows, chunks, 32] tensors with one scale per (row, chunk) and slice.
Planes of a row, each starting on a 16-byte boundary, the row padded to 64 bytes (so every plane's
row stride is a multiple of 16 elements, which Triton specialises on):

  q     4-bit types: 32 little-endian int32 words per chunk, word j holding slice i's value in
        nibble i (the low 4 bits for Q5 and Q6_K); Q8_0: the 256 int8 values in order
  qh    Q5_0, Q5_1, Q5_K: 32 bytes per chunk, bit i of byte j the fifth bit of value 32 i + j;
        Q6_K: 32 int16 per chunk, bits 2i, 2i + 1 of element j the top two bits of value 32 i + j
  d, m  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the float16 scale (and min) of block i of chunk c at [i][c]
  d, dmin   Q4_K, Q5_K: the super-block's float16 scale and min scale at [c]
  sc, m     Q4_K, Q5_K: the 6-bit scale and min of sub-block i as a byte at [i][c]
  sc, d     Q6_K: the int8 scale of 16-value group s at [s][c]; the float16 scale at [c]

Bits per weight (`bits_per_weight`, rows of whole chunks): the file's for every type but Q4_K and
Q5_K, whose packed 6-bit sub-block scales take a byte each here (4.625 and 5.625 instead of 4.5 and
5.5: a kernel cannot read 6-bit fields with wide loads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from .quants import _k4_scale_min

CHUNK = 256  # values per chunk
SLICES = 8  # slices of 32 values per chunk
ROW_ALIGN = 64  # bytes: plane strides are multiples of 16 elements for every element size
PLANE_ALIGN = 16

# (plane, bytes per element, elements per chunk), in row order.
PLANES: dict[QT, tuple[tuple[str, int, int], ...]] = {
    QT.Q8_0: (("q", 1, 256), ("d", 2, 8)),
    QT.Q4_0: (("q", 4, 32), ("d", 2, 8)),
    QT.Q4_1: (("q", 4, 32), ("d", 2, 8), ("m", 2, 8)),
    QT.Q5_0: (("q", 4, 32), ("qh", 1, 32), ("d", 2, 8)),
    QT.Q5_1: (("q", 4, 32), ("qh", 1, 32), ("d", 2, 8), ("m", 2, 8)),
    QT.Q4_K: (("q", 4, 32), ("d", 2, 1), ("dmin", 2, 1), ("sc", 1, 8), ("m", 1, 8)),
    QT.Q5_K: (("q", 4, 32), ("qh", 1, 32), ("d", 2, 1), ("dmin", 2, 1), ("sc", 1, 8), ("m", 1, 8)),
    QT.Q6_K: (("q", 4, 32), ("qh", 2, 32), ("sc", 1, 16), ("d", 2, 1)),
}
LAYOUT_TYPES: frozenset[QT] = frozenset(PLANES)
PLANE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class Layout:
    """Where each plane lies in a row of the device layout of a `qtype` weight with rows of `k` values."""

    qtype: QT
    k: int
    chunks: int
    offsets: dict  # plane -> byte offset in the row
    nbytes: dict  # plane -> bytes in the row
    row_bytes: int

    def plane(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Plane `name` of a layout buffer [rows, row_bytes] as a [rows, elements] view of its type."""
        size = dict((p, s) for p, s, _ in PLANES[self.qtype])[name]
        a = self.offsets[name]
        return buffer[:, a:a + self.nbytes[name]].view(PLANE_DTYPES[size])


def layout_of(qtype: QT, k: int) -> Layout:
    """The layout of rows of `k` values of `qtype` (ValueError for a type without one or a row
    that is not whole blocks)."""
    if qtype not in PLANES:
        raise ValueError(f"{QT(qtype).name} has no device layout; types with one: "
                         f"{', '.join(sorted(t.name for t in PLANES))}")
    block = GGML_QUANT_SIZES[qtype][0]
    if k <= 0 or k % block:
        raise ValueError(f"{qtype.name} rows of {k} values are not whole blocks of {block}")
    chunks = -(-k // CHUNK)
    offsets, nbytes, at = {}, {}, 0
    for name, size, per_chunk in PLANES[qtype]:
        offsets[name], nbytes[name] = at, chunks * per_chunk * size
        at += -(-nbytes[name] // PLANE_ALIGN) * PLANE_ALIGN
    return Layout(qtype, k, chunks, offsets, nbytes, -(-at // ROW_ALIGN) * ROW_ALIGN)


def bits_per_weight(qtype: QT) -> float:
    """Stored bits per weight in the layout for rows of whole chunks (padding aside)."""
    return sum(size * per_chunk for _, size, per_chunk in PLANES[qtype]) * 8 / CHUNK


# -- the blocks' integer fields, in value order ----------------------------------------------------
def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2, n]: low nibbles, then high nibbles."""
    return torch.stack((b & 15, b >> 4), dim=-2)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """uint8 [..., n] -> [..., n, count]: bit t of each byte at [..., t]."""
    shifts = torch.arange(count, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-1) >> shifts) & 1


def _fields(b: torch.Tensor, qtype: QT) -> dict:
    """Blocks [n, type_size] -> their fields: 2-byte scalars as uint8 [n, 2], quant values as uint8
    [n, block] in value order (Q8_0: the int8 bytes), sub-block scales as uint8 [n, count]."""
    n = b.shape[0]
    if qtype == QT.Q8_0:
        return {"d": b[:, 0:2], "q": b[:, 2:]}
    if qtype in (QT.Q4_0, QT.Q4_1):
        start = 2 if qtype == QT.Q4_0 else 4
        out = {"d": b[:, 0:2], "q": _nibbles(b[:, start:]).reshape(n, 32)}
        if qtype == QT.Q4_1:
            out["m"] = b[:, 2:4]
        return out
    if qtype in (QT.Q5_0, QT.Q5_1):
        hq = 2 if qtype == QT.Q5_0 else 4
        q = _nibbles(b[:, hq + 4:]).reshape(n, 32) | (_bits(b[:, hq:hq + 4], 8).reshape(n, 32) << 4)
        out = {"d": b[:, 0:2], "q": q}
        if qtype == QT.Q5_1:
            out["m"] = b[:, 2:4]
        return out
    if qtype in (QT.Q4_K, QT.Q5_K):
        sm = _k4_scale_min(b[:, 4:16])  # [n, 2, 8]
        qs = b[:, 16:] if qtype == QT.Q4_K else b[:, 48:]
        q = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 256)  # 64 c + 32 nibble + byte
        if qtype == QT.Q5_K:
            q = q | (_bits(b[:, 16:48], 8).transpose(1, 2).reshape(n, 256) << 4)  # bit s of qh[lane]
        return {"d": b[:, 0:2], "dmin": b[:, 2:4], "sc": sm[:, 0], "m": sm[:, 1], "q": q}
    if qtype == QT.Q6_K:
        low = _nibbles(b[:, :128].reshape(n, 2, 2, 32))  # half, 32-byte run, nibble, lane
        low = low.permute(0, 1, 3, 2, 4).reshape(n, 256)  # value 128 half + 32 (2 nibble + run) + lane
        high = (b[:, 128:192].reshape(n, 2, 1, 32) >> torch.arange(0, 8, 2, dtype=torch.uint8,
                                                                  device=b.device).view(1, 1, 4, 1)) & 3
        return {"q": low | (high.reshape(n, 256) << 4), "sc": b[:, 192:208], "d": b[:, 208:210]}
    raise ValueError(f"{qtype.name} has no device layout")


def _blocks(f: dict, qtype: QT) -> torch.Tensor:
    """The inverse of `_fields`: blocks [n, type_size] uint8."""
    q = f["q"]
    n = q.shape[0]
    if qtype == QT.Q8_0:
        return torch.cat((f["d"], q), dim=1)
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        qs = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)
        head = [f["d"]] + ([f["m"]] if "m" in f else [])
        if qtype in (QT.Q5_0, QT.Q5_1):
            head.append(_pack_bits(((q >> 4) & 1).reshape(n, 4, 8)))
        return torch.cat(head + [qs], dim=1)
    if qtype in (QT.Q4_K, QT.Q5_K):
        sc, m = f["sc"], f["m"]
        scales = torch.cat((sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)), dim=1)
        nib = (q & 15).reshape(n, 4, 2, 32)
        qs = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(n, 128)
        parts = [f["d"], f["dmin"], scales]
        if qtype == QT.Q5_K:
            parts.append(_pack_bits(((q >> 4) & 1).reshape(n, 8, 32).transpose(1, 2)))
        return torch.cat(parts + [qs], dim=1)
    if qtype == QT.Q6_K:
        low = (q & 15).reshape(n, 2, 2, 2, 32)  # half, nibble, run, lane
        ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
        high = ((q >> 4) & 3).reshape(n, 2, 4, 32)
        qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
        return torch.cat((ql, qh.reshape(n, 64), f["sc"], f["d"]), dim=1)
    raise ValueError(f"{qtype.name} has no device layout")


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 0/1 [..., m, 8] -> [..., m]: element t of the last dimension in bit t."""
    out = bits[..., 0].clone()
    for t in range(1, 8):
        out |= bits[..., t] << t
    return out


# -- planes ----------------------------------------------------------------------------------------
def _chunked(x: torch.Tensor, rows: int, chunks: int, per_chunk: int) -> torch.Tensor:
    """[rows, m, ...] -> [rows, chunks * per_chunk, ...] zero-padded along m."""
    need = chunks * per_chunk
    if x.shape[1] == need:
        return x
    pad = torch.zeros((rows, need - x.shape[1]) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat((x, pad), dim=1)


def _slice_major(x: torch.Tensor, chunks: int, per_chunk: int) -> torch.Tensor:
    """[rows, chunks * per_chunk, ...] in value order -> [rows, per_chunk, chunks, ...] ([i][c])."""
    rows = x.shape[0]
    return x.reshape((rows, chunks, per_chunk) + tuple(x.shape[2:])).transpose(1, 2)


def _chunk_major(x: torch.Tensor, chunks: int, per_chunk: int, keep: int) -> torch.Tensor:
    """The inverse of `_slice_major`, cut to the first `keep` entries."""
    rows = x.shape[0]
    x = x.reshape((rows, per_chunk, chunks) + tuple(x.shape[3:])).transpose(1, 2)
    return x.reshape((rows, chunks * per_chunk) + tuple(x.shape[3:]))[:, :keep]


def to_planes(blocks: torch.Tensor, qtype: QT, k: int, *, rows_per_pass: int = 4096) -> torch.Tensor:
    """GGUF block rows [n, k / block * type_size] uint8 -> the layout [n, row_bytes] uint8, on the
    blocks' device (in passes of `rows_per_pass` rows, bounding the temporaries)."""
    lay = layout_of(qtype, k)
    block, size = GGML_QUANT_SIZES[qtype]
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != k // block * size:
        raise ValueError(f"{qtype.name} rows of {k} values are [n, {k // block * size}] uint8 blocks, got "
                         f"{blocks.dtype} {list(blocks.shape)}")
    out = torch.zeros(n, lay.row_bytes, dtype=torch.uint8, device=blocks.device)
    for a in range(0, n, rows_per_pass):
        b = min(n, a + rows_per_pass)
        _fill(out[a:b], blocks[a:b].reshape(-1, size), qtype, lay, b - a)
    return out


def _fill(out: torch.Tensor, blocks: torch.Tensor, qtype: QT, lay: Layout, rows: int) -> None:
    f = _fields(blocks, qtype)
    s, per_row = lay.chunks, lay.k // GGML_QUANT_SIZES[qtype][0]
    q = _chunked(f["q"].reshape(rows, -1), rows, s, CHUNK).reshape(rows, s, SLICES, 32)  # [r, c, i, j]
    if qtype == QT.Q8_0:
        _put(out, lay, "q", q.reshape(rows, -1))
    else:
        nib = (q & 15).permute(0, 1, 3, 2)  # [r, c, j, i]
        _put(out, lay, "q", (nib[..., 0::2] | (nib[..., 1::2] << 4)).reshape(rows, -1))  # byte t: nibbles 2t, 2t+1
    if qtype in (QT.Q5_0, QT.Q5_1, QT.Q5_K):
        _put(out, lay, "qh", _pack_bits(((q >> 4) & 1).permute(0, 1, 3, 2)).reshape(rows, -1))
    if qtype == QT.Q6_K:
        crumbs = ((q >> 4) & 3).permute(0, 1, 3, 2)  # [r, c, j, i]
        lo = crumbs[..., 0] | (crumbs[..., 1] << 2) | (crumbs[..., 2] << 4) | (crumbs[..., 3] << 6)
        hi = crumbs[..., 4] | (crumbs[..., 5] << 2) | (crumbs[..., 6] << 4) | (crumbs[..., 7] << 6)
        _put(out, lay, "qh", torch.stack((lo, hi), dim=-1).reshape(rows, -1))
    for name, element, per_chunk in PLANES[qtype][1:]:
        if name == "qh":
            continue
        value = f[name].reshape(rows, -1, 2) if element == 2 else f[name].reshape(rows, -1)
        if per_chunk > 1:  # one per block (32-value types, per_row of them) or per sub-block
            value = _slice_major(_chunked(value, rows, s, per_chunk), s, per_chunk)
        _put(out, lay, name, value.reshape(rows, -1))


def _put(out: torch.Tensor, lay: Layout, name: str, value: torch.Tensor) -> None:
    a = lay.offsets[name]
    out[:, a:a + value.shape[1]] = value


def to_blocks(planes: torch.Tensor, qtype: QT, k: int) -> torch.Tensor:
    """The layout [n, row_bytes] -> the GGUF block rows it was made from, bit for bit."""
    lay = layout_of(qtype, k)
    block, size = GGML_QUANT_SIZES[qtype]
    if planes.dtype != torch.uint8 or planes.dim() != 2 or planes.shape[1] != lay.row_bytes:
        raise ValueError(f"a {qtype.name} layout of rows of {k} values is [n, {lay.row_bytes}] uint8, got "
                         f"{planes.dtype} {list(planes.shape)}")
    rows, s, per_row = planes.shape[0], lay.chunks, k // block

    def get(name: str) -> torch.Tensor:
        a = lay.offsets[name]
        return planes[:, a:a + lay.nbytes[name]]

    if qtype == QT.Q8_0:
        q = get("q")
    else:
        words = get("q").reshape(rows, s, 32, 4)  # [r, c, j, byte t]
        q = torch.stack((words & 15, words >> 4), dim=-1).reshape(rows, s, 32, SLICES).permute(0, 1, 3, 2)
        if qtype in (QT.Q5_0, QT.Q5_1, QT.Q5_K):
            q = q | (_bits(get("qh").reshape(rows, s, 32), 8).permute(0, 1, 3, 2) << 4)
        if qtype == QT.Q6_K:
            pairs = get("qh").reshape(rows, s, 32, 2)
            crumbs = torch.stack([(pairs[..., t // 4] >> (2 * (t % 4))) & 3 for t in range(8)], dim=-1)
            q = q | (crumbs.permute(0, 1, 3, 2) << 4)
        q = q.reshape(rows, s * CHUNK)
    f = {"q": q[:, :k].reshape(rows * per_row, block)}
    for name, element, per_chunk in PLANES[qtype][1:]:
        if name == "qh":
            continue
        value = get(name).reshape(rows, per_chunk, s, 2) if element == 2 else get(name).reshape(rows, per_chunk, s)
        count = per_row if per_chunk == SLICES and block == 32 else per_chunk * s
        if per_chunk > 1:
            value = _chunk_major(value, s, per_chunk, count)
        f[name] = value.reshape(rows * (per_row if block == 32 else s), -1)
    return _blocks(f, qtype).reshape(rows, per_row * size)


def dequantize(planes: torch.Tensor, qtype: QT, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layout's weight [n, k] in `dtype`, equal to the dequantization of its blocks."""
    from .quants import dequantize as dequantize_blocks

    blocks = to_blocks(planes, qtype, k)
    return dequantize_blocks(blocks, qtype, (planes.shape[0], k), dtype)


def layout_nbytes(qtype: QT, n: int, k: int) -> int:
    """Bytes of the layout of an [n, k] weight."""
    return n * layout_of(qtype, k).row_bytes


def file_nbytes(qtype: QT, n: int, k: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return n * (k // block) * size


