"""Which components a file holds and opening it: our GGUF files by `general.architecture`, another
tool's files through `mm3.dialects` (by tensor names, never by file name); header reads cached per
file version."""

from __future__ import annotations

import os

from ..components import ARCH_OF, ARCHITECTURES, DESCRIPTIONS, Component, read_hparams
from ..dialects import describe, open_mapped
from ..dialects.source import file_format
from ..filecache import FileCache
from ..formats.gguf.errors import ComponentError, GGUFFormatError
from ..formats.gguf.reader import GGUFFile, read_architecture

# HOT-Step writes `mm3-depth`, `mm3-cond` and `mm3-dit` too, with other tensor names; its files carry this.
FOREIGN_MARKER = ("mm3.model", "MiniMax-Music3")


def _foreign_namesake(path) -> bool:
    """Whether a file under one of our architecture names is another tool's (header read)."""
    try:
        with GGUFFile(path, header_only=True) as f:
            return f.metadata.get(FOREIGN_MARKER[0]) == FOREIGN_MARKER[1]
    except GGUFFormatError:
        return False  # ours by its name, and broken: opening it says how


def kinds_of(path: str | os.PathLike) -> tuple[str, ...]:
    """The component kinds a file holds: one for our files (by `general.architecture`), one or more
    for another tool's files (`mm3.dialects`: a ComfyUI text encoder holds the LM and the depth
    decoder), none for anything else (header read, cached)."""
    def classify(st) -> tuple[str, ...]:
        found = None
        fmt = file_format(path)
        if fmt == "gguf":
            kind = ARCHITECTURES.get(read_architecture(path))
            found = (None, (kind,)) if kind is not None and not _foreign_namesake(path) else None
        if found is None and fmt:
            found = describe(path)
        return found[1] if found else ()

    try:
        return _KINDS.get(path, classify)
    except (OSError, ValueError):
        return ()  # unreadable now: not remembered, so a repaired file is classified again


_KINDS = FileCache(512)


def open_component(path: str | os.PathLike, expect: str | None = None, *, header_only: bool = False) -> Component:
    """Open a component file, classified by `general.architecture` or, for another tool's file, by
    its tensor names (never by its file name).

    `expect` is a kind ("lm", "depth", "cond", "dit", "vae"); another architecture is an error
    that says what the file is and what was expected (a file holding several components gives the
    one asked for, the first one without `expect`). `header_only`: metadata and the tensor table
    only (no tensors mapped), enough for `hparams` and `check_compatible`.
    """
    fmt = file_format(path)
    if fmt == "gguf":
        f = GGUFFile(path, header_only=header_only)
        try:
            arch = f.architecture
            kind = ARCHITECTURES.get(arch)
            if kind is not None and f.metadata.get(FOREIGN_MARKER[0]) == FOREIGN_MARKER[1]:
                kind = None  # HOT-Step's file under our architecture name: a dialect reads it
            if kind is not None:
                if expect is not None and kind != expect:
                    raise ComponentError(f"{f.path} is {arch}, expected {ARCH_OF[expect]} ({DESCRIPTIONS[expect]})")
                return Component(kind, str(path), f, read_hparams(f, kind))
        except BaseException:
            f.close()
            raise
        f.close()
    elif not os.path.isfile(path):
        raise GGUFFormatError(f"{path}: no such file")
    found = describe(path) if fmt else None
    if found is None:
        if fmt == "gguf":
            raise ComponentError(f"{path}: unknown architecture {arch!r} (expected one of {', '.join(ARCHITECTURES)}, "
                                 "or a ComfyUI or HOT-Step MiniMax Music 3 file)")
        raise GGUFFormatError(f"{path}: not a GGUF file, nor a safetensors file in a known MiniMax Music 3 layout")
    what, kinds = found
    kind = expect or kinds[0]
    if kind not in kinds:
        held = " and ".join(DESCRIPTIONS[k] for k in kinds)
        raise ComponentError(f"{path} is a {what} (it holds the {held}), expected {ARCH_OF[expect]} "
                             f"({DESCRIPTIONS[expect]})")
    f = open_mapped(path, kind, header_only=header_only)
    try:
        return Component(kind, str(path), f, read_hparams(f, kind))
    except BaseException:
        f.close()
        raise


def read_component(path: str | os.PathLike, expect: str | None = None) -> Component:
    """Kind and hyper-parameters of a file from its header alone (the file is not kept open), cached
    by path, size, mtime and kind: a whole request's files can be checked with `check_compatible`
    before any model is loaded."""
    kinds = kinds_of(path)
    kind = expect if expect in kinds else None

    def header(st) -> Component:
        comp = open_component(path, kind, header_only=True)
        comp.close()
        return comp

    comp = _HEADERS.get(path, header, kind)
    if expect is not None and comp.kind != expect:
        raise ComponentError(f"{comp.path} is {ARCH_OF[comp.kind]}, expected {ARCH_OF[expect]} ({DESCRIPTIONS[expect]})")
    return comp


_HEADERS = FileCache(64)
