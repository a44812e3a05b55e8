"""The plan's settings, each checked where it is built: `PlanSettings` (the duration cap, guidance,
top-k, how many songs, the seed), `Shaping` (how the semantic draw is shaped beyond the reference)
and `Takes` (natural endings).

The ranges are the reference's and the ComfyUI widgets', with one-line errors that name the request
field, the value and what was expected, so a setting has one rule wherever it comes from (a request
file, a flag, a node widget). `check_plan_start` holds the two checks that need the song a plan
starts from. The request (`mm3.song.request`) reads and writes these objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral

from ..constants import (
    DEFAULT_LM_CFG, DEFAULT_TOP_K, FRAME_RATE, MAX_AUDIO_FRAMES, MAX_CFG, MAX_SONGS, SEMANTIC_VOCAB_SIZE)
from ..errors import check_integer, check_number

PENALTIES = ("none", "dry", "frequency", "presence")
DEFAULT_PENALTY_WINDOW = 320  # frames: ~13 s, a few bars of a loop at typical tempi
DEFAULT_DRY_MIN_MATCH = 15  # frames: 0.6 s, shorter repeats are musical (a held note, a beat)
MAX_TEMPERATURE = 5.0
MAX_PENALTY_STRENGTH = {"dry": 2.0, "frequency": 10.0, "presence": 10.0}
MAX_TAKES = 16
MAX_ENDING_ROUNDS = 10


def _number(name: str, value) -> float:
    return check_number(name, value, -math.inf, math.inf)


@dataclass(frozen=True)
class Shaping:
    """What shapes the semantic draw (`mm3.plan.shaping`); the defaults are the reference (nothing
    shaped). `min_frames`: frames before which the song may not end."""

    temperature: float = 1.0
    top_p: float = 1.0
    penalty: str = "none"
    penalty_strength: float = 0.0
    penalty_window: int = DEFAULT_PENALTY_WINDOW
    min_match: int = DEFAULT_DRY_MIN_MATCH
    min_frames: int = 0

    def __post_init__(self):
        if not 0 < _number("lm_temperature", self.temperature) <= MAX_TEMPERATURE:
            raise ValueError(f"lm_temperature must be in (0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < _number("lm_top_p", self.top_p) <= 1:
            raise ValueError(f"lm_top_p must be in (0, 1], got {self.top_p}")
        if self.penalty not in PENALTIES:
            raise ValueError(f"lm_penalty must be one of {', '.join(PENALTIES)}, got {self.penalty!r}")
        strength = _number("lm_penalty_strength", self.penalty_strength)
        if self.penalty != "none":
            low, high = (1.0, MAX_PENALTY_STRENGTH["dry"]) if self.penalty == "dry" else (0.0, MAX_PENALTY_STRENGTH[self.penalty])
            if not low <= strength <= high:
                raise ValueError(f"lm_penalty_strength for {self.penalty} must be in [{low:g}, {high:g}], "
                                 f"got {self.penalty_strength}")
        for name, value in (("lm_penalty_window", self.penalty_window), ("lm_dry_min_match", self.min_match)):
            # a window past the longest song only costs memory
            if isinstance(value, bool) or not isinstance(value, Integral) or not 1 <= value <= MAX_AUDIO_FRAMES:
                raise ValueError(f"{name} must be between 1 and {MAX_AUDIO_FRAMES} frames, got {value!r}")
        if isinstance(self.min_frames, bool) or not isinstance(self.min_frames, Integral) or self.min_frames < 0:
            raise ValueError(f"min_frames must be an integer of at least 0, got {self.min_frames!r}")

    @property
    def is_reference(self) -> bool:
        return (self.temperature == 1.0 and self.top_p == 1.0 and self.penalty == "none"
                and self.min_frames == 0)


@dataclass(frozen=True)
class PlanSettings:
    """What decides a plan besides the prompt: the duration cap, guidance, top-k, how many songs,
    the seed of song 0 (None or -1: random, recorded in the result; song i draws from lm_seed + i),
    and the optional shaping of the semantic draw (the default is the reference's draw)."""

    duration: float
    lm_seed: int | None = None
    lm_cfg: float = DEFAULT_LM_CFG
    top_k: int = DEFAULT_TOP_K
    songs: int = 1
    frame_rate: float = FRAME_RATE
    shaping: Shaping = field(default_factory=Shaping)

    def __post_init__(self):
        if not _number("frame_rate", self.frame_rate) > 0:
            raise ValueError(f"frame_rate must be positive, got {self.frame_rate:g}")
        if not _number("duration", self.duration) > 0:
            raise ValueError(f"duration must be positive, got {self.duration:g}")
        if self.duration > MAX_AUDIO_FRAMES / self.frame_rate:
            raise ValueError(f"duration must be at most {MAX_AUDIO_FRAMES / self.frame_rate:g} seconds "
                             f"({MAX_AUDIO_FRAMES} frames), got {self.duration:g}")
        if int(self.duration * self.frame_rate) < 1:
            raise ValueError(f"duration must be at least {1 / self.frame_rate:g} seconds (one frame), got "
                             f"{self.duration:g}")
        check_integer("lm_batch_size", self.songs, 1, MAX_SONGS)
        if isinstance(self.top_k, Integral) and not isinstance(self.top_k, bool) and self.top_k < 1:
            raise ValueError(f"lm_top_k must be at least 1, got {self.top_k}")
        check_integer("lm_top_k", self.top_k, 1, SEMANTIC_VOCAB_SIZE)
        check_number("lm_cfg", self.lm_cfg, 0, MAX_CFG)
        if self.lm_seed is not None and (isinstance(self.lm_seed, bool) or not isinstance(self.lm_seed, Integral)
                                         or self.lm_seed < -1):
            raise ValueError(f"lm_seed must be -1 or None (random) or a seed of at least 0, got {self.lm_seed!r}")
        if not isinstance(self.shaping, Shaping):
            raise ValueError(f"shaping must be a Shaping, got {self.shaping!r}")

    @property
    def frames(self) -> int:
        """The frames this duration asks for (before the LM context and MAX_AUDIO_FRAMES cap them)."""
        return int(self.duration * self.frame_rate)


@dataclass(frozen=True)
class Takes:
    """Natural endings (`mm3.plan.takes`): `takes` candidates per song, with `require_ending` only
    those that ended by themselves, planning up to `rounds` rounds."""

    takes: int = 1
    require_ending: bool = False
    rounds: int = 1

    def __post_init__(self):
        check_integer("takes", self.takes, 1, MAX_TAKES)
        if not isinstance(self.require_ending, bool):
            raise ValueError(f"require_ending must be true or false, got {self.require_ending!r}")
        check_integer("ending_rounds", self.rounds, 1, MAX_ENDING_ROUNDS)

    @property
    def is_plain(self) -> bool:
        return self.takes == 1 and not self.require_ending


def check_plan_start(settings: PlanSettings, prior_frames: int | None = None) -> None:
    """The checks that need where a plan starts: a new song (`prior_frames` None) may not hold its
    ending off past its duration; a continued one (`prior_frames` frames already planned) must have
    frames left to add."""
    if prior_frames is None:
        least = settings.shaping.min_frames / settings.frame_rate
        if least > settings.duration:
            raise ValueError(f"min_duration must be between 0 and the duration {settings.duration:g} s, "
                             f"got {least:g}")
    elif prior_frames >= settings.frames:
        raise ValueError(f"continue_codes already hold {prior_frames} frames ({prior_frames / settings.frame_rate:.2f} "
                         f"s): the duration {settings.duration:g} s must be longer to add any")
