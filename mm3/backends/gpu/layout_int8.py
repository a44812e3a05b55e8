"""The decode k-loop with 8-bit inputs (`MM3_GPU_INT8_INPUTS`), for the `layout_triton` kernels:
each program rounds the 32 input values of a block to int8 with the block's own scale (its largest
magnitude / 127, as llama.cpp's decode products do) and multiplies them with the weight's integer
fields four at a time (PTX's `dp4a`); the block's scales then apply once to its integer sums.

Q8_0 bytes are read as they are stored; the 4- and 5-bit types' fields are masked into bytes (the
fifth bits turned in from the qh word), the even slices of a lane's word in one word and the odd
ones in another (`device_layout`: nibble i of a lane's word is slice i), the inputs packed in the
same order; Q6_K's fields go to a word for each group of 16 (`_q6_lane`). A block's sum is then exact in
integers: y = sum over blocks of dx * (a * sum(q * xq) - b * sum(xq)), with dx the inputs' scale
and (a, b) the weight's (`layout_fields.factors`). The only rounding the float path lacks is the
inputs': at most half a step of 1/127 of each block's largest value.

Under Triton's interpreter `dp4a` is the same sum of byte products (inline PTX does not run
there) and the rounding is done in float64, so both give the same integers.
"""

import triton
import triton.language as tl

from .layout_fields import factors, high_words, lanes, rotr, signed_byte, tile
from .layout_inputs import inverse_rms, norm_weight, rstds, x_slice
from .norm_kernels import largest


@triton.jit
def dp4a(a, b, c, NATIVE: tl.constexpr):
    """c + the sum of the products of the 4 signed bytes of int32 words a and b, elementwise (tensors
    broadcast): one `dp4a` on a GPU, the same integers from the bytes under the interpreter."""
    if NATIVE:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return (signed_byte(a, 0) * signed_byte(b, 0) + signed_byte(a, 1) * signed_byte(b, 1)
            + signed_byte(a, 2) * signed_byte(b, 2) + signed_byte(a, 3) * signed_byte(b, 3) + c)


@triton.jit
def _code(x, inv, NATIVE: tl.constexpr):
    """int32 words whose low byte is round(x * inv) (to nearest even, one rounding; |x * inv| <= 127):
    on a GPU the bits of fma(x, inv, 1.5 * 2 ** 23), whose last byte is the integer's; under the
    interpreter the integer itself (the product exact in float64, rounded there)."""
    if NATIVE:
        return tl.fma(x, inv, 12582912.0).to(tl.int32, bitcast=True)
    p = x.to(tl.float64) * inv.to(tl.float64)
    return ((p + 6755399441055744.0) - 6755399441055744.0).to(tl.int32)


@triton.jit
def prmt(a, b, SEL: tl.constexpr, NATIVE: tl.constexpr):
    """Bytes picked from the 8 of int32 words b:a (a's bytes 0-3, b's 4-7), byte k of the result by
    hex digit k of SEL: PTX's `prmt` (one instruction) on a GPU, shifts and masks elsewhere."""
    if NATIVE:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a) + SEL],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return (_picked(a, b, SEL & 7) | (_picked(a, b, (SEL >> 4) & 7) << 8) | (_picked(a, b, (SEL >> 8) & 7) << 16)
            | (_picked(a, b, (SEL >> 12) & 7) << 24))


@triton.jit
def _picked(a, b, n: tl.constexpr):
    """Byte n (0-7) of b:a, unsigned."""
    if n < 4:
        return (a >> (8 * n)) & 255
    return (b >> (8 * (n - 4))) & 255


@triton.jit
def _packed(x0, x1, x2, x3, inv, NATIVE: tl.constexpr):
    """The int8 codes of four input slices (float32 [1, C, 32]) in the bytes of one word, x0 lowest
    (three `prmt` on a GPU)."""
    lo = prmt(_code(x0, inv, NATIVE), _code(x1, inv, NATIVE), 0x0040, NATIVE)
    hi = prmt(_code(x2, inv, NATIVE), _code(x3, inv, NATIVE), 0x0040, NATIVE)
    return prmt(lo, hi, 0x5410, NATIVE)


