"""How a tile of the device layout (`mm3.backends.gpu.device_layout`) becomes float32 weights, for
the kernels of `mm3.backends.gpu.layout_triton` (imported only where Triton can run).

A program takes a tile of weight rows and chunks (256 values). Every plane of the tile is loaded
once as an int32 [rows, chunks, 32] tensor, 4 consecutive words per thread (`tile`), so all of
them (and the inputs, [1, chunks, 32]) share one register layout: a scale word is picked from the
thread's own 4 words (`_word`), never moved between threads. A thread's 4 lanes hold one block of
32 values, so its scales and high-bit words are picked once a tile (`factors`, `high_words`). The tile
is then expanded one slice (32 values of each chunk, 4 of each block: `value_at`) at a time to
float32 with the arithmetic of `mm3.formats.gguf.quants`, the same exact products (`weight_slice`, or
`weight_slice_at` for a slice index known at run time).

QTYPE codes: 0 float weights, 1 Q8_0, 2 Q4_0, 3 Q4_1, 4 Q5_0, 5 Q5_1, 6 Q4_K, 7 Q5_K, 8 Q6_K.
"""

import triton
import triton.language as tl


@triton.jit
def _word(t, e, R: tl.constexpr, C: tl.constexpr):
    """Word e (0-3; a scalar or a tensor broadcasting to [1, C, 1, 1]) of each group of 4 lanes of
    t [R, C, 32]: [R, C, 8] (each thread holds its group's 4 words: no data moves between threads)."""
    t4 = tl.reshape(t, (R, C, 8, 4))
    v = tl.arange(0, 4)[None, None, None, :]
    return tl.sum(tl.where(v == e, t4, 0), axis=3)


