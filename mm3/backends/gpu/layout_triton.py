"""The Triton kernels over the device layout (`mm3.backends.gpu.device_layout`), launched by
`mm3.backends.gpu.layout_kernels` (imported only where Triton can run).

A program takes a tile of weight rows and chunks (256 values). Every plane of the tile is loaded
once as an int32 [rows, chunks, 32] tensor, 4 consecutive words per thread, so all of them (and the
inputs, [1, chunks, 32]) share one register layout: a scale word is picked from the thread's own 4
words (`_word`), never moved between threads. A thread's 4 lanes hold one block of 32 values, so
its scales and high-bit words are picked once a tile (`_factors`, `_high`). The tile is then
expanded one slice (32 values of each chunk, 4 of each block) at a time to float32 with the
arithmetic of `mm3.formats.gguf.quants` (the same exact products) and multiplied with the inputs'
32 matching values. `gemv_kernel` (decode: a few input
rows) accumulates with FMAs in float32 and may split K over programs (the last program of a tile
adds the partial sums in a fixed order), or with SWIGLU computes matching gate and up rows
(interleaved in its tile) and stores `silu(gate) * up`; `gemv_segments_kernel` is it over two
weights of different types stacked by their outputs (q and k of one type, v of another);
`gemm_kernel` (prefill, the DiT) multiplies input and weight tiles with `tl.dot`.

QTYPE codes: 0 float weights, 1 Q8_0, 2 Q4_0, 3 Q4_1, 4 Q5_0, 5 Q5_1, 6 Q4_K, 7 Q5_K, 8 Q6_K.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .norm_kernels import cast


@triton.jit
def _word(t, e, R: tl.constexpr, C: tl.constexpr):
    """Word e (0-3; a scalar or a tensor broadcasting to [1, C, 1, 1]) of each group of 4 lanes of
    t [R, C, 32]: [R, C, 8] (each thread holds its group's 4 words: no data moves between threads)."""
    t4 = tl.reshape(t, (R, C, 8, 4))
    v = tl.arange(0, 4)[None, None, None, :]
    return tl.sum(tl.where(v == e, t4, 0), axis=3)


@triton.jit
def _lanes(s, R: tl.constexpr, C: tl.constexpr):
    """[R, C, 8] -> [R, C, 32]: each value for its group's 4 lanes."""
    return tl.reshape(tl.broadcast_to(s[:, :, :, None], (R, C, 8, 4)), (R, C, 32))


@triton.jit
def _half(w, upper):
    """The float16 in the low (upper = 0) or high 16 bits of int32 words, as float32."""
    return ((w >> (16 * upper)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _plane(p, r3, stride, c3, E: tl.constexpr, lane):
    """Words of a plane with E words per chunk: [R, C, 32], lane j reading word c * E + lane(j)."""
    return tl.load(p + r3 * stride + c3 * E + lane)


@triton.jit
def _tile(q_ptr, qh_ptr, s_ptr, s2_ptr, rows, cs, q_stride, qh_stride, s_stride, s2_stride,
          QTYPE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """The planes of rows [R] x chunks [C] a k-tile reads once, each int32 [R, C, 32]:
    (quant words, second quant words (Q8_0) or fifth / top bits, scales A, scales B)."""
    j = tl.arange(0, 32)[None, None, :]
    r3 = rows[:, None, None].to(tl.int64)
    c3 = cs[None, :, None]
    wq = tl.zeros((1, 1, 1), tl.int32)
    wh = tl.zeros((1, 1, 1), tl.int32)
    sa = tl.zeros((1, 1, 1), tl.int32)
    sb = tl.zeros((1, 1, 1), tl.int32)
    if QTYPE == 1:  # Q8_0: slices 0-3, then 4-7
        wq = _plane(q_ptr, r3, q_stride, c3, 64, j)
        wh = _plane(q_ptr, r3, q_stride, c3, 64, 32 + j)
    elif QTYPE >= 2:
        wq = _plane(q_ptr, r3, q_stride, c3, 32, j)
    if QTYPE == 4 or QTYPE == 5 or QTYPE == 7:
        wh = _plane(qh_ptr, r3, qh_stride, c3, 8, 4 * (j // 16) + j % 4)
    if QTYPE == 8:
        wh = _plane(qh_ptr, r3, qh_stride, c3, 16, 4 * (j // 8) + j % 4)
    if QTYPE >= 1:  # d (32-value types), hdr (Q4_K, Q5_K), sc (Q6_K): 4 words per chunk
        sa = _plane(s_ptr, r3, s_stride, c3, 4, j % 4)
    if QTYPE == 3 or QTYPE == 5:  # m
        sb = _plane(s2_ptr, r3, s2_stride, c3, 4, j % 4)
    if QTYPE == 8:  # d: 4 words per 8 chunks
        sb = tl.load(s2_ptr + r3 * s2_stride + (c3 // 8) * 4 + j % 4)
    return wq, wh, sa, sb


@triton.jit
def _byte(w, b):
    """Signed byte b (0-3) of int32 words."""
    return (w << (24 - 8 * b)) >> 24


@triton.jit
def _exact(q, offset: tl.constexpr):
    """float32(q - offset) for 0 <= q < 2 ** 22, exactly, without an int-to-float conversion (a
    slow instruction): q's bits under the exponent of 2 ** 23, minus 2 ** 23 + offset."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _in_place(w, i: tl.constexpr, BITS: tl.constexpr):
    """Field i (BITS wide, at bit BITS * i) of int32 words where it lies in its 16-bit half, under
    the exponent of 2 ** 23 (the bits of `_exact`'s constant): one AND a field, the half words with
    the exponent made once per word and shared by its fields. Read by `_unshifted`."""
    per: tl.constexpr = 16 // BITS
    if i // per == 1:
        half = ((w >> 16) & 0xFFFF) | 0x4B000000
    else:
        half = (w & 0xFFFF) | 0x4B000000
    return half & ((((1 << BITS) - 1) << (BITS * (i % per))) | 0x4B000000)


@triton.jit
def _unshifted(v, offset: tl.constexpr, sh: tl.constexpr):
    """float32(field - offset) * 2 ** sh for `_in_place`'s bits (a field at bit sh of the mantissa
    of 2 ** 23), exactly; the factor 2 ** -sh goes into the scale (`_scale`)."""
    return v.to(tl.float32, bitcast=True) - (8388608.0 + offset * (1 << sh))


@triton.jit
def _scale(f, sh: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """A block's factor f [R, C, 8] times 2 ** -sh (exact: a power of two), for every lane."""
    return _lanes(f * (1.0 / (1 << sh)), R, C)


@triton.jit
def _widened(v):
    """v as float32, exactly: a bfloat16 value's bits moved to the upper half of a word (one
    instruction a value, where the plain conversion takes two for every other value of a pair)."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _value(i, j, QTYPE: tl.constexpr):
    """The value of a chunk at lane j of slice i: 32 (j // 4) + 4 i + j % 4 for a quantized weight
    (each group of 4 lanes, one thread's 4 words, holds a whole block of 32 values: `device_layout`,
    so its scales are found once a tile, not once a slice: `_factors`); 32 i + j for float weights
    (a thread's values of a slice side by side with its neighbours': the widest loads)."""
    if QTYPE == 0:
        return 32 * i + j
    return 32 * (j // 4) + 4 * i + j % 4


@triton.jit
def _inside(c, j, i, K, QTYPE: tl.constexpr):
    """Whether value `_value(i, j)` of chunk c lies in a row of K values; for a quantized weight
    (rows of whole blocks of 32) its block's start does, the same test for a thread's 4 lanes."""
    if QTYPE == 0:
        return c * 256 + 32 * i + j < K
    return c * 256 + 32 * (j // 4) < K


@triton.jit
def _factors(sa, sb, cs, QTYPE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """The scales of the block each group of 4 lanes holds, (a, b) [R, C, 8] float32, exact: a the
    block's scale (Q4_K, Q5_K: d * sc; Q6_K: d * the scale of its first group of 16, slices 0-3),
    b its min (Q4_1, Q5_1: m; Q4_K, Q5_K: dmin * m) or Q6_K's second group's scale (slices 4-7)."""
    g = tl.arange(0, 8)[None, None, :]  # the group's block
    b = tl.zeros((R, C, 8), tl.float32)
    if QTYPE == 6 or QTYPE == 7:  # Q4_K, Q5_K: d * sc and dmin * m from the 16-byte header
        head = _word(sa, 0, R, C)
        s1, s2, s3 = _word(sa, 1, R, C), _word(sa, 2, R, C), _word(sa, 3, R, C)
        t = 8 * (g % 4)
        sc = tl.where(g < 4, (s1 >> t) & 63, ((s3 >> t) & 15) | (((s1 >> (t + 6)) & 3) << 4))
        mn = tl.where(g < 4, (s2 >> t) & 63, ((s3 >> (t + 4)) & 15) | (((s2 >> (t + 6)) & 3) << 4))
        a = _half(head, 0) * _exact(sc, 0)
        b = _half(head, 1) * _exact(mn, 0)
    elif QTYPE == 8:  # Q6_K: d * the int8 scales of groups 2 g and 2 g + 1
        d = _half(_word(sb, ((cs % 8) // 2)[None, :, None, None], R, C), (cs % 2)[None, :, None])
        scales = _word(sa, (g // 2)[:, :, :, None], R, C)
        a = d * _byte(scales, 2 * (g % 2)).to(tl.float32)
        b = d * _byte(scales, 2 * (g % 2) + 1).to(tl.float32)
    elif QTYPE >= 1:  # the 32-value types: the block's float16 d (and m)
        a = _half(_word(sa, (g // 2)[:, :, :, None], R, C), g % 2)
        if QTYPE == 3 or QTYPE == 5:
            b = _half(_word(sb, (g // 2)[:, :, :, None], R, C), g % 2)
    else:
        a = b
    return a, b


@triton.jit
def _high(wh, QTYPE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """The qh words each group of 4 lanes reads, [R, C, 8] each, picked once a tile from the 4 the
    thread loaded: (lanes 0-1's, lanes 2-3's) for Q6_K, its one word twice for the Q5 types (read
    for a lane by `_high_word`); wh twice for a type without high bits."""
    g = tl.arange(0, 8)[None, None, :]
    if QTYPE == 8:
        odd = (g % 2) == 1
        return tl.where(odd, _word(wh, 2, R, C), _word(wh, 0, R, C)), tl.where(odd, _word(wh, 3, R, C),
                                                                               _word(wh, 1, R, C))
    elif QTYPE == 4 or QTYPE == 5 or QTYPE == 7:
        word = _word(wh, (g % 4)[:, :, :, None], R, C)
        return word, word
    else:
        return wh, wh


@triton.jit
def _high_word(hl, hh, R: tl.constexpr, C: tl.constexpr):
    """Each lane's qh word [R, C, 32] from `_high`'s pair."""
    return tl.where(tl.arange(0, 32)[None, None, :] % 4 < 2, _lanes(hl, R, C), _lanes(hh, R, C))


@triton.jit
def _turn(j, i, QTYPE: tl.constexpr):
    """How far lane j's qh word turns right to bring slice i's high bits to just above its nibble
    (`device_layout.high_bit` less 4 (i % 4) + 4)."""
    if QTYPE == 8:
        return 16 * (j % 2) + 2 * (i // 4)
    return 16 * ((j % 4) // 2) + 2 * (j % 2) + i // 4


@triton.jit
def _rotr(c, s):
    """int32 words rotated right by s bits (0 <= s < 32)."""
    u = c.to(tl.uint32, bitcast=True)
    return ((u >> s) | (u << ((32 - s) % 32))).to(tl.int32, bitcast=True)


@triton.jit
def _slice(q_ptr, rows, cs, q_stride, K, wq, wh, hl, hh, a, b, i: tl.constexpr, QTYPE: tl.constexpr,
           R: tl.constexpr, C: tl.constexpr):
    """Slice i (value `_value(i, j)` of each chunk at lane j) of the tile as float32 [R, C, 32], with
    the tile's `_factors` (a, b) and high-bit words (`_high`: hl, hh; wh: Q8_0's slices 4-7). Quant
    fields are read where they lie (`_in_place`) and the scale takes their power of two (`_scale`):
    each value is the product of `mm3.formats.gguf.quants` (exact, as there)."""
    j = tl.arange(0, 32)[None, None, :]
    if QTYPE == 0:  # float weights [N, K]
        col = cs[None, :, None] * 256 + _value(i, j, QTYPE)
        w = tl.load(q_ptr + rows[:, None, None].to(tl.int64) * q_stride + col, mask=col < K, other=0.0)
        w = w.to(tl.float32)
    elif QTYPE == 1:  # Q8_0: int8 = (unsigned ^ 128) - 128, the XOR (0x80808080) once a word
        p: tl.constexpr = 8 * (i % 2)
        if i < 4:
            v = _in_place(wq ^ -2139062144, i, 8)
        else:
            v = _in_place(wh ^ -2139062144, i - 4, 8)
        w = _unshifted(v, 128, p) * _scale(a, p, R, C)
    elif QTYPE == 6 or QTYPE == 7:  # Q4_K, Q5_K: d * sc * q - dmin * m
        p: tl.constexpr = 4 * (i % 4)
        v = _in_place(wq, i, 4)
        if QTYPE == 7:  # the fifth bit, rotated to just above the nibble (`device_layout.high_bit`)
            v = v | (_rotr(_high_word(hl, hh, R, C), _turn(j, i, QTYPE)) & (1 << (4 + p)))
        w = _unshifted(v, 0, p) * _scale(a, p, R, C) - _lanes(b, R, C)
    elif QTYPE == 8:  # Q6_K: d * the int8 scale of the lane's group of 16
        p: tl.constexpr = 4 * (i % 4)
        v = _in_place(wq, i, 4)
        v = v | (_rotr(_high_word(hl, hh, R, C), _turn(j, i, QTYPE)) & (3 << (4 + p)))  # the top two bits
        if i < 4:
            w = _unshifted(v, 32, p) * _scale(a, p, R, C)
        else:
            w = _unshifted(v, 32, p) * _scale(b, p, R, C)
    else:  # Q4_0, Q4_1, Q5_0, Q5_1
        p: tl.constexpr = 4 * (i % 4)
        v = _in_place(wq, i, 4)
        if QTYPE == 4 or QTYPE == 5:
            v = v | (_rotr(_high_word(hl, hh, R, C), _turn(j, i, QTYPE)) & (1 << (4 + p)))
        if QTYPE == 2:
            w = _unshifted(v, 8, p) * _scale(a, p, R, C)
        elif QTYPE == 4:
            w = _unshifted(v, 16, p) * _scale(a, p, R, C)
        else:
            w = _unshifted(v, 0, p) * _scale(a, p, R, C) + _lanes(b, R, C)
    return w


@triton.jit
def _slice_runtime(q_ptr, rows, cs, q_stride, K, wq, wh, hl, hh, a, b, i, QTYPE: tl.constexpr, R: tl.constexpr,
                   C: tl.constexpr):
    """`_slice` for a slice index i known only at run time (the prefill's k-loop: unrolled, its
    tiles would spill on sm_80): each field shifted down, then read as a float; a and b the tile's
    `_factors`."""
    j = tl.arange(0, 32)[None, None, :]
    if QTYPE == 0:  # float weights [N, K]
        col = cs[None, :, None] * 256 + _value(i, j, QTYPE)
        w = tl.load(q_ptr + rows[:, None, None].to(tl.int64) * q_stride + col, mask=col < K, other=0.0)
        w = w.to(tl.float32)
    elif QTYPE == 1:  # Q8_0
        q = _exact(((tl.where(i < 4, wq, wh) >> (8 * (i % 4))) & 255) ^ 128, 128)  # int8 = unsigned ^ 128 - 128
        w = q * _lanes(a, R, C)
    elif QTYPE == 6 or QTYPE == 7:  # Q4_K, Q5_K: d * sc * q - dmin * m
        q = (wq >> (4 * i)) & 15
        if QTYPE == 7:
            q = q | (((_high_word(hl, hh, R, C) >> ((4 * (i % 4) + 4 + _turn(j, i, QTYPE)) % 32)) & 1) << 4)
        w = _exact(q, 0) * _lanes(a, R, C) - _lanes(b, R, C)
    elif QTYPE == 8:  # Q6_K: d * the int8 scale of the lane's group of 16
        q = (wq >> (4 * i)) & 15
        q = q | (((_high_word(hl, hh, R, C) >> ((4 * (i % 4) + 4 + _turn(j, i, QTYPE)) % 32)) & 3) << 4)
        w = _exact(q, 32) * _lanes(tl.where(i < 4, a, b), R, C)
    else:  # Q4_0, Q4_1, Q5_0, Q5_1
        q = (wq >> (4 * i)) & 15
        if QTYPE == 4 or QTYPE == 5:
            q = q | (((_high_word(hl, hh, R, C) >> ((4 * (i % 4) + 4 + _turn(j, i, QTYPE)) % 32)) & 1) << 4)
        d = _lanes(a, R, C)
        if QTYPE == 2:
            w = _exact(q, 8) * d
        elif QTYPE == 4:
            w = _exact(q, 16) * d
        else:
            w = _exact(q, 0) * d + _lanes(b, R, C)
    return w


@triton.jit
def _rounded(v, dt: tl.constexpr, NATIVE: tl.constexpr):
    """v (float32) rounded to `dt` and back: the device's own conversion (round to nearest even on
    a GPU, one instruction), or `norm_kernels.cast` where it would truncate (the interpreter)."""
    if NATIVE:
        return v.to(dt).to(tl.float32)
    else:
        return cast(v, dt).to(tl.float32)


@triton.jit
def _added(v, m, M, col, ok, add_ptr, add_rows, add_stride, dt: tl.constexpr, NATIVE: tl.constexpr):
    """v (float32 values of row m at columns col) plus row m % add_rows of the rows at add_ptr,
    rounded to `dt` as torch adds two tensors of it (`_rounded`)."""
    a = tl.load(add_ptr + (m % add_rows).to(tl.int64) * add_stride + col, mask=ok & (m < M), other=0.0)
    return _rounded(v + a.to(tl.float32), dt, NATIVE)


@triton.jit
def _x_slice(x_ptr, m, M, x_stride, cs, K, i, nw_ptr, r, add_ptr, add_rows, add_stride, NORM: tl.constexpr,
             ADD: tl.constexpr, NATIVE: tl.constexpr, QTYPE: tl.constexpr):
    """Input row m's values of slice i of chunks cs (`_value`): float32 [1, C, 32] (zeros past K or M); with
    NORM the row's RMSNorm by the weight at nw_ptr (r: the row's `_rstds`), in the roundings of
    `norm_kernels`: the normalized value and its product with the weight each rounded to x's dtype;
    with NORM and ADD the row normalized is x's plus a row at add_ptr (`_added`)."""
    dt: tl.constexpr = x_ptr.dtype.element_ty
    j = tl.arange(0, 32)[None, None, :]
    col = cs[None, :, None] * 256 + _value(i, j, QTYPE)
    ok = _inside(cs[None, :, None], j, i, K, QTYPE)
    x = tl.load(x_ptr + m.to(tl.int64) * x_stride + col, mask=ok & (m < M), other=0.0)
    if NORM and ADD:  # the plain conversion: compiled with the add's rounding, it costs fewer instructions
        x = _added(x.to(tl.float32), m, M, col, ok, add_ptr, add_rows, add_stride, dt, NATIVE)
    else:
        x = _widened(x)
    if NORM:
        w = tl.load(nw_ptr + col, mask=ok, other=0.0)
        if NATIVE:  # the product of two values of dt is exact in float32: dt's own product rounds it the same
            return _widened(w * (x * r).to(dt))
        return _rounded(w.to(tl.float32) * _rounded(x * r, dt, NATIVE), dt, NATIVE)
    return x


@triton.jit
def _squares(x_ptr, m, M, x_stride, col, K, add_ptr, add_rows, add_stride, ADD: tl.constexpr, NATIVE: tl.constexpr):
    """The squares of input row m's values at columns col (zeros past K or M); with ADD of the row
    plus a row at add_ptr (`_added`)."""
    v = tl.load(x_ptr + m.to(tl.int64) * x_stride + col, mask=(col < K) & (m < M), other=0.0)
    if ADD:
        v = _added(v.to(tl.float32), m, M, col, col < K, add_ptr, add_rows, add_stride, x_ptr.dtype.element_ty,
                   NATIVE)
    else:
        v = _widened(v)
    return v * v


@triton.jit
def _inverse_rms(acc, K, eps):
    """1 / sqrt(mean + eps) of the squares summed in acc, correctly rounded twice."""
    return tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(acc, axis=0) / K + eps))


@triton.jit
def _rstds(x_ptr, m0, M, x_stride, K, eps, add_ptr, add_rows, add_stride, NORM: tl.constexpr, ADD: tl.constexpr,
           NATIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr = 512):
    """1 / sqrt(mean(x[m]^2) + eps) of input rows m0..m0 + 3 (those past BLOCK_M: 1.0) in float32,
    correctly rounded twice as `norm_kernels` computes it (the sum of squares in another order), the
    rows read in one loop; with ADD of each row plus a row at add_ptr (`_added`); 1.0 without NORM."""
    r0, r1, r2, r3 = 1.0, 1.0, 1.0, 1.0
    if NORM:
        a0 = tl.zeros((BLOCK,), tl.float32)
        a1 = tl.zeros((BLOCK,), tl.float32)
        a2 = tl.zeros((BLOCK,), tl.float32)
        a3 = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, K, BLOCK):
            col = k0 + tl.arange(0, BLOCK)
            a0 += _squares(x_ptr, m0, M, x_stride, col, K, add_ptr, add_rows, add_stride, ADD, NATIVE)
            if BLOCK_M > 1:
                a1 += _squares(x_ptr, m0 + 1, M, x_stride, col, K, add_ptr, add_rows, add_stride, ADD, NATIVE)
            if BLOCK_M > 2:
                a2 += _squares(x_ptr, m0 + 2, M, x_stride, col, K, add_ptr, add_rows, add_stride, ADD, NATIVE)
                a3 += _squares(x_ptr, m0 + 3, M, x_stride, col, K, add_ptr, add_rows, add_stride, ADD, NATIVE)
        r0 = _inverse_rms(a0, K, eps)
        if BLOCK_M > 1:
            r1 = _inverse_rms(a1, K, eps)
        if BLOCK_M > 2:
            r2 = _inverse_rms(a2, K, eps)
            r3 = _inverse_rms(a3, K, eps)
    return r0, r1, r2, r3


@triton.jit
def _gemv_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride, qh_stride, s_stride, s2_stride,
               rows, m0, c_lo, c_hi, nw_ptr, eps, add_ptr, add_rows, add_stride, QTYPE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NORM: tl.constexpr,
               ADD: tl.constexpr, NATIVE: tl.constexpr):
    """The k-loop: float32 [BLOCK_N, BLOCK_C, 32] sums of weight rows `rows` (of these planes) times
    input rows m0..m0 + 3 (those past BLOCK_M stay zero) over chunks [c_lo, c_hi); with NORM the
    inputs RMS-normalized first (`_x_slice`; ADD: each plus a row at add_ptr), each program reading its
    rows whole for their norm."""
    r0, r1, r2, r3 = _rstds(x_ptr, m0, M, x_stride, K, eps, add_ptr, add_rows, add_stride, NORM, ADD, NATIVE,
                            BLOCK_M)
    acc0 = tl.zeros((BLOCK_N, BLOCK_C, 32), tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_C, 32), tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_C, 32), tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_C, 32), tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        wq, wh, sa, sb = _tile(q_ptr, qh_ptr, s_ptr, s2_ptr, rows, cs, q_stride, qh_stride, s_stride, s2_stride,
                               QTYPE, BLOCK_N, BLOCK_C)
        a, b = _factors(sa, sb, cs, QTYPE, BLOCK_N, BLOCK_C)
        hl, hh = _high(wh, QTYPE, BLOCK_N, BLOCK_C)
        for i in tl.static_range(8):
            w = _slice(q_ptr, rows, cs, q_stride, K, wq, wh, hl, hh, a, b, i, QTYPE, BLOCK_N, BLOCK_C)
            acc0 += w * _x_slice(x_ptr, m0, M, x_stride, cs, K, i, nw_ptr, r0, add_ptr, add_rows,
                                 add_stride, NORM, ADD, NATIVE, QTYPE)
            if BLOCK_M > 1:
                acc1 += w * _x_slice(x_ptr, m0 + 1, M, x_stride, cs, K, i, nw_ptr, r1, add_ptr, add_rows,
                                 add_stride, NORM, ADD, NATIVE, QTYPE)
            if BLOCK_M > 2:
                acc2 += w * _x_slice(x_ptr, m0 + 2, M, x_stride, cs, K, i, nw_ptr, r2, add_ptr, add_rows,
                                 add_stride, NORM, ADD, NATIVE, QTYPE)
                acc3 += w * _x_slice(x_ptr, m0 + 3, M, x_stride, cs, K, i, nw_ptr, r3, add_ptr, add_rows,
                                 add_stride, NORM, ADD, NATIVE, QTYPE)
    return acc0, acc1, acc2, acc3


@triton.jit
def gemv_kernel(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
                M, N, K, x_stride, y_stride, q_stride, qh_stride, s_stride, s2_stride, chunks, split_chunks,
                nw_ptr, res_ptr, res_stride, add_ptr, add_rows, add_stride, eps,
                QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                SWIGLU: tl.constexpr = False, PRECISE: tl.constexpr = True, NORM: tl.constexpr = False,
                RESIDUAL: tl.constexpr = False, ADD: tl.constexpr = False):
    """y[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for BLOCK_M (1, 2 or 4) input rows, BLOCK_N weight
    rows and the chunks [pid_k * split_chunks, + split_chunks) (whole tiles of BLOCK_C); PARTIAL: K
    split over the grid's third axis (`_store`). SWIGLU (no split, no bias): W is [2 N, K], gate
    rows then up rows; the tile takes BLOCK_N / 2 of each, interleaved, and y[m, n] =
    silu(gate) * up in y's dtype (`_store_swiglu`). NORM: the inputs RMS-normalized by the weight
    at nw_ptr (eps) on the way in (`_x_slice`; PRECISE: rounded by the device's own conversions, as
    on a GPU, else as `norm_kernels.cast`); RESIDUAL (not with SWIGLU): y = res + the product, each
    rounded to y's dtype as torch adds a layer's output to the residual stream (`_store_row`). ADD
    (with NORM or RESIDUAL): the stream, the rows normalized or the residual, is the stored rows plus
    rows at add_ptr (row m: add_rows' row m % add_rows, add_stride apart), rounded to x's dtype as
    torch adds them: the depth decoder's position embeddings, added where they are read."""
    pid_n = tl.program_id(1)
    if SWIGLU:
        r = tl.arange(0, BLOCK_N)
        offs_n = pid_n * (BLOCK_N // 2) + r // 2
        rows = tl.minimum(offs_n, N - 1) + (r % 2) * N  # even: gate row n, odd: up row n
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1)  # clamped: every weight load is in bounds
    m0 = tl.program_id(0) * BLOCK_M
    c_lo = tl.program_id(2) * split_chunks
    c_hi = tl.minimum(chunks, c_lo + split_chunks)
    acc0, acc1, acc2, acc3 = _gemv_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride, qh_stride,
                                        s_stride, s2_stride, rows, m0, c_lo, c_hi, nw_ptr, eps, add_ptr, add_rows,
                                        add_stride, QTYPE, BLOCK_M, BLOCK_N, BLOCK_C, NORM, ADD, PRECISE)
    if SWIGLU:
        _store_swiglu(acc0, m0, M, N, pid_n, y_ptr, y_stride, BLOCK_N, PRECISE)
        if BLOCK_M > 1:
            _store_swiglu(acc1, m0 + 1, M, N, pid_n, y_ptr, y_stride, BLOCK_N, PRECISE)
        if BLOCK_M > 2:
            _store_swiglu(acc2, m0 + 2, M, N, pid_n, y_ptr, y_stride, BLOCK_N, PRECISE)
            _store_swiglu(acc3, m0 + 3, M, N, pid_n, y_ptr, y_stride, BLOCK_N, PRECISE)
    else:
        _store(acc0, acc1, acc2, acc3, m0, M, N, offs_n, b_ptr, y_ptr, y_stride, part_ptr, count_ptr, res_ptr,
               res_stride, add_ptr, add_rows, add_stride, HAS_BIAS, PARTIAL, BLOCK_M, RESIDUAL, ADD)


@triton.jit
def gemv_segments_kernel(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, q2_ptr, qh2_ptr, s3_ptr, s4_ptr, b_ptr, y_ptr,
                         part_ptr, count_ptr, M, N, N1, K, x_stride, y_stride, q_stride, qh_stride, s_stride,
                         s2_stride, q2_stride, qh2_stride, s3_stride, s4_stride, chunks, split_chunks,
                         nw_ptr, res_ptr, res_stride, add_ptr, add_rows, add_stride, eps,
                         QTYPE: tl.constexpr, QTYPE2: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_C: tl.constexpr, NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                         PRECISE: tl.constexpr = True, ADD: tl.constexpr = False):
    """`gemv_kernel` over two weights of different types stacked by their outputs: rows [0, N1) of
    QTYPE (planes q, qh, s, s2), rows [N1, N) of QTYPE2 (planes q2, qh2, s3, s4); N1 is a multiple
    of BLOCK_N, so each program reads one of them (a q/k/v group whose v has another type). NORM,
    RESIDUAL and ADD (and PRECISE: the device's own roundings) as `gemv_kernel`'s."""
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m0 = tl.program_id(0) * BLOCK_M
    c_lo = tl.program_id(2) * split_chunks
    c_hi = tl.minimum(chunks, c_lo + split_chunks)
    if pid_n * BLOCK_N < N1:
        acc0, acc1, acc2, acc3 = _gemv_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride,
                                            qh_stride, s_stride, s2_stride, offs_n, m0, c_lo, c_hi, nw_ptr, eps,
                                            add_ptr, add_rows, add_stride, QTYPE, BLOCK_M, BLOCK_N, BLOCK_C, NORM,
                                            ADD, PRECISE)
    else:
        rows = tl.minimum(offs_n, N - 1) - N1
        acc0, acc1, acc2, acc3 = _gemv_sums(x_ptr, q2_ptr, qh2_ptr, s3_ptr, s4_ptr, M, K, x_stride, q2_stride,
                                            qh2_stride, s3_stride, s4_stride, rows, m0, c_lo, c_hi, nw_ptr, eps,
                                            add_ptr, add_rows, add_stride, QTYPE2, BLOCK_M, BLOCK_N, BLOCK_C, NORM,
                                            ADD, PRECISE)
    _store(acc0, acc1, acc2, acc3, m0, M, N, offs_n, b_ptr, y_ptr, y_stride, part_ptr, count_ptr, res_ptr,
           res_stride, add_ptr, add_rows, add_stride, HAS_BIAS, PARTIAL, BLOCK_M, RESIDUAL, ADD)


