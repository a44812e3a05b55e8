"""RMSNorm in one Triton kernel, alone (`norm_rms_kernel`) or after a residual add
(`norm_add_rms_kernel`), launched by `rms_norm` and `add_rms_norm` (imported only where Triton runs).

The arithmetic of `mm3.models.lm.rms_norm`'s torch path: the variance of the row in float32, the
normalized row cast to x's dtype, then times the weight in x's dtype (each product of two values
of that dtype rounded once, as torch rounds it). 1 / sqrt is correctly rounded twice, as torch's
`rsqrt` on the CPU; only the order of the float32 sum of squares differs from torch's, so a
normalized value may differ from torch's by one rounding of x's dtype where the sums differ in
their last bits. Products and sums are not fused into one rounding (`enable_fp_fusion=False`),
so float32 inputs give torch's numbers up to that sum too. A row is any element of x's leading
dimensions (up to three after merging the contiguous ones), so a head view of a fused product's
output ([B, S, heads, D] with a row stride) is read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def cast(v, dtype: tl.constexpr):
    """v (float32) rounded to the nearest value of `dtype` (ties to even), as torch rounds; for
    bfloat16 by the float32 bits (Triton's interpreter would truncate), the same on a GPU."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return v.to(dtype)


@triton.jit
def largest(a, b):
    """The larger of a and b, NaN where either is (where a NaN must not vanish: a rounding's scale)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _normalize(v, n, eps):
    """The rows of v [ROWS, BLOCK] float32 (zeros beyond n) divided by their root mean square
    (+ eps), in float32."""
    var = tl.sum(v * v, axis=1) / n
    r = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    return v * r[:, None]


@triton.jit
def norm_rms_kernel(x_ptr, w_ptr, y_ptr, rows, n, eps, d1, d2, s0, s1, s2, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows `program_id` * ROWS ... (x's leading index (i0, i1, i2) over sizes (., d1, d2),
    strides s0-s2) of x normalized into the contiguous rows of y."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i2 = row % d2
    i1 = (row // d2) % d1
    i0 = row // (d2 * d1)
    start = i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2
    cols = tl.arange(0, BLOCK)
    inside = (row < rows)[:, None] & (cols < n)[None, :]
    x = tl.load(x_ptr + start[:, None] + cols[None, :], mask=inside, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0)[None, :]
    normed = cast(_normalize(x.to(tl.float32), n, eps), x.dtype)
    y = cast(w.to(tl.float32) * normed.to(tl.float32), x.dtype)
    tl.store(y_ptr + row.to(tl.int64)[:, None] * n + cols[None, :], y, mask=inside)


@triton.jit
def norm_add_rms_kernel(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, rows, n, eps, sx, sd, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Rows `program_id` * ROWS ...: s = x + d (rounded to x's dtype, as torch adds), y =
    RMSNorm(s) * w; both written as contiguous rows."""
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = (row < rows)[:, None] & (cols < n)[None, :]
    x = tl.load(x_ptr + row[:, None] * sx + cols[None, :], mask=inside, other=0.0)
    d = tl.load(d_ptr + row[:, None] * sd + cols[None, :], mask=inside, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0)[None, :]
    s = cast(x.to(tl.float32) + d.to(tl.float32), x.dtype)
    tl.store(s_ptr + row[:, None] * n + cols[None, :], s, mask=inside)
    normed = cast(_normalize(s.to(tl.float32), n, eps), x.dtype)
    y = cast(w.to(tl.float32) * normed.to(tl.float32), x.dtype)
    tl.store(y_ptr + row[:, None] * n + cols[None, :], y, mask=inside)


def warps(block: int) -> int:
    """Warps for a row of `block` values: about 8 values a thread, 1 to 8 warps."""
    return max(1, min(8, block // 256))


TILE_VALUES = 2048  # values one norm program takes when rows are short (head views): a launch size, not a model size


def tile(n: int) -> tuple[int, int]:
    """(rows a program takes, the row's block): short rows (the heads' values) in tiles of about
    TILE_VALUES values, long ones (the hidden size) one a program."""
    block = triton.next_power_of_2(n)
    return max(1, min(16, TILE_VALUES // block)), block


def leading(x: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """x's leading dimensions (all but the last) merged where contiguous, as three (sizes,
    strides), or None where more than three remain."""
    dims = [(size, stride) for size, stride in zip(x.shape[:-1], x.stride()[:-1]) if size != 1]
    merged: list[tuple[int, int]] = []
    for size, stride in dims:
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) > 3:
        return None
    merged = [(1, 0)] * (3 - len(merged)) + merged
    return [s for s, _ in merged], [t for _, t in merged]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x's rows (last stride 1) by `weight` -> a contiguous tensor of x's shape, or None
    where x's leading dimensions do not fold into three."""
    rows = leading(x)
    if rows is None:
        return None
    (d0, d1, d2), (s0, s1, s2) = rows
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel():
        count = d0 * d1 * d2
        per, block = tile(n)
        norm_rms_kernel[(triton.cdiv(count, per),)](x, weight, y, count, n, eps, d1, d2, s0, s1, s2, ROWS=per,
                                                    BLOCK=block, num_warps=warps(per * block), enable_fp_fusion=False)
    return y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, RMSNorm(x + delta) * weight) for x, delta of one shape (last stride 1) -> two
    contiguous tensors of x's shape, or None where either's rows are not one strided dimension."""
    n = x.shape[-1]
    rows_x, rows_d = leading(x), leading(delta)
    if rows_x is None or rows_d is None or rows_x[0][:2] != [1, 1] or rows_d[0][:2] != [1, 1]:
        return None
    s, y = torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if s.numel():
        count = rows_x[0][2]
        per, block = tile(n)
        norm_add_rms_kernel[(triton.cdiv(count, per),)](x, delta, weight, s, y, count, n, eps, rows_x[1][2],
                                                        rows_d[1][2], ROWS=per, BLOCK=block,
                                                        num_warps=warps(per * block), enable_fp_fusion=False)
    return s, y
