"""MM3Request: the request JSON shared with minimaxmusic.cpp's server.

Every field has a default and omitting one equals sending its default. Validation follows the
reference server's order and words, so a request refused there is refused here with the same
message; checks the server leaves to the job (types, ranges) get messages that name the field,
the value and what was expected.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import asdict, dataclass, field, fields, replace

from .components import MODEL_FIELDS
from .constants import (
    DEFAULT_DIT_CFG,
    DEFAULT_DURATION,
    DEFAULT_LM_CFG,
    DEFAULT_MP3_BITRATE,
    DEFAULT_PEAK_CLIP,
    DEFAULT_RNG,
    DEFAULT_STEPS,
    DEFAULT_TOP_K,
    FRAME_RATE,
    MAX_AUDIO_FRAMES,
    MAX_DURATION,
    MAX_SONGS,
    MAX_VARIATIONS,
    MP3_BITRATES,
    OUTPUT_FORMATS,
    RNG_MODES,
    SEED_MAX,
)
from .errors import InputError


class RequestError(InputError):
    """An invalid request; the message is what the reference server answers (HTTP 400)."""


@dataclass
class MM3Request:
    caption: str = ""
    lyrics: str = ""
    duration: float = DEFAULT_DURATION
    steps: int = DEFAULT_STEPS
    seed: int = -1
    lm_seed: int = -1
    lm_cfg: float = DEFAULT_LM_CFG
    lm_top_k: int = DEFAULT_TOP_K
    lm_batch_size: int = 1
    synth_batch_size: int = 1
    dit_cfg: float = DEFAULT_DIT_CFG
    peak_clip: int = DEFAULT_PEAK_CLIP
    output_format: str = "mp3"
    mp3_bitrate: int = DEFAULT_MP3_BITRATE
    audio_codes: str = ""
    lm_model: str = ""
    depth_model: str = ""
    cond_model: str = ""
    dit_model: str = ""
    vae_model: str = ""
    # Fields of this engine that minimaxmusic.cpp's parser ignores: the random streams that made the
    # track, and a fingerprint of each model file used (`mm3.fingerprint`), keyed by the *_model field.
    rng: str = DEFAULT_RNG
    model_fingerprints: dict = field(default_factory=dict)

    # -- JSON ---------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | bytes) -> "MM3Request":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("Malformed JSON") from None
        if not isinstance(data, dict):
            raise RequestError("Malformed JSON")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "MM3Request":
        kwargs = {}
        for f in fields(cls):
            if f.name not in data or data[f.name] is None:
                continue
            v = data[f.name]
            if f.type == "str":
                if not isinstance(v, str):
                    raise RequestError(f"{f.name} must be a string, got {json.dumps(v)}")
            elif f.type == "int":
                if isinstance(v, bool) or not isinstance(v, int):
                    raise RequestError(f"{f.name} must be an integer, got {json.dumps(v)}")
            elif f.type == "float":
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise RequestError(f"{f.name} must be a number, got {json.dumps(v)}")
                v = float(v)
            elif f.type == "dict":
                if not isinstance(v, dict):
                    raise RequestError(f"{f.name} must be an object, got {json.dumps(v)}")
                v = dict(v)
            kwargs[f.name] = v
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, ensure_ascii=False)

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> "MM3Request":
        """Check the request; returns it unchanged. The prompt-token budget and the model names
        need the LM and the models folder, so the pipeline checks those."""
        self._check_types()
        if not self.caption.strip() or not self.lyrics.strip():
            raise RequestError("caption and lyrics are required")
        from .prompt import text_problem

        for name in ("caption", "lyrics"):
            problem = text_problem(name, getattr(self, name))
            if problem:
                raise RequestError(problem)
        if not (self.duration > 0):
            raise RequestError(f"duration must be positive, got {self.duration:g}")
        if self.duration > MAX_DURATION and not self.audio_codes:
            raise RequestError(f"duration must be at most {MAX_DURATION:g} seconds ({MAX_AUDIO_FRAMES} frames), "
                               f"got {self.duration:g}")
        if not self.audio_codes and int(self.duration * FRAME_RATE) < 1:
            raise RequestError(f"duration must be at least {1 / FRAME_RATE:g} seconds (one frame), got {self.duration:g}")
        if self.steps < 2:
            raise RequestError(f"steps must be at least 2, got {self.steps}")
        if not 1 <= self.lm_batch_size <= MAX_SONGS:
            raise RequestError(f"lm_batch_size must be between 1 and {MAX_SONGS}, got {self.lm_batch_size}")
        if not 1 <= self.synth_batch_size <= MAX_VARIATIONS:
            raise RequestError(f"synth_batch_size must be between 1 and {MAX_VARIATIONS}, got {self.synth_batch_size}")
        if self.audio_codes:
            check_codes_syntax(self.audio_codes)
        check_output_format(self.output_format)
        if self.lm_top_k < 1:
            raise RequestError(f"lm_top_k must be at least 1, got {self.lm_top_k}")
        for name in ("lm_cfg", "dit_cfg"):
            v = getattr(self, name)
            if not math.isfinite(v):  # NaN / Infinity (JSON 1e400)
                raise RequestError(f"{name} must be a finite number, got {v}")
        if self.output_format == "mp3" and self.mp3_bitrate not in MP3_BITRATES:
            raise RequestError(f"mp3_bitrate must be one of {', '.join(map(str, MP3_BITRATES))}, "
                               f"got {self.mp3_bitrate}")
        for name in ("seed", "lm_seed"):
            v = getattr(self, name)
            if v < -1 or v > SEED_MAX:
                raise RequestError(f"{name} must be -1 (random) or 0..{SEED_MAX}, got {v}")
        if self.rng not in RNG_MODES:
            raise RequestError(f"rng must be one of {', '.join(RNG_MODES)}, got {json.dumps(self.rng)}")
        from .fingerprint import is_fingerprint

        for key, value in self.model_fingerprints.items():
            if key not in MODEL_FIELDS.values():
                raise RequestError(f"model_fingerprints has an unknown key {json.dumps(key)} (expected "
                                   f"{', '.join(MODEL_FIELDS.values())})")
            if not is_fingerprint(value):
                raise RequestError(f"model_fingerprints {key} must be \"<size>-<16 hex digits>\", got {json.dumps(value)}")
        return self

    def _check_types(self):
        """Fields set from Python (flags, nodes) get the type checks `from_dict` makes on JSON."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "str":
                ok = isinstance(v, str)
            elif f.type == "int":
                ok = isinstance(v, int) and not isinstance(v, bool)
            elif f.type == "dict":
                ok = isinstance(v, dict)
            else:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok:
                kind = {"str": "a string", "int": "an integer", "dict": "an object"}.get(f.type, "a number")
                raise RequestError(f"{f.name} must be {kind}, got {v!r}")

    @property
    def clamped_peak_clip(self) -> int:
        return min(max(self.peak_clip, 0), 999)

    def resolve_seeds(self) -> "MM3Request":
        """A copy whose -1 seeds are replaced by random ones (written back into replay files)."""
        return replace(
            self,
            seed=self.seed if self.seed >= 0 else secrets.randbelow(SEED_MAX + 1),
            lm_seed=self.lm_seed if self.lm_seed >= 0 else secrets.randbelow(SEED_MAX + 1),
        )

    def replay(self, audio_codes: str, song: int = 0, variation: int = 0) -> "MM3Request":
        """The request that re-renders one track: its codes, its exact seeds, batch sizes 1."""
        return replace(self, audio_codes=audio_codes, lm_seed=self.lm_seed + song, seed=self.seed + variation,
                       lm_batch_size=1, synth_batch_size=1)


def check_output_format(name) -> str:
    """`name` if it is an output format, else the reference server's error."""
    if name not in OUTPUT_FORMATS:
        raise RequestError(f"Invalid output_format (use: {', '.join(OUTPUT_FORMATS)}), got {json.dumps(name)}")
    return name


def check_codes_syntax(text: str) -> int:
    """Number of frames in a flat `audio_codes` list (syntax and count only: code ranges depend on
    the models and are checked before they are loaded, `Pipeline.preflight`)."""
    from .codes import AudioCodesError, count_code_frames

    try:
        return count_code_frames(text)
    except AudioCodesError as e:
        raise RequestError(str(e)) from None