@triton.jit
def _store(acc0, acc1, acc2, acc3, m0, M, N, offs_n, b_ptr, y_ptr, y_stride, part_ptr, count_ptr, res_ptr,
           res_stride, add_ptr, add_rows, add_stride, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
           BLOCK_M: tl.constexpr, RESIDUAL: tl.constexpr, ADD: tl.constexpr):
    """The program's rows of y, or with PARTIAL its partial sums (float32 [splits, M, N] at
    part_ptr), then a count of the tile's programs done (count_ptr, one int32 per tile, zero before);
    the last one adds the splits' sums in their order (the same bits whatever the timing), stores
    y and sets the count back to zero for the next launch."""
    n_ok = offs_n < N
    s0 = tl.sum(tl.sum(acc0, axis=2), axis=1)
    s1 = tl.sum(tl.sum(acc1, axis=2), axis=1)
    s2 = tl.sum(tl.sum(acc2, axis=2), axis=1)
    s3 = tl.sum(tl.sum(acc3, axis=2), axis=1)
    if PARTIAL:
        splits = tl.num_programs(2)
        at = part_ptr + (tl.program_id(2) * M).to(tl.int64) * N + offs_n
        tl.store(at + m0 * N, s0, mask=n_ok & (m0 < M))
        if BLOCK_M > 1:
            tl.store(at + (m0 + 1) * N, s1, mask=n_ok & (m0 + 1 < M))
        if BLOCK_M > 2:
            tl.store(at + (m0 + 2) * N, s2, mask=n_ok & (m0 + 2 < M))
            tl.store(at + (m0 + 3) * N, s3, mask=n_ok & (m0 + 3 < M))
        tl.debug_barrier()  # every thread's sums are written before the count says so
        counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == splits - 1:  # the last of the tile's programs: the sums in a fixed order
            tl.debug_barrier()
            s0 = _split_sum(part_ptr, m0, M, N, offs_n, n_ok, splits)
            if BLOCK_M > 1:
                s1 = _split_sum(part_ptr, m0 + 1, M, N, offs_n, n_ok, splits)
            if BLOCK_M > 2:
                s2 = _split_sum(part_ptr, m0 + 2, M, N, offs_n, n_ok, splits)
                s3 = _split_sum(part_ptr, m0 + 3, M, N, offs_n, n_ok, splits)
            _store_rows(s0, s1, s2, s3, m0, M, N, offs_n, n_ok, b_ptr, y_ptr, y_stride, res_ptr, res_stride,
                        add_ptr, add_rows, add_stride, HAS_BIAS, BLOCK_M, RESIDUAL, ADD)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        _store_rows(s0, s1, s2, s3, m0, M, N, offs_n, n_ok, b_ptr, y_ptr, y_stride, res_ptr, res_stride,
                        add_ptr, add_rows, add_stride, HAS_BIAS, BLOCK_M, RESIDUAL, ADD)


