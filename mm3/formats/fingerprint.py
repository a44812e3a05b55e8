"""A short content fingerprint of a model file, recorded in replay requests.

A replay request names the files that made its track; rendering it later in a folder that gained
another quant, or where a file was replaced, must not silently use other weights. Hashing a whole
17 GB file is too slow for that check, so the fingerprint is the file size and a SHA-256 of the
GGUF header (metadata, tensor table: quant types and shapes) plus the first bytes of tensor data.
"""

from __future__ import annotations

import hashlib
import os
import struct

from ..filecache import FileCache

DATA_BYTES = 1 << 20  # tensor data hashed after the header
HEX_DIGITS = 16  # 64 bits of the digest: enough to tell files apart, short enough to read
_FINGERPRINTS = FileCache(1024)


def _hashed_length(path: str, size: int) -> int:
    """Bytes to hash: the GGUF header and DATA_BYTES of tensor data; other files, their first
    DATA_BYTES."""
    from .gguf.errors import GGUFFormatError
    from .gguf.reader import GGUFFile

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        return min(size, DATA_BYTES)
    try:
        with GGUFFile(path, header_only=True) as g:
            return min(size, g.data_offset + DATA_BYTES)
    except GGUFFormatError:
        return min(size, DATA_BYTES)


def file_fingerprint(path: str | os.PathLike) -> str:
    """"<size>-<first 16 hex digits of SHA-256>" of `path` (cached by path, size and mtime)."""
    path = os.fspath(path)
    return _FINGERPRINTS.get(path, lambda st: _fingerprint(path, st.st_size))


def _fingerprint(path: str, size: int) -> str:
    n = _hashed_length(path, size)
    h = hashlib.sha256(struct.pack("<Q", size))
    with open(path, "rb") as f:
        while n > 0:
            chunk = f.read(min(n, 1 << 22))
            if not chunk:
                break
            h.update(chunk)
            n -= len(chunk)
    return f"{size}-{h.hexdigest()[:HEX_DIGITS]}"


def is_fingerprint(value) -> bool:
    """Whether `value` has the form `file_fingerprint` writes."""
    if not isinstance(value, str) or "-" not in value:
        return False
    size, digest = value.split("-", 1)
    return size.isdigit() and len(digest) == HEX_DIGITS and all(c in "0123456789abcdef" for c in digest)
