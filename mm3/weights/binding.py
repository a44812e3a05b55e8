"""How a layer reaches the back end that computes with its weights: one binder answers every question
a layer asks (its product for inputs of a dtype on a device, the form its weight takes where it
moves, the rows of a table, a packing for a kernel), so the layers import no back end.

`mm3.backends` installs its binder (the rule table over the CPU and GPU back ends) when it is
imported, as every model module does. Before that, `Portable` answers with torch's own operations:
a dequantization per use and `F.linear`, the reference's products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats.gguf.quants import dequantize


def indexed_device(device: torch.device | str) -> torch.device:
    """`device` as its tensors report it: an accelerator named without an index ("cuda") becomes
    the current one ("cuda:0"). Products, kernel checks and tables are kept under this key, so
    the device a caller names and the one an input reports find the same entry (a step compiled
    or captured as a CUDA graph must not choose its products again)."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        if device.type == "mps":  # one device, no current_device
            return torch.device("mps", 0)
        current = getattr(getattr(torch, device.type, None), "current_device", None)
        try:
            return torch.device(device.type, current()) if current is not None else device
        except (AssertionError, RuntimeError):  # a torch built without that device, or no driver
            return device
    return device


class Portable:
    """The binder of torch's operations alone (the methods a back end's binder overrides)."""

    def linear(self, layer, dtype: torch.dtype, device: torch.device):
        """The product `(x, bias) -> y` of a `Linear` for inputs of `dtype` on `device`."""
        at_hand = layer.float_at_hand(dtype, device)
        if at_hand is not None:
            return lambda x, bias=None: F.linear(x, at_hand, bias)
        return lambda x, bias=None: F.linear(x, layer.get("weight", dtype, device, scratch=True), bias)

    def fused(self, fused, dtype: torch.dtype, device: torch.device):
        """The product `x -> [y per part]` of a `Fused` group (here: each part its own)."""
        return self.separate(fused.parts)

    def separate(self, parts: list):
        """The product `x -> [y per part]` of layers that each multiply by their own product."""
        return lambda x, bias=None: [p(x) for p in parts]

    def ready(self, product) -> None:
        """Make now what `product` makes at its first call (a step about to be traced only calls it)."""

    def settle(self, layer, name: str, value: torch.Tensor, form: str | None) -> tuple[torch.Tensor, str | None]:
        """(tensor, form) a slot holds on value's device after a move (here: as the file has it)."""
        return value, form

    def file_form(self, layer, name: str, value: torch.Tensor) -> torch.Tensor:
        """The slot's tensor in the file's form (blocks or floats), from the form it is held in."""
        return value

    def rows(self, table: torch.Tensor, qtype, ids: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (any shape) of a quantized table [rows, row bytes] dequantized to `dtype`
        -> [*ids.shape, width], where the table lives."""
        raw = table[ids.reshape(-1)]
        return dequantize(raw, qtype, (raw.shape[0], width), dtype).view(*ids.shape, -1)

    def packing(self, kernel: str, blocks: torch.Tensor, qtype, n: int, k: int):
        """The blocks of an [n, k] weight packed for a back end's `kernel` (none here)."""
        raise RuntimeError(f"no back end packs weights for the {kernel!r} kernel")

    def release_pages(self, layer) -> None:
        """After a packing of the layer's weight: give back the file pages its blocks occupy."""

    def wants_copy(self, layer, qtype, device: torch.device) -> bool:
        """Whether a float copy of `layer`'s weight would serve its products on `device`."""
        return True

    def kept_form(self, layer, name: str, value: torch.Tensor) -> torch.Tensor:
        """A float copy of a `Linear`'s slot (`value`, not shared with other layers) in the form
        its product reads best (here: as it is)."""
        return value


_BINDER: list[Portable] = [Portable()]


def install(binder: Portable) -> None:
    """Make `binder` answer every layer's questions from now on (products already chosen stay)."""
    _BINDER[0] = binder


def binder() -> Portable:
    """The binder in force."""
    return _BINDER[0]
