"""Numpy quantizers that write GGML block bytes (the `quantize` tool's writer side).

`quantize(array, qtype)` -> the bytes ggml and gguf-py read back, [..., row_bytes] like gguf-py's
`gguf.quants.quantize` (for `GGUFWriter.add_tensor(..., raw_dtype=qtype)`). BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1 go through gguf-py; Q4_K, Q5_K, Q6_K are vectorised ports of ggml's reference quantizers
(no importance matrix), float32 in C's operation order so the files match minimaxmusic.cpp's byte for
byte, except that a float16 overflow of a block scale is an error (C writes inf). Q2_K, Q3_K: read only.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from .quants import UnsupportedQuantType, parse_qtype

__all__ = ["WRITABLE_TYPES", "quantize"]

_VIA_GGUF_PY = frozenset({QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1})
_K_TYPES = frozenset({QT.Q4_K, QT.Q5_K, QT.Q6_K})
WRITABLE_TYPES: frozenset[QT] = frozenset({QT.F32, QT.F16}) | _VIA_GGUF_PY | _K_TYPES

_QK_K = GGML_QUANT_SIZES[QT.Q4_K][0]  # values per K-quant super-block (256)
_GROUP_MAX_EPS = np.float32(1e-15)  # ggml-quants.c: a sub-block with |x| below this is all zero
CHUNK_BLOCKS = 512  # super-blocks per numpy pass: keeps the search's temporaries cache-sized

_F = np.float32
_MAGIC = _F(12582912.0)  # 1.5 * 2**23, nearest_int's rounding constant


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int, bit for bit: add 1.5*2**23 in float32, keep the low 23 mantissa bits
    (round half to even for |v| <= 4194303; what C gives outside that range, inf or NaN too)."""
    bits = (np.asarray(v, dtype=_F) + _MAGIC).view(np.int32)
    bits &= 0x007FFFFF
    bits -= 0x00400000
    return bits


def _clamped_levels(v: np.ndarray, lo: int, hi: int, out: np.ndarray, in_range: bool) -> np.ndarray:
    """out = float(MAX(lo, MIN(hi, nearest_int(v)))). `in_range`: every |v| <= 4194303 (not NaN),
    where nearest_int is np.rint (round half to even); else the bit trick, whatever v holds."""
    if in_range:
        np.rint(v, out=out)
        return np.clip(out, lo, hi, out=out)
    np.copyto(out, np.clip(_nearest_int(v), lo, hi), casting="unsafe")
    return out


def _sum(terms: np.ndarray, first: bool = False) -> np.ndarray:
    """Sequential float32 sums over axis 0 of terms [k, ...], as C's `s += t[i]` loop: from 0, or
    (`first`) from t[0]; never numpy's pairwise reduction, so every rounding is the C one."""
    acc = terms[0].copy() if first else np.zeros(terms.shape[1:], dtype=_F)
    for row in terms[1:] if first else terms:
        acc += row
    return acc


