"""Kept bfloat16 copies of weights in oneDNN's own layout on the CPU, and their product.

A kept copy serves many products (the DiT reads every weight twice a step). torch's bfloat16
product over a plain weight has oneDNN lay the weight out for its kernel at every call and, with a
bias, copy the bias into the output first; a copy kept already in oneDNN's layout
(`torch.ops.mkldnn._reorder_linear_weight`) is multiplied as it is, the bias added in the kernel
(`_linear_pointwise`): the same bits, in less time. Taken only where a once-per-process check finds
those bits equal to `F.linear`'s (`works`); elsewhere the plain copy serves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS_HINT = 1024  # the rows oneDNN lays a weight out for: a DiT window's order (any count is multiplied)
PROBE_ROWS = (1, 7, 300)  # the row counts of the check: a decode step's, a few, many
_WORKS: list[bool] = []


def _ops():
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None), \
        getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)


def works() -> bool:
    """Whether this torch lays out and multiplies bfloat16 weights in oneDNN's layout with the bits
    of `F.linear` over the plain weight (checked once per process, with and without a bias)."""
    if not _WORKS:
        ok = False
        product, reorder = _ops()
        if product is not None and reorder is not None and torch.backends.mkldnn.is_available():
            g = torch.Generator().manual_seed(0)
            w = torch.randn(48, 96, generator=g).to(torch.bfloat16)
            b = torch.randn(48, generator=g).to(torch.bfloat16)
            try:
                packed = reorder(w, ROWS_HINT)
                ok = True
                for rows in PROBE_ROWS:
                    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
                    for bias in (None, b):
                        ok = ok and torch.equal(product(x, packed, bias, "none", [], ""), F.linear(x, w, bias))
            except (RuntimeError, TypeError, ValueError):
                ok = False
        _WORKS.append(ok)
    return _WORKS[0]


def laid_out(value: torch.Tensor) -> torch.Tensor:
    """A kept copy `value` [n, k] in oneDNN's layout where it serves (a bfloat16 CPU weight, `works`),
    else `value` as it is."""
    if value.device.type != "cpu" or value.dtype != torch.bfloat16 or value.dim() != 2 or not works():
        return value
    return _ops()[1](value.contiguous(), ROWS_HINT)


def is_laid_out(value: torch.Tensor | None) -> bool:
    """Whether a kept copy is in oneDNN's layout (`laid_out`), which only `Product` reads."""
    return value is not None and value.layout == torch._mkldnn


class Product:
    """x [..., k] @ W.T (+ bias) in bfloat16 over a weight in oneDNN's layout (`laid_out`)."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.multiply = weight, _ops()[0]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.multiply(x if x.is_contiguous() else x.contiguous(), self.weight, bias, "none", [], "")
