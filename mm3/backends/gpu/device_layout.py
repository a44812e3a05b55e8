"""The device layout of a quantized weight: its GGUF blocks rearranged into planes of 32-bit words
that a GPU kernel reads with 16-byte loads, bit for bit reversible, at the file's bits per weight.

A row of K values is cut into chunks of 256 (the last padded with zeros; K-quant rows are whole
chunks already). Value `32 b + 4 i + l` of a chunk is lane j = 4 b + l of slice i (b = 0..7,
i = 0..7, l = 0..3): a kernel works on one slice at a time, as [rows, chunks, 32] tensors, and each
group of 4 lanes (one thread's 4 words) holds block b of 32 values whole, so a thread finds its
block's scales once, not once a slice. Every plane holds a fixed number of little-endian words per
chunk, chunk after chunk, and is loaded as such a tensor (4 consecutive words per thread), so its
words land in the registers of the lanes that use them:

  q     4-bit types: 32 words, word j holding lane j's value of slice i in nibble i (the low 4
        bits for the Q5 types and Q6_K); Q8_0: 64 words, byte b of word 32 h + j holding lane j of
        slice 4 h + b (int8)
  qh    the high bits of lane j's values, placed so that one rotation of a word brings those of
        four slices to just above their nibbles (bit 4 (i % 4) + 4 of a half word; `high_bit`):
        Q5 types: 8 words, word j // 4 holding the fifth bit of slice i at bit
        (4 (i % 4) + 4 + 16 (l // 2) + 2 (l % 2) + i // 4) % 32 (l = j % 4); Q6_K: 16 words, word
        j // 2 holding the top two bits at bit (4 (i % 4) + 4 + 2 (i // 4) + 16 (j % 2)) % 32
  d, m  Q8_0, Q4_*, Q5_*: the 8 blocks' float16 scales (and mins), in order (4 words)
  hdr   Q4_K, Q5_K: the super-block's first 16 bytes as in the file (d, dmin, 6-bit scales)
  sc, d     Q6_K: the 16 int8 group scales as in the file; the float16 scale of chunk c in half
            c % 8 of the 4 words of chunk group c // 8

Each plane's row starts on a 16-byte boundary and the row is padded to 64 bytes, so every stride
is a multiple of 16 words (which Triton specialises on). Bits per weight (`bits_per_weight`, rows
of whole chunks) are the file's for every type.
"""

import functools
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

CHUNK = 256  # values per chunk
SLICES = 8  # slices of 32 values per chunk
ROW_ALIGN = 64  # bytes: plane strides are multiples of 16 elements for every element size
PLANE_ALIGN = 16

# (plane, words per chunk), in row order; Q6_K's d takes 4 words per 8 chunks.
PLANES: dict[QT, tuple[tuple[str, float], ...]] = {
    QT.Q8_0: (("q", 64), ("d", 4)),
    QT.Q4_0: (("q", 32), ("d", 4)),
    QT.Q4_1: (("q", 32), ("d", 4), ("m", 4)),
    QT.Q5_0: (("q", 32), ("qh", 8), ("d", 4)),
    QT.Q5_1: (("q", 32), ("qh", 8), ("d", 4), ("m", 4)),
    QT.Q4_K: (("q", 32), ("hdr", 4)),
    QT.Q5_K: (("q", 32), ("qh", 8), ("hdr", 4)),
    QT.Q6_K: (("q", 32), ("qh", 16), ("sc", 4), ("d", 0.5)),
}
LAYOUT_TYPES: frozenset[QT] = frozenset(PLANES)


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
        """Plane `name` of a layout buffer [rows, row_bytes] as an int32 [rows, words] view."""
        a = self.offsets[name]
        return buffer[:, a:a + self.nbytes[name]].view(torch.int32)


