"""Pure-torch dequantization of GGML block formats (F32, F16, BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K).

A quantized tensor travels as its raw block bytes (uint8) and is expanded here, on the device those
bytes sit on, right before use. One function per type turns [n_blocks, type_size] bytes into
[n_blocks, block_size] float32, chosen from `_DEQUANT`; each mirrors gguf-py's numpy float32 arithmetic
step for step, so results are bit-identical to it before the cast to `dtype`. Byte layouts are ggml's,
read with uint8/int8 shifts, masks and f16 views (on CPU, CUDA, ROCm, XPU, MPS). Little-endian only.
"""

from __future__ import annotations

import math

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ...errors import InputError

__all__ = [
    "SCALE_OFFSETS", "SUPPORTED_TYPES", "random_blocks", "UnsupportedQuantType", "as_qtype", "dequantize", "dequantize_rows",
    "row_nbytes",
]


class UnsupportedQuantType(InputError):
    """A GGML tensor type this module cannot dequantize (or one that is not a GGML type at all)."""


# Sub-block sizes inside a 256-element K-quant super-block (ggml-common.h): Q4_K/Q5_K keep one
# 6-bit scale and min per 32 values, Q2_K/Q3_K/Q6_K one scale per 16 values.
_K_SUB32 = 32
_K_SUB16 = 16

# Bit-field unpacking has two equivalent forms. On CPU, one op per field with a Python-int shift on
# contiguous bytes runs vectorised (a broadcast tensor shift does not). On accelerators
# the single broadcast shift launches 2 kernels instead of 2 per field. Integer results are identical.
BROADCAST_SHIFTS_ON_CPU = False  # True: the accelerators' form on the CPU too (the same integers)

# Values dequantized per pass on CPU (4 MiB of float32; see _run). Tests shrink it to force chunks.
CPU_CHUNK_VALUES = 1 << 20

# Per-device cache of the shift-amount tensors for the broadcast form.
_SHIFTS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}

_NIBBLES = (0, 4)
_CRUMBS = (0, 2, 4, 6)  # four 2-bit fields per byte
_BITS = tuple(range(8))


