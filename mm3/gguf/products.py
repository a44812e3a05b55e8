"""How a layer multiplies: one product strategy per layer, chosen when its weights or numerics change.

A product is a callable `product(x [..., K], bias [N] | None) -> [..., N]` (a list of outputs for a
`Fused` layer) that serves inputs of one dtype on one device. `choose(layer, dtype, device)`
picks it from what the layer holds at that moment: a float weight at hand (`FloatWeight`: a kept
copy or a stored float of that dtype), the Triton kernels over the device layout the weight was
placed in (`LayoutProduct`, `mm3.gguf.placement`), the Triton kernel reading the GGUF blocks
(`KernelProduct`), the CPU int4 planes for decode-shaped inputs (`Int4Product` within `ByRows`),
or a dequantization per use (`FloatWeight` over a fresh weight each time). The layer keeps the
choice until its weights are filled or moved, float copies are kept or dropped, or its numerics
change (`Linear.decode_products`, `Linear.fused_kernels`, `Fused.fuse`); forward only calls it.

Another product (a measured CPU form, a LoRA side product) is one more class with that call
signature, returned by `choose`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..matmul import DECODE_MAX_ROWS, decode_linear
from . import cpu_int4, custom_ops, kernels, layout_kernels

Weight = Callable[[], torch.Tensor]  # the weight a product reads, on the input's device


class FloatWeight:
    """torch's product over a float weight in the input's dtype: `decode` takes the fastest form
    for few rows (`mm3.matmul.decode_linear`), else `F.linear` (the reference's). `after` runs
    after each product (an int4 layer's blocks read again give back their pages)."""

    def __init__(self, weight: Weight, decode: bool, after: Callable[[], None] | None = None):
        self.weight, self.decode, self.after = weight, decode, after

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight()
        y = decode_linear(x, w, bias) if self.decode else F.linear(x, w, bias)
        if self.after is not None:
            self.after()
        return y


class KernelProduct:
    """The fused Triton kernel over the stored weight (GGUF blocks, or floats of another dtype)."""

    def __init__(self, weight: Weight, qtype):
        self.weight, self.qtype = weight, qtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return custom_ops.block_linear(x, self.weight(), self.qtype, bias)


class LayoutProduct:
    """The Triton kernels over the weight held in the device layout (`mm3.gguf.layout_kernels`)."""

    def __init__(self, weight: Weight, qtype, in_features: int):
        self.weight, self.qtype, self.in_features = weight, qtype, in_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return custom_ops.layout_linear(x, self.weight(), self.qtype, self.in_features, bias)


class Int4Product:
    """torch's CPU int4 product over the weight's `cpu_int4` packing (made on first use)."""

    def __init__(self, packing: Callable[[], cpu_int4.Packing], out_features: int):
        self.packing, self.out_features = packing, out_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_int4.linear(x, self.packing(), self.out_features, bias)


class ByRows:
    """Decode-shaped inputs (up to `DECODE_MAX_ROWS` rows) to `decode`, wider ones (a prefill) to `wide`."""

    def __init__(self, decode, wide):
        self.decode, self.wide = decode, wide

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None):
        few = x.numel() <= DECODE_MAX_ROWS * x.shape[-1]
        return (self.decode if few else self.wide)(x, bias)


class Split:
    """One product over stacked weight rows, split into each part's output."""

    def __init__(self, product, sizes: list[int]):
        self.product, self.sizes = product, sizes

    def __call__(self, x: torch.Tensor, bias: None = None) -> list[torch.Tensor]:
        return self.product(x).split_with_sizes(self.sizes, dim=-1)


class Separate:
    """Each part its own product (the reference's op shapes, or parts of mixed kinds)."""

    def __init__(self, parts):
        self.parts = parts

    def __call__(self, x: torch.Tensor, bias: None = None) -> list[torch.Tensor]:
        return [p(x) for p in self.parts]


def kernel_reads(layer, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel computes this `Linear`'s product for inputs of `dtype` on `device`: it
    runs there and reads the type, and no float weight of that dtype is at hand (a kept copy, or a
    float tensor already in that dtype, goes to torch's product)."""
    qtype = layer.qtype("weight")
    if not layer.fused_kernels or qtype is None or layer.form("weight") is not None or \
            not kernels.available(device.type):
        return False
    if (qtype in kernels.FLOAT_DTYPES and kernels.FLOAT_DTYPES[qtype] == dtype) or layer.keeps_copy(dtype, device):
        return False
    return kernels.supports(qtype, layer.in_features) and kernels.works(qtype, dtype, device)


def layout_reads(layer, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the layout kernels compute this `Linear`'s product: its weight is held in the device
    layout on `device` (`mm3.gguf.placement`), no float copy of `dtype` is kept there, and the
    kernels compute right for `dtype` inputs."""
    if layer.form("weight") != "layout" or not layer.fused_kernels or layer.keeps_copy(dtype, device):
        return False
    return layer.stored("weight").device == device and layout_kernels.works(layer.qtype("weight"), dtype, device)


def int4_takes(layer, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this `Linear`'s decode-shaped products on `device` go to the CPU int4 product
    (`cpu_int4.serves`, with no kept float copy and the weight on the CPU)."""
    if layer.form("weight") is not None or not cpu_int4.serves(layer, layer.qtype("weight"), device):
        return False
    return not layer.keeps_copy(dtype, device) and layer.stored("weight").device.type == "cpu"


def for_linear(layer, dtype: torch.dtype, device: torch.device):
    """The product of a `mm3.gguf.ops.Linear` for inputs of `dtype` on `device`."""
    qtype = layer.qtype("weight")
    stored = layer.stored("weight")
    if layout_reads(layer, dtype, device):
        return LayoutProduct(lambda: stored, qtype, layer.in_features)
    if kernel_reads(layer, dtype, device):
        return KernelProduct(_resident(stored, device) or (lambda: layer.fetch("weight", device)), qtype)
    at_hand = layer.float_at_hand(dtype, device)
    if at_hand is not None:
        return FloatWeight(lambda: at_hand, layer.decode_products)
    per_use = FloatWeight(lambda: layer.get("weight", dtype, device, scratch=True), layer.decode_products,
                          after=layer.blocks_read)
    if int4_takes(layer, dtype, device):
        return ByRows(Int4Product(layer.packing, layer.out_features), per_use)
    return per_use


def for_fused(fused, dtype: torch.dtype, device: torch.device):
    """The product of a `mm3.gguf.ops.Fused` for inputs of `dtype` on `device`."""
    parts = fused.parts
    if not fused.fuse:
        return Separate(parts)
    qtype = parts[0].qtype("weight")
    same = all(p.qtype("weight") == qtype for p in parts)
    if all(layout_reads(p, dtype, device) for p in parts):  # a mix of types: each part its own product
        return Split(LayoutProduct(fused.stacked_stored_source(device), qtype, fused.in_features), fused.sizes) \
            if same else Separate(parts)
    if kernels.available(device.type) and same and all(kernel_reads(p, dtype, device) for p in parts):
        return Split(KernelProduct(fused.stacked_stored_source(device), qtype), fused.sizes)
    int4 = [int4_takes(p, dtype, device) for p in parts]
    wide = Split(FloatWeight(fused.stacked_weight_source(dtype, device), parts[0].decode_products,
                             after=fused.blocks_read), fused.sizes)
    if all(int4) and same:
        return ByRows(Split(Int4Product(fused.packing, sum(fused.sizes)), fused.sizes), wide)
    if any(int4):  # a mix raised some parts to another type (v_proj in Q6_K): each part its own way
        return ByRows(Separate(parts), wide)
    return wide


def _resident(stored: torch.Tensor, device: torch.device) -> Weight | None:
    return (lambda: stored) if stored.device == device else None
