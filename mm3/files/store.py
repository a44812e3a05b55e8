"""Loaded engine models and the memory policy of the command line.

The AR group {LM, depth} is used per frame and the synthesis group {cond, DiT, VAE} per window, so
they never need to be resident together: in strict mode (the default) asking for one group
releases the other; `keep_loaded` keeps everything for back-to-back runs. A model is keyed by
its file, so asking for another quant of a component replaces the loaded one.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field

import torch

from ..components import GROUP_OF, Component, check_compatible
from ..backends.device import empty_cache
from ..formats.gguf.errors import ComponentError, GGUFFormatError
from ..models import build_model
from .opener import open_component
from .registry import Registry


@dataclass
class Loaded:
    component: Component
    model: torch.nn.Module
    seconds: float
    numerics: str


@dataclass
class ModelStore:
    registry: Registry
    device: torch.device
    keep_loaded: bool = False
    loaded: dict[str, Loaded] = field(default_factory=dict)
    tokenizers: dict[str, object] = field(default_factory=dict)  # LM path -> tokenizer (CPU, kept)
    load_seconds: float = 0.0
    loading: str | None = None  # the file being loaded, or whose loading failed (for error messages)

    def model(self, kind: str, name: str = "", numerics: str = "fast", together: bool = False):
        """The engine model of `kind` from file `name` ("" or "auto": the registry picks one), on the device;
        the LM and the depth decoder in `numerics` (`mm3.models.build_model`). `together`: the other
        group stays loaded (planning and synthesis overlapped, `mm3.song.overlap`)."""
        path = self.registry.resolve(kind, name)
        have = self.loaded.get(kind)
        if have is not None and have.component.path == path and have.numerics == numerics:
            return have.model
        if have is not None:
            self._release(kind)  # another quant of the same component, or other numerics
        if not (self.keep_loaded or together):
            group = GROUP_OF[kind]
            others = [k for k in self.loaded if GROUP_OF[k] != group]
            for other in others:
                self._release(other, collect=other == others[-1])
        start = time.perf_counter()
        self.loading = path
        component = open_component(path, expect=kind)
        try:
            check_compatible({k: v.component for k, v in self.loaded.items()} | {kind: component})
            model = build_model(component, numerics=numerics).to(self.device)
        except BaseException:
            component.close()
            raise  # `loading` still names the file, for the caller's error message
        self.loading = None
        seconds = time.perf_counter() - start
        self.load_seconds += seconds
        self.loaded[kind] = Loaded(component, model, seconds, numerics)
        return model

    def tokenizer(self, name: str = ""):
        from ..tokenizer import MM3Tokenizer

        path = self.registry.resolve("lm", name)
        if path not in self.tokenizers:
            try:
                self.tokenizers[path] = MM3Tokenizer.from_gguf(path)
            except (ComponentError, GGUFFormatError):
                raise
            except Exception as e:  # the tokenizers library's own errors on corrupt token lists / merges
                raise ComponentError(f"{path}: cannot build the tokenizer from its tokenizer.ggml.* arrays "
                                     f"({type(e).__name__}: {e})") from e
        return self.tokenizers[path]

    def component(self, kind: str) -> Component | None:
        have = self.loaded.get(kind)
        return have.component if have else None

    def _release(self, kind: str, collect: bool = True):
        have = self.loaded.pop(kind, None)
        if have is None:
            return
        del have.model
        have.component.close()
        del have
        if collect:
            gc.collect()
            empty_cache(self.device)

    def release_all(self):
        if not self.loaded:
            return
        for kind in list(self.loaded):
            self._release(kind, collect=False)
        gc.collect()  # once for the group: a full collection costs ~0.1 s
        empty_cache(self.device)

    def resident_bytes(self) -> int:
        """The sizes of the files of the loaded models."""
        return sum(os.path.getsize(path) for path in {have.component.path for have in self.loaded.values()})

    def resident(self) -> list[str]:
        return sorted(self.loaded)
