"""The operations seam: layers whose weights stay GGUF-compressed until they reach the compute device.

Every weight is a buffer holding either the raw block bytes (uint8) of a quantized tensor or the
float tensor of an F32/F16/BF16 one; `nn.Module.to(device)` moves the compressed bytes, and each
forward dequantizes on the input's device to the input's dtype. Models are written against these
classes only, so another implementation (fused quantized matmuls, a ComfyUI cast layer) can be
swapped in without touching model code.

Dequantizing on every forward costs a full write and read of the float weight. Where memory allows,
`cache_dequantized(model, dtype, budget)` keeps float copies that `get` returns instead (the DiT
reuses every weight 2 x steps times per window); `release_dequantized` drops them.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from .errors import ComponentError
from .reader import CompressedTensor

FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


class WeightSlots(nn.Module):
    """A module with named tensor slots filled from GGUF tensors by `load_tensors`."""

    def __init__(self):
        super().__init__()
        self._slot_shapes: dict[str, tuple[int, ...]] = {}
        self._slot_types: dict[str, GGMLQuantizationType] = {}
        self._dequantized: dict[str, torch.Tensor] = {}  # see cache_dequantized

    def declare(self, name: str, *shape: int):
        self._slot_shapes[name] = tuple(int(s) for s in shape)
        self.register_buffer(name, torch.empty(0), persistent=False)

    def fill(self, name: str, tensor: CompressedTensor):
        expected = self._slot_shapes[name]
        got = tuple(tensor.shape)
        if got != expected:
            raise ComponentError(f"tensor {tensor.name} has shape {list(got)}, expected {list(expected)}")
        if tensor.qtype in FLOAT_TYPES:
            value = tensor.raw.view(FLOAT_TYPES[tensor.qtype]).view(expected)
        else:
            value = tensor.raw
        setattr(self, name, value)
        self._slot_types[name] = tensor.qtype
        self._dequantized.pop(name, None)

    def set_float(self, name: str, value: torch.Tensor):
        """Fill a slot with a computed float tensor (folded constants, tests)."""
        if tuple(value.shape) != self._slot_shapes[name]:
            raise ComponentError(f"{name}: shape {list(value.shape)}, expected {list(self._slot_shapes[name])}")
        setattr(self, name, value)
        self._slot_types[name] = {v: k for k, v in FLOAT_TYPES.items()}[value.dtype]
        self._dequantized.pop(name, None)

    def rebind(self, name: str, value: torch.Tensor):
        """Point a filled slot at `value`, a tensor of the same shape and dtype holding the same
        bytes (mm3.fast packs the rows of several layers into one buffer and rebinds each slot to
        its view, so the packed copy replaces the originals instead of doubling the memory)."""
        old = getattr(self, name)
        if value.shape != old.shape or value.dtype != old.dtype or value.device != old.device:
            raise ValueError(f"{type(self).__name__}.{name}: cannot rebind {old.dtype} {list(old.shape)} on "
                             f"{old.device} to {value.dtype} {list(value.shape)} on {value.device}")
        setattr(self, name, value)
        self._dequantized.pop(name, None)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The slot's tensor, dequantized on its current device to `dtype`."""
        qtype = self._slot_types.get(name)
        if qtype is None:
            raise ComponentError(f"{type(self).__name__}.{name} was never loaded")
        value = getattr(self, name)
        cached = self._dequantized.get(name)
        if cached is not None and cached.dtype == dtype and cached.device == value.device:
            return cached
        if qtype in FLOAT_TYPES:
            return value.to(dtype)
        from .quants import dequantize

        return dequantize(value, qtype, self._slot_shapes[name], dtype)

    def qtype(self, name: str) -> GGMLQuantizationType | None:
        return self._slot_types.get(name)


