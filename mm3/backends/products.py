"""How a layer multiplies: the rule table that binds one product to each layer, and the products.

A product is a callable `product(x [..., K], bias [N] | None) -> [..., N]` (a list of outputs for a
`Fused` layer) that serves inputs of one dtype on one device. The back ends' binder
(`mm3.backends.binder`) asks `for_linear` / `for_fused` when a layer's weights, copies, adapters,
numerics, CPU form or device change; the layer keeps the answer and forward only calls it. The
rules, first match wins (`_base_for_linear`; `for_fused` stacks the parts where they share one):

  1. adapters to merge (`LowRank.merge`)     -> `FloatWeight` over a float copy with them merged in
  2. held in the GPU's device layout          -> `LayoutProduct` (`gpu.layout_kernels`, `layout_reads`;
                                                 a group of two types: `LayoutSegments`; gate/up
                                                 also `LayoutSwiGLU`, for `Fused.swiglu`)
  3. a GPU kernel reads the GGUF blocks       -> `KernelProduct` (`gpu.kernels`, `kernel_reads`)
  4. a float weight of the dtype at hand      -> `FloatWeight` (weight-major where the CPU form says;
                                                 a copy kept in oneDNN's layout: `cpu.onednn.Product`)
  5. the CPU form's packed kernel (few rows)  -> `ByRows(PackedProduct, per-use)` (`cpu.native`,
                                                 `cpu.int4`; `packed_takes`), the many rows in
                                                 bfloat16 where `Linear.many_rows_bf16` (`Bf16Product`)
  6. otherwise                                -> `FloatWeight` over a dequantization per use

The CPU form of a layer (`cpu.forms`, given by `cpu.choice`'s rule or named by `MM3_CPU_PRODUCT`)
and the GPU kernel family of a weight (`gpu.kernel_choice`'s rule, `MM3_KERNELS`) are this table's
inputs. Adapters attached to a layer (`Linear.low_rank`) run beside whichever product
serves (`WithLowRank`; a `Fused` layer's over its stacked output), so a quantized weight stays
quantized. `KERNELS` is the one registry of kernels that read a packing of their own.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.nn.functional as F

from ..weights.low_rank import LowRank
from .cpu.matmul import DECODE_MAX_ROWS, weight_major_linear
from .cpu import forms as cpu_forms, int4 as cpu_int4, native as cpu_native, onednn as cpu_onednn, steps as cpu_steps
from .gpu import custom_ops, kernels, layout_kernels

Weight = Callable[[], torch.Tensor]  # the weight a product reads, on the input's device


class FloatWeight:
    """torch's product over a float weight in the input's dtype: `major` multiplies few rows
    weight-major (`mm3.backends.cpu.matmul.weight_major_linear`), else `F.linear` (the reference's). `after`
    runs after each product (an int4 layer's blocks read again give back their pages)."""

    def __init__(self, weight: Weight, major: bool, after: Callable[[], None] | None = None):
        self.weight, self.major, self.after = weight, major, after

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight()
        y = weight_major_linear(x, w, bias) if self.major else F.linear(x, w, bias)
        if self.after is not None:
            self.after()
        return y


class Bf16Product:
    """torch's product in bfloat16 over a weight given in bfloat16, for inputs of another float
    dtype (their rows cast, the output cast back, a bias added in the inputs' dtype): the
    many-row products of a layer set to (`Linear.many_rows_bf16`). `after` as `FloatWeight`'s."""

    def __init__(self, weight: Weight, after: Callable[[], None] | None = None):
        self.weight, self.after = weight, after

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight()).to(x.dtype)
        if self.after is not None:
            self.after()
        return y if bias is None else y + bias


class KernelProduct:
    """The fused Triton kernel over the stored weight (GGUF blocks, or floats of another dtype)."""

    def __init__(self, weight: Weight, qtype):
        self.weight, self.qtype = weight, qtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return custom_ops.block_linear(x, self.weight(), self.qtype, bias)


class LayoutProduct:
    """The Triton kernels over the weight held in the device layout (`mm3.backends.gpu.layout_kernels`)."""

    def __init__(self, weight: Weight, qtype, in_features: int):
        self.weight, self.qtype, self.in_features = weight, qtype, in_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return custom_ops.layout_linear(x, self.weight(), self.qtype, self.in_features, bias)

    def fused(self, x: torch.Tensor, norm: tuple | None = None, residual: torch.Tensor | None = None,
              add: torch.Tensor | None = None) -> torch.Tensor:
        """The product of x RMS-normalized by `norm` (weight, eps), plus `residual`, with rows `add`
        added to the rows normalized or to the residual, in one launch for decode-shaped inputs
        (`layout_kernels.linear`)."""
        return layout_kernels.linear(x, self.weight(), self.qtype, self.in_features, norm=norm, residual=residual,
                                     add=add)


KERNELS = {"int4": cpu_int4, "native": cpu_native}  # a CPU kernel (`cpu_forms.PACKED`) -> its module


class PackedProduct:
    """A CPU kernel's product (`kernel`: "int4", torch's int4 product over the `cpu_int4` planes;
    "native", the `cpu_native` integer kernel) over the weight packed for it, made at the first call
    (a replay that only multiplies many rows never packs) or by `ready`, then held: a call then
    reads nothing but its tensors, so a compiled step traces it whole."""

    def __init__(self, kernel: str, packing: Callable[[str], object], out_features: int):
        self.kernel, self.packing, self.out_features = kernel, packing, out_features
        self.packed = self.bound = None

    def ready(self) -> None:
        if self.packed is None:
            self.packed = self.packing(self.kernel)
            bind = getattr(KERNELS[self.kernel], "bind", None)  # the packing checked once, where the kernel can
            self.bound = bind(self.packed, self.out_features) if bind else None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is None:
            self.ready()
        if self.bound is not None:
            return self.bound(x, bias)
        return KERNELS[self.kernel].linear(x, self.packed, self.out_features, bias)


class ByRows:
    """Decode-shaped inputs (up to `DECODE_MAX_ROWS` rows) to `decode`, wider ones (a prefill) to `wide`."""

    def __init__(self, decode, wide):
        self.decode, self.wide = decode, wide

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None):
        few = x.numel() <= DECODE_MAX_ROWS * x.shape[-1]
        return (self.decode if few else self.wide)(x, bias)


