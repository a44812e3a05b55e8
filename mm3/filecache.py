"""Values computed from a file, kept while the file is unchanged: the one cache every header read,
hash and classification goes through, so each is done once per file version."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable


class FileCache:
    """Keyed by absolute path, size and mtime_ns (plus any `extra` key parts), so a rewritten file
    is read again; at most `size` entries, the least recently used dropped first. `compute(st)`
    gets the file's `os.stat` result; what it raises propagates and nothing is stored."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a file cache holds at least 1 entry, got {size}")
        self.size = size
        self._values: OrderedDict[tuple, object] = OrderedDict()

    def get(self, path: str | os.PathLike, compute: Callable[[os.stat_result], object], *extra):
        st = os.stat(path)  # OSError propagates: a missing file is no entry
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, *extra)
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = compute(st)
        self._values[key] = value
        while len(self._values) > self.size:
            self._values.popitem(last=False)
        return value

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)