def _unpack(q: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Bit fields of bytes: q [..., k] uint8 -> [..., len(shifts), k], field i = (q >> shifts[i]) & mask."""
    if q.device.type == "cpu" and not BROADCAST_SHIFTS_ON_CPU:
        q = q.contiguous()
        width = mask.bit_length()
        fields = []
        for s in shifts:
            f = q >> s if s else q
            fields.append(f & mask if s + width < 8 else f)  # the top field needs no mask
        return torch.stack(fields, dim=-2)
    key = (q.device, shifts)
    t = _SHIFTS.get(key)
    if t is None:
        t = _SHIFTS[key] = torch.tensor(shifts, dtype=torch.uint8, device=q.device)
    return (q.unsqueeze(-2) >> t.view(-1, 1)) & mask


def _halves(b: torch.Tensor, first: int, count: int = 1) -> torch.Tensor:
    """`count` little-endian f16 values at byte `first` of each block: b [n, size] -> [n, count] float32.

    `b` is contiguous with an even row size (every GGML block is), so it views as float16 pairs.
    """
    return b.view(torch.float16)[:, first // 2:first // 2 + count].to(torch.float32)


# ---------------------------------------------------------------------------------------------
# one function per type: fill out [n, block_size] float32 from blocks b [n, type_size] (contiguous
# uint8). Integer work stays in uint8/int8; the float part is the same chain of float32 products,
# sums and differences as gguf-py's, in the same order, done in place in `out` (exact int -> float
# copy first, then one rounding per operation, as numpy does).


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: d, qs[32] int8
    out.copy_(b[:, 2:].view(torch.int8)).mul_(_halves(b, 0))


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: d, qs[16]: value j in the low nibble of byte j, value 16+j in the high nibble
    q = _unpack(b[:, 2:], _NIBBLES, 0x0F).reshape(out.shape)
    out.copy_(q.view(torch.int8) - 8).mul_(_halves(b, 0))


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: d, m, qs[16]
    dm = _halves(b, 0, 2)
    out.copy_(_unpack(b[:, 4:], _NIBBLES, 0x0F).reshape(out.shape)).mul_(dm[:, :1]).add_(dm[:, 1:])


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """qh [n, 4]: a little-endian u32 whose bit j is value j's fifth bit -> [n, 32] uint8 of 0 or 0x10."""
    return (_unpack(qh.unsqueeze(-1), _BITS, 1) << 4).reshape(qh.shape[0], -1)  # [n, 4, 8, 1]: byte, bit


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: d, qh[4], qs[16]
    q = _unpack(b[:, 6:], _NIBBLES, 0x0F).reshape(out.shape) | _q5_high(b[:, 2:6])
    out.copy_(q.view(torch.int8) - 16).mul_(_halves(b, 0))


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: d, m, qh[4], qs[16]
    dm = _halves(b, 0, 2)
    q = _unpack(b[:, 8:], _NIBBLES, 0x0F).reshape(out.shape) | _q5_high(b[:, 4:8])
    out.copy_(q).mul_(dm[:, :1]).add_(dm[:, 1:])


def _q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin
    n = b.shape[0]
    sc = b[:, :16]
    dm = _halves(b, 80, 2)  # [n, 2]
    dl = (dm[:, :1] * (sc & 0x0F)).unsqueeze(-1)  # [n, 16, 1]
    ml = (dm[:, 1:] * (sc >> 4)).unsqueeze(-1)
    q = _unpack(b[:, 16:80].reshape(n, 2, 32), _CRUMBS, 3).reshape(n, 16, _K_SUB16)
    out.view(n, 16, _K_SUB16).copy_(q).mul_(dl).sub_(ml)


def _q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: hmask[32], qs[64], scales[12] (16 x 6-bit, offset 32), d
    n = b.shape[0]
    sc = b[:, 96:108]
    lo = _unpack(sc[:, :8], _NIBBLES, 0x0F).reshape(n, 16)  # low 4 bits: bytes 0-7, low then high nibble
    hi = _unpack(sc[:, 8:12], _CRUMBS, 3).reshape(n, 16)  # high 2 bits: bytes 8-11, four crumbs each
    scale = (lo | (hi << 4)).view(torch.int8) - 32
    dl = (_halves(b, 108) * scale).unsqueeze(-1)  # [n, 16, 1]
    ql = _unpack(b[:, 32:96].reshape(n, 2, 32), _CRUMBS, 3).reshape(n, 16, _K_SUB16)
    qh = _unpack(b[:, :32].reshape(n, 1, 32), _BITS, 1).reshape(n, 16, _K_SUB16)
    # a clear hmask bit means "subtract 4": q = ql + 4*qh - 4
    q = (ql | (qh << 2)).view(torch.int8) - 4
    out.view(n, 16, _K_SUB16).copy_(q).mul_(dl)


def _k4_scale_min(s: torch.Tensor) -> torch.Tensor:
    """The 12 packed bytes of Q4_K/Q5_K -> [n, 2, 8] uint8: 6-bit scales (row 0) and mins (row 1).

    Bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and the top 2 bits of entries 4-7;
    bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    n = s.shape[0]
    sm = s[:, :8].reshape(n, 2, 4)
    low = _unpack(s[:, 8:12], _NIBBLES, 0x0F)  # [n, 2, 4]
    return torch.cat((sm & 0x3F, low | ((sm >> 2) & 0x30)), dim=-1)


def _k4_affine(b: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """out = d*sc * q - dmin*m for Q4_K/Q5_K, given q [n, 8, 32] uint8."""
    f = _halves(b, 0, 2).unsqueeze(-1) * _k4_scale_min(b[:, 4:16])  # [n, 2, 8]: d*sc, dmin*m
    out.view(q.shape).copy_(q).mul_(f[:, 0].unsqueeze(-1)).sub_(f[:, 1].unsqueeze(-1))


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: d, dmin, scales[12], qs[128]; byte k of chunk j holds values 64j+k (low) and 64j+32+k (high)
    n = b.shape[0]
    q = _unpack(b[:, 16:].reshape(n, 4, 32), _NIBBLES, 0x0F).reshape(n, 8, _K_SUB32)
    _k4_affine(b, q, out)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: d, dmin, scales[12], qh[32] (bit j = fifth bit of sub-block j), qs[128]
    n = b.shape[0]
    ql = _unpack(b[:, 48:].reshape(n, 4, 32), _NIBBLES, 0x0F).reshape(n, 8, _K_SUB32)
    qh = _unpack(b[:, 16:48].reshape(n, 1, 32), _BITS, 1).reshape(n, 8, _K_SUB32)
    _k4_affine(b, ql | (qh << 4), out)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # layout: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d
    n = b.shape[0]
    dl = (_halves(b, 208) * b[:, 192:208].view(torch.int8)).unsqueeze(-1)  # [n, 16, 1]
    ql = _unpack(b[:, :128].reshape(n, 2, 64), _NIBBLES, 0x0F)  # [n, 2, 2, 64]: half, nibble, byte
    ql = ql.reshape(n, 2, 4, 32)  # per 128-half: low nibbles of bytes 0-31, 32-63, then high nibbles
    qh = _unpack(b[:, 128:192].reshape(n, 2, 32), _CRUMBS, 3)  # [n, 2, 4, 32]
    q = (ql | (qh << 4)).view(torch.int8) - 32
    out.view(n, 16, _K_SUB16).copy_(q.reshape(n, 16, _K_SUB16)).mul_(dl)


def _f32(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.float32))


def _f16_values(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.float16))


def _bf16(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.bfloat16))


_DEQUANT = {
    QT.F32: _f32, QT.F16: _f16_values, QT.BF16: _bf16,
    QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1,
    QT.Q2_K: _q2_k, QT.Q3_K: _q3_k, QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k,
}

SUPPORTED_TYPES: frozenset[QT] = frozenset(_DEQUANT)

# Byte offsets of the f16 scale fields inside one block (the layouts above). Not used by the
# kernels; tests and the benchmark write valid scales there when they build random blocks.
SCALE_OFFSETS: dict[QT, tuple[int, ...]] = {
    QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}


def random_blocks(qtype: QT, n: int, k: int, *, generator: torch.Generator | None = None,
                  device="cpu") -> torch.Tensor:
    """GGUF block rows [n, row bytes] of random quants whose scales are all 0.01: a weight whose
    products stay finite, for checking and timing the kernels."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n * (k // block), size), dtype=torch.uint8, generator=generator, device=device)
    scale = torch.full((1,), 0.01, dtype=torch.float16, device=device).view(torch.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        raw[:, offset:offset + 2] = scale
    return raw.reshape(n, -1)


# ---------------------------------------------------------------------------------------------
# public API


def parse_qtype(qtype) -> QT:
    """A `GGMLQuantizationType` from an enum member, its integer id or its name."""
    try:
        return QT[qtype] if isinstance(qtype, str) else QT(int(qtype))
    except (KeyError, ValueError, TypeError):
        raise UnsupportedQuantType(f"unknown GGML tensor type {qtype!r}") from None


def as_qtype(qtype) -> QT:
    """A dequantizable `GGMLQuantizationType` (see `parse_qtype`); else UnsupportedQuantType."""
    t = parse_qtype(qtype)
    if t not in SUPPORTED_TYPES:
        names = ", ".join(sorted(s.name for s in SUPPORTED_TYPES))
        raise UnsupportedQuantType(f"GGML tensor type {t.name} ({int(t)}) cannot be dequantized; supported: {names}")
    return t


def row_nbytes(qtype, row_len: int) -> int:
    """Bytes of one row of `row_len` values; ValueError if `row_len` is not a whole number of blocks."""
    t = as_qtype(qtype)
    block, size = GGML_QUANT_SIZES[t]
    if row_len % block:
        raise ValueError(f"{t.name} stores blocks of {block} values; a row of {row_len} values is not a multiple")
    return row_len // block * size


def _prefix(name: str | None) -> str:
    return f"{name}: " if name else ""


def _check_raw(raw: torch.Tensor, name: str | None) -> None:
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        got = raw.dtype if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise TypeError(f"{_prefix(name)}raw block bytes must be a uint8 torch tensor, got {got}")


def _blocks(flat: torch.Tensor, type_size: int) -> torch.Tensor:
    """Flat bytes -> [n_blocks, type_size]; re-based copy when a dtype view would be misaligned."""
    flat = flat.reshape(-1, type_size)
    if not flat.is_contiguous() or flat.storage_offset() % 4:  # dtype views need aligned, dense rows
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat


def _run(blocks: torch.Tensor, t: QT, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """[n_blocks, type_size] bytes -> [n_blocks, block_size] in `dtype` (written into `out` if given)."""
    n, block = blocks.shape[0], GGML_QUANT_SIZES[t][0]
    if t == QT.F32:  # already float32: a view, cast or copied only when asked
        values = blocks.view(torch.float32)
        if out is not None:
            return out.copy_(values)
        return values if dtype == torch.float32 else values.to(dtype)
    if out is None:
        out = torch.empty(n, block, dtype=dtype, device=blocks.device)
    kernel = _DEQUANT[t]
    # On CPU, chunks keep the temporaries small and reused (whole-tensor ones would each be fresh,
    # page-faulted memory and add ~3 bytes per output byte to the peak). Accelerators take one pass.
    step = max(1, CPU_CHUNK_VALUES // block) if blocks.device.type == "cpu" else max(n, 1)
    scratch = None
    for start in range(0, n, step):
        stop = min(n, start + step)
        if dtype == torch.float32:
            kernel(blocks[start:stop], out[start:stop])
        else:  # compute in float32, then one rounding to dtype
            if scratch is None:
                scratch = torch.empty(min(step, n), block, dtype=torch.float32, device=blocks.device)
            kernel(blocks[start:stop], scratch[:stop - start])
            out[start:stop].copy_(scratch[:stop - start])
    return out


def dequantize(raw: torch.Tensor, qtype, shape, dtype: torch.dtype = torch.float32, *,
               out: torch.Tensor | None = None, name: str | None = None) -> torch.Tensor:
    """Expand raw GGML bytes (uint8, read flat) to `shape` (torch order; the last dimension is the GGML
    row) in `dtype` on raw's device, bit for bit gguf-py's float32 dequantization cast to `dtype`. F32
    read as float32 may share memory with `raw`. out: a contiguous tensor of `shape` and `dtype` on
    raw's device to write into (a reused buffer saves the allocation and, on CPU, its page faults).
    `name` only prefixes error messages."""
    t = as_qtype(qtype)
    _check_raw(raw, name)
    shape = tuple(int(s) for s in shape)
    block, size = GGML_QUANT_SIZES[t]
    row_len = shape[-1] if shape else 1
    if row_len % block:
        raise ValueError(f"{_prefix(name)}{t.name} stores blocks of {block} values along the last dimension; "
                         f"shape {list(shape)} has rows of {row_len}")
    expected = math.prod(shape) // block * size
    if raw.numel() != expected:
        raise ValueError(f"{_prefix(name)}{t.name} tensor of shape {list(shape)} needs {expected} bytes, "
                         f"got {raw.numel()}")
    if out is None:
        return _run(_blocks(raw, size), t, dtype).reshape(shape)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != raw.device or not out.is_contiguous():
        raise ValueError(f"{_prefix(name)}out must be a contiguous {dtype} tensor of shape {list(shape)} on "
                         f"{raw.device}, got {out.dtype} {list(out.shape)} on {out.device}")
    _run(_blocks(raw, size), t, dtype, out.view(-1, block))
    return out


def dequantize_rows(raw_rows: torch.Tensor, qtype, row_len: int, dtype: torch.dtype = torch.float32, *,
                    name: str | None = None) -> torch.Tensor:
    """Dequantize selected rows: raw_rows [..., row_nbytes(qtype, row_len)] uint8 -> [..., row_len].

    For embedding lookups: index the table's bytes viewed as [rows, row_nbytes] with the token ids
    and expand only those rows.
    """
    t = as_qtype(qtype)
    _check_raw(raw_rows, name)
    nbytes = row_nbytes(t, row_len)
    if raw_rows.dim() == 0 or raw_rows.shape[-1] != nbytes:
        raise ValueError(f"{_prefix(name)}{t.name} rows of {row_len} values take {nbytes} bytes each, "
                         f"got raw rows of shape {list(raw_rows.shape)}")
    lead = tuple(raw_rows.shape[:-1])
    return _run(_blocks(raw_rows, GGML_QUANT_SIZES[t][1]), t, dtype).reshape(*lead, row_len)