class WithLowRank:
    """`base(x, bias) + (x A^T) B^T`: attached adapters beside the product that serves the weight.
    `down_t` A^T [in, R] and each block's B^T [r, n] are held contiguous (a few rows multiply
    them row-major, faster on the CPU than A and B as stored); `blocks` ((first,
    last output column, first, last rank, B^T), ...): each up factor adds into its own columns of
    the output (a `Fused` layer's parts, over its stacked output), in place."""

    def __init__(self, base, down_t: torch.Tensor, blocks: list[tuple]):
        self.base, self.down_t, self.blocks = base, down_t, blocks

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.base(x, bias)
        y2 = y.reshape(-1, y.shape[-1])  # a view of the product's fresh output, or a copy of it
        t = torch.mm(x.reshape(-1, x.shape[-1]), self.down_t)
        for c0, c1, r0, r1, up_t in self.blocks:
            y2[:, c0:c1].addmm_(t[:, r0:r1], up_t)
        return y2.view(y.shape)


def ready(product) -> None:
    """Make now what `product` (any product of this module, wrapped or not) would make at its
    first call: a step about to be compiled then only calls it."""
    if isinstance(product, PackedProduct):
        product.ready()
    for inner in (getattr(product, name, None) for name in ("decode", "wide", "product", "base")):
        if inner is not None:
            ready(inner)