def _qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants(use_mad=false) for the columns of x [k, m] (one sub-block a column).

    Every intermediate is float32 in C's operation order (the loops over a sub-block are
    sequential sums, one numpy operation per position, across all sub-blocks at once).
    Returns (scale [m], the_min [m] (= -min), levels [k, m] float32 in 0..nmax).
    """
    m = x.shape[1]
    lowest = x.min(axis=0)
    mx = x.max(axis=0)
    sum_w = _sum(w, first=True)
    sum_x = _sum(w * x, first=True)
    mn = np.where(lowest > 0, _F(0), lowest)
    flat = mx == mn  # C returns at once: levels 0, scale 0, the_min = -min
    la = np.empty_like(x)
    t = np.empty_like(x)
    terms = np.empty((3, m), dtype=_F)

    def grid(iscale, origin):  # la = the levels of x on the grid (x - origin) * iscale
        v = np.subtract(x, origin, out=t)
        v *= iscale
        reach = np.abs(iscale) * np.maximum(np.abs(mx - origin), np.abs(lowest - origin))
        in_range = bool(np.all(np.where(flat, _F(0), reach) <= _F(4.0e6)))  # flat columns are discarded
        return _clamped_levels(v, 0, nmax, la, in_range)

    def error(sc, mi):  # sum of w * (sc*l + mi - x)^2 over la, as C
        e = np.multiply(la, sc, out=t)
        e += mi
        e -= x
        e *= e
        e *= w
        return _sum(e)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = _F(nmax) / (mx - mn)
        scale = _F(1) / iscale
        grid(iscale, mn)
        best_error = error(scale, mn)
        # The best levels are those of one grid: keep its (iscale, origin) and rebuild them at the end.
        best_iscale, best_origin = iscale, mn
        for step in range(nstep + 1):
            iscale = (_F(rmin) + _F(rdelta) * _F(step) + _F(nmax)) / (mx - mn)
            grid(iscale, mn)
            wl = np.multiply(w, la, out=t)
            terms[0] = _sum(wl)
            wl *= la
            terms[1] = _sum(wl)
            np.multiply(w, la, out=wl)
            wl *= x
            terms[2] = _sum(wl)
            sum_l, sum_l2, sum_xl = terms
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, _F(0), this_min)
            cur_error = error(this_scale, this_min)
            better = (det > 0) & (cur_error < best_error) & ~flat
            best_iscale = np.where(better, iscale, best_iscale)
            best_origin = np.where(better, mn, best_origin)
            best_error = np.where(better, cur_error, best_error)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
        levels = grid(best_iscale, best_origin).copy()
    scale = np.where(flat, _F(0), scale)
    levels[:, flat] = 0
    return scale, -mn, levels


def _qx(x: np.ndarray, nmax: int):
    """make_qx_quants(rmse_type=1, no weights) for the columns of x [k, m], float32 in C's order.

    Returns (scale [m], levels [k, m] uint8 = l + nmax in 0..2*nmax-1; all 0 for a zero sub-block).
    """
    m = x.shape[1]
    at = np.abs(x).argmax(axis=0)  # the first largest |x|, as C's strict '>'
    xmax = x[at, np.arange(m)]
    zero = np.abs(xmax) < _GROUP_MAX_EPS
    xmax = np.where(zero, _F(1), xmax)
    w = x * x
    wx = w * x  # C: sumlx += w*x[i]*l, i.e. (w*x)*l; suml2 += w*l*l, i.e. (w*l)*l
    lv = np.empty_like(x)
    t = np.empty_like(x)

    def grid(iscale):  # |iscale * x| <= nmax + 1 since |x| <= |xmax| >= 1e-15: in nearest_int's range
        np.multiply(x, iscale, out=t)
        return _clamped_levels(t, -nmax, nmax - 1, lv, True)

    def fit(iscale):
        grid(iscale)
        np.multiply(wx, lv, out=t)
        sumlx = _sum(t)
        wl = np.multiply(w, lv, out=t)
        wl *= lv
        return sumlx, _sum(wl)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        best_iscale = _F(-nmax) / xmax
        sumlx, suml2 = fit(best_iscale)
        scale = np.where(suml2 != 0, sumlx / suml2, _F(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            iscale = -(_F(nmax) + _F(0.1) * _F(step)) / xmax
            sumlx, suml2 = fit(iscale)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            best_iscale = np.where(better, iscale, best_iscale)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
        grid(best_iscale)
    scale = np.where(zero, _F(0), scale)
    lv += _F(nmax)
    out = lv.astype(np.uint8)
    out[:, zero] = 0  # C writes L = 0 for an all-zero sub-block
    return scale, out


def _f16_bytes(v: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n] -> (f16 bytes [n, 2], the stored value as float32 [n]); error if it overflows f16
    (numpy's conversion rounds to nearest even, as GGML_FP32_TO_FP16)."""
    with np.errstate(over="ignore"):
        h = v.astype(np.float16)
    if not np.isfinite(h).all():
        raise ValueError(f"{qtype.name}: a block scale of {float(np.abs(v).max()):g} overflows float16; "
                         f"values this large cannot be stored in {qtype.name}")
    return h.view(np.uint8).reshape(-1, 2), h.astype(_F)