@triton.jit
def _store_rows(s0, s1, s2, s3, m0, M, N, offs_n, n_ok, b_ptr, y_ptr, y_stride, res_ptr, res_stride,
                add_ptr, add_rows, add_stride, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                RESIDUAL: tl.constexpr, ADD: tl.constexpr):
    """The program's BLOCK_M rows of y from their sums (`_store_row` each)."""
    _store_row(s0, m0, M, N, offs_n, n_ok, b_ptr, y_ptr, y_stride, res_ptr, res_stride, add_ptr, add_rows,
                   add_stride, HAS_BIAS, RESIDUAL, ADD)
    if BLOCK_M > 1:
        _store_row(s1, m0 + 1, M, N, offs_n, n_ok, b_ptr, y_ptr, y_stride, res_ptr, res_stride, add_ptr, add_rows,
                   add_stride, HAS_BIAS, RESIDUAL, ADD)
    if BLOCK_M > 2:
        _store_row(s2, m0 + 2, M, N, offs_n, n_ok, b_ptr, y_ptr, y_stride, res_ptr, res_stride, add_ptr, add_rows,
                   add_stride, HAS_BIAS, RESIDUAL, ADD)
        _store_row(s3, m0 + 3, M, N, offs_n, n_ok, b_ptr, y_ptr, y_stride, res_ptr, res_stride, add_ptr, add_rows,
                   add_stride, HAS_BIAS, RESIDUAL, ADD)


