"""The errors the engine raises on purpose, under one base that carries the command line's exit code.

`InputError` (exit 2): what the user gave cannot work (a request, prompt, codes, model file or
output path); refused before any work where possible. `RunError` (exit 1): a run that failed
(diverged to NaN/Inf, out of device memory, the LM ended at once). `Cancelled` (exit 130): the
caller asked to stop. Messages name the value and what was expected; the `check_*` functions
give every settings object (`mm3.plan.settings`, `mm3.synth.settings`) those one-line errors.
"""

from __future__ import annotations

import math
from numbers import Integral, Real


class MM3Error(Exception):
    """Base of the engine's errors; `exit_code` is what `python -m mm3` exits with."""

    exit_code = 1


class InputError(MM3Error, ValueError):
    """Bad input: nothing was run, or nothing was written."""

    exit_code = 2


class RunError(MM3Error, RuntimeError):
    """A run that failed part way; every model was released and nothing was written."""

    exit_code = 1


class Cancelled(MM3Error):
    """The caller asked to stop (`Progress.should_stop()` returned True); no partial result."""

    exit_code = 130


def check_range(name: str, value, low, high) -> None:
    """A ValueError naming `name` unless `low <= value <= high` (NaN is outside every range)."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low:g} and {high:g}, got {value if isinstance(value, int) else f'{value:g}'}")


def check_integer(name: str, value, low, high) -> int:
    """`value` as an int if it is an integer (not a bool) in `low..high`, else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    check_range(name, int(value), low, high)
    return int(value)


def check_number(name: str, value, low, high) -> float:
    """`value` as a float if it is a finite number (not a bool) in `low..high`, else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    check_range(name, float(value), low, high)
    return float(value)
