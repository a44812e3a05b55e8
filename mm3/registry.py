"""A models folder sorted into the five component buckets by architecture (header reads only)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .components import ARCH_OF, ARCHITECTURES, DESCRIPTIONS, KINDS
from .gguf.errors import ComponentError, GGUFFormatError
from .gguf.reader import read_architecture


@dataclass
class Registry:
    """Files of one or more folders: `buckets[kind]` are sorted file names; `foreign` lists every
    other `.gguf` file with its architecture or the reason it could not be read."""

    folders: list[str]
    buckets: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KINDS})
    paths: dict[str, str] = field(default_factory=dict)  # file name -> full path
    foreign: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def scan(cls, *folders: str | os.PathLike) -> "Registry":
        reg = cls([str(f) for f in folders])
        for folder in folders:
            folder = Path(folder)
            if not folder.is_dir():
                continue
            for p in sorted(folder.rglob("*.gguf")):
                if not p.is_file():
                    continue
                name = p.relative_to(folder).as_posix()
                if name in reg.paths:
                    continue  # the first folder wins, as with ComfyUI's model paths
                try:
                    arch = read_architecture(p)
                except (GGUFFormatError, OSError) as e:
                    reg.foreign.append((name, f"unreadable: {e}"))
                    continue
                kind = ARCHITECTURES.get(arch)
                if kind is None:
                    reg.foreign.append((name, f"architecture {arch!r}"))
                    continue
                reg.buckets[kind].append(name)
                reg.paths[name] = str(p)
        for names in reg.buckets.values():
            names.sort()  # native BF16/F32 sort before Q..., so "" picks the native file
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
        """Full path of `name` in the `kind` bucket; "" picks the first file of the bucket."""
        if kind not in self.buckets:
            raise ComponentError(f"unknown component kind {kind!r} (expected one of {', '.join(KINDS)})")
        names = self.buckets[kind]
        where = ", ".join(self.folders) or "(no folder)"
        missing = [f for f in self.folders if not Path(f).is_dir()]
        note = f" ({', '.join(missing)}: no such folder)" if missing else ""
        if not name:
            if not names:
                skipped = "".join(f"; skipped {n}: {why}" for n, why in self.foreign[:5])
                if len(self.foreign) > 5:
                    skipped += f" (and {len(self.foreign) - 5} more)"
                raise ComponentError(
                    f"no {ARCH_OF[kind]} ({DESCRIPTIONS[kind]}) file in {where}{note}{skipped}")
            return self.paths[names[0]]
        found = self.find(kind, name)  # a bare file name also finds a file in a subfolder
        if found is not None:
            return found
        for other, others in self.buckets.items():  # the file exists, but is another component
            for n in others:
                if name in (n, os.path.basename(n)):
                    raise ComponentError(f"{n} is {ARCH_OF[other]} ({DESCRIPTIONS[other]}), expected "
                                         f"{ARCH_OF[kind]} ({DESCRIPTIONS[kind]})")
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
