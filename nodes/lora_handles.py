"""What MM3 Load LoRA hands on: the LM or DiT handle it was given, with adapters.

An `AdaptedHandle` shares its base handle's file, engine model and ComfyUI patcher; it only adds
the adapters (`mm3.lora.attach.Applied`). `comfy_models.load` sets on the engine model exactly the
adapters of the handle a node runs (none for a plain handle), so the model a loader hands to other
branches of the graph, and ComfyUI's cached outputs, never run with them.

No ComfyUI import here: the node layer's tests use it directly.
"""

from __future__ import annotations

from dataclasses import replace

from mm3.lora.attach import Applied
from mm3.song.stages import ModelFile

from .handles import ComponentHandle


class AdaptedHandle:
    """`base` (a `ComponentHandle`) with `applied` adapters, in order."""

    def __init__(self, base: ComponentHandle, applied: tuple[Applied, ...]):
        self.base, self.applied = base, tuple(applied)

    def __repr__(self):
        return f"AdaptedHandle({self.base!r}, {', '.join(a.use.describe() for a in self.applied)})"

    # What a stage node reads of a handle: the base's, except the file record.
    kind = property(lambda self: self.base.kind)
    name = property(lambda self: self.base.name)
    path = property(lambda self: self.base.path)
    keep_loaded = property(lambda self: self.base.keep_loaded)
    group = property(lambda self: self.base.group)
    hparams = property(lambda self: self.base.hparams)
    fingerprint = property(lambda self: self.base.fingerprint)

    @property
    def patcher(self):
        return self.base.patcher

    @patcher.setter
    def patcher(self, value):
        self.base.patcher = value

    def component(self):
        return self.base.component()

    def model(self):
        return self.base.model()

    def nbytes(self) -> int:
        return self.base.nbytes()

    def adapter_nbytes(self) -> int:
        """What the adapters' factors take (they travel to the device with the model)."""
        return sum(t.numel() * t.element_size() for a in self.applied for m in a.modules for t in (m.down, m.up))

    def file(self) -> ModelFile:
        """The file as a stage records it, with the adapters its model ran with."""
        return replace(self.base.file(), adapters=tuple(a.use for a in self.applied))


def adapters_of(handle) -> tuple[Applied, ...]:
    """The adapters a handle carries (none for a loader's own)."""
    return getattr(handle, "applied", ())


def base_of(handle) -> ComponentHandle:
    return getattr(handle, "base", handle)
