"""A read past the end of a model file cut short while it is mapped: zeros and a count, not SIGBUS.

A unit of work (an AR frame, a DiT step, a vocoder window) on the CPU reads its model files'
mapped pages; one cut short in place under it faults the process with SIGBUS at the first read
past its new end. `fault_guard.c`, built once per machine with the system's C compiler (`CC`,
else `cc`, `gcc` or `clang`) into the cache folder and loaded with ctypes, installs a SIGBUS
handler: a fault inside a registered mapping (`guard`) gets a zero-filled page mapped over the
faulting one and is counted (`faults`), so the read goes on and `mm3.filewatch.check` turns the
count into an error for the run; any other SIGBUS goes to the handler that was there before, so a
real crash still crashes.

Where the guard cannot be had (Windows, no compiler, a failed build or load) `guard` returns
None and a cut-short file faults as before, with one debug line a process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path

from . import compiler
from .cache_dir import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fault_guard.c")
FLAGS = ("-O2", "-shared", "-fPIC", "-std=c11")
BUILD_SECONDS = 60
_LIBRARY: list = []  # [ctypes library or None], once per process
_LOCK = threading.RLock()  # re-entrant: a mapping's finalizer may run in a collection while it is held
_GUARDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a guarded mapping -> its release


def _folder() -> tuple[Path, bool]:
    """Where to build: the cache folder's `native`, else a temporary folder of its own (True: remove
    it once the library is loaded). Silent: the cache folder's own warning belongs to its users."""
    folder = cache_dir() / "native"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK | os.X_OK):
            return folder, False
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="mm3-fault-guard-")), True


def build() -> Path | None:
    """The compiled guard in the cache folder, built now if it is not there; None where it cannot be
    (not POSIX, no compiler, a failed build), with the reason in the debug log."""
    if os.name != "posix":
        return None
    cc = compiler.find()
    if cc is None:
        log.debug("no C compiler: a model file cut short while in use ends the process (SIGBUS)")
        return None
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, cc.encode(), sys.platform.encode(), platform.machine().encode(),
                                        " ".join(FLAGS).encode()])).hexdigest()[:20]
    name = f"fault_guard-{digest}.so"
    cached = cache_dir() / "native" / name
    try:
        if cached.is_file() and cached.stat().st_size > 0:
            return cached
    except OSError:
        pass
    try:
        folder, own = _folder()
        handle, tmp = tempfile.mkstemp(prefix=f".{Path(name).stem}.", suffix=".tmp", dir=folder)
        os.close(handle)
    except OSError as e:
        log.debug("no folder to build the SIGBUS guard in (%s)", e)
        return None
    try:
        done = compiler.run([cc, *FLAGS, str(SOURCE), "-o", tmp], BUILD_SECONDS)
        if done.returncode == 0:
            os.replace(tmp, folder / name)
            return folder / name
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    except (OSError, subprocess.SubprocessError) as e:
        why = str(e)
    finally:
        Path(tmp).unlink(missing_ok=True)
    if own:
        shutil.rmtree(folder, ignore_errors=True)
    log.debug("cannot build the SIGBUS guard with %s (%s)", cc, why)
    return None


def _load():
    """The guard loaded and installed; a cached build that does not load (cut short, damaged) is
    built again once."""
    for again in (False, True):
        path = build()
        if path is None:
            return None
        try:
            return _install(path)
        except OSError as e:
            log.debug("cannot load the SIGBUS guard %s (%s)%s", path, e, "" if again else ": building it again")
        path.unlink(missing_ok=True)
    return None


def _install(path: Path):
    try:
        lib = ctypes.CDLL(str(path))
        lib.mm3_guard_install.restype = ctypes.c_int
        lib.mm3_guard_add.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        lib.mm3_guard_add.restype = ctypes.c_int
        lib.mm3_guard_remove.argtypes = [ctypes.c_int]
        lib.mm3_guard_remove.restype = None
        lib.mm3_guard_faults.argtypes = [ctypes.c_int]
        lib.mm3_guard_faults.restype = ctypes.c_long
        installed = lib.mm3_guard_install() == 1
    except AttributeError as e:  # a library of that name without the guard's functions
        raise OSError(str(e)) from None
    finally:
        if path.parent.name.startswith("mm3-fault-guard-"):
            shutil.rmtree(path.parent, ignore_errors=True)
    if not installed:
        log.debug("cannot install the SIGBUS guard")
        return None
    return lib


def library():
    """The loaded guard with its handler installed, or None (built and loaded once a process)."""
    if not _LIBRARY:
        with _LOCK:
            if not _LIBRARY:
                _LIBRARY.append(_load())
    return _LIBRARY[0]


def _span(mapping) -> tuple[int, int]:
    """The address and length of `mapping`'s memory (a buffer: an `mmap.mmap`, writable or not)."""
    try:
        view = ctypes.c_char.from_buffer(mapping)
    except TypeError:  # a read-only buffer
        import numpy as np

        view = np.frombuffer(mapping, dtype=np.uint8)
        address = view.ctypes.data
    else:
        address = ctypes.addressof(view)
    del view  # the buffer is not held: the mapping still closes
    return address, len(mapping)


def guard(mapping) -> int | None:
    """Guard `mapping` (an open `mmap.mmap` of a model file) until it is gone: its slot for
    `faults`, or None where there is no guard (or its table is full)."""
    lib = library()
    if lib is None:
        return None
    address, length = _span(mapping)
    with _LOCK:
        slot = lib.mm3_guard_add(address, length)
    if slot < 0:
        log.debug("the SIGBUS guard's table is full: a mapping goes unguarded")
        return None
    _GUARDED[mapping] = weakref.finalize(mapping, _release, lib, slot)
    return slot


def unguard(mapping) -> None:
    """Stop guarding `mapping` now (it was just closed: its addresses may be mapped again for
    another file), not when it is collected."""
    release = _GUARDED.pop(mapping, None)
    if release is not None:
        release()


def _release(lib, slot: int) -> None:
    with _LOCK:
        lib.mm3_guard_remove(slot)


def faults(slot: int | None) -> int:
    """Reads past its file's end that the guarded mapping of `slot` took as zeros (0 unguarded)."""
    if slot is None:
        return 0
    return int(_LIBRARY[0].mm3_guard_faults(slot))