def _q45_k(x: np.ndarray, qtype: QT) -> np.ndarray:
    """quantize_row_q4_K_ref / quantize_row_q5_K_ref on super-blocks x [nb, 256]."""
    nb = x.shape[0]
    five = qtype == QT.Q5_K
    nmax = 31 if five else 15
    xs = np.ascontiguousarray(x.reshape(nb * 8, 32).T)  # [32, nb*8]: one sub-block of 32 a column
    av_x = np.sqrt(_sum(xs * xs) / _F(32))
    w = av_x + np.abs(xs)
    if five:
        scales, mins, levels = _qkx2(xs, w, 31, -0.5, 0.1, 15)
    else:
        scales, mins, levels = _qkx2(xs, w, 15, -1.0, 0.1, 20)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    # C: max over `if (v > max) max = v` from 0 (NaN never wins)
    max_scale = np.fmax(np.fmax.reduce(scales, axis=1), _F(0))
    max_min = np.fmax(np.fmax.reduce(mins, axis=1), _F(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F(63) / max_scale, _F(0))
        inv_min = np.where(max_min > 0, _F(63) / max_min, _F(0))
    # uint8_t ls = nearest_int(...) wraps modulo 256 before MIN(63, ls)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d_bytes, d = _f16_bytes(max_scale / _F(63), qtype)
    m_bytes, dmin = _f16_bytes(max_min / _F(63), qtype)

    packed = np.empty((nb, 12), dtype=np.uint8)  # see quants._k4_scale_min for the layout
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)

    # re-quantize against the scales as stored (f16 super-scales times 6-bit sub-scales)
    sd = (d[:, None] * ls).reshape(-1)  # float * uint8, as C
    sm = (dmin[:, None] * lm).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest_int((xs + sm) / sd), 0, nmax)
    levels = np.where(sd != 0, requant, levels).T.astype(np.uint8).reshape(nb, 4, 2, 32)

    qs = (levels[:, :, 0] & 0x0F) | ((levels[:, :, 1] & 0x0F) << 4)  # [nb, 4, 32]
    parts = [d_bytes, m_bytes, packed]
    if five:  # bit j of qh[l] is the fifth bit of value l of sub-block j
        high = (levels >> 4).reshape(nb, 8, 32)
        qh = np.zeros((nb, 32), dtype=np.uint8)
        for j in range(8):
            qh |= high[:, j] << j
        parts.append(qh)
    parts.append(qs.reshape(nb, 128))
    return np.concatenate(parts, axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref on super-blocks x [nb, 256]."""
    nb = x.shape[0]
    xs = np.ascontiguousarray(x.reshape(nb * 16, 16).T)  # [16, nb*16]: one sub-block of 16 a column
    scales, levels = _qx(xs, 32)
    scales = scales.reshape(nb, 16)
    at = np.abs(scales).argmax(axis=1)  # the first largest |scale|
    max_scale = scales[np.arange(nb), at]
    zero = ~(np.abs(max_scale) >= _GROUP_MAX_EPS)  # whole super-block zero: all bytes 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, _F(0), _F(-128) / np.where(zero, _F(1), max_scale))
        d_bytes, d = _f16_bytes(np.where(zero, _F(0), _F(1) / iscale), QT.Q6_K)
    # int8_t scale = MIN(127, nearest_int(...)): the int is converted (wrapped) to int8
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)  # [nb, 16]
    sd = (d[:, None] * sc).reshape(-1)  # float * int8, as C
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = (np.clip(_nearest_int(xs / sd), -32, 31) + 32).astype(np.uint8)
    levels = np.where(sd != 0, requant, levels).T.reshape(nb, 2, 4, 32)  # half, quarter, l

    ql = np.concatenate([(levels[:, :, 0] & 0x0F) | ((levels[:, :, 2] & 0x0F) << 4),
                         (levels[:, :, 1] & 0x0F) | ((levels[:, :, 3] & 0x0F) << 4)], axis=-1)  # [nb, 2, 64]
    qh = np.zeros((nb, 2, 32), dtype=np.uint8)
    for c in range(4):
        qh |= (levels[:, :, c] >> 4) << (2 * c)
    out = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d_bytes], axis=1)
    out[zero] = 0
    return out


def _workers() -> int:
    """Threads for the K-quant search: one per CPU this process may use (numpy releases the GIL
    inside each array operation, and the chunks are independent)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _quantize_k(rows: np.ndarray, qtype: QT, threads: int | None, chunk_blocks: int) -> np.ndarray:
    blocks = rows.reshape(-1, _QK_K)
    out = np.empty((blocks.shape[0], GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)

    def chunk(start: int) -> None:
        part = blocks[start:start + chunk_blocks]
        out[start:start + chunk_blocks] = _q6_k(part) if qtype == QT.Q6_K else _q45_k(part, qtype)

    starts = range(0, blocks.shape[0], chunk_blocks)
    workers = min(_workers() if threads is None else threads, len(starts))
    if workers <= 1:
        for start in starts:
            chunk(start)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(chunk, starts))  # list(): re-raise the first error
    return out


def quantize(array: np.ndarray, qtype, *, threads: int | None = None, chunk_blocks: int = CHUNK_BLOCKS) -> np.ndarray:
    """Float values -> GGML block bytes, uint8 [..., row_bytes] (the last axis is the GGML row).

    `array`: float32 (or convertible) with the last dimension a multiple of the type's block size.
    The K-quant search runs on `threads` threads (None: one per CPU this process may use) over
    chunks of `chunk_blocks` super-blocks; neither changes the bytes.
    Raises UnsupportedQuantType for types we cannot write (Q2_K, Q3_K, IQ*, ...) and ValueError for
    bad shapes or non-finite input.
    """
    t = parse_qtype(qtype)
    if t not in WRITABLE_TYPES:
        names = ", ".join(sorted(s.name for s in WRITABLE_TYPES))
        raise UnsupportedQuantType(f"writing GGML type {t.name} is not supported; writable types: {names}")
    a = np.ascontiguousarray(array, dtype=np.float32)
    if a.ndim == 0:
        raise ValueError(f"{t.name}: cannot quantize a 0-d array")
    block, size = GGML_QUANT_SIZES[t]
    if a.shape[-1] % block:
        raise ValueError(f"{t.name} stores blocks of {block} values; the last dimension of shape "
                         f"{list(a.shape)} is not a multiple")
    if t != QT.F32 and not np.isfinite(a).all():
        raise ValueError(f"{t.name}: input holds NaN or Inf values, which cannot be quantized")
    out_shape = (*a.shape[:-1], a.shape[-1] // block * size)
    if t == QT.F32:
        return a.view(np.uint8).reshape(out_shape)
    if t == QT.F16:
        with np.errstate(over="ignore"):
            h = a.astype(np.float16)
        if not np.isfinite(h).all():
            raise ValueError(f"F16: values up to {float(np.abs(a).max()):g} overflow float16 (max 65504)")
        return h.view(np.uint8).reshape(out_shape)
    if t in _VIA_GGUF_PY:
        return np.asarray(gguf.quants.quantize(a, t), dtype=np.uint8).reshape(out_shape)
    return _quantize_k(a.reshape(-1, a.shape[-1]), t, threads, max(1, int(chunk_blocks))).reshape(out_shape)
