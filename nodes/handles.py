"""What a loader node hands on: a component handle, and the memory estimates of each stage.

A loader node returns a `ComponentHandle`: the file is classified (header read, cached) but nothing
is built until a stage node asks for the model. The stage nodes pass the engine's stage results
(`mm3.song.stages`), whose tensors wait on the CPU while ComfyUI caches them.

No ComfyUI import here: the node layer's tests use it directly.
"""

from __future__ import annotations

import os
import weakref
import torch

from mm3.plan import ar
from mm3.components import ARCH_OF, DESCRIPTIONS, GROUP_OF, Component, check_loadable
from mm3.formats.fingerprint import file_fingerprint as content_fingerprint
from mm3.formats.gguf.errors import ComponentError
from mm3.weights.copies import compressed_nbytes
from mm3.models import build_model, dit, vocoder
from mm3.files.opener import kinds_of, open_component, read_component
from mm3.song.stages import ModelFile


def classify(path: str) -> tuple[str, ...]:
    """The component kinds a file holds (our GGUF by its `general.architecture`, another tool's file by
    its tensor names; none when unreadable), header read, cached by path, size and mtime."""
    return kinds_of(path)


class ComponentHandle:
    """One component file chosen in a loader. `component()` opens it (header + mmap) and `model()`
    builds the engine model on the CPU over the mapped bytes, each once; the ComfyUI layer wraps
    the model for the memory manager (`patcher`)."""

    def __init__(self, kind: str, name: str, path: str, keep_loaded: bool = False):
        found = classify(path)
        if kind not in found:
            what = ("is not a readable MM3 file" if not found else f"is {ARCH_OF[found[0]]}" if len(found) == 1
                    else "holds the " + " and ".join(DESCRIPTIONS[k] for k in found))
            raise ComponentError(f"{name} {what}, expected {ARCH_OF[kind]} ({DESCRIPTIONS[kind]})")
        # What the command line refuses before loading anything, refused here at the loader: tensor
        # types the engine cannot dequantize, sizes the tensors cannot hold (header read, cached).
        check_loadable(read_component(path, kind))
        self.kind, self.name, self.path, self.keep_loaded = kind, name, path, keep_loaded
        self._component: Component | None = None
        self._model: torch.nn.Module | None = None
        self.patcher = None  # set by the ComfyUI layer

    def __repr__(self):
        return f"ComponentHandle({self.kind}, {self.name!r})"

    @property
    def group(self) -> str:
        return GROUP_OF[self.kind]

    def component(self) -> Component:
        if self._component is None:
            self._component = open_component(self.path, expect=self.kind)
            weakref.finalize(self, self._component.close)
        return self._component

    @property
    def hparams(self) -> dict:
        return self.component().hparams

    def model(self) -> torch.nn.Module:
        """The engine model (the CLI's builder, fast numerics), on the CPU over the file's mapping; a
        vocoder with its encoder when the file carries one (MM3 Vocoder Encode needs it)."""
        if self._model is None:
            self._model = build_model(self.component(), with_encoder=None if self.kind == "vae" else False)
        return self._model

    @property
    def fingerprint(self) -> str:
        """The file's content fingerprint, recorded in replay requests (`mm3.formats.fingerprint`)."""
        return content_fingerprint(self.path)

    def file(self) -> ModelFile:
        """The file as a stage result records it (name, fingerprint, hyper-parameters)."""
        return ModelFile(self.kind, self.name, self.fingerprint, self.hparams)

    def nbytes(self) -> int:
        """The weights' stored (compressed) size, a tensor shared by two layers counted once."""
        return compressed_nbytes(self.model())


_HANDLES: "weakref.WeakValueDictionary[tuple, ComponentHandle]" = weakref.WeakValueDictionary()


def handle_for(kind: str, name: str, path: str, keep_loaded: bool = False) -> ComponentHandle:
    """The live handle of this file version (same path, size, mtime) if any node output still holds
    one, so a re-run loader does not build the model twice; otherwise a new one."""
    st = os.stat(path)
    key = (kind, os.path.abspath(path), st.st_size, st.st_mtime_ns, bool(keep_loaded))
    h = _HANDLES.get(key)
    if h is None:
        h = ComponentHandle(kind, name, path, keep_loaded)
        _HANDLES[key] = h
    return h


def file_fingerprint(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.abspath(path), st.st_size, st.st_mtime_ns)


# -- memory estimates for ComfyUI's loader (bytes of activations beyond the weights) --------------
def ar_memory(lm_hp: dict, prompt_tokens: int, frames: int, songs: int, lm_cfg: float, device, elem: int) -> int:
    """The AR stage's, for the rows its songs take (`mm3.plan.ar.activation_bytes`; the nodes run the
    fast numerics)."""
    return ar.activation_bytes(lm_hp, prompt_tokens, frames, songs, lm_cfg, device, elem)


def dit_memory(dit_hp: dict, latent_len: int, elem: int) -> int:
    return dit.activation_bytes(dit_hp, latent_len, elem)


def vocoder_memory(shapes: dict, ratios: list[int], latent_len: int, rows: int = 2) -> int:
    return vocoder.activation_bytes(shapes, ratios, latent_len, rows)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4

