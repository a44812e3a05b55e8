"""The errors the engine raises on purpose, under one base that carries the command line's exit code.

`InputError` (exit 2): what the user gave cannot work (a request, prompt, codes, model file or
output path); refused before any work where possible. `RunError` (exit 1): a run that failed
(diverged to NaN/Inf, out of device memory, the LM ended at once). `Cancelled` (exit 130): the
caller asked to stop. Messages name the value and what was expected.
"""

from __future__ import annotations


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
