"""The Triton products and the embedding rows' dequantization as torch custom ops
(`torch.ops.mm3.layout_linear`, `layout_segments`, `layout_swiglu`, `block_linear`, `dequantize`), so
`torch.compile(fullgraph=True)` traces a model through them as single nodes; an eager call goes to
the function directly (a custom op's dispatch costs microseconds, a decode step makes hundreds)."""

from __future__ import annotations

from typing import Optional

import torch
from gguf import GGMLQuantizationType as QT


@torch.library.custom_op("mm3::layout_linear", mutates_args=())
def _layout_linear(x: torch.Tensor, weight: torch.Tensor, qtype: int, k: int,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    from . import layout_kernels

    return layout_kernels.linear(x, weight, QT(qtype), k, bias)


@_layout_linear.register_fake
def _(x, weight, qtype, k, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("mm3::layout_segments", mutates_args=())
def _layout_segments(x: torch.Tensor, weight: torch.Tensor, weight2: torch.Tensor, qtype: int, qtype2: int, k: int,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    from . import layout_kernels

    return layout_kernels.linear_segments(x, [(weight, QT(qtype)), (weight2, QT(qtype2))], k, bias)


@_layout_segments.register_fake
def _(x, weight, weight2, qtype, qtype2, k, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0] + weight2.shape[0]))


def layout_segments(x: torch.Tensor, weight: torch.Tensor, weight2: torch.Tensor, qtype: QT, qtype2: QT, k: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """`layout_kernels.linear_segments` of two weights, as a custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        return torch.ops.mm3.layout_segments(x, weight, weight2, int(qtype), int(qtype2), k, bias)
    from . import layout_kernels

    return layout_kernels.linear_segments(x, [(weight, qtype), (weight2, qtype2)], k, bias)


@torch.library.custom_op("mm3::layout_swiglu", mutates_args=())
def _layout_swiglu(x: torch.Tensor, weight: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    from . import layout_kernels

    return layout_kernels.swiglu(x, weight, QT(qtype), k)


@_layout_swiglu.register_fake
def _(x, weight, qtype, k):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def layout_swiglu(x: torch.Tensor, weight: torch.Tensor, qtype: QT, k: int) -> torch.Tensor:
    """`layout_kernels.swiglu`, as a custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        return torch.ops.mm3.layout_swiglu(x, weight, int(qtype), k)
    from . import layout_kernels

    return layout_kernels.swiglu(x, weight, qtype, k)


@torch.library.custom_op("mm3::block_linear", mutates_args=())
def _block_linear(x: torch.Tensor, weight: torch.Tensor, qtype: int,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    from . import kernels

    return kernels.fused_linear(x, weight, QT(qtype), bias)


@_block_linear.register_fake
def _(x, weight, qtype, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def layout_linear(x: torch.Tensor, weight: torch.Tensor, qtype: QT, k: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`layout_kernels.linear`, as a custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        return torch.ops.mm3.layout_linear(x, weight, int(qtype), k, bias)
    from . import layout_kernels

    return layout_kernels.linear(x, weight, qtype, k, bias)


def block_linear(x: torch.Tensor, weight: torch.Tensor, qtype: QT, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.fused_linear`, as a custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        return torch.ops.mm3.block_linear(x, weight, int(qtype), bias)
    from . import kernels

    return kernels.fused_linear(x, weight, qtype, bias)


@torch.library.custom_op("mm3::dequantize", mutates_args=())
def _dequantize(raw: torch.Tensor, qtype: int, rows: int, row_len: int, dtype: torch.dtype) -> torch.Tensor:
    from ...formats.gguf.quants import dequantize as dequantize_blocks

    return dequantize_blocks(raw, QT(qtype), (rows, row_len), dtype).clone()


@_dequantize.register_fake
def _(raw, qtype, rows, row_len, dtype):
    return raw.new_empty((rows, row_len), dtype=dtype)


def dequantize(raw: torch.Tensor, qtype: QT, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """`quants.dequantize` of [rows, row_len] (an embedding lookup's rows), as a custom op while
    torch.compile traces (its checks read storage offsets, which a trace cannot)."""
    if torch.compiler.is_compiling():
        return torch.ops.mm3.dequantize(raw, int(qtype), int(shape[0]), int(shape[1]), dtype)
    from ...formats.gguf.quants import dequantize as dequantize_blocks

    return dequantize_blocks(raw, qtype, shape, dtype)
