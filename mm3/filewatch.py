"""Model files mapped into memory, and whether one changed under its mapping.

A component's weights stay views of its file's mapping and are read at every use. A file rewritten
in place (not replaced by a rename: that leaves the mapped version intact) shows its new bytes to the
mapping, and one cut short faults the process (SIGBUS) at the first read past its new end. So every
mapping is recorded with its file's identity (device, inode, size, mtime), and `check(path)` turns a
change of that file into a `FileChanged` error for the run: before a model is built, before each
stage, between its units and at its end (`mm3.song.stages`).

A file cut short while a unit of work (an AR frame, a DiT step, a vocoder window) reads it is
caught too, where the SIGBUS guard builds (`mm3.fault_guard`: Linux and macOS with a C compiler):
the reads past the new end get zeros and are counted, and the next `check` stops the run with
`FileChanged`, so the unit's result never reaches an output. Without the guard such a read still
ends the process; every tool of this package replaces the files it writes, never rewrites them.
"""

from __future__ import annotations

import os
import threading
import weakref

from . import fault_guard
from .errors import RunError


class FileChanged(RunError):
    """A mapped model file was rewritten in place or cut short while in use; the run stopped."""


_WATCHED: dict[str, list[tuple[tuple, weakref.ref, int | None]]] = {}  # abspath -> per mapping: (identity,
# the mapping, its slot in the SIGBUS guard)
_LOCK = threading.Lock()


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def watch(path: str | os.PathLike, fd: int, mapping) -> None:
    """Record that `mapping` (an `mmap.mmap`) maps the file open as `fd` at `path`, as it is now;
    the record goes with the mapping, which is guarded against a read past the file's end meanwhile."""
    key = os.path.abspath(path)
    entry = (_identity(os.fstat(fd)), weakref.ref(mapping), fault_guard.guard(mapping))
    with _LOCK:
        live = [e for e in _WATCHED.get(key, []) if e[1]() is not None]
        _WATCHED[key] = live + [entry]


def check(*paths: str | os.PathLike) -> None:
    """Raise `FileChanged` where a file of `paths` that a live mapping reads was changed in place
    since it was mapped, or cut short while it was read (a stat a file: microseconds)."""
    for path in paths:
        key = os.path.abspath(path)
        with _LOCK:
            entries = [(ident, slot) for ident, ref, slot in _WATCHED.get(key, ()) if ref() is not None]
        if not entries:
            continue
        try:
            now = _identity(os.stat(key))
        except OSError:
            now = None  # removed: the mapped version lives on until it is unmapped
        for ident, slot in entries:
            if fault_guard.faults(slot):
                size = f"{ident[2]} bytes, now {now[2]}" if now is not None and now[2] < ident[2] else \
                    f"{ident[2]} bytes, read while shorter, now " + (f"{now[2]}" if now is not None else "removed")
                raise FileChanged(f"{path} was cut short while in use ({size}): the run stopped; " + _ADVICE)
        if now is None:
            continue
        for ident in {ident for ident, _ in entries}:
            if ident[:2] == now[:2] and ident != now:
                if now[2] < ident[2]:
                    raise FileChanged(f"{path} was cut short while in use ({ident[2]} bytes, now {now[2]}): the run "
                                      "stopped; " + _ADVICE)
                size = f"{ident[2]} bytes, now {now[2]}" if ident[2] != now[2] else f"still {now[2]} bytes"
                raise FileChanged(f"{path} changed on disk while in use ({size}): the run stopped; " + _ADVICE)


_ADVICE = "write a new model file beside it and rename it over the old one, never into it"
