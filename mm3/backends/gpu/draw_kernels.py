"""A guided top-k draw in one Triton kernel (imported only where Triton runs): the reference's
`mm3.plan.sampling` chain (`guide`, `top_k_probs`, `draw`) as `mm3.backends.cpu.steps.top_k_draw`
states it, one program per song looping over the N columns.

The logits are read in their own dtype and widened in registers (what `.float()` makes). The
k-th largest value is found without a sort: a radix select over the float's bits, 8 at a time,
with a 256-bin histogram per digit (4 digits; 2 for bfloat16 logits' conditional row); with `GATE`
once over the conditional row, then over the guided values (the largest found on the way). Then
the softmax's sum, the renormalising sum and the argmax of p / q. A row of at most one block
(the acoustic draws' 1024) is read once and held in registers; a longer one (the LM's 16389) is
read block by block at every pass, 7 to 9 of them.

The guidance and every division are rounded as torch's (no fused multiply-adds, `div_rn`); the
exponential is libdevice's `expf` on a GPU (within 2 units in the last place) and numpy's under
the interpreter, and the sums run in another order than torch's. So the index is torch's except where the two largest ratios
p / q lie within a few float32 roundings of each other (relatively, about 1e-6), as with the CPU
library's draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .interpreter import interpreted

FP_FUSION = False  # launch option: `u + (c - u) * cfg` rounded twice, as torch computes it
NAN_FILL = tl.constexpr(1e9)  # `mm3.plan.sampling.NAN_FILL`: nan_to_num's bounds
MAX_BLOCK = 4096  # logits a program holds in registers at once: a longer row (the LM's) is read block by block


@triton.jit
def _key(x):
    """An unsigned key of float32 x that orders as the floats do, every NaN above +inf (as topk
    ranks NaN)."""
    u = x.to(tl.uint32, bitcast=True)
    key = tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)
    return tl.where(x != x, 0xFFFFFFFF, key)


@triton.jit
def _unkey(key):
    """The float32 of a `_key`."""
    u = tl.where((key >> 31) != 0, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _guided(row_ptr, row_stride, excl_ptr, cols, ok, cfg, kth_c,
            R: tl.constexpr, HAS_EXCL: tl.constexpr, GATE: tl.constexpr, COND: tl.constexpr):
    """COND: the conditional logits (excluded columns -inf). Else the values `top_k_probs` ranks:
    guided (with GATE only where the conditional logit is not below `kth_c`; excluded -inf), then
    nan_to_num with the reference's bounds."""
    c = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_EXCL:
        ex = tl.load(excl_ptr + cols, mask=ok, other=0) != 0
        c = tl.where(ex, float("-inf"), c)
    if COND:
        return c
    if R == 2:
        u = tl.load(row_ptr + row_stride + cols, mask=ok, other=0.0).to(tl.float32)
        g = u + (c - u) * cfg
    else:
        g = c
    if GATE:
        g = tl.where(c < kth_c, float("-inf"), g)
    if HAS_EXCL:
        g = tl.where(ex, float("-inf"), g)
    g = tl.where(g != g, -NAN_FILL, g)
    g = tl.where(g == float("inf"), NAN_FILL, g)
    return tl.where(g == float("-inf"), -NAN_FILL, g)


@triton.jit
def _digit(hist, want, prefix):
    """One radix step: the digit (0-255) whose suffix count in `hist` reaches `want`, the count
    still wanted below it, and the prefix extended by it."""
    bins = tl.arange(0, 256)
    at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # keys whose digit is >= each bin's
    d = tl.max(tl.where(at_least >= want, bins, -1))
    return want - tl.sum(tl.where(bins > d, hist, 0)), (prefix << 8) | d.to(tl.uint32)


@triton.jit
def _kth_of(prefix, LEVELS: tl.constexpr):
    """The float32 of a key whose top 8 * LEVELS bits are `prefix`, the rest those every key of a
    wider float's values has (a bfloat16's: 0 for a positive value, all ones for a negative one)."""
    if LEVELS < 4:
        low: tl.constexpr = 32 - 8 * LEVELS
        prefix = (prefix << low) | tl.where((prefix >> (8 * LEVELS - 1)) != 0, 0, (1 << low) - 1).to(tl.uint32)
    return tl.max(_unkey(prefix))