def side_product(base, low_ranks: list[LowRank | None], sizes: list[int], dtype: torch.dtype,
                 device: torch.device) -> WithLowRank:
    """`base` (over the outputs of `sizes` rows each, stacked) with each part's adapters beside it."""
    downs, blocks, row, rank = [], [], 0, 0
    for low_rank, n in zip(low_ranks, sizes):
        if low_rank is not None:
            down, up = low_rank.side(dtype, device)
            downs.append(down)
            blocks.append((row, row + n, rank, rank + down.shape[0], up.t().contiguous()))
            rank += down.shape[0]
        row += n
    return WithLowRank(base, torch.cat(downs).t().contiguous(), blocks)


class LayoutSegments:
    """The layout kernels over two weights of different types stacked by their outputs, in one
    launch (`mm3.backends.gpu.layout_kernels.linear_segments`): a q/k/v group whose v has another type."""

    def __init__(self, segments: list[tuple], in_features: int):
        (self.qtype, self.weight), (self.qtype2, self.weight2) = segments
        self.in_features = in_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return custom_ops.layout_segments(x, self.weight(), self.weight2(), self.qtype, self.qtype2,
                                          self.in_features, bias)

    def fused(self, x: torch.Tensor, norm: tuple | None = None, residual: torch.Tensor | None = None,
              add: torch.Tensor | None = None) -> torch.Tensor:
        """As `LayoutProduct.fused`."""
        return layout_kernels.linear_segments(x, [(self.weight(), self.qtype), (self.weight2(), self.qtype2)],
                                              self.in_features, norm=norm, residual=residual, add=add)


class LayoutSwiGLU:
    """`silu(gate) * up` of a (gate, up) group held in the device layout, from one launch
    (`mm3.backends.gpu.layout_kernels.swiglu`)."""

    def __init__(self, weight: Weight, qtype, in_features: int):
        self.weight, self.qtype, self.in_features = weight, qtype, in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return custom_ops.layout_swiglu(x, self.weight(), self.qtype, self.in_features)

    def fused(self, x: torch.Tensor, norm: tuple | None = None) -> torch.Tensor:
        """`silu(gate) * up` of x RMS-normalized by `norm` (weight, eps), in one launch for
        decode-shaped inputs (`layout_kernels.swiglu`)."""
        return layout_kernels.swiglu(x, self.weight(), self.qtype, self.in_features, norm=norm)


class Split:
    """One product over stacked weight rows, split into each part's output; `swiglu`, where set,
    gives `silu(first) * second` of a two-part group from one product (`Fused.swiglu`)."""

    def __init__(self, product, sizes: list[int], swiglu=None):
        self.product, self.sizes, self.swiglu = product, sizes, swiglu

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
    layout on `device` (`mm3.backends.gpu.placement`), no float copy of `dtype` is kept there, and the
    kernels compute right for `dtype` inputs."""
    if layer.form("weight") != "layout" or not layer.fused_kernels or layer.keeps_copy(dtype, device):
        return False
    return layer.stored("weight").device == device and layout_kernels.works(layer.qtype("weight"), dtype, device)


def many_rows_bf16(layer, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this `Linear`'s products over many rows multiply in bfloat16: it is set to
    (`Linear.many_rows_bf16`, in the fast numerics) and its float32 inputs are on the CPU."""
    return (layer.many_rows_bf16 and layer.decode_products and dtype == torch.float32 and device.type == "cpu")


def packed_takes(layer, dtype: torch.dtype, device: torch.device) -> str | None:
    """The CPU kernel over a packing ("int4", "native") that this `Linear`'s decode-shaped products
    on `device` go to (its form, `cpu_forms.packed_kernel`, with no kept float copy and the weight
    on the CPU), or None."""
    if layer.form("weight") is not None:
        return None
    kernel = cpu_forms.packed_kernel(layer, layer.qtype("weight"), device)
    if kernel is None or layer.keeps_copy(dtype, device) or layer.stored("weight").device.type != "cpu":
        return None
    return kernel


