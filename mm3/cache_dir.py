"""Where the engine keeps what it measured on this machine (kernel choices and tunings): a folder
the user can see and clear. `MM3_CACHE_DIR` names it; otherwise the platform's user cache folder
(`$XDG_CACHE_HOME` or `~/.cache` on Linux, `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on
Windows) + `mm3`. Deleting it only costs the measurements again."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import switches


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
