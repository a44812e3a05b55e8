"""Every stage's settings in one import: the plan's (`mm3.plan.settings`: `PlanSettings`, `Shaping`,
`Takes`) and the synthesis's (`mm3.synth.settings`: `SynthSettings`, `RepaintSettings`,
`OutputSettings`).

Each object checks itself where it is built and lives in the layer of the stage that runs it; the
request (`mm3.song.request`) is their serializer, and the stages take these objects, never the
request, so a setting has one rule wherever it comes from (a request file, a flag, a node widget).
"""

from __future__ import annotations

from ..errors import check_range
from ..plan.settings import (
    DEFAULT_DRY_MIN_MATCH, DEFAULT_PENALTY_WINDOW, MAX_ENDING_ROUNDS, MAX_PENALTY_STRENGTH, MAX_TAKES, MAX_TEMPERATURE,
    PENALTIES, PlanSettings, Shaping, Takes, check_plan_start)
from ..synth.settings import (
    AUTO_SHIFT, DEFAULT_REPAINT_FADE, MAX_REPAINT_FADE, MAX_SHIFT, OutputSettings, RepaintSettings, SynthSettings,
    check_seed, check_shift)

__all__ = [
    "AUTO_SHIFT", "MAX_SHIFT", "check_shift", "DEFAULT_DRY_MIN_MATCH", "DEFAULT_PENALTY_WINDOW", "DEFAULT_REPAINT_FADE", "MAX_ENDING_ROUNDS",
    "MAX_PENALTY_STRENGTH", "MAX_REPAINT_FADE", "MAX_TAKES", "MAX_TEMPERATURE", "PENALTIES", "OutputSettings",
    "PlanSettings", "RepaintSettings", "Shaping", "SynthSettings", "Takes", "check_plan_start", "check_range",
    "check_seed"]