def for_linear(layer, dtype: torch.dtype, device: torch.device):
    """The product of a `mm3.weights.layers.Linear` for inputs of `dtype` on `device`, with its attached
    adapters (`layer.low_rank`) beside it or merged into a float copy."""
    low_rank = layer.low_rank
    if low_rank is not None and low_rank.merge:
        merged = low_rank.merged(layer.get("weight", dtype, device))
        return FloatWeight(lambda: merged, cpu_forms.weight_major(layer, device))
    product = _base_for_linear(layer, dtype, device)
    return product if low_rank is None else side_product(product, [low_rank], [layer.out_features], dtype, device)


def _base_for_linear(layer, dtype: torch.dtype, device: torch.device):
    qtype = layer.qtype("weight")
    stored = layer.stored("weight")
    if layout_reads(layer, dtype, device):
        return LayoutProduct(lambda: stored, qtype, layer.in_features)
    if kernel_reads(layer, dtype, device):
        return KernelProduct(_resident(stored, device) or (lambda: layer.fetch("weight", device)), qtype)
    kept = layer.kept_copy(dtype, device)
    if cpu_onednn.is_laid_out(kept):
        return cpu_onednn.Product(kept)
    major = cpu_forms.weight_major(layer, device)
    at_hand = layer.float_at_hand(dtype, device)
    if at_hand is not None:
        return FloatWeight(lambda: at_hand, major)
    per_use = FloatWeight(lambda: layer.get("weight", dtype, device, scratch=True), major, after=layer.blocks_read)
    wide = per_use
    if many_rows_bf16(layer, dtype, device):
        wide = Bf16Product(lambda: layer.get("weight", torch.bfloat16, device, scratch=True), after=layer.blocks_read)
    kernel = packed_takes(layer, dtype, device)
    if kernel is not None:
        return ByRows(PackedProduct(kernel, layer.packing, layer.out_features), wide)
    return per_use if wide is per_use else ByRows(per_use, wide)


def for_fused(fused, dtype: torch.dtype, device: torch.device):
    """The product of a `mm3.weights.layers.Fused` for inputs of `dtype` on `device`; the parts' attached
    adapters beside each stacked product (a part's own product carries its own), or each part its
    own product where one is merged."""
    parts = fused.parts
    low_ranks = [p.low_rank for p in parts]
    if not fused.fuse or any(r is not None and r.merge for r in low_ranks):
        return Separate(parts)

    plain = all(r is None for r in low_ranks)

    def split(product):  # the stacked product, with the parts' adapters beside it, split into the parts
        return Split(product if plain else side_product(product, low_ranks, fused.sizes, dtype, device), fused.sizes)

    qtype = parts[0].qtype("weight")
    same = all(p.qtype("weight") == qtype for p in parts)
    held = [layout_reads(p, dtype, device) for p in parts]
    if all(held) and same:
        source = fused.stacked_stored_source(device)
        product = split(LayoutProduct(source, qtype, fused.in_features))
        if plain and len(parts) == 2 and fused.sizes[0] == fused.sizes[1] and \
                layout_kernels.fused_works("swiglu", qtype, dtype, device):
            product.swiglu = LayoutSwiGLU(source, qtype, fused.in_features)
        return product
    if all(held):  # two runs of types (q, k of one, v of another): one launch; more, each part its own
        segments = fused.segment_sources(device)
        if len(segments) == 2 and layout_kernels.fused_works("segments", segments[0][0], dtype, device,
                                                             segments[1][0]):
            return split(LayoutSegments(segments, fused.in_features))
    if any(p.form("weight") is not None for p in parts):  # a part in the layout among others (another type,
        return Separate(parts)  # another kernel family): each its own product, never a stack dequantized per call
    if kernels.available(device.type) and same and all(kernel_reads(p, dtype, device) for p in parts):
        return split(KernelProduct(fused.stacked_stored_source(device), qtype))
    packed = [packed_takes(p, dtype, device) for p in parts]
    floats = split(FloatWeight(fused.stacked_weight_source(dtype, device), cpu_forms.weight_major(parts[0], device),
                               after=fused.blocks_read))
    wide = floats
    if all(many_rows_bf16(p, dtype, device) and p.float_at_hand(dtype, device) is None for p in parts):
        wide = split(Bf16Product(fused.stacked_weight_source(torch.bfloat16, device), after=fused.blocks_read))
    if packed[0] is not None and same and len(set(packed)) == 1:
        return ByRows(split(PackedProduct(packed[0], fused.packing, sum(fused.sizes))), wide)
    if any(packed):  # a mix raised some parts to another type (v_proj in Q6_K): each part its own way
        return ByRows(Separate(parts), wide)
    return floats if wide is floats else ByRows(floats, wide)