@triton.jit
def _quarters(t, R: tl.constexpr, C: tl.constexpr):
    """Lanes 0, 1, 2 and 3 of each group of 4 (a block) of t [R, C, 32], each [R, C, 8] (a thread's own
    words: nothing moves between threads)."""
    even, odd = tl.split(tl.reshape(t, (R, C, 8, 2, 2)))
    l0, l2 = tl.split(even)
    l1, l3 = tl.split(odd)
    return l0, l1, l2, l3


@triton.jit
def _chain(w, u, c, C: tl.constexpr, NATIVE: tl.constexpr):
    """c + each block's sum of the byte products of its lanes' words w (a tuple of 4 [R, C, 8]: lanes
    0-3 of each block, `_quarters`) with words u [1, C, 32]: [R, C, 8], one chain of 4 `dp4a` a block."""
    u0, u1, u2, u3 = _quarters(u, 1, C)
    return dp4a(w[3], u3, dp4a(w[2], u2, dp4a(w[1], u1, dp4a(w[0], u0, c, NATIVE), NATIVE), NATIVE), NATIVE)


@triton.jit
def _code_sums(u, C: tl.constexpr, NATIVE: tl.constexpr):
    """Each block's sum of the codes in words u [1, C, 32]: [1, C, 8]."""
    ones = tl.full((1, C, 8), 0x01010101, tl.int32)  # a tensor: a constant's shifts would be Python's
    return _chain((ones, ones, ones, ones), u, 0, C, NATIVE)


BIASED = tl.constexpr(0x4B400000)  # the bits of 1.5 * 2 ** 23: a sum started there reads as a float (`_biased_float`)


@triton.jit
def _biased_float(s):
    """float32(s - BIASED) for int32 sums s started at BIASED (|s - BIASED| < 2 ** 22), exactly, without an
    int-to-float conversion (a slow instruction): s's bits as a float, less 1.5 * 2 ** 23."""
    return s.to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _q6_lane(wq, word, l: tl.constexpr, NATIVE: tl.constexpr):
    """Lane l's Q6_K fields in bytes: (slices 0-3, slices 4-7) words, from its quant word wq and its qh
    word (`device_layout`: nibble i of wq is slice i; the qh word turned right by `_turn` puts slice
    i's top bits just above nibble i % 4 of a half word, and turned 16 further, slices 4-7's above the
    upper half's nibbles). The even slices' nibbles and bits go to one word, the odd ones' (a nibble
    early, then turned) to another, and two `prmt` put each slice in its byte."""
    low = rotr(word, 16 * (l % 2))  # slices 0-3's top bits at 4-5, 8-9, 12-13, 16-17
    high = rotr(word, (16 * (l % 2) + 18) % 32)  # slices 4-7's at 20-21, 24-25, 28-29, 0-1
    even = (wq & 0x0F0F0F0F) | (((low & 0xFFFF) | (high & -65536)) & 0x30303030)  # slices 0, 2, 4, 6
    odd = rotr((wq & -252645136) | (((low & 0x00FFFF00) | (high & -16776961)) & 0x03030303), 4)  # 1, 3, 5, 7
    return prmt(even, odd, 0x5140, NATIVE), prmt(even, odd, 0x7362, NATIVE)