@triton.jit
def _select(key, ok, k, LEVELS: tl.constexpr):
    """The k-th largest of the keys held in registers (where `ok`), as a float32."""
    want = k
    prefix = tl.zeros([1], tl.uint32)
    for level in tl.static_range(LEVELS):
        digit = ((key >> (24 - 8 * level)) & 255).to(tl.int32)
        mask = ok
        if level > 0:
            mask = ok & ((key >> (32 - 8 * level)) == prefix)
        want, prefix = _digit(tl.histogram(digit, 256, mask=mask), want, prefix)
    return _kth_of(prefix, LEVELS)


@triton.jit
def _kth_largest(row_ptr, row_stride, excl_ptr, N, k, cfg, kth_c,
                 R: tl.constexpr, HAS_EXCL: tl.constexpr, GATE: tl.constexpr, COND: tl.constexpr,
                 LEVELS: tl.constexpr, BLOCK: tl.constexpr):
    """(the k-th largest (1 <= k <= N) of `_guided`'s values over the row, read block by block;
    the largest): the key's digits from the top, each the one whose suffix count of keys (among
    those sharing the digits found) reaches k; the largest made on the first pass."""
    want = k
    prefix = tl.zeros([1], tl.uint32)
    top = float("-inf")
    for level in tl.static_range(LEVELS):
        hist = tl.zeros([256], tl.int32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < N
            x = _guided(row_ptr, row_stride, excl_ptr, cols, ok, cfg, kth_c, R, HAS_EXCL, GATE, COND)
            key = _key(x)
            digit = ((key >> (24 - 8 * level)) & 255).to(tl.int32)
            if level == 0:
                top = tl.maximum(top, tl.max(tl.where(ok, x, float("-inf"))))
            else:
                ok = ok & ((key >> (32 - 8 * level)) == prefix)
            hist += tl.histogram(digit, 256, mask=ok)
        want, prefix = _digit(hist, want, prefix)
    return _kth_of(prefix, LEVELS), top


@triton.jit
def _exp(x, PRECISE_EXP: tl.constexpr):
    if PRECISE_EXP:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def draw_top_k_kernel(logits_ptr, q_ptr, excl_ptr, out_ptr, end_ptr, N, row_stride, q_stride, cfg, k,
                      start_id, code_offset, end_id,
                      R: tl.constexpr, HAS_EXCL: tl.constexpr, GATE: tl.constexpr, CODED: tl.constexpr,
                      PRECISE_EXP: tl.constexpr, COND_LEVELS: tl.constexpr, BLOCK: tl.constexpr,
                      WHOLE: tl.constexpr):
    """Song s's draw over logits rows [s * R, s * R + R) and its Exponential(1) draws q[s]: the
    column index, or with CODED its code (index + start_id - code_offset, at least 0) and whether
    index + start_id is end_id. WHOLE (N <= BLOCK): the row is read once and held in registers;
    else every pass reads it block by block. COND_LEVELS: radix digits the conditional row's keys
    need (2 for bfloat16 logits)."""
    song = tl.program_id(0)
    row_ptr = logits_ptr + song.to(tl.int64) * R * row_stride
    q_row = q_ptr + song.to(tl.int64) * q_stride
    kth_c = 0.0
    if WHOLE:
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        if GATE:
            c = _guided(row_ptr, row_stride, excl_ptr, cols, ok, cfg, kth_c, R, HAS_EXCL, GATE, True)
            kth_c = _select(_key(c), ok, k, COND_LEVELS)
        v = _guided(row_ptr, row_stride, excl_ptr, cols, ok, cfg, kth_c, R, HAS_EXCL, GATE, False)
        kth = _select(_key(v), ok, k, 4)
        top = tl.max(tl.where(ok, v, float("-inf")))
        keep = ok & (v >= kth)
        e = tl.where(keep, _exp(v - top, PRECISE_EXP), 0.0)
        total = tl.sum(e)
        p = tl.where(keep, tl.div_rn(e, total), 0.0)
        norm = tl.maximum(tl.sum(p), 1e-12)
        ratio = tl.where(ok, tl.div_rn(tl.div_rn(p, norm), tl.load(q_row + cols, mask=ok, other=1.0)), -1.0)
        index = tl.argmax(ratio, 0, tie_break_left=True)
    else:
        if GATE:
            kth_c, _ = _kth_largest(row_ptr, row_stride, excl_ptr, N, k, cfg, kth_c, R, HAS_EXCL, GATE, True,
                                    COND_LEVELS, BLOCK)
        kth, top = _kth_largest(row_ptr, row_stride, excl_ptr, N, k, cfg, kth_c, R, HAS_EXCL, GATE, False, 4, BLOCK)
        total = 0.0
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < N
            v = _guided(row_ptr, row_stride, excl_ptr, cols, ok, cfg, kth_c, R, HAS_EXCL, GATE, False)
            total += tl.sum(tl.where(ok & (v >= kth), _exp(v - top, PRECISE_EXP), 0.0))
        norm = 0.0
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < N
            v = _guided(row_ptr, row_stride, excl_ptr, cols, ok, cfg, kth_c, R, HAS_EXCL, GATE, False)
            norm += tl.sum(tl.where(ok & (v >= kth), tl.div_rn(_exp(v - top, PRECISE_EXP), total), 0.0))
        norm = tl.maximum(norm, 1e-12)
        best = -1.0
        index = 0
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < N
            v = _guided(row_ptr, row_stride, excl_ptr, cols, ok, cfg, kth_c, R, HAS_EXCL, GATE, False)
            p = tl.where(ok & (v >= kth), tl.div_rn(tl.div_rn(_exp(v - top, PRECISE_EXP), total), norm), 0.0)
            ratio = tl.where(ok, tl.div_rn(p, tl.load(q_row + cols, mask=ok, other=1.0)), -1.0)
            most = tl.max(ratio)
            at = start + tl.argmax(ratio, 0, tie_break_left=True)
            index = tl.where(most > best, at, index)
            best = tl.maximum(best, most)
    if CODED:
        token = index + start_id
        tl.store(out_ptr + song, tl.maximum(token - code_offset, 0).to(tl.int64))
        tl.store(end_ptr + song, token == end_id)
    else:
        tl.store(out_ptr + song, index.to(tl.int64))


def draw(logits: torch.Tensor, rows_per_song: int, cfg: float, top_k: int, q: torch.Tensor,
         excluded: torch.Tensor | None, gate: bool, coded: tuple | None):
    """`draw_top_k_kernel` over logits [songs * rows_per_song, N] and q [songs, N] (float32) -> the
    indices [songs] int64, or with `coded` (start, code offset, END id) (codes [songs] int64, END
    flags [songs] bool)."""
    precise = logits.device.type == "cuda" and not interpreted()  # libdevice's expf (CUDA, ROCm)
    rows, n = logits.shape
    songs = rows // rows_per_song
    out = torch.empty(songs, dtype=torch.int64, device=logits.device)
    end = torch.empty(songs, dtype=torch.bool, device=logits.device) if coded else out
    start, offset, end_id = coded or (0, 0, 0)
    block = min(MAX_BLOCK, 1 << (n - 1).bit_length())
    if songs:
        draw_top_k_kernel[(songs,)](
            logits, q, logits if excluded is None else excluded, out, end, n, logits.stride(0), q.stride(0),
            float(cfg), min(int(top_k), n), int(start), int(offset), int(end_id),
            R=int(rows_per_song), HAS_EXCL=excluded is not None, GATE=bool(gate), CODED=bool(coded),
            PRECISE_EXP=precise, COND_LEVELS=2 if logits.dtype == torch.bfloat16 else 4, BLOCK=block,
            WHOLE=n <= block, num_warps=max(4, min(16, block // 256)), enable_fp_fusion=FP_FUSION)
    return (out, end) if coded else out
