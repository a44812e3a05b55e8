"""The settings of the synthesis, a repaint and the output, each checked where it is built.

The plan's settings are `mm3.plan.ar.PlanSettings` and `mm3.plan.takes.Takes`. A request (`mm3.song.request`)
reads and writes all of them; the stages take these objects, never the request, so a setting has
one rule wherever it comes from (a request file, a flag, a node widget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..constants import (
    DEFAULT_DIT_CFG, DEFAULT_MP3_BITRATE, DEFAULT_PEAK_CLIP, DEFAULT_STEPS, MAX_CFG, MAX_PEAK_CLIP, MAX_STEPS,
    MAX_VARIATIONS, MP3_BITRATES, OUTPUT_FORMATS, SEED_MAX)
from ..synth.flow import AUTO_SHIFT, check_shift

DEFAULT_REPAINT_FADE = 0.25  # seconds of crossfade inside each edge of a repainted range
MAX_REPAINT_FADE = 10.0


def check_range(name: str, value, low, high) -> None:
    """A ValueError naming `name` unless `low <= value <= high` (NaN is outside every range)."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low:g} and {high:g}, got {value if isinstance(value, int) else f'{value:g}'}")


def _check_seed(name: str, seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"{name} must be an integer in 0..{SEED_MAX}, got {seed!r}")


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
        _check_seed("seed", self.seed)
        if self.steps < 2:
            raise ValueError(f"steps must be at least 2, got {self.steps}")
        check_range("steps", self.steps, 2, MAX_STEPS)
        if not math.isfinite(self.dit_cfg):
            raise ValueError(f"dit_cfg must be a finite number, got {self.dit_cfg}")
        check_range("dit_cfg", self.dit_cfg, 0, MAX_CFG)
        if not 1 <= self.variations <= MAX_VARIATIONS:
            raise ValueError(f"synth_batch_size must be between 1 and {MAX_VARIATIONS}, got {self.variations}")
        if self.shift != AUTO_SHIFT:
            check_shift(self.shift)


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
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"repaint_{name} must be a finite number, got {getattr(self, name)}")
        if not 0 <= self.start < self.end:
            raise ValueError(f"repaint needs 0 <= repaint_start < repaint_end (seconds), got {self.start:g} and "
                             f"{self.end:g}")
        if self.fade < 0:
            raise ValueError(f"repaint_fade must be at least 0 seconds, got {self.fade:g}")
        check_range("repaint_fade", self.fade, 0, MAX_REPAINT_FADE)


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
        if self.mp3_bitrate not in MP3_BITRATES:  # whatever the format: a replay file may be rendered as MP3
            raise ValueError(f"mp3_bitrate must be one of {', '.join(map(str, MP3_BITRATES))}, got {self.mp3_bitrate}")
        check_range("peak_clip", self.peak_clip, 0, MAX_PEAK_CLIP)