@triton.jit
def _q5_lane(wq, word, l: tl.constexpr):
    """Lane l's 5-bit fields in bytes: (even slices, odd slices) words, from its quant word wq and its
    block's qh word (`device_layout`: turned right by `_turn`, slice i's fifth bit lies just above
    nibble i % 4 of a half word; turned 16 further, slices 4-7's above the upper half's), as
    `_q6_lane` places Q6_K's two top bits."""
    base: tl.constexpr = 16 * (l // 2) + 2 * (l % 2)
    low = rotr(word, base)  # slices 0-3's fifth bits at 4, 8, 12, 16
    high = rotr(word, (base + 17) % 32)  # slices 4-7's at 20, 24, 28, 0
    even = (wq & 0x0F0F0F0F) | (((low & 0xFFFF) | (high & -65536)) & 0x10101010)  # slices 0, 2, 4, 6
    odd = rotr((wq & -252645136) | (((low & 0x00FFFF00) | (high & -16776961)) & 0x01010101), 4)  # 1, 3, 5, 7
    return even, odd


@triton.jit
def _weight_bytes(wq, wh, QTYPE: tl.constexpr, R: tl.constexpr, C: tl.constexpr, NATIVE: tl.constexpr):
    """A tile's integer fields in bytes, once a tile: two tuples of its lanes' words (`_quarters`), the
    order the inputs' two words of a lane are packed in (`_row_sums`): Q8_0's bytes as stored (slices
    0-3, 4-7); Q4 nibbles masked into bytes (even slices, odd slices); the Q5 types' with their fifth
    bits (`_q5_lane`: even, odd); Q6_K by `_q6_lane` (slices 0-3, 4-7), each lane with its own qh word
    (lanes 0-1 of a block read the first, 2-3 the second)."""
    if QTYPE == 8:
        hl, hh = high_words(wh, 8, R, C)
        q0, q1, q2, q3 = _quarters(wq, R, C)
        a0, b0 = _q6_lane(q0, hl, 0, NATIVE)
        a1, b1 = _q6_lane(q1, hl, 1, NATIVE)
        a2, b2 = _q6_lane(q2, hh, 2, NATIVE)
        a3, b3 = _q6_lane(q3, hh, 3, NATIVE)
        return (a0, a1, a2, a3), (b0, b1, b2, b3)
    if QTYPE == 4 or QTYPE == 5 or QTYPE == 7:
        word, _ = high_words(wh, QTYPE, R, C)
        q0, q1, q2, q3 = _quarters(wq, R, C)
        e0, o0 = _q5_lane(q0, word, 0)
        e1, o1 = _q5_lane(q1, word, 1)
        e2, o2 = _q5_lane(q2, word, 2)
        e3, o3 = _q5_lane(q3, word, 3)
        return (e0, e1, e2, e3), (o0, o1, o2, o3)
    if QTYPE == 1:
        return _quarters(wq, R, C), _quarters(wh, R, C)
    return _quarters(wq & 0x0F0F0F0F, R, C), _quarters((wq >> 4) & 0x0F0F0F0F, R, C)


@triton.jit
def _stream(x_ptr, m, M, x_stride, cs, K, i, nw_ptr, add_ptr, add_rows, add_stride, sq, NORM: tl.constexpr,
            ADD: tl.constexpr, SQUARES: tl.constexpr, NATIVE: tl.constexpr, QTYPE: tl.constexpr):
    """Slice i of input row m as the 8-bit loop rounds it (`x_slice`; with NORM times the norm's
    weight, not normalized) and sq plus the squares of the values the norm reads where SQUARES."""
    x = x_slice(x_ptr, m, M, x_stride, cs, K, i, nw_ptr, 1.0, add_ptr, add_rows, add_stride, NORM, ADD, NATIVE,
                QTYPE, False)
    if SQUARES:
        sq += x * x
    if NORM:
        x = x * norm_weight(nw_ptr, cs, K, i, QTYPE)
    return x, sq


@triton.jit
def _row_sums(x_ptr, m, M, x_stride, cs, K, nw_ptr, add_ptr, add_rows, add_stride, w0, w1, a, b, sq,
              QTYPE: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, SQUARES: tl.constexpr,
              NATIVE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """Input row m's products with the tile's weight rows, a float32 [R, C, 8] sum per block, and sq
    plus the squares the row's norm reads where SQUARES: the row's 8 slices (`_stream`) rounded to
    int8 with each block's scale, packed in two words a lane as the weight's bytes w0, w1 are
    (`_weight_bytes`), multiplied by chains of `dp4a`, then scaled by the block's factors a, b. With
    NORM the slices are the row times the norm's weight, not yet normalized (the codes are the same;
    `int8_sums` multiplies by 1/rms): the normalized inputs are rounded once, to int8, where the float
    loop rounds them twice to the row's dtype."""
    x0, sq = _stream(x_ptr, m, M, x_stride, cs, K, 0, nw_ptr, add_ptr, add_rows, add_stride, sq, NORM, ADD, SQUARES,
                     NATIVE, QTYPE)
    x1, sq = _stream(x_ptr, m, M, x_stride, cs, K, 1, nw_ptr, add_ptr, add_rows, add_stride, sq, NORM, ADD, SQUARES,
                     NATIVE, QTYPE)
    x2, sq = _stream(x_ptr, m, M, x_stride, cs, K, 2, nw_ptr, add_ptr, add_rows, add_stride, sq, NORM, ADD, SQUARES,
                     NATIVE, QTYPE)
    x3, sq = _stream(x_ptr, m, M, x_stride, cs, K, 3, nw_ptr, add_ptr, add_rows, add_stride, sq, NORM, ADD, SQUARES,
                     NATIVE, QTYPE)
    x4, sq = _stream(x_ptr, m, M, x_stride, cs, K, 4, nw_ptr, add_ptr, add_rows, add_stride, sq, NORM, ADD, SQUARES,
                     NATIVE, QTYPE)
    x5, sq = _stream(x_ptr, m, M, x_stride, cs, K, 5, nw_ptr, add_ptr, add_rows, add_stride, sq, NORM, ADD, SQUARES,
                     NATIVE, QTYPE)
    x6, sq = _stream(x_ptr, m, M, x_stride, cs, K, 6, nw_ptr, add_ptr, add_rows, add_stride, sq, NORM, ADD, SQUARES,
                     NATIVE, QTYPE)
    x7, sq = _stream(x_ptr, m, M, x_stride, cs, K, 7, nw_ptr, add_ptr, add_rows, add_stride, sq, NORM, ADD, SQUARES,
                     NATIVE, QTYPE)
    top = largest(largest(largest(tl.abs(x0), tl.abs(x1)), largest(tl.abs(x2), tl.abs(x3))),
                  largest(largest(tl.abs(x4), tl.abs(x5)), largest(tl.abs(x6), tl.abs(x7))))
    t0, t1, t2, t3 = _quarters(top, 1, C)
    top = largest(largest(largest(t0, t1), largest(t2, t3)), 1e-30)  # each block's largest magnitude, [1, C, 8]
    dx = top * (1.0 / 127.0)  # a NaN input makes its block's sums NaN, as the float loop's
    inv = lanes(tl.div_rn(127.0, top), 1, C)
    if QTYPE == 1 or QTYPE == 8:
        u = _packed(x0, x1, x2, x3, inv, NATIVE)
        v = _packed(x4, x5, x6, x7, inv, NATIVE)
    else:
        u = _packed(x0, x2, x4, x6, inv, NATIVE)
        v = _packed(x1, x3, x5, x7, inv, NATIVE)
    if QTYPE == 1:
        return a * (_biased_float(_chain(w1, v, _chain(w0, u, BIASED, C, NATIVE), C, NATIVE)) * dx), sq
    if QTYPE == 8:  # Q6_K: d * sc * (q - 32), slices 0-3 and 4-7 with a scale each
        su = _chain(w0, u, BIASED - 32 * _code_sums(u, C, NATIVE), C, NATIVE)
        sv = _chain(w1, v, BIASED - 32 * _code_sums(v, C, NATIVE), C, NATIVE)
        return (a * _biased_float(su) + b * _biased_float(sv)) * dx, sq
    xs = _code_sums(u, C, NATIVE) + _code_sums(v, C, NATIVE)
    if QTYPE == 2 or QTYPE == 4:  # Q4_0, Q5_0: d * (q - 8), d * (q - 16)
        zero: tl.constexpr = 8 if QTYPE == 2 else 16
        return a * (_biased_float(_chain(w1, v, _chain(w0, u, BIASED - zero * xs, C, NATIVE), C, NATIVE)) * dx), sq
    s = _biased_float(_chain(w1, v, _chain(w0, u, BIASED, C, NATIVE), C, NATIVE)) * dx
    xs = _biased_float(xs + BIASED) * dx
    if QTYPE == 3 or QTYPE == 5:  # Q4_1, Q5_1: d * q + m
        return a * s + b * xs, sq
    return a * s - b * xs, sq  # Q4_K, Q5_K: d * sc * q - dmin * m


@triton.jit
def int8_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride, qh_stride, s_stride, s2_stride,
              rows, m0, c_lo, c_hi, nw_ptr, eps, add_ptr, add_rows, add_stride, QTYPE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NORM: tl.constexpr,
              ADD: tl.constexpr, PARTIAL: tl.constexpr, NATIVE: tl.constexpr):
    """`layout_triton`'s k-loop with 8-bit inputs (every quantized QTYPE): the float32 [BLOCK_N] sums of
    weight rows `rows` times input rows m0..m0 + 3 (those past BLOCK_M zero) over chunks [c_lo, c_hi),
    a block's products summed in integers (`_row_sums`). With NORM the sums are multiplied by each
    row's 1/rms at the end: from the squares summed in the loop where the program reads whole rows,
    from a first pass over them (`rstds`) where K is split (PARTIAL)."""
    SQUARES: tl.constexpr = NORM and not PARTIAL
    r0, r1, r2, r3 = rstds(x_ptr, m0, M, x_stride, K, eps, add_ptr, add_rows, add_stride, NORM and PARTIAL, ADD,
                           NATIVE, BLOCK_M)
    sq0 = tl.zeros((1, BLOCK_C, 32), tl.float32)
    sq1 = tl.zeros((1, BLOCK_C, 32), tl.float32)
    sq2 = tl.zeros((1, BLOCK_C, 32), tl.float32)
    sq3 = tl.zeros((1, BLOCK_C, 32), tl.float32)
    acc0 = tl.zeros((BLOCK_N, BLOCK_C, 8), tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_C, 8), tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_C, 8), tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_C, 8), tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        wq, wh, sa, sb = tile(q_ptr, qh_ptr, s_ptr, s2_ptr, rows, cs, q_stride, qh_stride, s_stride, s2_stride,
                              QTYPE, BLOCK_N, BLOCK_C)
        a, b = factors(sa, sb, cs, QTYPE, BLOCK_N, BLOCK_C)
        w0, w1 = _weight_bytes(wq, wh, QTYPE, BLOCK_N, BLOCK_C, NATIVE)
        s, sq0 = _row_sums(x_ptr, m0, M, x_stride, cs, K, nw_ptr, add_ptr, add_rows, add_stride, w0, w1, a, b, sq0,
                           QTYPE, NORM, ADD, SQUARES, NATIVE, BLOCK_N, BLOCK_C)
        acc0 += s
        if BLOCK_M > 1:
            s, sq1 = _row_sums(x_ptr, m0 + 1, M, x_stride, cs, K, nw_ptr, add_ptr, add_rows, add_stride, w0, w1, a, b,
                               sq1, QTYPE, NORM, ADD, SQUARES, NATIVE, BLOCK_N, BLOCK_C)
            acc1 += s
        if BLOCK_M > 2:
            s, sq2 = _row_sums(x_ptr, m0 + 2, M, x_stride, cs, K, nw_ptr, add_ptr, add_rows, add_stride, w0, w1, a, b,
                               sq2, QTYPE, NORM, ADD, SQUARES, NATIVE, BLOCK_N, BLOCK_C)
            acc2 += s
            s, sq3 = _row_sums(x_ptr, m0 + 3, M, x_stride, cs, K, nw_ptr, add_ptr, add_rows, add_stride, w0, w1, a, b,
                               sq3, QTYPE, NORM, ADD, SQUARES, NATIVE, BLOCK_N, BLOCK_C)
            acc3 += s
    if SQUARES:
        r0 = inverse_rms(tl.reshape(sq0, (BLOCK_C * 32,)), K, eps)
        r1 = inverse_rms(tl.reshape(sq1, (BLOCK_C * 32,)), K, eps)
        r2 = inverse_rms(tl.reshape(sq2, (BLOCK_C * 32,)), K, eps)
        r3 = inverse_rms(tl.reshape(sq3, (BLOCK_C * 32,)), K, eps)
    return (tl.sum(tl.sum(acc0, axis=2), axis=1) * r0, tl.sum(tl.sum(acc1, axis=2), axis=1) * r1,
            tl.sum(tl.sum(acc2, axis=2), axis=1) * r2, tl.sum(tl.sum(acc3, axis=2), axis=1) * r3)