def native_parts(product, dtype: torch.dtype, device: torch.device) -> list | None:
    """The native integer kernel's bound products (`cpu_native.Bound`) that serve a layer's
    decode-shaped inputs: the stacked packing's one, or each part's own where the parts multiply
    apart; None where anything else serves (another kernel or form, adapters beside it, a float
    copy). A block made of such layers can then run whole in the kernel library."""
    if isinstance(product, ByRows):
        product = product.decode
    if isinstance(product, Split):
        product = product.product
    if isinstance(product, Separate):
        out = []
        for part in product.parts:
            got = native_parts(part.product_for(dtype, device), dtype, device)
            if got is None:
                return None
            out += got
        return out
    if isinstance(product, PackedProduct) and product.kernel == "native":
        product.ready()
        return None if product.bound is None else [product.bound]
    return None


def layout_block(layers: tuple, dtype: torch.dtype, device: torch.device) -> tuple | None:
    """A block's four layers (q/k/v, out, gate/up, down: `products()` of an LM layer or depth
    block) as the products a back end's whole decode step launches with their norm and residual
    inside (`fused`): (q/k/v stacked, out, gate/up's SwiGLU, down), or None where any of them is
    not held in the device layout as one product (adapters beside it, parts apart, another form)
    or the kernels' norm and residual do not compute right there (`layout_kernels.fused_works`)."""
    qkv, out, gate_up, down = (layer.product_for(dtype, device) for layer in layers)
    stacked = qkv.product if isinstance(qkv, Split) else None
    swiglu = gate_up.swiglu if isinstance(gate_up, Split) else None
    if not isinstance(stacked, (LayoutProduct, LayoutSegments)) or not isinstance(swiglu, LayoutSwiGLU) or \
            not isinstance(out, LayoutProduct) or not isinstance(down, LayoutProduct):
        return None
    qtypes = {stacked.qtype, getattr(stacked, "qtype2", stacked.qtype), out.qtype, swiglu.qtype, down.qtype}
    if not all(layout_kernels.fused_works("norm", qtype, dtype, device) for qtype in qtypes):
        return None
    return stacked, out, swiglu, down


def native_blocks(held: tuple | None, blocks: list[tuple], dtype: torch.dtype, device: torch.device) -> tuple:
    """Blocks of layers (each block's layers with products in their order of use) as the kernel
    library reads them: (the products chosen, held weakly, and their `cpu_steps.BlockParts`, or None
    where anything but the native kernel serves one of them). `held`, the pair made before, is
    returned while every layer keeps the product it had and every part is still there."""
    chosen = [layer.product_for(dtype, device) for block in blocks for layer in block]
    if held is not None and len(held[0]) == len(chosen) and all(ref() is c for ref, c in zip(held[0], chosen)) and \
            (held[1] is None or held[1].alive()):
        return held
    refs = tuple(weakref.ref(product) for product in chosen)
    parts = [native_parts(product, dtype, device) for product in chosen]
    if None in parts or not parts:
        return refs, None
    per = len(blocks[0])
    return refs, cpu_steps.BlockParts([parts[i:i + per] for i in range(0, len(parts), per)])


def _resident(stored: torch.Tensor, device: torch.device) -> Weight | None:
    return (lambda: stored) if stored.device == device else None
