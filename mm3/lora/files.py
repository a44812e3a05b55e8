"""Finding the adapter file a request names: as a path, by its name in the folders searched, or (a
replay request's, renamed or moved) by its recorded fingerprint among their `.safetensors` files."""

from __future__ import annotations

import os
from pathlib import Path

from ..formats.fingerprint import file_fingerprint
from .adapter import SUFFIX


def find_lora(name: str, fingerprint: str | None, folders) -> tuple[str | None, str]:
    """(path, how it was found: "path", "folder" or "fingerprint"), or (None, "") when no file of
    that name or fingerprint is found. Searched: `name` as a path, then each folder (and its `loras/`
    subfolder) for its file name, then their files by `fingerprint`."""
    if os.path.isfile(name):
        return name, "path"
    places = [Path(f) for f in folders] + [Path(f) / "loras" for f in folders]
    base = Path(name).name
    for folder in places:
        candidate = folder / base
        if candidate.is_file():
            return str(candidate), "folder"
    if fingerprint:
        for folder in places:
            if not folder.is_dir():
                continue
            for candidate in sorted(folder.glob("*" + SUFFIX)):
                if file_fingerprint(candidate) == fingerprint:
                    return str(candidate), "fingerprint"
    return None, ""
