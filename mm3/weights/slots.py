"""A module whose weights are named slots filled from GGUF tensors and kept as the file holds them:
quantized blocks as byte rows, floats in their shape. A use moves a slot's tensor to the input's
device and dequantizes it to the input's dtype (a kept float copy serves where one matches); a
move asks the back end's binder which form the tensor takes there, and a slot sent back to its
file's device gets the file's mapping back instead of a copy (`WeightSlots._apply`)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from gguf import GGMLQuantizationType

from ..formats.gguf.errors import ComponentError
from ..formats.gguf.quants import dequantize
from ..formats.gguf.reader import CompressedTensor
from .binding import binder
from .scratch import CPU_SCRATCH

FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_GGML_OF = {v: k for k, v in FLOAT_TYPES.items()}


def _stored(qtype: GGMLQuantizationType, raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """How a slot holds a tensor: floats in their shape, quantized bytes as rows of blocks."""
    if qtype in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[qtype]).view(shape)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return raw.reshape(rows, -1)


class WeightSlots(nn.Module):
    """A module with named weight slots filled from GGUF tensors by `load_tensors`.

    `version` counts the changes to what its uses read (weights filled, moved or restacked, float
    copies kept or dropped, numerics): whatever is derived from the weights (a `Fused` product,
    the lookups of `get`) is valid while it stays the same."""

    def __init__(self):
        super().__init__()
        self._slot_shapes: dict[str, tuple[int, ...]] = {}
        self._slot_types: dict[str, GGMLQuantizationType] = {}
        self._homes: dict[str, torch.Tensor] = {}  # slot -> the tensor it was filled with (see _apply)
        self._dequantized: dict[str, torch.Tensor] = {}  # slot -> kept float copy (cache_dequantized)
        self._ready: dict[tuple, torch.Tensor] = {}  # (slot, dtype, device) -> the weight `get` returns as is
        self._forms: dict[str, str] = {}  # slot -> the form it is held in when not the file's (mm3.backends.gpu.placement)
        self.version = 0

    def _changed(self, weights: bool = False) -> None:
        """What a use reads changed; `weights`: the weights themselves (filled or moved)."""
        self._ready.clear()
        self.version += 1

    # -- filling ---------------------------------------------------------------------------------
    def declare(self, name: str, *shape: int):
        self._slot_shapes[name] = tuple(int(s) for s in shape)
        self.register_parameter(name, None)

    @property
    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each declared slot's shape (that of the float tensor `get` returns), in declaration order."""
        return dict(self._slot_shapes)

    def _set(self, name: str, qtype: GGMLQuantizationType, value: torch.Tensor):
        self._parameters[name] = nn.Parameter(value, requires_grad=False)
        self._slot_types[name] = qtype
        self._homes[name] = value
        self._forms.pop(name, None)
        self._dequantized.pop(name, None)
        self._changed(weights=True)

    def fill(self, name: str, tensor: CompressedTensor):
        expected = self._slot_shapes[name]
        got = tuple(tensor.shape)
        if got != expected:
            raise ComponentError(f"tensor {tensor.name} has shape {list(got)}, expected {list(expected)}")
        self._set(name, tensor.qtype, _stored(tensor.qtype, tensor.raw, expected))

    def set_float(self, name: str, value: torch.Tensor):
        """Fill a slot with a computed float tensor (folded constants, tests)."""
        if tuple(value.shape) != self._slot_shapes[name]:
            raise ComponentError(f"{name}: shape {list(value.shape)}, expected {list(self._slot_shapes[name])}")
        self._set(name, _GGML_OF[value.dtype], value)

    def set_stored(self, name: str, qtype: GGMLQuantizationType, value: torch.Tensor):
        """Fill a slot with a tensor already in its stored form (float in shape, or byte rows)."""
        self._set(name, qtype, value)

    def stored(self, name: str) -> torch.Tensor:
        """The slot's tensor as held (float in its shape, or uint8 rows of blocks)."""
        value = self._parameters.get(name)
        if value is None:
            raise ComponentError(f"{type(self).__name__}.{name} was never loaded")
        return value

    def qtype(self, name: str) -> GGMLQuantizationType | None:
        return self._slot_types.get(name)

    def form(self, name: str) -> str | None:
        """How the slot's tensor is held when not as in the file: "layout" (the device layout of
        `mm3.backends.gpu.device_layout`, placed by `mm3.backends.gpu.placement`), else None."""
        return self._forms.get(name)

    # -- float copies ----------------------------------------------------------------------------
    def keep_copy(self, name: str, value: torch.Tensor) -> None:
        """Keep `value`, the slot's weight as floats, for the uses in its dtype on its device."""
        self._dequantized[name] = value
        self._changed()

    def drop_copies(self) -> None:
        if self._dequantized:  # nothing dropped, nothing changed: the chosen products stay
            self._dequantized.clear()
            self._changed()

    def kept_copy(self, dtype: torch.dtype, device: torch.device, name: str = "weight") -> torch.Tensor | None:
        """The float copy of the slot kept in `dtype` on `device`, in the form the back end gave it
        (`binder().kept_form`: a plain tensor, or one only its product reads), or None."""
        cached = self._dequantized.get(name)
        return cached if cached is not None and cached.dtype == dtype and cached.device == device else None

    def keeps_copy(self, dtype: torch.dtype, device: torch.device, name: str = "weight") -> bool:
        """Whether a float copy of the slot in `dtype` is kept on `device` (it then serves)."""
        return self.kept_copy(dtype, device, name) is not None

    def float_at_hand(self, dtype: torch.dtype, device: torch.device, name: str = "weight") -> torch.Tensor | None:
        """The slot as floats of `dtype` on `device` when no work makes them: a kept copy (a plain
        tensor), or the stored float tensor itself; else None."""
        cached = self.kept_copy(dtype, device, name)
        if cached is not None and cached.layout == torch.strided:
            return cached
        value = self.stored(name)
        if self._slot_types[name] in FLOAT_TYPES and value.dtype == dtype and value.device == device:
            return value
        return None

    # -- using -----------------------------------------------------------------------------------
    def fetch(self, name: str, device: torch.device | None) -> torch.Tensor:
        """The slot's tensor as in the file (blocks, or floats) on `device` (a copy for this use when
        it lives elsewhere or in another form)."""
        value = binder().file_form(self, name, self.stored(name))
        return value if device is None or value.device == torch.device(device) else value.to(device, non_blocking=True)

    def get(self, name: str, dtype: torch.dtype, device: torch.device | None = None, *,
            scratch: bool = False) -> torch.Tensor:
        """The slot's tensor dequantized to `dtype` on `device` (default: where it lives). A kept
        copy (`cache_dequantized`) is returned when it matches; `scratch` dequantizes a CPU weight
        into the shared scratch buffer (valid until the next such call)."""
        ready = self._ready.get((name, dtype, device))
        if ready is not None:
            return ready
        qtype = self._slot_types.get(name)
        if qtype is None:
            raise ComponentError(f"{type(self).__name__}.{name} was never loaded")
        target = self.stored(name).device if device is None else torch.device(device)
        at_hand = self.float_at_hand(dtype, target, name)
        if at_hand is not None:
            self._ready[(name, dtype, device)] = at_hand
            return at_hand
        value = self.fetch(name, target)
        if qtype in FLOAT_TYPES:
            value = value.to(dtype)
            if len(self._slot_shapes[name]) == 1:  # a vector (a norm scale): kept cast, not cast at every use
                self._ready[(name, dtype, device)] = value
            return value
        out = CPU_SCRATCH.take(self._slot_shapes[name], dtype) if scratch and target.type == "cpu" else None
        return dequantize(value, qtype, self._slot_shapes[name], dtype, out=out)

    # -- moving ----------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """`Module.to()` and friends, except that a slot sent back to its home's device and dtype
        gets the home tensor back (the file mapping) instead of a copy, and a quantized weight
        reaching an accelerator takes the form its products read there (`mm3.backends.gpu.placement`:
        the device layout replaces the blocks; back on the CPU, the file's blocks return). Kept
        float copies are dropped: they belong to the device they were made on."""
        if recurse:
            for child in self.children():
                child._apply(fn)
        for name, value in list(self._parameters.items()):
            if value is None:
                continue
            probe = fn(torch.empty(0, dtype=value.dtype))  # where and as what `fn` sends a tensor
            home = self._homes.get(name)
            if home is not None and probe.device == home.device and probe.dtype == home.dtype:
                moved, form = home, None
            else:
                with torch.no_grad():
                    moved = fn(value)
                form = self._forms.get(name)
            moved, form = binder().settle(self, name, moved, form)  # the form for that device
            self._forms.pop(name, None)
            if form is not None:
                self._forms[name] = form
                if home is not None and home.device == moved.device and home.device.type != "cpu":
                    del self._homes[name]  # a home in device memory: the layout replaces it
            self._parameters[name] = nn.Parameter(moved, requires_grad=False)
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = fn(buf)
        self._dequantized.clear()
        self._changed(weights=True)
        return self
