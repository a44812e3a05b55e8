"""The settings of the synthesis stage, each checked where it is built: `SynthSettings` (how the DiT
renders a plan), `RepaintSettings` (a range sampled anew) and `OutputSettings` (how a track is
written).

The ranges are the reference's and the ComfyUI widgets', with one-line errors that name the request
field, the value and what was expected. The request (`mm3.song.request`) reads and writes these
objects; the stages take them, never the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..constants import (
    DEFAULT_DIT_CFG, DEFAULT_MP3_BITRATE, DEFAULT_PEAK_CLIP, DEFAULT_STEPS, MAX_CFG, MAX_PEAK_CLIP, MAX_STEPS,
    MAX_VARIATIONS, MP3_BITRATES, OUTPUT_FORMATS, SEED_MAX)
from ..errors import check_integer, check_number

AUTO_SHIFT = 0.0  # dit_shift value meaning "automatic" (`mm3.synth.flow.schedule_shift`)
MAX_SHIFT = 30.0  # the automatic shift at 2 steps is 29
DEFAULT_REPAINT_FADE = 0.25  # seconds of crossfade inside each edge of a repainted range
MAX_REPAINT_FADE = 10.0


def check_seed(name: str, seed) -> int:
    """`seed` if it is an integer in 0..SEED_MAX (a resolved seed), else a ValueError naming `name`."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"{name} must be an integer in 0..{SEED_MAX}, got {seed!r}")
    return seed


def check_shift(shift: float) -> float:
    """`shift` as a float if it is a flow schedule's shift (0 < shift <= MAX_SHIFT), else a ValueError."""
    if not (math.isfinite(shift) and 0 < shift <= MAX_SHIFT):
        raise ValueError(f"dit_shift must be in (0, {MAX_SHIFT:g}] (or {AUTO_SHIFT:g}: automatic), got {shift}")
    return float(shift)


@dataclass(frozen=True)
class SynthSettings:
    """How the DiT renders a plan: variation j draws its noise from `seed + j`; `shift` 0 is
    automatic (`mm3.synth.flow.schedule_shift`)."""

    seed: int
    steps: int = DEFAULT_STEPS
    dit_cfg: float = DEFAULT_DIT_CFG
    variations: int = 1
    shift: float = AUTO_SHIFT

    def __post_init__(self):
        if isinstance(self.steps, int) and not isinstance(self.steps, bool) and self.steps < 2:
            raise ValueError(f"steps must be at least 2, got {self.steps}")
        check_integer("steps", self.steps, 2, MAX_STEPS)
        check_integer("synth_batch_size", self.variations, 1, MAX_VARIATIONS)
        check_number("dit_cfg", self.dit_cfg, 0, MAX_CFG)
        if check_number("dit_shift", self.shift, -math.inf, math.inf) != AUTO_SHIFT:
            check_shift(self.shift)
        check_seed("seed", self.seed)


@dataclass(frozen=True)
class RepaintSettings:
    """Seconds [start, end) sampled anew, with `fade` seconds of crossfade inside each edge; the
    rest keeps the source's latents. The new part's noise is the synthesis seed's."""

    start: float
    end: float
    fade: float = DEFAULT_REPAINT_FADE
    # The lyric line or section that chose the range, as a replay request's lyric_edit records it
    # (`mm3.plan.lyric_edit.LyricRange.record`, as items); empty: chosen in seconds.
    chosen: tuple = ()

    def __post_init__(self):
        for name in ("start", "end", "fade"):
            check_number(f"repaint_{name}", getattr(self, name), -math.inf, math.inf)
        if not 0 <= self.start < self.end:
            raise ValueError(f"repaint needs 0 <= repaint_start < repaint_end (seconds), got {self.start:g} and "
                             f"{self.end:g}")
        if self.fade < 0:
            raise ValueError(f"repaint_fade must be at least 0 seconds, got {self.fade:g}")
        check_number("repaint_fade", self.fade, 0, MAX_REPAINT_FADE)


@dataclass(frozen=True)
class OutputSettings:
    """How a track is written: the file format, the MP3 bitrate, and the parts per million of
    samples allowed above the peak normalisation level (`mm3.synth.output.normalize_peak`)."""

    format: str = "mp3"
    mp3_bitrate: int = DEFAULT_MP3_BITRATE
    peak_clip: int = DEFAULT_PEAK_CLIP

    def __post_init__(self):
        if self.format not in OUTPUT_FORMATS:
            raise ValueError(f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, got {self.format!r}")
        # whatever the format: a replay file may be rendered as MP3
        if isinstance(self.mp3_bitrate, bool) or self.mp3_bitrate not in MP3_BITRATES:
            raise ValueError(f"mp3_bitrate must be one of {', '.join(map(str, MP3_BITRATES))}, got {self.mp3_bitrate}")
        check_integer("peak_clip", self.peak_clip, 0, MAX_PEAK_CLIP)