@triton.jit
def _split_sum(part_ptr, m, M, N, offs_n, n_ok, splits):
    """Row m's partial sums over the splits, added in split order (read past the caches: other
    programs wrote them)."""
    y = tl.zeros(offs_n.shape, tl.float32)
    for s in range(0, splits):
        y += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + offs_n, mask=n_ok & (m < M), other=0.0,
                     cache_modifier=".cg")
    return y


@triton.jit
def _store_row(y, m, M, N, offs_n, n_ok, b_ptr, y_ptr, y_stride, res_ptr, res_stride, add_ptr, add_rows,
               add_stride, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, ADD: tl.constexpr):
    """Row m of y: its sums (+ bias) in y's dtype; with RESIDUAL, res[m] + that, rounded again
    (with ADD, res[m] plus a row at add_ptr first, rounded: `_added`)."""
    dt = y_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    out = y.to(dt)
    if RESIDUAL:
        res = tl.load(res_ptr + m.to(tl.int64) * res_stride + offs_n, mask=n_ok & (m < M), other=0.0).to(tl.float32)
        if ADD:
            res = _added(res, m, M, offs_n, n_ok, add_ptr, add_rows, add_stride, dt, False)
        out = cast(res + out.to(tl.float32), dt)
    tl.store(y_ptr + m.to(tl.int64) * y_stride + offs_n, out, mask=n_ok & (m < M))


