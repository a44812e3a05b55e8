"""The Triton kernel behind `mm3.backends.gpu.kernels.fused_linear` (imported only where it can run).

`_weights` expands a tile of GGUF block bytes to float32 with the arithmetic of `mm3.formats.gguf.quants`
(the same products in the same order, so a tile equals the torch dequantization bit for bit);
`fused_linear_kernel` multiplies input tiles by those weight tiles.
"""

import triton
import triton.language as tl


@triton.jit
def _f16(p):
    """The little-endian float16 at byte pointers `p` (any alignment), as float32."""
    lo = tl.load(p).to(tl.uint16)
    hi = tl.load(p + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

@triton.jit
def _k4_scale_min(sc_ptr, s):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block `s` (0-7) from the 12 packed bytes."""
    lo = s < 4
    a = tl.load(sc_ptr + s).to(tl.int32)  # s < 4: scale; else the top bits of min s-4
    b = tl.load(sc_ptr + s + 4).to(tl.int32)
    c = tl.load(sc_ptr + tl.where(lo, s, s - 4)).to(tl.int32)
    scale = tl.where(lo, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(lo, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale.to(tl.float32), mn.to(tl.float32)

@triton.jit
def _blocks32(w_ptr, rows, cols, row_stride, QTYPE: tl.constexpr):
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (32-value blocks)."""
    j = cols % 32
    if QTYPE == 1:  # Q8_0: d, qs[32] int8
        b = w_ptr + rows * row_stride + (cols // 32) * 34
        w = tl.load(b + 2 + j).to(tl.int8, bitcast=True).to(tl.float32) * _f16(b)
    elif QTYPE == 2:  # Q4_0: d, qs[16] (value j in the low nibble of byte j, value 16 + j in the high one)
        b = w_ptr + rows * row_stride + (cols // 32) * 18
        q = (tl.load(b + 2 + j % 16) >> (4 * (j // 16)).to(tl.uint8)) & 0xF
        w = (q.to(tl.int32) - 8).to(tl.float32) * _f16(b)
    elif QTYPE == 3:  # Q4_1: d, m, qs[16]
        b = w_ptr + rows * row_stride + (cols // 32) * 20
        q = (tl.load(b + 4 + j % 16) >> (4 * (j // 16)).to(tl.uint8)) & 0xF
        w = q.to(tl.float32) * _f16(b) + _f16(b + 2)
    elif QTYPE == 4:  # Q5_0: d, qh[4] (bit j: value j's fifth bit), qs[16]
        b = w_ptr + rows * row_stride + (cols // 32) * 22
        h = (tl.load(b + 2 + j // 8) >> (j % 8).to(tl.uint8)) & 1
        q = ((tl.load(b + 6 + j % 16) >> (4 * (j // 16)).to(tl.uint8)) & 0xF) | (h << 4)
        w = (q.to(tl.int32) - 16).to(tl.float32) * _f16(b)
    else:  # Q5_1: d, m, qh[4], qs[16]
        b = w_ptr + rows * row_stride + (cols // 32) * 24
        h = (tl.load(b + 4 + j // 8) >> (j % 8).to(tl.uint8)) & 1
        q = ((tl.load(b + 8 + j % 16) >> (4 * (j // 16)).to(tl.uint8)) & 0xF) | (h << 4)
        w = q.to(tl.float32) * _f16(b) + _f16(b + 2)
    return w


@triton.jit
def _q6_k(w_ptr, rows, cols, row_stride):
    """Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d."""
    j = cols % 256
    b = w_ptr + rows * row_stride + (cols // 256) * 210
    half, r = j // 128, j % 128
    group, lane = r // 32, r % 32
    low = (tl.load(b + half * 64 + (group % 2) * 32 + lane) >> (4 * (group // 2)).to(tl.uint8)) & 0xF
    high = (tl.load(b + 128 + half * 32 + lane) >> (2 * group).to(tl.uint8)) & 3
    q = (low | (high << 4)).to(tl.int32) - 32
    scale = tl.load(b + 192 + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
    return q.to(tl.float32) * (_f16(b + 208) * scale)


@triton.jit
def _q45_k(w_ptr, rows, cols, row_stride, FIFTH_BIT: tl.constexpr):
    """Q4_K: d, dmin, scales[12], qs[128]; Q5_K: d, dmin, scales[12], qh[32] (bit s of qh[j % 32]
    is the fifth bit in sub-block s), qs[128]. Byte k of 32-byte chunk c holds values 64c + k (low
    nibble) and 64c + 32 + k (high nibble)."""
    j = cols % 256
    sub = j // 32
    nibble = (4 * ((j % 64) // 32)).to(tl.uint8)
    if FIFTH_BIT:
        b = w_ptr + rows * row_stride + (cols // 256) * 176
        q = (tl.load(b + 48 + (j // 64) * 32 + j % 32) >> nibble) & 0xF
        q = q | (((tl.load(b + 16 + j % 32) >> sub.to(tl.uint8)) & 1) << 4)
    else:
        b = w_ptr + rows * row_stride + (cols // 256) * 144
        q = (tl.load(b + 16 + (j // 64) * 32 + j % 32) >> nibble) & 0xF
    scale, mn = _k4_scale_min(b + 4, sub)
    return q.to(tl.float32) * (_f16(b) * scale) - _f16(b + 2) * mn


@triton.jit
def _weights(w_ptr, rows, cols, row_stride, QTYPE: tl.constexpr):
    """Float32 weights [R, C] at `rows` [R, 1] x `cols` [1, C] (valid indices) of the tensor:
    QTYPE 0 a float tensor of any dtype (row_stride in elements), else block bytes (in bytes)."""
    if QTYPE == 0:
        w = tl.load(w_ptr + rows * row_stride + cols).to(tl.float32)
    elif QTYPE <= 5:
        w = _blocks32(w_ptr, rows, cols, row_stride, QTYPE)
    elif QTYPE == 8:
        w = _q6_k(w_ptr, rows, cols, row_stride)
    else:
        w = _q45_k(w_ptr, rows, cols, row_stride, QTYPE == 7)
    return w


@triton.jit
def fused_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, y_stride, w_stride,
                         QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]  # clamped: every weight load is in bounds
    m_ok = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :],
                    mask=m_ok & k_ok[None, :], other=0.0)
        w = _weights(w_ptr, rows, tl.minimum(offs_k, K - 1)[None, :], w_stride, QTYPE)
        w = tl.where(k_ok[None, :], w, 0.0).to(x.dtype)
        if x.dtype == tl.float32:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * y_stride + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok & (offs_n[None, :] < N))
