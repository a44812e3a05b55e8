"""The Triton kernels over the device layout (`mm3.backends.gpu.device_layout`), launched by
`mm3.backends.gpu.layout_kernels` (imported only where Triton can run).

A program takes a tile of weight rows and chunks (256 values), expands it one slice at a time to
float32 weights (`mm3.backends.gpu.layout_fields`) and multiplies them with the inputs' 32 matching
values of each chunk. `gemv_kernel` (decode: a few input rows) accumulates with FMAs in float32 and
may split K over programs (the last program of a tile adds the partial sums in a fixed order), or
with SWIGLU computes matching gate and up rows (interleaved in its tile) and stores
`silu(gate) * up`; `gemv_segments_kernel` is it over two weights of different types stacked by
their outputs (q and k of one type, v of another); `gemm_kernel` (prefill, the DiT) multiplies
input and weight tiles with `tl.dot`. QTYPE codes as `layout_fields`'.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .layout_fields import factors, high_words, inside, tile, value_at, weight_slice, weight_slice_at
from .layout_inputs import added, rstds, x_slice
from .layout_int8 import int8_sums
from .norm_kernels import cast


@triton.jit
def _float_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride, qh_stride, s_stride, s2_stride,
               rows, m0, c_lo, c_hi, nw_ptr, eps, add_ptr, add_rows, add_stride, QTYPE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NORM: tl.constexpr,
               ADD: tl.constexpr, NATIVE: tl.constexpr):
    """The k-loop: float32 [BLOCK_N, BLOCK_C, 32] sums of weight rows `rows` (of these planes) times
    input rows m0..m0 + 3 (those past BLOCK_M stay zero) over chunks [c_lo, c_hi); with NORM the
    inputs RMS-normalized first (`x_slice`; ADD: each plus a row at add_ptr), each program reading its
    rows whole for their norm."""
    r0, r1, r2, r3 = rstds(x_ptr, m0, M, x_stride, K, eps, add_ptr, add_rows, add_stride, NORM, ADD, NATIVE,
                            BLOCK_M)
    acc0 = tl.zeros((BLOCK_N, BLOCK_C, 32), tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_C, 32), tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_C, 32), tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_C, 32), tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        wq, wh, sa, sb = tile(q_ptr, qh_ptr, s_ptr, s2_ptr, rows, cs, q_stride, qh_stride, s_stride, s2_stride,
                               QTYPE, BLOCK_N, BLOCK_C)
        a, b = factors(sa, sb, cs, QTYPE, BLOCK_N, BLOCK_C)
        hl, hh = high_words(wh, QTYPE, BLOCK_N, BLOCK_C)
        for i in tl.static_range(8):
            w = weight_slice(q_ptr, rows, cs, q_stride, K, wq, wh, hl, hh, a, b, i, QTYPE, BLOCK_N, BLOCK_C)
            acc0 += w * x_slice(x_ptr, m0, M, x_stride, cs, K, i, nw_ptr, r0, add_ptr, add_rows,
                                 add_stride, NORM, ADD, NATIVE, QTYPE)
            if BLOCK_M > 1:
                acc1 += w * x_slice(x_ptr, m0 + 1, M, x_stride, cs, K, i, nw_ptr, r1, add_ptr, add_rows,
                                 add_stride, NORM, ADD, NATIVE, QTYPE)
            if BLOCK_M > 2:
                acc2 += w * x_slice(x_ptr, m0 + 2, M, x_stride, cs, K, i, nw_ptr, r2, add_ptr, add_rows,
                                 add_stride, NORM, ADD, NATIVE, QTYPE)
                acc3 += w * x_slice(x_ptr, m0 + 3, M, x_stride, cs, K, i, nw_ptr, r3, add_ptr, add_rows,
                                 add_stride, NORM, ADD, NATIVE, QTYPE)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride, qh_stride, s_stride, s2_stride,
               rows, m0, c_lo, c_hi, nw_ptr, eps, add_ptr, add_rows, add_stride, QTYPE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NORM: tl.constexpr,
               ADD: tl.constexpr, PARTIAL: tl.constexpr, NATIVE: tl.constexpr, INT8: tl.constexpr):
    """The program's float32 [BLOCK_N] sums for input rows m0..m0 + 3 (zeros past BLOCK_M): the k-loop
    in float32 (`_float_sums`), or with INT8 for a quantized weight the one with 8-bit inputs
    (`layout_int8`)."""
    if INT8 and QTYPE >= 1:
        s0, s1, s2, s3 = int8_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride, qh_stride,
                                   s_stride, s2_stride, rows, m0, c_lo, c_hi, nw_ptr, eps, add_ptr, add_rows,
                                   add_stride, QTYPE, BLOCK_M, BLOCK_N, BLOCK_C, NORM, ADD, PARTIAL, NATIVE)
    else:
        acc0, acc1, acc2, acc3 = _float_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride,
                                             qh_stride, s_stride, s2_stride, rows, m0, c_lo, c_hi, nw_ptr, eps,
                                             add_ptr, add_rows, add_stride, QTYPE, BLOCK_M, BLOCK_N, BLOCK_C, NORM,
                                             ADD, NATIVE)
        s0, s1 = tl.sum(tl.sum(acc0, axis=2), axis=1), tl.sum(tl.sum(acc1, axis=2), axis=1)
        s2, s3 = tl.sum(tl.sum(acc2, axis=2), axis=1), tl.sum(tl.sum(acc3, axis=2), axis=1)
    return s0, s1, s2, s3


@triton.jit
def gemv_kernel(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
                M, N, K, x_stride, y_stride, q_stride, qh_stride, s_stride, s2_stride, chunks, split_chunks,
                nw_ptr, res_ptr, res_stride, add_ptr, add_rows, add_stride, eps,
                QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                SWIGLU: tl.constexpr = False, PRECISE: tl.constexpr = True, NORM: tl.constexpr = False,
                RESIDUAL: tl.constexpr = False, ADD: tl.constexpr = False, INT8: tl.constexpr = False):
    """y[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for BLOCK_M (1, 2 or 4) input rows, BLOCK_N weight
    rows and the chunks [pid_k * split_chunks, + split_chunks) (whole tiles of BLOCK_C); PARTIAL: K
    split over the grid's third axis (`_store`). SWIGLU (no split, no bias): W is [2 N, K], gate
    rows then up rows; the tile takes BLOCK_N / 2 of each, interleaved, and y[m, n] =
    silu(gate) * up in y's dtype (`_store_swiglu`). NORM: the inputs RMS-normalized by the weight
    at nw_ptr (eps) on the way in (`x_slice`; PRECISE: rounded by the device's own conversions, as
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
    s0, s1, s2, s3 = _gemv_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride, qh_stride, s_stride,
                                s2_stride, rows, m0, c_lo, c_hi, nw_ptr, eps, add_ptr, add_rows, add_stride, QTYPE,
                                BLOCK_M, BLOCK_N, BLOCK_C, NORM, ADD, PARTIAL, PRECISE, INT8)
    if SWIGLU:
        _store_swiglu(s0, m0, M, N, pid_n, y_ptr, y_stride, BLOCK_N, PRECISE)
        if BLOCK_M > 1:
            _store_swiglu(s1, m0 + 1, M, N, pid_n, y_ptr, y_stride, BLOCK_N, PRECISE)
        if BLOCK_M > 2:
            _store_swiglu(s2, m0 + 2, M, N, pid_n, y_ptr, y_stride, BLOCK_N, PRECISE)
            _store_swiglu(s3, m0 + 3, M, N, pid_n, y_ptr, y_stride, BLOCK_N, PRECISE)
    else:
        _store(s0, s1, s2, s3, m0, M, N, offs_n, b_ptr, y_ptr, y_stride, part_ptr, count_ptr, res_ptr,
               res_stride, add_ptr, add_rows, add_stride, HAS_BIAS, PARTIAL, BLOCK_M, RESIDUAL, ADD)


@triton.jit
def gemv_segments_kernel(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, q2_ptr, qh2_ptr, s3_ptr, s4_ptr, b_ptr, y_ptr,
                         part_ptr, count_ptr, M, N, N1, K, x_stride, y_stride, q_stride, qh_stride, s_stride,
                         s2_stride, q2_stride, qh2_stride, s3_stride, s4_stride, chunks, split_chunks,
                         nw_ptr, res_ptr, res_stride, add_ptr, add_rows, add_stride, eps,
                         QTYPE: tl.constexpr, QTYPE2: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_C: tl.constexpr, NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                         PRECISE: tl.constexpr = True, ADD: tl.constexpr = False,
                         INT8: tl.constexpr = False):
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
        s0, s1, s2, s3 = _gemv_sums(x_ptr, q_ptr, qh_ptr, s_ptr, s2_ptr, M, K, x_stride, q_stride, qh_stride,
                                    s_stride, s2_stride, offs_n, m0, c_lo, c_hi, nw_ptr, eps, add_ptr, add_rows,
                                    add_stride, QTYPE, BLOCK_M, BLOCK_N, BLOCK_C, NORM, ADD, PARTIAL, PRECISE, INT8)
    else:
        rows = tl.minimum(offs_n, N - 1) - N1
        s0, s1, s2, s3 = _gemv_sums(x_ptr, q2_ptr, qh2_ptr, s3_ptr, s4_ptr, M, K, x_stride, q2_stride,
                                    qh2_stride, s3_stride, s4_stride, rows, m0, c_lo, c_hi, nw_ptr, eps, add_ptr,
                                    add_rows, add_stride, QTYPE2, BLOCK_M, BLOCK_N, BLOCK_C, NORM, ADD, PARTIAL, PRECISE,
                                    INT8)
    _store(s0, s1, s2, s3, m0, M, N, offs_n, b_ptr, y_ptr, y_stride, part_ptr, count_ptr, res_ptr,
           res_stride, add_ptr, add_rows, add_stride, HAS_BIAS, PARTIAL, BLOCK_M, RESIDUAL, ADD)


@triton.jit
def _store(s0, s1, s2, s3, m0, M, N, offs_n, b_ptr, y_ptr, y_stride, part_ptr, count_ptr, res_ptr, res_stride,
           add_ptr, add_rows, add_stride, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr,
           RESIDUAL: tl.constexpr, ADD: tl.constexpr):
    """The program's rows of y from its sums s0..s3 [BLOCK_N], or with PARTIAL those (float32 [splits,
    M, N] at part_ptr), then a count of the tile's programs done (count_ptr, one int32 per tile, zero
    before); the last one adds the splits' sums in their order (the same bits whatever the timing), stores
    y and sets the count back to zero for the next launch."""
    n_ok = offs_n < N
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
    (with ADD, res[m] plus a row at add_ptr first, rounded: `added`)."""
    dt = y_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    out = y.to(dt)
    if RESIDUAL:
        res = tl.load(res_ptr + m.to(tl.int64) * res_stride + offs_n, mask=n_ok & (m < M), other=0.0).to(tl.float32)
        if ADD:
            res = added(res, m, M, offs_n, n_ok, add_ptr, add_rows, add_stride, dt, False)
        out = cast(res + out.to(tl.float32), dt)
    tl.store(y_ptr + m.to(tl.int64) * y_stride + offs_n, out, mask=n_ok & (m < M))


@triton.jit
def _store_swiglu(sums, m, M, N, pid_n, y_ptr, y_stride, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr):
    """y[m, n] = silu(gate) * up with torch's arithmetic in y's dtype: gate and up rounded to it,
    silu(g) = g / (1 + exp(-g)) in float32 (PRECISE: CUDA's expf and an IEEE division, as torch's
    kernel; else the interpreter's exp) rounded, the product in float32 rounded."""
    dt = y_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(sums, (BLOCK_N // 2, 2)))
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
        wq, wh, sa, sb = tile(q_ptr, qh_ptr, s_ptr, s2_ptr, rows, cs, q_stride, qh_stride, s_stride, s2_stride,
                               QTYPE, BLOCK_N, BLOCK_C)
        a, b = factors(sa, sb, cs, QTYPE, BLOCK_N, BLOCK_C)
        hl, hh = high_words(wh, QTYPE, BLOCK_N, BLOCK_C)
        for i in range(8):
            w = weight_slice_at(q_ptr, rows, cs, q_stride, K, wq, wh, hl, hh, a, b, i, QTYPE, BLOCK_N, BLOCK_C)
            col = (c0 + flat // 32) * 256 + value_at(i, flat % 32, QTYPE)
            ok = inside(c0 + flat // 32, flat % 32, i, K, QTYPE)  # chunks past the row's too
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
