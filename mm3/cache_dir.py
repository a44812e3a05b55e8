"""Where the engine keeps what it measured on this machine (kernel choices and tunings): a folder
the user can see and clear. `MM3_CACHE_DIR` names it; otherwise the platform's user cache folder
(`$XDG_CACHE_HOME` or `~/.cache` on Linux, `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on
Windows) + `mm3`. Deleting it only costs the measurements again; a folder that cannot be written costs them at
every run (`writable`), never the run."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from . import switches

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    named = switches.value("MM3_CACHE_DIR")
    if named:
        return Path(named).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mm3"


_UNUSABLE: dict[str, str] = {}  # folder -> why it cannot be written, warned once a process


def writable(part: str = "") -> Path | None:
    """The cache folder (or its sub-folder `part`), made if absent, where this process may write
    in it; None where it cannot (read-only, a file, a parent that cannot be made), with one warning
    a process naming the folder and why: the engine then runs on, keeping nothing it measures."""
    root = cache_dir()
    folder = root / part if part else root
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"no permission to write in {folder}")
        return folder
    except OSError as e:
        key = str(root)
        if key not in _UNUSABLE:
            _UNUSABLE[key] = e.strerror or str(e)
            log.warning("the cache folder %s cannot be written (%s; MM3_CACHE_DIR names another): what this "
                        "run measures or builds is not kept",
                        root, _UNUSABLE[key])
        return None


def clear_stale(folder: Path, pattern: str, seconds: float) -> None:
    """Remove what matches `pattern` in `folder` and was last changed over `seconds` ago: the
    temporaries of a process killed while it wrote (a live writer's are younger: its work is bounded
    in time). Whatever cannot be removed stays."""
    import shutil
    import time

    try:
        found = list(folder.glob(pattern))
    except OSError:
        return
    limit = time.time() - seconds
    for p in found:
        try:
            if p.lstat().st_mtime >= limit:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError:
            pass