@triton.jit
def _store_swiglu(acc, m, M, N, pid_n, y_ptr, y_stride, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr):
    """y[m, n] = silu(gate) * up with torch's arithmetic in y's dtype: gate and up rounded to it,
    silu(g) = g / (1 + exp(-g)) in float32 (PRECISE: CUDA's expf and an IEEE division, as torch's
    kernel; else the interpreter's exp) rounded, the product in float32 rounded."""
    dt = y_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(tl.sum(tl.sum(acc, axis=2), axis=1), (BLOCK_N // 2, 2)))
    g = gate.to(dt).to(tl.float32)
    if PRECISE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = tl.div_rn(g, 1.0 + e).to(dt).to(tl.float32)
    y = (s * up.to(dt).to(tl.float32)).to(dt)
    offs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + m.to(tl.int64) * y_stride + offs, y, mask=(offs < N) & (m < M))


@triton.jit
def gemm_kernel(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, b_ptr, y_ptr,
                M, N, K, x_stride, y_stride, q_stride, qh_stride, s_stride, s2_stride, chunks,
                QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """y [M, N] = x [M, K] @ W.T (+ bias) by tiles: per slice of each chunk tile, a `tl.dot` of
    the inputs' [BLOCK_M, BLOCK_C * 32] values with the weight's expanded in x's dtype (float32
    inputs at IEEE precision, no TF32)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    m_ok = offs_m < M
    flat = tl.arange(0, BLOCK_C * 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, chunks, BLOCK_C):
        cs = tl.minimum(c0 + tl.arange(0, BLOCK_C), chunks - 1)  # clamped; their inputs are masked to zero
        wq, wh, sa, sb = _tile(q_ptr, qh_ptr, s_ptr, s2_ptr, rows, cs, q_stride, qh_stride, s_stride, s2_stride,
                               QTYPE, BLOCK_N, BLOCK_C)
        a, b = _factors(sa, sb, cs, QTYPE, BLOCK_N, BLOCK_C)
        hl, hh = _high(wh, QTYPE, BLOCK_N, BLOCK_C)
        for i in range(8):
            w = _slice_runtime(q_ptr, rows, cs, q_stride, K, wq, wh, hl, hh, a, b, i, QTYPE, BLOCK_N, BLOCK_C)
            col = (c0 + flat // 32) * 256 + _value(i, flat % 32, QTYPE)
            ok = _inside(c0 + flat // 32, flat % 32, i, K, QTYPE)  # chunks past the row's too
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + col[None, :],
                        mask=m_ok[:, None] & ok[None, :], other=0.0)
            wt = tl.reshape(w, (BLOCK_N, BLOCK_C * 32)).to(x.dtype)
            if x.dtype == tl.float32:
                acc = tl.dot(x, tl.trans(wt), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(wt), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * y_stride + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_n[None, :] < N))