class Linear(WeightSlots):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.declare("weight", out_features, in_features)
        self.has_bias = bias
        if bias:
            self.declare("bias", out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.get("bias", x.dtype) if self.has_bias else None
        return F.linear(x, self.get("weight", x.dtype), b)

    def rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Weight rows [start, stop) in `dtype`, dequantizing only those (a GGUF row is whole blocks,
        so a row range is a byte range); float rows are views when no cast is needed."""
        qtype = self._slot_types.get("weight")
        if qtype is None:
            raise ComponentError("Linear.weight was never loaded")
        if qtype in FLOAT_TYPES:
            return self.weight[start:stop].to(dtype)
        from .quants import dequantize

        raw = self.weight.view(self.out_features, -1)[start:stop]
        return dequantize(raw, qtype, (stop - start, self.in_features), dtype)


class Embedding(WeightSlots):
    """Row lookup that dequantizes only the rows asked for (the LM table has 200000 rows)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.declare("weight", num_embeddings, embedding_dim)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        qtype = self._slot_types.get("weight")
        if qtype is None:
            raise ComponentError("Embedding.weight was never loaded")
        ids = ids.to(self.weight.device)
        if qtype in FLOAT_TYPES:
            return F.embedding(ids, self.weight).to(dtype)
        from .quants import dequantize

        rows = self.weight.view(self.num_embeddings, -1)[ids.reshape(-1)]
        out = dequantize(rows, qtype, (rows.shape[0], self.embedding_dim), dtype)
        return out.view(*ids.shape, self.embedding_dim)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.lookup(ids, dtype)

    def rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of the table (a tied LM head reads its candidates' rows this way)."""
        return self.lookup(torch.arange(start, stop), dtype)


class Conv1d(WeightSlots):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, bias=True):
        super().__init__()
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.declare("weight", out_channels, in_channels, kernel_size)
        self.has_bias = bias
        if bias:
            self.declare("bias", out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.get("bias", x.dtype) if self.has_bias else None
        return F.conv1d(x, self.get("weight", x.dtype), b, self.stride, self.padding, self.dilation)


class ConvTranspose1d(WeightSlots):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True):
        super().__init__()
        self.stride, self.padding = stride, padding
        self.declare("weight", in_channels, out_channels, kernel_size)
        self.has_bias = bias
        if bias:
            self.declare("bias", out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.get("bias", x.dtype) if self.has_bias else None
        return F.conv_transpose1d(x, self.get("weight", x.dtype), b, self.stride, self.padding)


class Vector(WeightSlots):
    """A bare weight (norm scales, Snake alphas, mixing logits) with no operation of its own."""

    def __init__(self, *shape: int):
        super().__init__()
        self.declare("weight", *shape)

    def forward(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.get("weight", dtype)


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


def cache_dequantized(module: nn.Module, dtype: torch.dtype, budget_bytes: int | None = None) -> int:
    """Keep float copies in `dtype` of the weights of `module` that `get` would otherwise dequantize
    or cast on every call, in module order until `budget_bytes` (None: no limit) is spent; returns
    the bytes used. Copies sit on each weight's device and are ignored once it moves."""
    used = 0
    for sub in module.modules():
        if not isinstance(sub, WeightSlots):
            continue
        for name, qtype in sub._slot_types.items():
            value = getattr(sub, name)
            if qtype in FLOAT_TYPES and FLOAT_TYPES[qtype] == dtype:
                continue  # already what get returns, no work to save
            nbytes = math.prod(sub._slot_shapes[name]) * torch.empty(0, dtype=dtype).element_size()
            cached = sub._dequantized.get(name)
            if cached is not None and cached.dtype == dtype and cached.device == value.device:
                used += nbytes
                continue
            if budget_bytes is not None and used + nbytes > budget_bytes:
                continue  # a smaller tensor further on may still fit
            sub._dequantized.pop(name, None)
            sub._dequantized[name] = sub.get(name, dtype)
            used += nbytes
    return used


def dequantized_nbytes(module: nn.Module) -> int:
    """Bytes of the copies `cache_dequantized` keeps under `module` now."""
    return sum(t.numel() * t.element_size() for sub in module.modules() if isinstance(sub, WeightSlots)
               for t in sub._dequantized.values())


def release_dequantized(module: nn.Module) -> int:
    """Drop every copy `cache_dequantized` kept under `module`; returns the bytes freed."""
    freed = dequantized_nbytes(module)
    for sub in module.modules():
        if isinstance(sub, WeightSlots):
            sub._dequantized.clear()
    return freed


def compressed_nbytes(module: nn.Module) -> int:
    """Bytes the module's weights occupy as stored (what a memory manager must budget)."""
    return sum(b.numel() * b.element_size() for b in module.buffers())
