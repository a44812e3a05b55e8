"""Progress reporting and cancellation shared by the long-running stages (AR, DiT, vocoder)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _no_progress(stage: str, done: int, total: int, info: dict) -> None:
    pass


def _never() -> bool:
    return False


@dataclass(frozen=True)
class Stage:
    """A long-running stage as the command line and the nodes show it."""

    label: str  # "planning", "DiT" ...
    unit: str  # what `done` counts: "frame", "step", "window"


# Every `on_progress` stage name the engine reports.
STAGES = {
    "ar": Stage("planning", "frame"),
    "replay": Stage("replaying codes", "frame"),
    "cond": Stage("conditions", "window"),
    "dit": Stage("DiT", "step"),
    "vae": Stage("vocoder", "window"),
}


@dataclass
class Progress:
    """`on_progress(stage, done, total, info)` after each unit of work; `should_stop()` is polled
    between units and a True answer makes the stage raise `Cancelled`."""

    on_progress: Callable[[str, int, int, dict], None] = field(default=_no_progress)
    should_stop: Callable[[], bool] = field(default=_never)


from .errors import Cancelled  # noqa: E402,F401  (raised by every long stage; lives with the other errors)
