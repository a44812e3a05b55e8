"""Whether Triton's kernels run under its interpreter: the one reader of `TRITON_INTERPRET` in the
GPU back end (it has to be set before Triton is first imported)."""

from __future__ import annotations

import os


def interpreted() -> bool:
    """Whether Triton's kernels run under its interpreter (`TRITON_INTERPRET=1`): on the CPU, with
    numpy's arithmetic where a GPU has its own conversions and functions."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
