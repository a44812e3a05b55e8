"""The operations seam: layers whose weights stay GGUF-compressed until they are used.

Every weight is a parameter (never trained) holding either the raw block bytes of a quantized
tensor, as uint8 rows [rows, row_bytes] (a GGUF row is whole blocks, so a row range is a byte
range), or the float tensor of an F32/F16/BF16 one in its own shape. The GGML type and the logical
shape are kept on the layer. Each use moves the weight to the input's device (a no-op once it is
there) and dequantizes it to the input's dtype, so a model works whatever part of it a memory
manager left on the CPU. Models are written against these classes only (another implementation,
a ComfyUI cast layer, is a subclass passed as `ops`). How a `Linear` or `Fused` multiplies (a
float copy, a back end's kernel, a dequantization per use) is its product, bound by the back ends'
binder (`mm3.weights.binding`) when its weights, numerics or CPU form change, not on each call.

Memory: weights built from a file are views of its mapping (their "home"). Moving a layer back to
the home's device and dtype puts the home view back instead of copying device memory to the host
(`mm3.weights.slots.WeightSlots._apply`), so unloading a model costs nothing and leaves no anonymous copy behind.

Dequantizing on every use costs a full write and read of the float weight. Where memory allows,
float copies are kept and used instead (`mm3.weights.copies`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..formats.gguf.errors import ComponentError
from ..formats.gguf.quants import dequantize
from ..formats.gguf.reader import CompressedTensor
from .binding import binder, indexed_device
from .low_rank import LowRank
from .scratch import CPU_SCRATCH
from .slots import FLOAT_TYPES, WeightSlots

class _Setting:
    """A layer setting whose change makes the layer choose its product again (`_changed`);
    `convert` makes the stored value (a flag by default)."""

    def __init__(self, convert=bool):
        self.convert = convert

    def __set_name__(self, owner, name):
        self.key = "_" + name

    def __get__(self, layer, owner=None):
        return self if layer is None else layer.__dict__[self.key]

    def __set__(self, layer, value) -> None:
        value = self.convert(value)
        if self.key not in layer.__dict__ or layer.__dict__[self.key] != value:
            layer.__dict__[self.key] = value
            layer._changed()


class Linear(WeightSlots):
    """`forward(x [..., in]) -> [..., out]` through the layer's product (`mm3.backends.products`),
    chosen on the first use after the weights, their copies or these settings change.
    `decode_products`: few-row products on the CPU in the layer's `cpu_form` (the int4 product,
    float copies, weight-major; `mm3.backends.cpu.forms`); off, every product is `F.linear` (the reference's).
    `fused_kernels`: where `mm3.backends.gpu.kernels` runs, products read the GGUF blocks directly (off:
    dequantize, then multiply, as the reference's op shapes).
    `cpu_form`: how few-row products read the weight on the CPU (a `cpu_forms.Serving`; None:
    `cpu_forms.DEFAULT`).
    `many_rows_bf16`: with `decode_products`, float32 products over more rows than a frame's
    (`mm3.backends.cpu.matmul.DECODE_MAX_ROWS`: a prefill, a replay) on the CPU multiply in bfloat16 where the
    weight has no float copy at hand (`mm3.backends.cpu.bf16.many_rows_bf16` decides; off: float32)."""

    decode_products = _Setting()
    fused_kernels = _Setting()
    cpu_form = _Setting(lambda serving: serving)
    many_rows_bf16 = _Setting()

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.decode_products, self.fused_kernels, self.cpu_form, self.many_rows_bf16 = False, True, None, False
        self._product: tuple | None = None  # (input dtype, device, product)
        self._packing: dict = {}  # kernel ("int4", "native") -> the weight packed for it, once made
        self._pages: list = []  # the weight's file pages, once looked up
        self.low_rank: LowRank | None = None  # attached adapters (`set_low_rank`)
        self.declare("weight", out_features, in_features)
        self.has_bias = bias
        if bias:
            self.declare("bias", out_features)

    def _changed(self, weights: bool = False) -> None:
        super()._changed(weights)
        self._product = None
        if weights:
            self._packing, self._pages = {}, []

    def set_low_rank(self, low_rank: LowRank | None) -> None:
        """Attach adapters' low-rank terms beside the weight (None: none); the product is chosen again."""
        self.low_rank = low_rank
        self._changed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.get("bias", x.dtype, x.device) if self.has_bias else None
        return self.product_for(x.dtype, x.device)(x, b)

    def product_for(self, dtype: torch.dtype, device: torch.device):
        """The product that serves inputs of `dtype` on `device` (chosen now if it is not)."""
        chosen = self._product
        if chosen is None or chosen[0] != dtype or chosen[1] != device:
            chosen = self.choose(dtype, device)
        return chosen[2]

    def chosen_product(self):
        """The product chosen and held (a callable from the back end), None until the next use
        chooses one (after the weights, copies, adapters, numerics or device changed)."""
        return None if self._product is None else self._product[2]

    def packings(self) -> dict:
        """The weight's packings held for back-end kernels, by kernel name ("int4", "native")."""
        return dict(self._packing)

    def choose(self, dtype: torch.dtype, device: torch.device) -> tuple:
        """Choose the product for inputs of `dtype` on `device` (what the first such use does)."""
        if self.qtype("weight") is None:
            raise ComponentError(f"{type(self).__name__}.weight was never loaded")
        device = indexed_device(device)
        self._product = (dtype, device, binder().linear(self, dtype, device))
        return self._product

    def packing(self, kernel: str = "int4"):
        """The weight packed for a back end's `kernel`, made on first use (its file pages then
        given back)."""
        if kernel not in self._packing:
            self._packing[kernel] = binder().packing(kernel, self.stored("weight"), self.qtype("weight"),
                                                     self.out_features, self.in_features)
            self.give_back_pages()
        return self._packing[kernel]

    def blocks_read(self) -> None:
        """After a product that read the blocks again (a prefill): the packed products will not."""
        if self._packing:
            self.give_back_pages()

    def drop_packing(self, keep: str | None = None) -> None:
        """Free the packings but `keep`'s (another form serves), with the product that holds them;
        both are made again if that kernel returns."""
        if set(self._packing) - {keep}:
            self._packing = {k: v for k, v in self._packing.items() if k == keep}
            self._product = None

    def give_back_pages(self) -> None:
        """Unmap the weight's file pages once it is packed for a kernel that reads the packing
        alone (the back end keeps where they lie in `_pages`, looked up once per weight)."""
        binder().release_pages(self)

    def rows(self, start: int, stop: int) -> "Linear":
        """A Linear of weight rows [start, stop): views of this layer's tensors, nothing copied."""
        out = type(self)(self.in_features, stop - start, bias=self.has_bias)
        out.decode_products, out.fused_kernels, out.cpu_form = self.decode_products, self.fused_kernels, self.cpu_form
        out.many_rows_bf16 = self.many_rows_bf16
        for name in ("weight", "bias") if self.has_bias else ("weight",):
            out.set_stored(name, self._slot_types[name], self.stored(name)[start:stop])
            if name in self._forms:  # a layout's rows are the rows of its planes
                out._forms[name] = self._forms[name]
        return out


def adjacent(tensors: list[torch.Tensor]) -> bool:
    """True when the tensors are consecutive contiguous pieces of one storage."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset or t.dtype != first.dtype or t.device != first.device):
            return False
        offset += t.numel()
    return True


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The row-wise concatenation of adjacent 2-D tensors, as a view."""
    n = sum(t.shape[0] for t in tensors)
    first = tensors[0]
    return first.as_strided((n, first.shape[1]), (first.shape[1], 1), first.storage_offset())


class Fused:
    """Linear layers that share their input (q, k, v; gate, up): `fused(x) -> one output per part`.

    Not a module: the parts stay children of their own parents under their file names (so a state
    dict, a memory manager and `load_tensors` see the GGUF names); this only runs them, through a
    product (`mm3.backends.products`) chosen again when a part changes (its `version`) or `fuse` is
    set. With `fuse` the parts run as one product over their stacked weight rows: float weights
    resident on the input's device are stacked once and each part's weight becomes a view of the
    stack (its file view stays its home); otherwise the parts are written into one temporary
    buffer per use (dequantized, or copied from wherever a memory manager left them), so the
    numbers do not depend on where the weights live. Without `fuse` every part keeps its own
    product: the op shapes, hence the numerics, of the reference."""

    def __init__(self, parts: list[Linear], fuse: bool = True):
        self.parts = list(parts)
        self.fusable = len(parts) > 1 and not any(p.has_bias for p in parts) and \
            len({p.in_features for p in parts}) == 1
        self.sizes = [p.out_features for p in parts]
        self.in_features = parts[0].in_features
        self._product: tuple | None = None  # (input dtype, device, parts' versions, product)
        self._packing: dict = {}  # kernel -> (where the parts' blocks lie, their packing for it)
        self.fuse = fuse

    @property
    def fuse(self) -> bool:
        return self._fuse

    @fuse.setter
    def fuse(self, on: bool) -> None:
        self._fuse = bool(on) and self.fusable
        self._product = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if not self._fuse:
            return [p(x) for p in self.parts]
        return self.product_for(x.dtype, x.device)(x)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of a (gate, up) group: from the stacked product in one launch where it
        offers that (`swiglu`), else `F.silu` and the product over the parts' outputs."""
        if self._fuse:
            one = getattr(self.product_for(x.dtype, x.device), "swiglu", None)
            if one is not None:
                return one(x)
        gate, up = self(x)
        return F.silu(gate) * up

    def product_for(self, dtype: torch.dtype, device: torch.device):
        """The product that serves inputs of `dtype` on `device` (chosen now if it is not); without
        `fuse`, each part's own."""
        if not self._fuse:
            return binder().separate(self.parts)
        versions = tuple(p.version for p in self.parts)
        chosen = self._product
        if chosen is None or chosen[0] != dtype or chosen[1] != device or chosen[2] != versions:
            chosen = self.choose(dtype, device)
        return chosen[3]

    def chosen_product(self):
        """The stacked product chosen and held, None until the next use chooses one."""
        return None if self._product is None else self._product[3]

    def packings(self) -> dict:
        """The parts' stacked packings held for back-end kernels, by kernel name."""
        return {kernel: held[1] for kernel, held in self._packing.items()}

    def choose(self, dtype: torch.dtype, device: torch.device) -> tuple:
        """Choose the product for inputs of `dtype` on `device` (what the first such use does)."""
        device = indexed_device(device)
        product = binder().fused(self, dtype, device)  # may restack the parts
        self._product = (dtype, device, tuple(p.version for p in self.parts), product)
        return self._product

    def packing(self, kernel: str = "int4"):
        """The parts' blocks as one packing for a back end's `kernel`, made once while the parts keep
        their weights."""
        stored = [p.stored("weight") for p in self.parts]
        key = tuple((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) for t in stored)
        held = self._packing.get(kernel)
        if held is None or held[0] != key:
            qtype = self.parts[0].qtype("weight")
            self._packing[kernel] = held = (key, binder().packing(kernel, torch.cat(stored), qtype, sum(self.sizes),
                                                                  self.in_features))
            for p in self.parts:
                p.give_back_pages()
        return held[1]

    def blocks_read(self) -> None:
        """After a stacked product that read the blocks of packed parts again (a prefill)."""
        if self._packing:
            for p in self.parts:
                p.give_back_pages()

    def drop_packing(self, keep: str | None = None) -> None:
        """Free the parts' stacked packings but `keep`'s (another form serves), with the product
        that holds them."""
        if set(self._packing) - {keep}:
            self._packing = {k: v for k, v in self._packing.items() if k == keep}
            self._product = None

    def stacked_weight(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[sum(out), in] in `dtype` on `device`."""
        return self.stacked_weight_source(dtype, torch.device(device))()

    def stacked_weight_source(self, dtype: torch.dtype, device: torch.device):
        """What gives `stacked_weight`: a view kept for the product (the parts' adjacent kept
        copies, or their resident float weights restacked), else a buffer written per use."""
        kept = [p._dequantized.get("weight") for p in self.parts]
        if all(k is not None and k.dtype == dtype and k.device == device for k in kept) and adjacent(kept):
            stack = _stacked(kept)
            return lambda: stack
        stored = [p.stored("weight") for p in self.parts]
        floats = all(p.qtype("weight") in FLOAT_TYPES for p in self.parts)
        if floats and all(s.dtype == dtype and s.device == device for s in stored):
            stack = self._restacked(stored)
            return lambda: stack
        shape = (sum(self.sizes), self.in_features)

        def per_use() -> torch.Tensor:
            out = CPU_SCRATCH.take(shape, dtype) if device.type == "cpu" else torch.empty(shape, dtype=dtype,
                                                                                           device=device)
            self._write_parts(out)
            return out
        return per_use

    def stacked_stored_source(self, device: torch.device):
        """What gives the parts' stored weights (one type) as one [sum(out), ...] tensor on
        `device`: resident parts are stacked once and become views of the stack; others are
        copied together per use."""
        return self._stored_source(self.parts, device)

    def segment_sources(self, device: torch.device) -> list[tuple]:
        """(qtype, source) per run of adjacent parts of one type (q and k, then v of another type):
        what gives the run's stored weights as one tensor on `device`, as `stacked_stored_source`."""
        runs: list[tuple] = []
        for p in self.parts:
            if runs and runs[-1][0] == p.qtype("weight"):
                runs[-1][1].append(p)
            else:
                runs.append((p.qtype("weight"), [p]))
        return [(qtype, self._stored_source(parts, device)) for qtype, parts in runs]

    def _stored_source(self, parts: list[Linear], device: torch.device):
        stored = [p.stored("weight") for p in parts]
        if any(s.device != device for s in stored):
            return lambda: torch.cat([p.fetch("weight", device) for p in parts])
        stack = self._restacked(stored, parts)
        return lambda: stack

    def _restacked(self, stored: list[torch.Tensor], parts: list[Linear] | None = None) -> torch.Tensor:
        """The parts' (or these of them) resident stored weights as one stack; once per device, the
        parts become views of it (their file views stay their homes)."""
        parts = self.parts if parts is None else parts
        if not adjacent(stored):
            stack = torch.cat(stored)
            start = 0
            for p, s in zip(parts, stored):
                p._parameters["weight"] = nn.Parameter(stack[start:start + s.shape[0]], requires_grad=False)
                p._changed()
                start += s.shape[0]
            stored = [p.stored("weight") for p in parts]
        return _stacked(stored)

    def _write_parts(self, out: torch.Tensor) -> None:
        start = 0
        for p, n in zip(self.parts, self.sizes):
            qtype, piece = p.qtype("weight"), out[start:start + n]
            value = p.fetch("weight", out.device)
            if qtype in FLOAT_TYPES:
                piece.copy_(value)
            else:
                dequantize(value, qtype, (n, self.in_features), out.dtype, out=piece)
            start += n

    def nbytes(self, dtype: torch.dtype) -> int:
        return sum(self.sizes) * self.in_features * torch.empty(0, dtype=dtype).element_size()

    def keep_dequantized(self, dtype: torch.dtype) -> int:
        """Keep one float copy of the stacked weight where the parts live (each part's kept copy a
        view of it); returns its bytes, 0 when the parts' own weights already serve."""
        stored = [p.stored("weight") for p in self.parts]
        if all(p.qtype("weight") in FLOAT_TYPES and s.dtype == dtype for p, s in zip(self.parts, stored)):
            return 0
        out = torch.empty(sum(self.sizes), self.in_features, dtype=dtype, device=stored[0].device)
        self._write_parts(out)
        start = 0
        for p, n in zip(self.parts, self.sizes):
            p.keep_copy("weight", out[start:start + n])
            start += n
        return out.numel() * out.element_size()


def choose_products(modules, dtype: torch.dtype, device: torch.device) -> None:
    """Choose now the product of every `Linear` and fused group under `modules` for inputs of
    `dtype` on `device`, make what the products make at their first call (the binder's `ready`) and
    look up every `Vector` in `dtype` there, as their first uses would: a step about to be compiled
    or captured as a CUDA graph then only calls them (and a compiled step's guards see the same
    state at every later call)."""
    device = indexed_device(device)
    for fused in fused_layers(modules):
        if fused.fuse:
            binder().ready(fused.choose(dtype, device)[3])
    for m in [modules] if isinstance(modules, nn.Module) else list(modules):
        for sub in m.modules():
            if isinstance(sub, Linear) and sub.qtype("weight") is not None:
                binder().ready(sub.choose(dtype, device)[2])
                if sub.has_bias:  # made ready in `dtype` there, as the step will read it
                    sub.get("bias", dtype, device)
            elif isinstance(sub, Vector) and sub.qtype("weight") is not None:
                sub(dtype, device)  # its weight in `dtype` made ready, as the step will read it


def set_many_rows_bf16(modules, on: bool) -> None:
    """Set `Linear.many_rows_bf16` of every layer under `modules` (a layer set to what it has keeps
    its product)."""
    for m in [modules] if isinstance(modules, nn.Module) else list(modules):
        for sub in m.modules():
            if isinstance(sub, Linear):
                sub.many_rows_bf16 = on


def fused_layers(modules) -> list[Fused]:
    """Every `Fused` helper held by a module under `modules`."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    return [v for m in modules for sub in m.modules() for v in vars(sub).values() if isinstance(v, Fused)]


class Embedding(WeightSlots):
    """Row lookup that dequantizes only the rows asked for (the LM table has 200000 rows), where
    the table lives; the rows then go to `device`."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.declare("weight", num_embeddings, embedding_dim)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        qtype = self._slot_types.get("weight")
        if qtype is None:
            raise ComponentError("Embedding.weight was never loaded")
        table = self.stored("weight")
        device = ids.device if device is None else torch.device(device)
        cached = self._dequantized.get("weight")
        if cached is not None and cached.dtype == dtype and cached.device == device:
            return F.embedding(ids.to(device), cached)
        at = ids.to(table.device)
        if qtype in FLOAT_TYPES:
            rows = F.embedding(at, table).to(dtype)
        else:
            rows = binder().rows(table, qtype, at, self.embedding_dim, dtype)
        return rows.to(device, non_blocking=True)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.lookup(ids, dtype)

    def rows(self, start: int, stop: int) -> Linear:
        """Rows [start, stop) of the table as a Linear (a tied LM head's candidate rows), views."""
        out = Linear(self.embedding_dim, stop - start, bias=False)
        out.set_stored("weight", self._slot_types["weight"], self.stored("weight")[start:stop])
        return out


class Conv1d(WeightSlots):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, bias=True):
        super().__init__()
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.declare("weight", out_channels, in_channels, kernel_size)
        self.has_bias = bias
        if bias:
            self.declare("bias", out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, L], or [B, C, 1, L] (a 1-D signal as a 2-D image, e.g. channels-last)."""
        b = self.get("bias", x.dtype, x.device) if self.has_bias else None
        w = self.get("weight", x.dtype, x.device)
        if x.dim() == 4:
            return F.conv2d(x, w.unsqueeze(2), b, (1, self.stride), (0, self.padding), (1, self.dilation))
        return F.conv1d(x, w, b, self.stride, self.padding, self.dilation)


class ConvTranspose1d(WeightSlots):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True):
        super().__init__()
        self.stride, self.padding = stride, padding
        self.declare("weight", in_channels, out_channels, kernel_size)
        self.has_bias = bias
        if bias:
            self.declare("bias", out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, L], or [B, C, 1, L] as `Conv1d`."""
        b = self.get("bias", x.dtype, x.device) if self.has_bias else None
        w = self.get("weight", x.dtype, x.device)
        if x.dim() == 4:
            return F.conv_transpose2d(x, w.unsqueeze(2), b, (1, self.stride), (0, self.padding))
        return F.conv_transpose1d(x, w, b, self.stride, self.padding)


class Vector(WeightSlots):
    """A bare weight (norm scales, Snake alphas, mixing logits) with no operation of its own:
    `forward(dtype, device)` returns it."""

    def __init__(self, *shape: int):
        super().__init__()
        self.declare("weight", *shape)

    def forward(self, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
        return self.get("weight", dtype, device)

    # A bare weight has no operation to hook: skip nn.Module's call machinery (a decode step reads
    # a few hundred norm scales).
    __call__ = forward


def load_tensors(module: nn.Module, tensors: dict[str, CompressedTensor], *, source: str,
                 strict: bool = True, prefix: str = "") -> list[str]:
    """Fill every slot of `module` from `tensors` by name (`<module path>.<slot>`).

    Missing and mis-shaped tensors raise `ComponentError` naming `source`; with `strict`, tensors
    the module does not use are an error too. Returns the names that were used.
    """
    used, missing = [], []
    for path, sub in module.named_modules():
        if not isinstance(sub, WeightSlots):
            continue
        for slot in sub._slot_shapes:
            name = prefix + (f"{path}.{slot}" if path else slot)
            t = tensors.get(name)
            if t is None:
                missing.append(name)
                continue
            try:
                sub.fill(slot, t)
            except ComponentError as e:
                raise ComponentError(f"{source}: {e}") from None
            used.append(name)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ComponentError(f"{source}: missing tensor(s) {', '.join(missing[:5])}{more}")
    if strict:
        extra = sorted(set(n for n in tensors if n.startswith(prefix)) - set(used))
        if extra:
            more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
            raise ComponentError(f"{source}: unexpected tensor(s) {', '.join(extra[:5])}{more}")
    return used
