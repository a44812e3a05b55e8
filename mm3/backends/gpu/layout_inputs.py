"""How a decode program of `mm3.backends.gpu.layout_triton` reads its input rows: a slice of a row's
values as float32 (`x_slice`), RMS-normalized on the way in by the 1/rms its program finds over the
whole row (`rstds`), with rows added to the stream where the depth decoder's position embeddings
are (`added`), in the roundings of `mm3.backends.gpu.norm_kernels` (imported only where Triton can
run).
"""

import triton
import triton.language as tl

from .layout_fields import inside, value_at, widened
from .norm_kernels import cast


@triton.jit
def rounded(v, dt: tl.constexpr, NATIVE: tl.constexpr):
    """v (float32) rounded to `dt` and back: the device's own conversion (round to nearest even on
    a GPU, one instruction), or `norm_kernels.cast` where it would truncate (the interpreter)."""
    if NATIVE:
        return v.to(dt).to(tl.float32)
    else:
        return cast(v, dt).to(tl.float32)


@triton.jit
def added(v, m, M, col, ok, add_ptr, add_rows, add_stride, dt: tl.constexpr, NATIVE: tl.constexpr):
    """v (float32 values of row m at columns col) plus row m % add_rows of the rows at add_ptr,
    rounded to `dt` as torch adds two tensors of it (`rounded`)."""
    a = tl.load(add_ptr + (m % add_rows).to(tl.int64) * add_stride + col, mask=ok & (m < M), other=0.0)
    return rounded(v + a.to(tl.float32), dt, NATIVE)


@triton.jit
def x_slice(x_ptr, m, M, x_stride, cs, K, i, nw_ptr, r, add_ptr, add_rows, add_stride, NORM: tl.constexpr,
            ADD: tl.constexpr, NATIVE: tl.constexpr, QTYPE: tl.constexpr, SCALED: tl.constexpr = True):
    """Input row m's values of slice i of chunks cs (`value_at`): float32 [1, C, 32] (zeros past K or M); with
    NORM the row's RMSNorm by the weight at nw_ptr (r: the row's `rstds`), in the roundings of
    `norm_kernels`: the normalized value and its product with the weight each rounded to x's dtype
    (not SCALED: the values the norm reads, not normalized: the 8-bit loop's, which multiplies them
    by `norm_weight` and takes 1/rms into its sums); with NORM and ADD the row normalized is x's plus
    a row at add_ptr (`added`)."""
    dt: tl.constexpr = x_ptr.dtype.element_ty
    j = tl.arange(0, 32)[None, None, :]
    col = cs[None, :, None] * 256 + value_at(i, j, QTYPE)
    ok = inside(cs[None, :, None], j, i, K, QTYPE)
    x = tl.load(x_ptr + m.to(tl.int64) * x_stride + col, mask=ok & (m < M), other=0.0)
    if NORM and ADD:  # the plain conversion: compiled with the add's rounding, it costs fewer instructions
        x = added(x.to(tl.float32), m, M, col, ok, add_ptr, add_rows, add_stride, dt, NATIVE)
    else:
        x = widened(x)
    if NORM and SCALED:
        w = tl.load(nw_ptr + col, mask=ok, other=0.0)
        if NATIVE:  # the product of two values of dt is exact in float32: dt's own product rounds it the same
            return widened(w * (x * r).to(dt))
        return rounded(w.to(tl.float32) * rounded(x * r, dt, NATIVE), dt, NATIVE)
    return x


@triton.jit
def norm_weight(nw_ptr, cs, K, i, QTYPE: tl.constexpr):
    """The norm's weight at slice i of chunks cs (`value_at`), float32 [1, C, 32] (zeros past K)."""
    j = tl.arange(0, 32)[None, None, :]
    col = cs[None, :, None] * 256 + value_at(i, j, QTYPE)
    return widened(tl.load(nw_ptr + col, mask=inside(cs[None, :, None], j, i, K, QTYPE), other=0.0))


@triton.jit
def _squares(x_ptr, m, M, x_stride, col, K, add_ptr, add_rows, add_stride, ADD: tl.constexpr, NATIVE: tl.constexpr):
    """The squares of input row m's values at columns col (zeros past K or M); with ADD of the row
    plus a row at add_ptr (`added`)."""
    v = tl.load(x_ptr + m.to(tl.int64) * x_stride + col, mask=(col < K) & (m < M), other=0.0)
    if ADD:
        v = added(v.to(tl.float32), m, M, col, col < K, add_ptr, add_rows, add_stride, x_ptr.dtype.element_ty,
                   NATIVE)
    else:
        v = widened(v)
    return v * v


@triton.jit
def inverse_rms(acc, K, eps):
    """1 / sqrt(mean + eps) of the squares summed in acc (one axis), correctly rounded twice."""
    return tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(acc, axis=0) / K + eps))


@triton.jit
def rstds(x_ptr, m0, M, x_stride, K, eps, add_ptr, add_rows, add_stride, NORM: tl.constexpr, ADD: tl.constexpr,
          NATIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr = 512):
    """1 / sqrt(mean(x[m]^2) + eps) of input rows m0..m0 + 3 (those past BLOCK_M: 1.0) in float32,
    correctly rounded twice as `norm_kernels` computes it (the sum of squares in another order), the
    rows read in one loop; with ADD of each row plus a row at add_ptr (`added`); 1.0 without NORM."""
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
        r0 = inverse_rms(a0, K, eps)
        if BLOCK_M > 1:
            r1 = inverse_rms(a1, K, eps)
        if BLOCK_M > 2:
            r2 = inverse_rms(a2, K, eps)
            r3 = inverse_rms(a3, K, eps)
    return r0, r1, r2, r3
