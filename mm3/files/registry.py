"""A models folder sorted into the five component buckets by architecture (header reads only), and
the choice of a file where none is named ("" or "auto")."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..components import ARCH_OF, DESCRIPTIONS, KINDS, check_loadable, is_full_size
from ..filecache import FileCache
from ..formats.gguf.errors import ComponentError, GGUFFormatError
from ..formats.gguf.reader import read_architecture
from .opener import kinds_of, read_component

AUTO = "auto"  # a model name that lets the engine choose the file (`pick_file`)
log = logging.getLogger(__name__)


# Files a models folder may hold: our GGUFs, and other tools' GGUF or safetensors files.
MODEL_SUFFIXES = (".gguf", ".safetensors", ".sft")


def _why_not(path) -> str:
    """Why a GGUF in a models folder is no component (for the listing of skipped files)."""
    try:
        return f"architecture {read_architecture(path)!r}"
    except (GGUFFormatError, OSError) as e:
        return f"unreadable: {e}"


def bits_per_weight(path: str | os.PathLike, kind: str | None = None) -> float:
    """Stored bits per value over the tensors of a file's component `kind` (its only one by
    default; header read, cached): 32 for F32, 16 for BF16, about 8.5 for Q8_0 and 4.8 for Q4_K_M."""
    infos = read_component(path, kind).file.tensor_infos()
    values = sum(math.prod(shape) for _, shape, _ in infos)
    return 8 * sum(_tensor_bytes(infos)) / max(1, values)


def _tensor_bytes(infos):
    import gguf

    for _, shape, qtype in infos:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        yield math.prod(shape) // block * size


def file_problem(path: str | os.PathLike, kind: str) -> str:
    """Why file `path` cannot be the `kind` component, or "" when it can: its header and tensor
    table readable, every tensor inside the file, the right component, tensor types the engine
    dequantizes and sizes its tensors can hold (header read; cached by path, size and mtime)."""
    try:
        return _PROBLEMS.get(path, lambda st: _problem(path, kind), kind)
    except OSError as e:
        return f"{path}: {e.strerror or e}"


def _problem(path, kind: str) -> str:
    try:
        held = kinds_of(path)
        if not held:
            read_component(path)  # raises, saying why the file is no component
            raise ComponentError(f"{path} is no readable MM3 file")
        if kind not in held:
            raise ComponentError(f"{path} is {' and '.join(ARCH_OF[k] for k in held)}, expected {ARCH_OF[kind]}")
        check_loadable(read_component(path, kind))
        return ""
    except (ComponentError, GGUFFormatError, OSError, ValueError) as e:
        return str(e)


_PROBLEMS = FileCache(512)
_WARNED: set[tuple] = set()


def pick_file(paths: list[str], memory: int | None = None, kind: str | None = None) -> str:
    """The file to use when none is named, of files that can be used (`pick_usable` sorts them
    out): full-size models before tiny ones (`is_full_size`), then the most precise (most stored
    bits per weight of component `kind`) whose size fits in `memory` bytes, else the smallest; with
    no limit, the most precise. Ties keep the order of `paths`."""
    if not paths:
        raise ValueError("no file to pick from")
    full = [p for p in paths if is_full_size(read_component(p, kind))]
    tier = full or list(paths)
    ranked = sorted(tier, key=lambda p: -bits_per_weight(p, kind))  # stable: ties keep their order
    if memory is None:
        return ranked[0]
    fitting = [p for p in ranked if os.path.getsize(p) <= memory]
    return fitting[0] if fitting else min(tier, key=os.path.getsize)


def pick_usable(paths: list[str], memory: int | None, kind: str, names: dict[str, str] | None = None) -> str:
    """`pick_file` over the files of `paths` that `kind` can use; each file skipped is one warning
    (once per file and version) naming it and why. None usable: a ComponentError listing each file
    and its problem. `names`: path -> the name to show (default: the path)."""
    names = names or {}
    problems = {p: file_problem(p, kind).removeprefix(f"{p}: ") for p in paths}
    usable = [p for p in paths if not problems[p]]
    if not usable:
        listing = "; ".join(f"{names.get(p, p)}: {why}" for p, why in problems.items())
        raise ComponentError(f"no usable {ARCH_OF[kind]} ({DESCRIPTIONS[kind]}) file: {listing}")
    chosen = pick_file(usable, memory, kind)
    for p, why in problems.items():
        if why:
            st = os.stat(p) if os.path.exists(p) else None
            key = (os.path.abspath(p), kind, st and st.st_size, st and st.st_mtime_ns)
            if key not in _WARNED:
                _WARNED.add(key)
                log.warning("MM3: auto skips %s for the %s, as it cannot be used (%s); using %s",
                            names.get(p, p), DESCRIPTIONS[kind], why, names.get(chosen, chosen))
    return chosen


@dataclass
class Registry:
    """Files of one or more folders: `buckets[kind]` are sorted file names; `foreign` lists every
    other `.gguf` file with its architecture or the reason it could not be read."""

    folders: list[str]
    buckets: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KINDS})
    paths: dict[str, str] = field(default_factory=dict)  # file name -> full path
    foreign: list[tuple[str, str]] = field(default_factory=list)
    memory: int | None = None  # bytes a chosen file may take (the device's memory), None: no limit

    @classmethod
    def scan(cls, *folders: str | os.PathLike) -> "Registry":
        reg = cls([str(f) for f in folders])
        for folder in folders:
            folder = Path(folder)
            if not folder.is_dir():
                continue
            for p in sorted(folder.rglob("*")):
                if not p.is_file() or p.suffix not in MODEL_SUFFIXES:
                    continue
                name = p.relative_to(folder).as_posix()
                if name in reg.paths:
                    continue  # the first folder wins, as with ComfyUI's model paths
                kinds = kinds_of(p)
                if not kinds:
                    if p.suffix == ".gguf":  # other safetensors are other models: not worth a line
                        reg.foreign.append((name, _why_not(p)))
                    continue
                for kind in kinds:  # another tool's file may hold several components
                    reg.buckets[kind].append(name)
                reg.paths[name] = str(p)
        for names in reg.buckets.values():
            names.sort()
        return reg

    def find(self, kind: str, name: str) -> str | None:
        """Full path of file `name` (or a bare file name in a subfolder) in the `kind` bucket, or None."""
        names = self.buckets.get(kind, [])
        if name in names:
            return self.paths[name]
        for n in names:
            if os.path.basename(n) == name:
                return self.paths[n]
        return None

    def name_of(self, path: str) -> str:
        """The name of a full path as the buckets list it."""
        for n, p in self.paths.items():
            if p == path:
                return n
        raise KeyError(path)

    def resolve(self, kind: str, name: str = "") -> str:
        """Full path of `name` in the `kind` bucket; "" or "auto" picks one (`pick_usable`: a usable
        file, full-size before tiny, the most precise that fits `self.memory`)."""
        if kind not in self.buckets:
            raise ComponentError(f"unknown component kind {kind!r} (expected one of {', '.join(KINDS)})")
        names = self.buckets[kind]
        where = ", ".join(self.folders) or "(no folder)"
        missing = [f for f in self.folders if not Path(f).is_dir()]
        note = f" ({', '.join(missing)}: no such folder)" if missing else ""
        if not name or name == AUTO:
            if not names:
                skipped = "".join(f"; skipped {n}: {why}" for n, why in self.foreign[:5])
                if len(self.foreign) > 5:
                    skipped += f" (and {len(self.foreign) - 5} more)"
                raise ComponentError(
                    f"no {ARCH_OF[kind]} ({DESCRIPTIONS[kind]}) file in {where}{note}{skipped}")
            return pick_usable([self.paths[n] for n in names], self.memory, kind, {self.paths[n]: n for n in names})
        found = self.find(kind, name)  # a bare file name also finds a file in a subfolder
        if found is not None:
            return found
        for other, others in self.buckets.items():  # the file exists, but is another component
            for n in others:
                if name in (n, os.path.basename(n)):
                    held = kinds_of(self.paths[n])
                    what = (f"is {ARCH_OF[other]} ({DESCRIPTIONS[other]})" if len(held) == 1 else
                            "holds the " + " and ".join(DESCRIPTIONS[k] for k in held))
                    raise ComponentError(f"{n} {what}, expected {ARCH_OF[kind]} ({DESCRIPTIONS[kind]})")
        for n, why in self.foreign:
            if name in (n, os.path.basename(n)):
                raise ComponentError(f"{n} cannot be the {ARCH_OF[kind]} model: {why}")
        listing = ", ".join(names) if names else "none"
        raise ComponentError(
            f"unknown {ARCH_OF[kind]} model {name!r} in {where}{note} (available: {listing})")

    def report(self) -> str:
        lines = []
        for kind in KINDS:
            names = self.buckets[kind]
            lines.append(f"{ARCH_OF[kind]:10s} {', '.join(names) if names else '(none)'}")
        for name, why in self.foreign:
            lines.append(f"skipped    {name}: {why}")
        return "\n".join(lines)
