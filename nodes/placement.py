"""Where an engine model's weights live: on the offload device as built, or on the compute device.

Engine weights are module buffers (GGUF bytes or float tensors, mmap views when built from a file),
not parameters, so ComfyUI's own weight mover never sees them. `Placement` moves them per module:
`load(device, budget)` copies modules to the compute device until the byte budget is spent, and
`unload()` puts the original CPU tensors back (no device-to-host copy, the mmap views come back).

Modules left behind still work: each of the engine's weight layers that stays behind is switched to
a `Streamed` subclass of its own class, which copies its compressed weight to the compute device for
one use (ComfyUI's low-VRAM idea, with the bytes still compressed), and back to its exact class once
resident, so a fully loaded model is exactly the engine's (its fast AR path checks the layer types).
Buffers of other modules (norm slots of the models' own classes, RoPE tables, folded constants) are
small and always go to the device.

No ComfyUI import here: the node layer's tests use it directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..mm3.gguf import ops as engine_ops


class Streamed:
    """Mixin for the engine's weight layers: when `mm3_stream_to` is set, the weight is not resident
    and each use copies it (still compressed) to that device before dequantizing."""

    mm3_stream_to: torch.device | None = None

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        dev = self.mm3_stream_to
        if dev is None:
            return super().get(name, dtype)
        home = self._buffers[name]
        self._buffers[name] = home.to(dev)  # a temporary copy; the original stays where it was
        try:
            return super().get(name, dtype)
        finally:
            self._buffers[name] = home


def _streamed_lookup(base_lookup):
    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Row lookups dequantize only the rows asked for, where the table is; the rows then move.
        out = base_lookup(self, ids, dtype)
        return out if self.mm3_stream_to is None else out.to(self.mm3_stream_to)
    return lookup


def _streamed_classes(base=engine_ops) -> dict[type, type]:
    """Engine weight layer class -> its `Streamed` subclass (same layout: instances switch class)."""
    out = {}
    for name, cls in vars(base).items():
        if isinstance(cls, type) and issubclass(cls, base.WeightSlots) and cls is not base.WeightSlots:
            body = {"__module__": __name__, "__doc__": f"{cls.__name__} whose weight stays off the device."}
            if hasattr(cls, "lookup"):
                body["lookup"] = _streamed_lookup(cls.lookup)
            out[cls] = type(f"Streamed{name}", (Streamed, cls), body)
    return out


STREAMED = _streamed_classes()


def buffer_bytes(buffers) -> int:
    return sum(b.numel() * b.element_size() for b in buffers)


@dataclass
class Unit:
    name: str
    module: nn.Module
    home: dict[str, torch.Tensor]  # buffer name -> the tensor the model was built with
    nbytes: int
    streamable: bool
    base: type  # the module's own class (a streamed module wears STREAMED[base] meanwhile)


class Placement:
    """Per-module placement of one engine model.

    `anchors` name modules that are always resident, whatever the budget: the engine reads a
    model's device from them (the LM's token embedding, the depth decoder's input projection) and
    puts its caches there, so an anchor left behind would split the model across two devices.
    """

    def __init__(self, model: nn.Module, anchors: tuple[str, ...] = ()):
        units, seen = [], set()
        for name, m in model.named_modules():
            own = {k: b for k, b in m._buffers.items() if b is not None}
            if own:
                fresh = []  # a tensor shared by two buffers counts once
                for b in own.values():
                    if id(b) not in seen:
                        seen.add(id(b))
                        fresh.append(b)
                streamable = type(m) in STREAMED and name not in anchors
                units.append(Unit(name, m, own, buffer_bytes(fresh), streamable, type(m)))
        # Mandatory units (anchors included) first, then the rest in model order (first layers resident).
        self.units = sorted(units, key=lambda u: u.streamable)
        self.resident: set[str] = set()
        self.device: torch.device | None = None  # the compute device while loaded

    @property
    def total_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def loaded_bytes(self) -> int:
        return sum(u.nbytes for u in self.units if u.name in self.resident)

    @property
    def streaming(self) -> bool:
        return self.device is not None and any(u.name not in self.resident for u in self.units if u.streamable)

    @staticmethod
    def _stream(u: Unit, to: torch.device | None):
        if u.streamable:
            u.module.__class__ = u.base if to is None else STREAMED[u.base]
            u.module.mm3_stream_to = to

    def _move(self, u: Unit, device: torch.device, copies: dict):
        for k, t in u.home.items():
            if id(t) not in copies:  # shared tensors stay shared on the device
                copies[id(t)] = t.to(device)
            u.module._buffers[k] = copies[id(t)]
        self._stream(u, None)
        self.resident.add(u.name)

    def _restore(self, u: Unit, stream_to: torch.device | None):
        for k, t in u.home.items():
            u.module._buffers[k] = t
        self._stream(u, stream_to)
        self.resident.discard(u.name)

    def load(self, device: torch.device, budget: float = math.inf) -> int:
        """Make the model usable on `device` with at most about `budget` bytes resident there
        (mandatory units go regardless). Returns the bytes resident on `device`."""
        device = torch.device(device)
        if self.device is not None and self.device != device:
            self.unload()
        self.device = device
        used, copies = 0, {}
        for u in self.units:
            if u.name in self.resident:
                used += u.nbytes
                continue
            if not u.streamable or used + u.nbytes <= budget:
                self._move(u, device, copies)
                used += u.nbytes
            else:
                self._stream(u, device)
        return used

    def unload(self, nbytes: float | None = None) -> int:
        """Put weights back on the offload device: everything (`nbytes` None), or streamable
        modules from the last one until at least `nbytes` are freed (the model stays usable on its
        device by streaming them). Returns the bytes freed."""
        freed = 0
        if nbytes is None:
            for u in self.units:
                if u.name in self.resident:
                    freed += u.nbytes
                self._restore(u, None)
            self.device = None
            return freed
        for u in reversed(self.units):
            if freed >= nbytes:
                break
            if u.streamable and u.name in self.resident:
                self._restore(u, self.device)
                freed += u.nbytes
        return freed
