"""Where the engine keeps what it measured and built on this machine: a folder the user can see and
clear. `MM3_CACHE_DIR` names it; otherwise the platform's user cache folder (`$XDG_CACHE_HOME` or
`~/.cache` on Linux, `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on Windows) + `mm3`. What is
measured goes to one record in it (`record.json`, in sections: `recorded`, `remember`), read with
bounds (`mm3.bounded`) and written in one step. Deleting the folder only costs the measurements
again; a folder that cannot be written costs them at every run (`writable`), never the run."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import time
from pathlib import Path

from . import switches
from .bounded import MAX_RECORD_BYTES, loads, read_bytes

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


# -- the record ----------------------------------------------------------------------------------------
RECORD_NAME = "record.json"
RECORD_VERSION = 1
RECORD_STALE_SECONDS = 60  # a record's temporary older than this was left by a killed process (writing takes milliseconds)


def _cpu_products(data) -> bool:
    return isinstance(data, dict) and set(data) == {"version", "choices"} and data["version"] == 1 and \
        isinstance(data["choices"], dict)


def _kernel_choices(data) -> bool:
    return isinstance(data, dict) and bool(data) and all(
        isinstance(k, str) and " | driver " in k and " | torch " in k and isinstance(v, dict) and
        all(isinstance(e, dict) for e in v.values()) for k, v in data.items())


# Records earlier versions of the engine kept, which the record replaces: each is removed where it
# holds what ours held (another program's file of that name stays).
OLD_RECORDS = {"cpu-products.json": _cpu_products, "choices.json": _kernel_choices}

_WARNED: set[tuple[str, str]] = set()  # (record, why), warned once a process
_SWEPT: set[str] = set()  # cache folders whose old records were looked at in this process


def record_path() -> Path:
    """The one file of what the engine measured on this machine, in sections."""
    return cache_dir() / RECORD_NAME


def _warn_once(path: Path, why: str, what: str) -> None:
    if (str(path), why) not in _WARNED:
        _WARNED.add((str(path), why))
        log.warning("%s the record %s (%s); %s", "ignoring" if what == "read" else "cannot write", path, why,
                    "measuring again" if what == "read" else "the measurement holds for this process")


def _read_record() -> dict:
    """The record's sections ({} without a record; one that cannot be read is warned about once)."""
    path = record_path()
    try:
        data = loads(read_bytes(path, MAX_RECORD_BYTES, "the record"), "the record")
    except (FileNotFoundError, NotADirectoryError):  # no record (or no folder): nothing to say
        return {}
    except (OSError, ValueError) as e:  # UnicodeDecodeError and the bounds' errors are ValueErrors
        _warn_once(path, getattr(e, "strerror", None) or str(e), "read")
        return {}
    sections = data.get("sections") if isinstance(data, dict) and data.get("version") == RECORD_VERSION else None
    if not isinstance(sections, dict) or not all(isinstance(s, dict) for s in sections.values()):
        _warn_once(path, f"not a record of version {RECORD_VERSION}", "read")
        return {}
    return sections


def recorded(section: str) -> dict:
    """The entries of `section` of the record, by key ({} without them)."""
    drop_old_records()
    return dict(_read_record().get(section, {}))


def remember(section: str, key: str, entry: dict) -> bool:
    """Keep `entry`, dated, under `key` in `section` of the record: the record read, merged and
    written to a temporary that replaces it in one step. Where the folder or the record cannot be
    written, nothing is kept, with one warning (never an error); returns whether it was kept."""
    drop_old_records()
    if writable() is None:  # warned once
        return False
    path = record_path()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    clear_stale(path.parent, f".{path.name}.*.tmp", RECORD_STALE_SECONDS)
    try:
        if path.exists() and not path.is_file():
            raise IsADirectoryError(errno.EISDIR, "not a file")
        sections = _read_record()
        sections.setdefault(section, {})[key] = {**entry, "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
        tmp.write_text(json.dumps({"version": RECORD_VERSION, "sections": sections}, indent=1, sort_keys=True) + "\n",
                       encoding="utf-8")
        os.replace(tmp, path)
        return True
    except OSError as e:
        _warn_once(path, e.strerror or str(e), "write")
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False


def drop_old_records() -> None:
    """Remove, once a process, the records earlier versions kept in the cache folder (`OLD_RECORDS`)
    where they hold what those versions wrote; whatever cannot be read or removed stays, unread."""
    folder = cache_dir()
    if str(folder) in _SWEPT:
        return
    _SWEPT.add(str(folder))
    for name, ours in OLD_RECORDS.items():
        path = folder / name
        try:
            if path.is_file() and ours(loads(read_bytes(path, MAX_RECORD_BYTES, name), name)):
                path.unlink()
        except (OSError, ValueError):
            pass
