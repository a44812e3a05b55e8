"""Model files mapped into memory, and whether one changed under its mapping.

A component's weights stay views of its file's mapping and are read at every use. A file rewritten
in place (not replaced by a rename: that leaves the mapped version intact) shows its new bytes to the
mapping, and one cut short faults the process (SIGBUS) at the first read past its new end. So every
mapping is recorded with its file's identity (device, inode, size, mtime), and `check(path)` turns a
change of that file into a `FileChanged` error for the run: before a model is built, before each
stage and between its units (`mm3.song.stages`).

What this cannot cover: a file cut short while a unit of work (an AR frame, a DiT step, a vocoder
window) reads it still faults before the next check; that needs the file to be replaced, not
rewritten in place, as every tool of this package writes its files.
"""

from __future__ import annotations

import os
import threading
import weakref

from .errors import RunError


class FileChanged(RunError):
    """A mapped model file was rewritten in place while in use; the run stopped."""


_WATCHED: dict[str, list[tuple[tuple, weakref.ref]]] = {}  # abspath -> (identity, the mapping) per mapping
_LOCK = threading.Lock()


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def watch(path: str | os.PathLike, fd: int, mapping) -> None:
    """Record that `mapping` (an `mmap.mmap`) maps the file open as `fd` at `path`, as it is now;
    the record goes with the mapping."""
    key = os.path.abspath(path)
    entry = (_identity(os.fstat(fd)), weakref.ref(mapping))
    with _LOCK:
        live = [e for e in _WATCHED.get(key, []) if e[1]() is not None]
        _WATCHED[key] = live + [entry]


def check(*paths: str | os.PathLike) -> None:
    """Raise `FileChanged` where a file of `paths` that a live mapping reads was changed in place
    since it was mapped (a stat a file: microseconds)."""
    for path in paths:
        key = os.path.abspath(path)
        with _LOCK:
            entries = [(ident, ref) for ident, ref in _WATCHED.get(key, ()) if ref() is not None]
        if not entries:
            continue
        try:
            now = _identity(os.stat(key))
        except OSError:
            continue  # removed: the mapped version lives on until it is unmapped
        for ident in {ident for ident, _ in entries}:
            if ident[:2] == now[:2] and ident != now:
                size = f"{ident[2]} bytes, now {now[2]}" if ident[2] != now[2] else f"still {now[2]} bytes"
                raise FileChanged(f"{path} changed on disk while in use ({size}): the run stopped; write a new "
                                  "model file beside it and rename it over the old one, never into it")
