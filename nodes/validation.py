"""Queue-time checks of node inputs (ComfyUI's `validate_inputs`): a value no stage can use is
refused when the prompt is queued, before any upstream node runs, as `/prompt` refuses a number
out of its widget's range.

ComfyUI passes a validator only the values typed in widgets: a linked input arrives as None and an
optional input left unset not at all, so each check skips what it was not given. ComfyUI also
skips its own min/max check for every input a validator names, so `out_of_range` repeats it.
"""

from __future__ import annotations

import math

from mm3.plan.prompt import text_problem

UNSET = object()  # the default of an optional input a validator names: absent from the prompt


def _given(value) -> bool:
    return value is not None and value is not UNSET


def verdict(*problems: str | None) -> bool | str:
    """What `validate_inputs` returns: True, or the first problem (ComfyUI shows it on the node)."""
    return next((p for p in problems if p), True)


def out_of_range(node, **values) -> str | None:
    """The first of `values` outside its widget's min..max in `node`'s schema (or not a finite
    number), or None."""
    inputs = {i.id: i for i in node.define_schema().inputs}
    for name, value in values.items():
        if not _given(value) or not isinstance(value, (int, float)):
            continue
        low, high = getattr(inputs[name], "min", None), getattr(inputs[name], "max", None)
        if math.isfinite(value) and (low is None or value >= low) and (high is None or value <= high):
            continue
        if low is not None and high is not None:
            return f"{name} must be between {low:g} and {high:g}, got {value:g}"
        return f"{name} must be a finite number{f' of at least {low:g}' if low is not None else ''}" \
               f"{f' of at most {high:g}' if high is not None else ''}, got {value:g}"
    return None


def repaint_range(start, end) -> str | None:
    """MM3 Repaint's range must run forwards."""
    if _given(start) and _given(end) and not start < end:
        return f"MM3 Repaint: start ({start:g} s) must be before end ({end:g} s)"
    return None


def plan_durations(duration, min_duration, prior_codes=UNSET) -> str | None:
    """AR Plan's min_duration may not pass its duration, unless it continues a song (prior codes
    linked: the request's rule, mm3.song.request)."""
    if prior_codes is not UNSET:
        return None
    if _given(duration) and _given(min_duration) and min_duration > duration:
        return (f"MM3 AR Plan: min_duration ({min_duration:g} s) must not be longer than the duration "
                f"({duration:g} s)")
    return None


def prompt_texts(**texts) -> str | None:
    """A caption or lyrics no prompt may carry (control characters, unpaired surrogates)."""
    for name, text in texts.items():
        if isinstance(text, str):
            problem = text_problem(name, text)
            if problem:
                return f"MM3 Prompt: {problem}"
    return None
