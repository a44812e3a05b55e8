"""Quantized weights multiplied on the CPU without a float copy, through torch's int4 matrix product.

torch's CPU kernel (`torch._weight_int4pack_mm_for_cpu`) multiplies bfloat16 rows by 4-bit weights
that carry a scale and an offset per group of 32 values along a row, w = (q - 8) * scale + offset.

One plane: Q4_0 (w = (q - 8) d), Q4_1 (w = q d + m) and Q4_K (w = d sc q - dmin mn per 32 values)
have that form as they are; their blocks are repacked once into the kernel's layout (4 bits a
weight plus two bfloat16 per 32, about the bytes of the blocks).

Two planes: any type whose values have at most 8 bits (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) is split into
a high and a low nibble, v = 16 h + l. Each sub-block (one scale) becomes a run of its high
nibbles and a run of its low ones, each multiplied by the sub-block's inputs x: two groups of the
kernel for 32 values, the high one with 16 times the scale (exact in bfloat16), so the input is x
twice over, one copy. Q6_K's 16-value sub-blocks share a group between the runs, so there the
high run's input is 16 x instead. The high nibbles are stored as h + 8 (h + 7 for Q5_0, h + 6 for
Q6_K, which takes their constant out of the scale); what remains of the formula's constant is
spread over the groups' offsets. The packing takes 10 bits a weight and the product reads twice
the row length.

Inputs, scales and offsets are rounded to bfloat16, so products differ from the float32 product of
the dequantized weight by about 0.3 % (less than the quantization's own error); used for
decode-shaped products of the LM and depth decoder in the fast numerics only.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from .matmul import rows_out
from ...formats.gguf.quants import _BITS, _CRUMBS, _NIBBLES, _halves, _k4_scale_min, _q5_high, _unpack

GROUP = 32
ONE_PLANE = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K})
# Two-plane types -> values per sub-block (one scale each).
TWO_PLANES = {QT.Q8_0: 32, QT.Q5_0: 32, QT.Q5_1: 32, QT.Q5_K: 32, QT.Q6_K: 16}
TYPES = ONE_PLANE | frozenset(TWO_PLANES)
_PROBE: list[bool] = []


class Packing(NamedTuple):
    """A weight in the kernel's layout: `weight` (packed nibbles), `pairs` ([groups, N, 2] bfloat16
    scales and offsets), `sub` (0: one plane; else values per sub-block of a two-plane packing)."""

    weight: torch.Tensor
    pairs: torch.Tensor
    sub: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.pairs))


def available() -> bool:
    """Whether this torch has the CPU int4 product and it computes what this module expects."""
    if not _PROBE:
        ok = False
        if hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
            try:
                g = torch.Generator().manual_seed(0)
                q = torch.randint(0, 16, (24, 64), dtype=torch.int32, generator=g)
                scale, offset = torch.rand(24, 2, generator=g) + 0.5, torch.randn(24, 2, generator=g)
                x = torch.randn(2, 64, generator=g)
                w = ((q - 8).view(24, 2, GROUP) * scale[..., None] + offset[..., None]).view(24, 64)
                got = _product(x, pack(q, scale, offset))[:, :24]
                want = x.bfloat16().float() @ w.bfloat16().float().T
                ok = bool(((got - want).norm() / want.norm()) < 2e-2)
            except (RuntimeError, TypeError, AttributeError):
                ok = False
        _PROBE.append(ok)
    return _PROBE[0]


ROWS_MULTIPLE = 16  # the packing takes whole groups of 16 rows: others get zero rows, cut off after


def serves(layer, qtype: QT | None, device: torch.device) -> bool:
    """Whether a decode-shaped product of this layer (`mm3.weights.layers.Linear`) on `device` comes here:
    a weight of one of `TYPES` in the LM or depth decoder in the fast numerics, on the CPU."""
    return (device.type == "cpu" and qtype in TYPES and layer.decode_products and layer.fused_kernels
            and available())


def pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, sub: int = 0) -> Packing:
    """q [N, K] integers in 0..15, scale and offset [N, K/32] -> the kernel's packing."""
    pad = -q.shape[0] % ROWS_MULTIPLE
    if pad:
        q = torch.cat((q, q.new_full((pad, q.shape[1]), 8)))
        scale, offset = (torch.cat((t, t.new_zeros(pad, t.shape[1]))) for t in (scale, offset))
    pairs = torch.stack((scale, offset), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/32, N, 2]
    return Packing(_nibbles(q), pairs, sub)


BLOCK_ROWS = 64  # rows torch's CPU packing lays out together
_DIRECT: list[bool] = []


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15 -> torch's CPU int4 layout ([N, K/2] uint8). Whole 64-row blocks
    are laid out here from bytes, as torch lays them out (byte (k, j) of a block: rows j and j + 32
    of column k, low nibble first; `_direct_agrees` checks it once against this torch); the rows
    after them through torch's op, which takes int32 (four times the bytes, and slower)."""
    n = q.shape[0]
    whole = n // BLOCK_ROWS * BLOCK_ROWS
    if not whole or not _direct_agrees():
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    body = _blocks(q[:whole])
    if whole == n:
        return body
    tail = torch._convert_weight_to_int4pack_for_cpu(q[whole:].to(torch.int32).contiguous(), 1)
    return torch.cat((body, tail))


