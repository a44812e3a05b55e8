"""What a user has: the component files in one or more model folders and, for each published set, which
of its files are present, partly downloaded, missing or unusable (headers read only, no network). A
set's file is present when it has the published name, component, file type and size (a tiny test
model or another file under a published name is not).

The ComfyUI model panel shows this (`/mm3/inventory`); downloads go through
`mm3.tools.download` (huggingface_hub underneath), which resumes the `.part` files counted here.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..components import ARCH_OF, BY_FOLDER, KINDS
from ..formats.published import PART, PUBLISHED_SIZES, SETS, matches_published, published_name
from .opener import kinds_of, read_component
from .registry import MODEL_SUFFIXES, bits_per_weight, file_problem

def published_bytes(component: str, file_type: str) -> int:
    """About how many bytes the published file of `component` in `file_type` is (the rounded figure
    the model's repository lists)."""
    return round(PUBLISHED_SIZES[BY_FOLDER[component].kind, file_type])


@dataclass
class LocalFile:
    """A component file in a models folder."""

    name: str  # relative to its folder
    folder: str
    size: int
    kind: str | None  # None: not a readable MM3 component
    file_type: str = ""  # general.file_type of a quantized file ("Q8_0", "Q4_K_M"), else the tensors' type
    bits_per_weight: float = 0.0
    problem: str = ""  # why the file cannot be used (unreadable header, unknown architecture)


@dataclass
class SetFile:
    """One file of a published set, as the folders have it."""

    name: str
    kind: str
    state: str  # "present", "partial" (a .part left by an interrupted download), "missing", "unusable"
    size: int = 0  # bytes on disk (for "partial": bytes downloaded so far)
    problem: str = ""
    published: int = 0  # about how many bytes the published file is


@dataclass
class Inventory:
    folders: list[str]
    components: dict[str, list[LocalFile]] = field(default_factory=lambda: {k: [] for k in KINDS})
    unusable: list[LocalFile] = field(default_factory=list)
    sets: dict[str, list[SetFile]] = field(default_factory=dict)
    free: int | None = None  # bytes free where a download goes (the first folder), None: unknown

    def complete_sets(self) -> list[str]:
        return [s for s, files in self.sets.items() if all(f.state == "present" for f in files)]

    def set_sizes(self) -> dict[str, dict[str, int]]:
        """Per set: about how many bytes its files are, and how many a download still fetches
        (a partly downloaded file resumes; an unusable one is fetched again)."""
        out = {}
        for s, files in self.sets.items():
            left = sum(0 if f.state == "present" else max(f.published - f.size, 0) if f.state == "partial"
                       else f.published for f in files)
            out[s] = {"total": sum(f.published for f in files), "to_fetch": left}
        return out

    def unusable_in_set(self, set_name: str) -> list[str]:
        """The set's files that are there under their published names but cannot be used."""
        return [f.name for f in self.sets.get(set_name, []) if f.state == "unusable"]

    def missing_kinds(self) -> list[str]:
        return [k for k in KINDS if not self.components[k]]

    def to_dict(self) -> dict:
        return {"folders": self.folders,
                "components": {k: [asdict(f) for f in v] for k, v in self.components.items()},
                "unusable": [asdict(f) for f in self.unusable],
                "sets": {s: [asdict(f) for f in v] for s, v in self.sets.items()},
                "complete_sets": self.complete_sets(), "missing_kinds": self.missing_kinds(),
                "set_sizes": self.set_sizes(), "free": self.free}


def free_bytes(folder: str | os.PathLike) -> int | None:
    """Bytes free on the disk of `folder` (or of its nearest existing parent: a download creates it)."""
    p = Path(folder).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _describe(path: Path, folder: Path) -> list[LocalFile]:
    """One entry per component the file holds (another tool's file may hold several), or one
    unusable entry (`mm3.files.registry.file_problem`, the check "auto" and the loaders' lists make); none
    for a safetensors file that is no MM3 file (another model)."""
    name, size = path.relative_to(folder).as_posix(), path.stat().st_size
    kinds = kinds_of(path)
    if not kinds and path.suffix != ".gguf":
        return []
    out = []
    for kind in kinds or (None,):
        why = file_problem(path, kind or KINDS[0])
        if why:
            return [LocalFile(name, str(folder), size, None, problem=why)]
        comp = read_component(path, kind)
        file_type = comp.file.metadata.get("general.file_type")
        if not isinstance(file_type, str):  # native files carry no file type string: name their tensors' type
            counts = Counter(qtype.name for _, _, qtype in comp.file.tensor_infos())
            file_type = counts.most_common(1)[0][0] if counts else ""
        out.append(LocalFile(name, str(folder), size, comp.kind, file_type, round(bits_per_weight(path, kind), 2)))
    return out


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def scan(*folders: str | os.PathLike, others: tuple = ()) -> Inventory:
    """The inventory of `folders` (the first folder holding a name wins, as a registry scan), plus
    the component files of `others` (folders of other models too: ComfyUI's text_encoders, ...;
    their files that are no MM3 component are not listed)."""
    inv = Inventory([str(f) for f in (*folders, *others)])
    only_components = {str(Path(f)) for f in others} - {str(Path(f)) for f in folders}
    seen: dict[str, LocalFile] = {}
    parts: dict[str, int] = {}
    for folder in map(Path, (*folders, *others)):
        if not folder.is_dir():
            continue
        for p in sorted(folder.rglob("*")):
            if not p.is_file():
                continue
            rel = p.relative_to(folder).as_posix()
            if rel.endswith(".gguf" + PART):
                parts.setdefault(rel[:-len(PART)], p.stat().st_size)
            elif p.suffix in MODEL_SUFFIXES and rel not in seen:
                if str(folder) in only_components and not kinds_of(p):
                    continue
                for f in _describe(p, folder):
                    seen.setdefault(rel, f)
                    (inv.components[f.kind] if f.kind else inv.unusable).append(f)
    by_base = {os.path.basename(n): f for n, f in seen.items()}
    for set_name in SETS:
        files = []
        for component, file_type in SETS[set_name].items():
            name, kind = published_name(component, file_type), BY_FOLDER[component].kind
            f, published = by_base.get(name), published_bytes(component, file_type)
            matches = f is not None and f.file_type == file_type and matches_published(kind, file_type, f.size)
            if f is not None and f.kind == kind and matches:
                files.append(SetFile(name, kind, "present", f.size, published=published))
            elif f is not None:
                if f.kind != kind:
                    what = f"{ARCH_OF[f.kind]}, expected {ARCH_OF[kind]}" if f.kind else f.problem
                elif f.file_type != file_type:
                    what = f"its tensors are {f.file_type}, the published file's {file_type}"
                else:
                    what = (f"{_size(f.size)}, the published file {_size(PUBLISHED_SIZES[kind, file_type])} "
                            "(not the published model)")
                files.append(SetFile(name, kind, "unusable", f.size, f"{name}: {what}", published))
            elif name in parts:
                files.append(SetFile(name, kind, "partial", parts[name], published=published))
            else:
                files.append(SetFile(name, kind, "missing", published=published))
        inv.sets[set_name] = files
    if folders:
        inv.free = free_bytes(folders[0])
    return inv
