"""The CPU timings the engine keeps: what one is keyed by, and how it is kept once per machine.

Where a rule over the processor's flags loses (`mm3.backends.cpu.bf16`, `long_attention`), a
choice is timed on the machine, once: kept in the cache folder's record under a key naming the
processor, the usable cores, torch and the thread count, so later runs choose the same and give
the same audio.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...cache_dir import recorded, remember
from . import choice


def key(what: str, details: str) -> str:
    """The record key of a timing of `what` (with its `details`) on this machine, at this thread count."""
    return (f"{what}; cpu={choice.processor()}; cores={choice.usable_cores()}; torch={torch.__version__}; "
            f"threads={torch.get_num_threads()}; {details}")


def kept(section: str, key: str, memo: dict, valid: Callable[[dict], bool], measure: Callable[[], dict]) -> dict:
    """The entry of the timing under `key`: this process's (`memo`), else the record's where `valid`
    takes it, else `measure()`'s, kept in both (a record that cannot be written is timed again by
    the next process)."""
    if key not in memo:
        known = recorded(section).get(key)
        if isinstance(known, dict) and valid(known):
            memo[key] = known
        else:
            memo[key] = measure()
            remember(section, key, memo[key])
    return memo[key]