@triton.jit
def lanes(s, R: tl.constexpr, C: tl.constexpr):
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
def tile(q_ptr, qh_ptr, s_ptr, s2_ptr, rows, cs, q_stride, qh_stride, s_stride, s2_stride,
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
def signed_byte(w, b):
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
    return lanes(f * (1.0 / (1 << sh)), R, C)


@triton.jit
def widened(v):
    """v as float32, exactly: a bfloat16 value's bits moved to the upper half of a word (one
    instruction a value, where the plain conversion takes two for every other value of a pair)."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def value_at(i, j, QTYPE: tl.constexpr):
    """The value of a chunk at lane j of slice i: 32 (j // 4) + 4 i + j % 4 for a quantized weight
    (each group of 4 lanes, one thread's 4 words, holds a whole block of 32 values: `device_layout`,
    so its scales are found once a tile, not once a slice: `factors`); 32 i + j for float weights
    (a thread's values of a slice side by side with its neighbours': the widest loads)."""
    if QTYPE == 0:
        return 32 * i + j
    return 32 * (j // 4) + 4 * i + j % 4


@triton.jit
def inside(c, j, i, K, QTYPE: tl.constexpr):
    """Whether value `value_at(i, j)` of chunk c lies in a row of K values; for a quantized weight
    (rows of whole blocks of 32) its block's start does, the same test for a thread's 4 lanes."""
    if QTYPE == 0:
        return c * 256 + 32 * i + j < K
    return c * 256 + 32 * (j // 4) < K


@triton.jit
def factors(sa, sb, cs, QTYPE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
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
        a = d * signed_byte(scales, 2 * (g % 2)).to(tl.float32)
        b = d * signed_byte(scales, 2 * (g % 2) + 1).to(tl.float32)
    elif QTYPE >= 1:  # the 32-value types: the block's float16 d (and m)
        a = _half(_word(sa, (g // 2)[:, :, :, None], R, C), g % 2)
        if QTYPE == 3 or QTYPE == 5:
            b = _half(_word(sb, (g // 2)[:, :, :, None], R, C), g % 2)
    else:
        a = b
    return a, b


@triton.jit
def high_words(wh, QTYPE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """The qh words each group of 4 lanes reads, [R, C, 8] each, picked once a tile from the 4 the
    thread loaded: (lanes 0-1's, lanes 2-3's) for Q6_K, its one word twice for the Q5 types (read
    for a lane by `high_word`); wh twice for a type without high bits."""
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
def high_word(hl, hh, R: tl.constexpr, C: tl.constexpr):
    """Each lane's qh word [R, C, 32] from `high_words`'s pair."""
    return tl.where(tl.arange(0, 32)[None, None, :] % 4 < 2, lanes(hl, R, C), lanes(hh, R, C))


@triton.jit
def _turn(j, i, QTYPE: tl.constexpr):
    """How far lane j's qh word turns right to bring slice i's high bits to just above its nibble
    (`device_layout.high_bit` less 4 (i % 4) + 4)."""
    if QTYPE == 8:
        return 16 * (j % 2) + 2 * (i // 4)
    return 16 * ((j % 4) // 2) + 2 * (j % 2) + i // 4


@triton.jit
def rotr(c, s):
    """int32 words rotated right by s bits (0 <= s < 32)."""
    u = c.to(tl.uint32, bitcast=True)
    return ((u >> s) | (u << ((32 - s) % 32))).to(tl.int32, bitcast=True)


@triton.jit
def weight_slice(q_ptr, rows, cs, q_stride, K, wq, wh, hl, hh, a, b, i: tl.constexpr, QTYPE: tl.constexpr,
           R: tl.constexpr, C: tl.constexpr):
    """Slice i (value `value_at(i, j)` of each chunk at lane j) of the tile as float32 [R, C, 32], with
    the tile's `factors` (a, b) and high-bit words (`high_words`: hl, hh; wh: Q8_0's slices 4-7). Quant
    fields are read where they lie (`_in_place`) and the scale takes their power of two (`_scale`):
    each value is the product of `mm3.formats.gguf.quants` (exact, as there)."""
    j = tl.arange(0, 32)[None, None, :]
    if QTYPE == 0:  # float weights [N, K]
        col = cs[None, :, None] * 256 + value_at(i, j, QTYPE)
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
            v = v | (rotr(high_word(hl, hh, R, C), _turn(j, i, QTYPE)) & (1 << (4 + p)))
        w = _unshifted(v, 0, p) * _scale(a, p, R, C) - lanes(b, R, C)
    elif QTYPE == 8:  # Q6_K: d * the int8 scale of the lane's group of 16
        p: tl.constexpr = 4 * (i % 4)
        v = _in_place(wq, i, 4)
        v = v | (rotr(high_word(hl, hh, R, C), _turn(j, i, QTYPE)) & (3 << (4 + p)))  # the top two bits
        if i < 4:
            w = _unshifted(v, 32, p) * _scale(a, p, R, C)
        else:
            w = _unshifted(v, 32, p) * _scale(b, p, R, C)
    else:  # Q4_0, Q4_1, Q5_0, Q5_1
        p: tl.constexpr = 4 * (i % 4)
        v = _in_place(wq, i, 4)
        if QTYPE == 4 or QTYPE == 5:
            v = v | (rotr(high_word(hl, hh, R, C), _turn(j, i, QTYPE)) & (1 << (4 + p)))
        if QTYPE == 2:
            w = _unshifted(v, 8, p) * _scale(a, p, R, C)
        elif QTYPE == 4:
            w = _unshifted(v, 16, p) * _scale(a, p, R, C)
        else:
            w = _unshifted(v, 0, p) * _scale(a, p, R, C) + lanes(b, R, C)
    return w


@triton.jit
def weight_slice_at(q_ptr, rows, cs, q_stride, K, wq, wh, hl, hh, a, b, i, QTYPE: tl.constexpr, R: tl.constexpr,
                   C: tl.constexpr):
    """`weight_slice` for a slice index i known only at run time (the prefill's k-loop: unrolled, its
    tiles would spill on sm_80): each field shifted down, then read as a float; a and b the tile's
    `factors`."""
    j = tl.arange(0, 32)[None, None, :]
    if QTYPE == 0:  # float weights [N, K]
        col = cs[None, :, None] * 256 + value_at(i, j, QTYPE)
        w = tl.load(q_ptr + rows[:, None, None].to(tl.int64) * q_stride + col, mask=col < K, other=0.0)
        w = w.to(tl.float32)
    elif QTYPE == 1:  # Q8_0
        q = _exact(((tl.where(i < 4, wq, wh) >> (8 * (i % 4))) & 255) ^ 128, 128)  # int8 = unsigned ^ 128 - 128
        w = q * lanes(a, R, C)
    elif QTYPE == 6 or QTYPE == 7:  # Q4_K, Q5_K: d * sc * q - dmin * m
        q = (wq >> (4 * i)) & 15
        if QTYPE == 7:
            q = q | (((high_word(hl, hh, R, C) >> ((4 * (i % 4) + 4 + _turn(j, i, QTYPE)) % 32)) & 1) << 4)
        w = _exact(q, 0) * lanes(a, R, C) - lanes(b, R, C)
    elif QTYPE == 8:  # Q6_K: d * the int8 scale of the lane's group of 16
        q = (wq >> (4 * i)) & 15
        q = q | (((high_word(hl, hh, R, C) >> ((4 * (i % 4) + 4 + _turn(j, i, QTYPE)) % 32)) & 3) << 4)
        w = _exact(q, 32) * lanes(tl.where(i < 4, a, b), R, C)
    else:  # Q4_0, Q4_1, Q5_0, Q5_1
        q = (wq >> (4 * i)) & 15
        if QTYPE == 4 or QTYPE == 5:
            q = q | (((high_word(hl, hh, R, C) >> ((4 * (i % 4) + 4 + _turn(j, i, QTYPE)) % 32)) & 1) << 4)
        d = lanes(a, R, C)
        if QTYPE == 2:
            w = _exact(q, 8) * d
        elif QTYPE == 4:
            w = _exact(q, 16) * d
        else:
            w = _exact(q, 0) * d + lanes(b, R, C)
    return w