def _blocks(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in whole 64-row blocks -> their packed bytes [N, K/2] (see `_nibbles`)."""
    n, k = q.shape
    qb = q.to(torch.uint8).view(n // BLOCK_ROWS, 2, BLOCK_ROWS // 2, k)
    return (qb[:, 0] | (qb[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


def _direct_agrees() -> bool:
    """Whether `_blocks` gives torch's own packing (probed once)."""
    if not _DIRECT:
        q = torch.randint(0, 16, (2 * BLOCK_ROWS, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        want, got = torch._convert_weight_to_int4pack_for_cpu(q, 1), _blocks(q)
        _DIRECT.append(want.shape == got.shape and bool(torch.equal(want, got)))
    return _DIRECT[0]


def _product(x2: torch.Tensor, packed: Packing) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), packed.weight, GROUP, packed.pairs).float()


def one_plane(b: torch.Tensor, qtype: QT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of a 4-bit type -> q [n, block] (0..15), scale and minimum [n, block / 32] with
    w = scale q - minimum (both exact in float32)."""
    n_blocks = b.shape[0]
    if qtype == QT.Q4_K:  # d, dmin, scales[12], qs[128]; byte k of chunk c: values 64c + k, 64c + 32 + k
        q = _unpack(b[:, 16:].reshape(n_blocks, 4, 32), _NIBBLES, 0x0F).reshape(n_blocks, 256)
        dm = _halves(b, 0, 2)
        sm = _k4_scale_min(b[:, 4:16]).float()  # [n, 2, 8]
        return q, dm[:, :1] * sm[:, 0], dm[:, 1:] * sm[:, 1]
    # Q4_0: d, qs[16]; Q4_1: d, m, qs[16] (value j low nibble of byte j, 16 + j high)
    start = 2 if qtype == QT.Q4_0 else 4
    q = _unpack(b[:, start:start + 16], _NIBBLES, 0x0F).reshape(n_blocks, 32)
    scale = _halves(b, 0)
    return q, scale, 8 * scale if qtype == QT.Q4_0 else -_halves(b, 2)


def two_planes(b: torch.Tensor, qtype: QT):
    """Blocks of an up-to-8-bit type -> (H, L) [n, block] uint8 and the sub-block scale S and constant
    c [n, block / sub] with w = S (16 (H - 8) + L) + c. The high nibble is stored off-centre where
    that takes the constant out of the scale (a smaller offset rounds less)."""
    n = b.shape[0]
    if qtype == QT.Q8_0:  # d, qs[32] int8: v = 16 (v >> 4) + (v & 15), arithmetic shift
        qs = b[:, 2:]
        d = _halves(b, 0)
        return (qs.view(torch.int8) >> 4).view(torch.uint8) + 8, qs & 0x0F, d, torch.zeros_like(d)
    if qtype in (QT.Q5_0, QT.Q5_1):  # d[, m], qh[4], qs[16]: v = low nibble | fifth bit << 4
        start = 2 if qtype == QT.Q5_0 else 4
        low = _unpack(b[:, start + 4:start + 20], _NIBBLES, 0x0F).reshape(n, 32)
        high = _q5_high(b[:, start:start + 4]) >> 4
        d = _halves(b, 0)
        if qtype == QT.Q5_0:  # v - 16 = 16 (high - 1) + low
            return high + 7, low, d, torch.zeros_like(d)
        return high + 8, low, d, _halves(b, 2)
    if qtype == QT.Q5_K:  # d, dmin, scales[12], qh[32] (bit j: fifth bit of sub-block j), qs[128]
        low = _unpack(b[:, 48:].reshape(n, 4, 32), _NIBBLES, 0x0F).reshape(n, 256)
        high = _unpack(b[:, 16:48].reshape(n, 1, 32), _BITS, 1).reshape(n, 256) + 8
        dm = _halves(b, 0, 2)
        sm = _k4_scale_min(b[:, 4:16]).float()
        return high, low, dm[:, :1] * sm[:, 0], -dm[:, 1:] * sm[:, 1]
    # Q6_K: ql[128], qh[64], scales[16] int8, d; per 128-half h, value 32 i + k (i < 4, k < 32) has
    # its low bits in byte 64 h + 32 (i % 2) + k (nibble i // 2) and its high bits in qh byte 32 h + k
    # (crumb i); v = (low | high << 4) - 32
    low = _unpack(b[:, :128].reshape(n, 2, 64), _NIBBLES, 0x0F)  # [n, half, nibble, 64 bytes] = [n, 2, 4, 32]
    high = _unpack(b[:, 128:192].reshape(n, 2, 32), _CRUMBS, 3) + 6  # v - 32 = 16 (high - 2) + low
    s = _halves(b, 208) * b[:, 192:208].view(torch.int8)  # [n, 16]
    return high.reshape(n, 256), low.reshape(n, 256), s, torch.zeros_like(s)


REPACK_ROWS = 1024  # rows unpacked at a time: bounds the temporaries (a multiple of the packing's 64-row tile)


def repack(raw: torch.Tensor, qtype: QT, out_features: int, in_features: int) -> Packing:
    """GGUF block rows [N, row_bytes] of one of `TYPES` -> the kernel's packing, REPACK_ROWS rows at
    a time (the integer temporaries of a whole released-size weight would take hundreds of MB)."""
    rows = raw.reshape(out_features, -1)
    parts = [_repack_rows(rows[i:i + REPACK_ROWS], qtype, in_features)
             for i in range(0, out_features, REPACK_ROWS)]
    if len(parts) == 1:
        return parts[0]
    return Packing(torch.cat([p.weight for p in parts]), torch.cat([p.pairs for p in parts], dim=1), parts[0].sub)


def _repack_rows(raw: torch.Tensor, qtype: QT, in_features: int) -> Packing:
    b = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1]).contiguous()
    n, k = raw.shape[0], in_features
    if qtype in ONE_PLANE:
        q, scale, minimum = one_plane(b, qtype)
        groups = k // GROUP
        return pack(q.reshape(n, k), scale.reshape(n, groups), (8 * scale - minimum).reshape(n, groups))
    sub = TWO_PLANES[qtype]
    high, low, s, c = two_planes(b, qtype)
    # w = S (16 (H - 8) + (L - 8)) + (8 S + c): the kernel's (q - 8) scale for both planes, and the
    # constant 8 S + c in the offsets, which multiply the sums of the groups' inputs
    subs = k // sub
    q = torch.stack((high.reshape(n, subs, sub), low.reshape(n, subs, sub)), dim=2).reshape(n, 2 * k)
    s, constant = s.reshape(n, subs), (8 * s + c).reshape(n, subs)
    if sub == GROUP:  # each sub-block is two groups, both fed x: the high one scaled by 16, half the constant each
        scales = torch.stack((16 * s, s), dim=2).reshape(n, 2 * subs)
        return pack(q, scales, (constant / 2).repeat_interleave(2, dim=1), sub)
    return pack(q, s, constant / 17, sub)  # one group fed 16 x then x: 17 parts of the constant


MADV_DONTNEED = 4
_LIBC: list = []


def file_pages(t: torch.Tensor) -> tuple[int, int] | None:
    """The address range of the memory pages wholly inside CPU tensor t when they are pages of a
    mapped file (Linux), else None. Memory that is not a file's must never be released: dropping it
    would lose it."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or t.numel() == 0:
        return None
    page = mmap.PAGESIZE
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // page) * page, end // page * page
    return (first, last) if last > first and _in_mapped_file(first, last) else None


def release_pages(span: tuple[int, int] | None) -> bool:
    """Unmap the file pages of `span` (`file_pages`): once a weight is repacked, decode products no
    longer read its GGUF blocks, whose pages would otherwise stay mapped (and counted in the
    process's memory) next to the packing. They stay in the page cache, which the system reclaims
    as it needs, and come back on the next read (a prefill, a move to another device). Returns
    whether pages were released."""
    if span is None:
        return False
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    return _LIBC[0] is not None and _LIBC[0].madvise(span[0], span[1] - span[0], MADV_DONTNEED) == 0


def _in_mapped_file(first: int, last: int) -> bool:
    """Whether [first, last) lies inside one mapping of a file (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                low, high = (int(v, 16) for v in fields[0].split("-"))
                if low <= first < high:
                    return last <= high and fields[4] != "0" and len(fields) == 6 and fields[5].startswith("/")
    except (OSError, ValueError, IndexError):
        pass
    return False


def _planes_input(x2: torch.Tensor, sub: int) -> torch.Tensor:
    """x [rows, K] -> [rows, 2K] bfloat16: per sub-block, x for the high nibbles then x for the low
    ones (one copy); for 16-value sub-blocks (Q6_K) 16 x then x."""
    rows, k = x2.shape
    if sub == GROUP:
        out = torch.empty(rows, 2 * k, dtype=torch.bfloat16, device=x2.device)
        out.view(rows, k // sub, 2, sub).copy_(x2.view(rows, k // sub, 1, sub).expand(rows, k // sub, 2, sub))
        return out
    xb = x2.to(torch.bfloat16).view(rows, k // sub, 1, sub)
    return torch.cat((xb * 16, xb), dim=2).view(rows, 2 * k)


def linear(x: torch.Tensor, packed: Packing, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32) @ W.T (+ bias) -> [..., N] float32, W in the kernel's packing."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = _planes_input(x2, packed.sub) if packed.sub else x2.to(torch.bfloat16)
    y = torch._weight_int4pack_mm_for_cpu(x2, packed.weight, GROUP, packed.pairs)
    return rows_out(y, x, out_features, bias)
