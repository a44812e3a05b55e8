"""Reading outside data with bounds: JSON with a nesting depth and number lengths bounded, and files
read whole only up to a size.

Python's `json` recurses once per nesting level (a few thousand `[` end in a RecursionError) and
turns an integer of thousands of digits into a ValueError of its own words; reading `/dev/zero`
whole never ends. These helpers refuse such input with a `BoundError` (a ValueError) that names
what was read and the bound, before the work, so every reader of requests, headers and cache
records turns them into its own one-line error.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

MAX_JSON_DEPTH = 64  # requests, safetensors headers and cache records nest a few levels
MAX_RECORD_BYTES = 16 * 2**20  # a cache record of what the engine measured (a few kB per machine)
MAX_NUMBER_CHARS = 40  # a JSON number longer than this is no setting of this engine (2^64 has 20 digits)

# JSON text without its strings: the brackets left nest. Strings are matched whole (escapes
# included), so a bracket inside one never counts.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


class BoundError(ValueError):
    """Outside data past one of the bounds; the message names it and the bound."""


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text `raw` (strings skipped)."""
    b = np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)
    steps = (b == ord("[")).astype(np.int64) + (b == ord("{")) - (b == ord("]")) - (b == ord("}"))
    return int(np.cumsum(steps).max(initial=0))


def _number(text: str, kind):
    if len(text) > MAX_NUMBER_CHARS:
        raise BoundError(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return kind(text)


def loads(text: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH):
    """`json.loads(text)` with its nesting at most `max_depth` deep and every number at most
    `MAX_NUMBER_CHARS` long; a BoundError naming `what` otherwise. Malformed JSON stays a
    json.JSONDecodeError (a ValueError) and bytes that are no UTF-8 a UnicodeDecodeError."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    depth = json_depth(raw)
    if depth > max_depth:
        raise BoundError(f"{what} nests {depth} levels deep (at most {max_depth})")
    try:
        return json.loads(text, parse_int=lambda s: _number(s, int), parse_float=lambda s: _number(s, float))
    except BoundError as e:
        raise BoundError(f"{what} holds {e}") from None
    except RecursionError:  # unreachable within the depth bound; kept as a last guard
        raise BoundError(f"{what} nests too deep") from None


def read_bytes(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of file `path`, read only when it holds at most `limit` of them (a device such as
    /dev/zero or a pipe is read up to `limit` + 1 bytes, never whole); a BoundError naming `what`
    otherwise. OSError passes through."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BoundError(f"{what} {os.fspath(path)} is larger than {_size(limit)} (more than {limit} bytes)")
    return data


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB" if n >= 2**10 else f"{n} bytes"