@functools.cache  # pure in (qtype, k); asked at every layout product
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
    for name, words in PLANES[qtype]:
        count = chunks * words if words >= 1 else -(-chunks // 8) * 4
        offsets[name], nbytes[name] = at, count * 4
        at += -(-nbytes[name] // PLANE_ALIGN) * PLANE_ALIGN
    return Layout(qtype, k, chunks, offsets, nbytes, -(-at // ROW_ALIGN) * ROW_ALIGN)


def bits_per_weight(qtype: QT) -> float:
    """Stored bits per weight in the layout for rows of whole chunks (padding aside)."""
    return sum(words for _, words in PLANES[qtype]) * 32 / CHUNK


# -- the blocks' quant values, in value order -----------------------------------------------------
def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2, n]: low nibbles, then high nibbles."""
    return torch.stack((b & 15, b >> 4), dim=-2)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """uint8 [..., n] -> [..., n, count]: bit t of each byte at [..., t]."""
    shifts = torch.arange(count, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-1) >> shifts) & 1


def _fields(b: torch.Tensor, qtype: QT) -> dict:
    """Blocks [n, type_size] -> "q": the quant values as uint8 [n, block] in value order (Q8_0: the
    int8 bytes), and for the 32-value types "d" (and "m"): the float16 fields as uint8 [n, 2]."""
    n = b.shape[0]
    if qtype == QT.Q8_0:
        return {"d": b[:, 0:2], "q": b[:, 2:]}
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        head = {"d": b[:, 0:2]} if qtype in (QT.Q4_0, QT.Q5_0) else {"d": b[:, 0:2], "m": b[:, 2:4]}
        hq = 2 * len(head)  # the fifth bits follow the float16 fields
        if qtype in (QT.Q4_0, QT.Q4_1):
            return {**head, "q": _nibbles(b[:, hq:]).reshape(n, 32)}
        return {**head, "q": _nibbles(b[:, hq + 4:]).reshape(n, 32) | (_bits(b[:, hq:hq + 4], 8).reshape(n, 32) << 4)}
    if qtype in (QT.Q4_K, QT.Q5_K):
        qs = b[:, 16:] if qtype == QT.Q4_K else b[:, 48:]
        q = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 256)  # 64 c + 32 nibble + byte
        if qtype == QT.Q5_K:
            q = q | (_bits(b[:, 16:48], 8).transpose(1, 2).reshape(n, 256) << 4)  # bit s of qh[lane]
        return {"q": q}
    if qtype == QT.Q6_K:
        low = _nibbles(b[:, :128].reshape(n, 2, 2, 32))  # half, 32-byte run, nibble, lane
        low = low.permute(0, 1, 3, 2, 4).reshape(n, 256)  # value 128 half + 32 (2 nibble + run) + lane
        high = (b[:, 128:192].reshape(n, 2, 1, 32) >> torch.arange(0, 8, 2, dtype=torch.uint8,
                                                                  device=b.device).view(1, 1, 4, 1)) & 3
        return {"q": low | (high.reshape(n, 256) << 4)}
    raise ValueError(f"{qtype.name} has no device layout")


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 0/1 [..., m, 8] -> [..., m]: element t of the last dimension in bit t."""
    out = bits[..., 0].clone()
    for t in range(1, 8):
        out |= bits[..., t] << t
    return out


# -- the high bits' places ---------------------------------------------------------------------------
HIGH_BITS = {QT.Q5_0: 1, QT.Q5_1: 1, QT.Q5_K: 1, QT.Q6_K: 2}  # bits above each nibble


def high_bit(qtype: QT, i: int, lane: int) -> int:
    """Where the high bits of lane `lane` of slice i start in their qh word (word lane // per, per =
    4 lanes a word for the Q5 types, 2 for Q6_K). Rotating the word right by this bit less
    4 (i % 4) + 4 brings them, and those of the lane's three other slices with the same i // 4, to
    just above their nibbles in a half word (bit 4 (i % 4) + 4)."""
    if qtype == QT.Q6_K:
        return (4 * (i % 4) + 4 + 2 * (i // 4) + 16 * (lane % 2)) % 32
    return (4 * (i % 4) + 4 + 16 * ((lane % 4) // 2) + 2 * (lane % 2) + i // 4) % 32


def _high_words(high: torch.Tensor, qtype: QT) -> torch.Tensor:
    """High bits uint8 [r, c, 8, 32] (slice, lane) -> the qh plane's words int32 [r, c, words]."""
    width = HIGH_BITS[qtype]
    per = 4 // width  # lanes a word
    values = (high & ((1 << width) - 1)).to(torch.int32)
    out = torch.zeros(high.shape[:2] + (32 // per,), dtype=torch.int32, device=high.device)
    for i in range(SLICES):
        for lane in range(per):
            out |= values[:, :, i, lane::per] << high_bit(qtype, i, lane)
    return out


def _high_values(words: torch.Tensor, qtype: QT) -> torch.Tensor:
    """The inverse of `_high_words`: the qh plane's bytes [r, c, words * 4] -> uint8 [r, c, 8, 32]."""
    width = HIGH_BITS[qtype]
    per = 4 // width
    w = words.contiguous().view(torch.int32)
    out = torch.empty(w.shape[:2] + (SLICES, 32), dtype=torch.uint8, device=w.device)
    for i in range(SLICES):
        for lane in range(per):
            out[:, :, i, lane::per] = ((w >> high_bit(qtype, i, lane)) & ((1 << width) - 1)).to(torch.uint8)
    return out


# -- planes ----------------------------------------------------------------------------------------
def _padded(x: torch.Tensor, count: int) -> torch.Tensor:
    """[rows, m, ...] -> [rows, count, ...], zeros after the first m."""
    if x.shape[1] == count:
        return x
    pad = torch.zeros((x.shape[0], count - x.shape[1]) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat((x, pad), dim=1)


PASS_VALUES = 1 << 24  # weight values converted per pass: the unpacked temporaries (a few bytes a value)
#                       stay near 100 MB on the weight's device, whatever its shape


def to_planes(blocks: torch.Tensor, qtype: QT, k: int, *, rows_per_pass: int | None = None) -> torch.Tensor:
    """GGUF block rows [n, k / block * type_size] uint8 -> the layout [n, row_bytes] uint8, on the
    blocks' device (in passes of `rows_per_pass` rows, default PASS_VALUES // k, bounding the
    temporaries)."""
    rows_per_pass = rows_per_pass or max(1, PASS_VALUES // k)
    lay = layout_of(qtype, k)
    block, size = GGML_QUANT_SIZES[qtype]
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != k // block * size:
        raise ValueError(f"{qtype.name} rows of {k} values are [n, {k // block * size}] uint8 blocks, got "
                         f"{blocks.dtype} {list(blocks.shape)}")
    out = torch.zeros(n, lay.row_bytes, dtype=torch.uint8, device=blocks.device)
    for a in range(0, n, rows_per_pass):
        b = min(n, a + rows_per_pass)
        _fill(out[a:b], blocks[a:b], qtype, lay)
    return out


def _fill(out: torch.Tensor, blocks: torch.Tensor, qtype: QT, lay: Layout) -> None:
    rows, s = blocks.shape[0], lay.chunks
    block, size = GGML_QUANT_SIZES[qtype]
    f = _fields(blocks.reshape(-1, size), qtype)
    q = _padded(f["q"].reshape(rows, -1), s * CHUNK).reshape(rows, s, 8, SLICES, 4)  # [r, c, b, i, l]
    q = q.permute(0, 1, 3, 2, 4).reshape(rows, s, SLICES, 32)  # [r, c, i, j = 4 b + l]
    if qtype == QT.Q8_0:  # byte b of word 32 h + j: slice 4 h + b
        _put(out, lay, "q", q.reshape(rows, s, 2, 4, 32).permute(0, 1, 2, 4, 3))
    else:
        nib = (q & 15).permute(0, 1, 3, 2)  # [r, c, j, i]
        _put(out, lay, "q", nib[..., 0::2] | (nib[..., 1::2] << 4))  # byte t of word j: nibbles 2t, 2t + 1
    if qtype in HIGH_BITS:
        _put(out, lay, "qh", _high_words(q >> 4, qtype).view(torch.uint8))
    if block == 32:
        for name in ("d", "m"):
            if name in lay.offsets:
                _put(out, lay, name, _padded(f[name].reshape(rows, -1, 2), s * SLICES))
    elif qtype in (QT.Q4_K, QT.Q5_K):
        _put(out, lay, "hdr", blocks.reshape(rows, s, size)[:, :, :16])
    else:
        b = blocks.reshape(rows, s, size)
        _put(out, lay, "sc", b[:, :, 192:208])
        _put(out, lay, "d", b[:, :, 208:210])


def _put(out: torch.Tensor, lay: Layout, name: str, value: torch.Tensor) -> None:
    a = lay.offsets[name]
    value = value.reshape(out.shape[0], -1)
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
        q = get("q").reshape(rows, s, 2, 32, 4).permute(0, 1, 2, 4, 3)
    else:
        words = get("q").reshape(rows, s, 32, 4)  # [r, c, j, byte t]
        q = torch.stack((words & 15, words >> 4), dim=-1).reshape(rows, s, 32, SLICES).permute(0, 1, 3, 2)
        if qtype in HIGH_BITS:
            q = q | (_high_values(get("qh").reshape(rows, s, -1), qtype) << 4)
    q = q.reshape(rows, s, SLICES, 8, 4).permute(0, 1, 3, 2, 4)  # [r, c, i, j = 4 b + l] -> value order
    q = q.reshape(rows, s * CHUNK)[:, :k].reshape(rows, per_row, block)
    if block == 32:
        head = [get(name)[:, :per_row * 2].reshape(rows, per_row, 2) for name in ("d", "m") if name in lay.offsets]
        if qtype in (QT.Q5_0, QT.Q5_1):
            head.append(_pack_bits(((q >> 4) & 1).reshape(rows, per_row, 4, 8)))
        qs = (q[:, :, :16] & 15) | ((q[:, :, 16:] & 15) << 4)
        return torch.cat(head + [q if qtype == QT.Q8_0 else qs], dim=2).reshape(rows, per_row * size)
    out = torch.empty(rows, per_row, size, dtype=torch.uint8, device=planes.device)
    if qtype in (QT.Q4_K, QT.Q5_K):
        out[:, :, :16] = get("hdr").reshape(rows, s, 16)
        nib = (q & 15).reshape(rows, s, 4, 2, 32)
        out[:, :, -128:] = (nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).reshape(rows, s, 128)
        if qtype == QT.Q5_K:
            out[:, :, 16:48] = _pack_bits(((q >> 4) & 1).reshape(rows, s, 8, 32).transpose(2, 3))
    else:
        low = (q & 15).reshape(rows, s, 2, 2, 2, 32)  # half, nibble, run, lane
        out[:, :, :128] = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(rows, s, 128)
        high = ((q >> 4) & 3).reshape(rows, s, 2, 4, 32)
        out[:, :, 128:192] = (high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) |
                              (high[:, :, :, 3] << 6)).reshape(rows, s, 64)
        out[:, :, 192:208] = get("sc").reshape(rows, s, 16)
        out[:, :, 208:210] = get("d")[:, :2 * s].reshape(rows, s, 2)
    return out.reshape(rows, per_row * size)


def dequantize(planes: torch.Tensor, qtype: QT, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layout's weight [n, k] in `dtype`, equal to the dequantization of its blocks."""
    from ...formats.gguf.quants import dequantize as dequantize_blocks

    blocks = to_blocks(planes, qtype, k)
    return dequantize_blocks(blocks, qtype, (planes.shape[0], k), dtype)
