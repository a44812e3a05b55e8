"""Files other tools write, read as our components: which components a file holds (from its tensor
names, never its file name) and the engine's view of each (`mapped.MappedFile`).

Dialects: ComfyUI's repackaged files and GGUFs made from them (`comfy`), HOT-Step's GGUFs
(`hotstep`). A file in our own layout (general.architecture `mm3-*`) is not foreign and never
comes here.
"""

from __future__ import annotations

import os

from ..filecache import FileCache
from ..formats.gguf.errors import ComponentError
from . import comfy, hotstep
from .mapped import MappedFile
from .source import Source, file_format

DIALECTS = (comfy, hotstep)


def _detect(src: Source) -> dict[str, tuple[str, object]]:
    for dialect in DIALECTS:
        found = dialect.detect(src)
        if found:
            return found
    return {}


def describe(path: str | os.PathLike) -> tuple[str, tuple[str, ...]] | None:
    """(what the file is, the component kinds it holds) for a foreign file, None when it is not one
    (header read, cached by path, size and mtime)."""
    return _DESCRIBED.get(path, lambda st: _describe(path))


def _describe(path) -> tuple[str, tuple[str, ...]] | None:
    if file_format(path) is None:
        return None
    src = Source(path, header_only=True)
    try:
        found = _detect(src)
    finally:
        src.close()
    return (next(iter(found.values()))[0], tuple(found)) if found else None


_DESCRIBED = FileCache(256)


def open_mapped(path: str | os.PathLike, kind: str, *, header_only: bool = False) -> MappedFile:
    """The engine's view of component `kind` of a foreign file."""
    src = Source(path, header_only=header_only)
    try:
        found = _detect(src)
        if kind not in found:
            raise ComponentError(f"{path}: holds no {kind} component in a known layout")
        what, builder = found[kind]
        arch, metadata, plans = builder(src)
        return MappedFile(src, arch, metadata, plans, what)
    except BaseException:
        src.close()
        raise
