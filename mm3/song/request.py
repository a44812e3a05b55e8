"""MM3Request: the request JSON shared with minimaxmusic.cpp's server.

Every field has a default and omitting one equals sending its default. The request is the
serializer of the stages' settings objects (`mm3.song.settings`): it checks the JSON types and the
rules that join fields, and each stage's ranges by building its objects, which check themselves.
A request refused by the reference server is refused here in its words; checks it leaves to the
job get messages that name the field, the value and what was expected.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from .. import bounded
from ..bounded import BoundError
from ..components import MODEL_FIELDS
from ..constants import (
    DEFAULT_DIT_CFG, DEFAULT_DURATION, DEFAULT_LM_CFG, DEFAULT_MP3_BITRATE, DEFAULT_PEAK_CLIP, DEFAULT_RNG,
    DEFAULT_STEPS, DEFAULT_TOP_K, FRAME_RATE, MAX_AUDIO_FRAMES, MAX_DURATION, MAX_SONGS, OUTPUT_FORMATS, RNG_MODES,
    SEED_MAX)
from ..errors import InputError
from ..formats.fingerprint import is_fingerprint
from ..lora.use import check_entries
from ..plan.codes import AudioCodesError, count_code_frames
from ..plan.lyrics_align import LEAD_SECONDS, LyricHeads, check_lead
from ..plan.prompt import CAPTION_REQUIRED, size_problem, text_problem
from ..plan.sampling import resolve_seed
from .settings import (
    AUTO_SHIFT, DEFAULT_DRY_MIN_MATCH, DEFAULT_PENALTY_WINDOW, DEFAULT_REPAINT_FADE, MAX_ENDING_ROUNDS, MAX_TAKES,
    OutputSettings, PlanSettings, RepaintSettings, Shaping, SynthSettings, Takes, check_plan_start)

# Fields the reference server does not know; written only when set (`MM3Request.to_dict`).
EXTENSION_FIELDS = ("lm_temperature", "lm_top_p", "lm_penalty", "lm_penalty_strength", "lm_penalty_window",
                    "lm_dry_min_match", "min_duration", "takes", "require_ending", "ending_rounds", "lm_take",
                    "dit_shift", "continue_codes", "repaint_start", "repaint_end", "repaint_seed", "repaint_fade",
                    "source_codes", "source_lyrics", "lrc_heads", "lrc_lead", "loras", "lyric_times", "lyric_edit")


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
    # track, and a fingerprint of each model file used (`mm3.formats.fingerprint`), keyed by the *_model field.
    rng: str = DEFAULT_RNG
    model_fingerprints: dict = field(default_factory=dict)
    # Beyond the reference (each omitted from the JSON at its default, which is the reference's
    # behaviour). The semantic draw's shaping (`mm3.plan.shaping`):
    lm_temperature: float = 1.0
    lm_top_p: float = 1.0
    lm_penalty: str = "none"
    lm_penalty_strength: float = 0.0
    lm_penalty_window: int = DEFAULT_PENALTY_WINDOW
    lm_dry_min_match: int = DEFAULT_DRY_MIN_MATCH
    min_duration: float = 0.0
    # Natural endings (`mm3.plan.takes`); lm_take: which candidate a replay request's codes are.
    takes: int = 1
    require_ending: bool = False
    ending_rounds: int = 1
    lm_take: int = -1
    # The flow schedule's shift (0: automatic, `mm3.synth.flow.schedule_shift`).
    dit_shift: float = AUTO_SHIFT
    # Continue: the codes of the song to extend (planning goes on after them up to `duration`).
    continue_codes: str = ""
    # Repaint seconds [repaint_start, repaint_end) with noise from repaint_seed; the rest keeps the
    # latents of `source_codes` (or of audio_codes when empty) rendered with `seed`.
    repaint_start: float = -1.0
    repaint_end: float = -1.0
    repaint_seed: int = -1
    repaint_fade: float = DEFAULT_REPAINT_FADE
    source_codes: str = ""
    # A repaint that changed the words (`mm3.plan.lyric_edit`): the lyrics source_codes were made
    # with ("" the same as lyrics), and what was edited (the line or section, its words, the range,
    # the seed that planned it again).
    source_lyrics: str = ""
    lyric_edit: dict = field(default_factory=dict)
    # Lyric timestamps (`mm3.plan.lyrics_align`): the LM heads read ("" the released LM's) and the
    # seconds added to every stamp.
    lrc_heads: str = ""
    lrc_lead: float = LEAD_SECONDS
    # Each lyric line's start in seconds (null: not reached), one per line of the normalised lyrics,
    # "[start]" first: where a line or section is looked up without replaying the codes.
    lyric_times: list = field(default_factory=list)
    # Adapters (LoRA) on the LM and the DiT, in order: `mm3.lora.use` says the entries' fields.
    loras: list = field(default_factory=list)

    # -- JSON ---------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | bytes) -> "MM3Request":
        try:
            data = bounded.loads(text, "the request")
        except BoundError as e:
            raise RequestError(f"Malformed JSON: {e}") from None
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
            elif f.type == "bool":
                if not isinstance(v, bool):
                    raise RequestError(f"{f.name} must be true or false, got {json.dumps(v)}")
            elif f.type == "list":
                if not isinstance(v, list):
                    raise RequestError(f"{f.name} must be a list, got {json.dumps(v)}")
                v = list(v)
            kwargs[f.name] = v
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """Every field, except the extensions at their defaults (so a request written before them,
        or for the reference server, reads the same)."""
        out = asdict(self)
        for f in fields(self):
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            if f.name in EXTENSION_FIELDS and out[f.name] == default:
                del out[f.name]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, ensure_ascii=False)

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> "MM3Request":
        """Check the request; returns it unchanged. The fields' types and the rules that join
        fields (a replay's codes, continue, repaint) are checked here; each stage's ranges by
        building its settings objects (`mm3.song.settings`). The prompt-token budget and the model
        names need the LM and the models folder, so the pipeline checks those."""
        self._check_types()
        if not self.caption.strip():
            raise RequestError(CAPTION_REQUIRED)
        for name in ("caption", "lyrics"):
            problem = text_problem(name, getattr(self, name)) or size_problem(name, getattr(self, name))
            if problem:
                raise RequestError(problem)
        if not (self.duration > 0):
            raise RequestError(f"duration must be positive, got {self.duration:g}")
        if self.duration > MAX_DURATION and not self.audio_codes:
            raise RequestError(f"duration must be at most {MAX_DURATION:g} seconds ({MAX_AUDIO_FRAMES} frames), "
                               f"got {self.duration:g}")
        if not self.audio_codes and int(self.duration * FRAME_RATE) < 1:
            raise RequestError(f"duration must be at least {1 / FRAME_RATE:g} seconds (one frame), got {self.duration:g}")
        for name in ("min_duration", "repaint_start", "repaint_end", "repaint_fade"):
            v = getattr(self, name)
            if not math.isfinite(v):  # NaN / Infinity (JSON 1e400)
                raise RequestError(f"{name} must be a finite number, got {v}")
        if self.min_duration < 0:  # before the plan's settings, which hold it as frames
            raise RequestError(f"min_duration must be between 0 and the duration {self.duration:g} s, "
                               f"got {self.min_duration:g}")
        # The seeds may still be -1 (random): the synthesis is checked with a resolved one.
        self._settings(SynthSettings, **self._synth_fields(seed=max(self.seed, 0)))
        # A replay plans nothing: its duration was checked above, the rest of its plan here.
        plan = self._settings(PlanSettings, **self._plan_fields(
            duration=min(max(self.duration, 1 / FRAME_RATE), MAX_DURATION) if self.audio_codes else self.duration))
        if self.audio_codes:
            check_codes_syntax(self.audio_codes)
        check_output_format(self.output_format)
        self.output_settings()
        for name in ("seed", "lm_seed"):
            v = getattr(self, name)
            if v < -1 or v > SEED_MAX:
                raise RequestError(f"{name} must be -1 (random) or 0..{SEED_MAX}, got {v}")
        if self.rng not in RNG_MODES:
            raise RequestError(f"rng must be one of {', '.join(RNG_MODES)}, got {json.dumps(self.rng)}")
        for key, value in self.model_fingerprints.items():
            if key not in MODEL_FIELDS.values():
                raise RequestError(f"model_fingerprints has an unknown key {json.dumps(key)} (expected "
                                   f"{', '.join(MODEL_FIELDS.values())})")
            if not is_fingerprint(value):
                raise RequestError(f"model_fingerprints {key} must be \"<size>-<16 hex digits>\", got {json.dumps(value)}")
        self._check_extensions(plan)
        try:
            check_entries(self.loras)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return self

    def shaping(self) -> Shaping:
        """The semantic draw's shaping this request asks for (`mm3.plan.settings.Shaping`)."""
        try:
            return shaping_of(self, self.min_duration)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def plan_settings(self) -> PlanSettings:
        """The plan this request asks for (`mm3.plan.settings.PlanSettings`); `plan_fields` records one."""
        return self._settings(PlanSettings, **self._plan_fields(duration=self.duration))

    def _plan_fields(self, duration: float) -> dict:
        return dict(duration=duration, lm_seed=self.lm_seed, lm_cfg=self.lm_cfg, top_k=self.lm_top_k,
                    songs=self.lm_batch_size, shaping=self.shaping())

    def lyric_heads(self) -> LyricHeads:
        """The heads whose attention times the lyrics (`lrc_heads`; "" the default heads)."""
        try:
            return LyricHeads.parse(self.lrc_heads)
        except InputError as e:
            raise RequestError(f"lrc_heads: {e}") from None

    def takes_setting(self) -> Takes:
        """The takes this request asks for (`mm3.plan.settings.Takes`)."""
        return self._settings(Takes, takes=self.takes, require_ending=self.require_ending, rounds=self.ending_rounds)

    def synth_settings(self) -> SynthSettings:
        """The DiT run this request asks for (seeds resolved first: `resolve_seeds`)."""
        return self._settings(SynthSettings, **self._synth_fields(seed=self.seed))

    def _synth_fields(self, seed: int) -> dict:
        return dict(seed=seed, steps=self.steps, dit_cfg=self.dit_cfg, variations=self.synth_batch_size,
                    shift=self.dit_shift)

    def repaint_settings(self) -> RepaintSettings:
        return self._settings(RepaintSettings, start=self.repaint_start, end=self.repaint_end, fade=self.repaint_fade)

    def output_settings(self) -> OutputSettings:
        return self._settings(OutputSettings, format=self.output_format, mp3_bitrate=self.mp3_bitrate,
                              peak_clip=self.peak_clip)

    @staticmethod
    def _settings(cls, **kw):
        try:
            return cls(**kw)
        except ValueError as e:
            raise RequestError(str(e)) from None

    @property
    def repaints(self) -> bool:
        return self.repaint_end >= 0 or self.repaint_start >= 0

    def _check_extensions(self, plan: PlanSettings):
        """The fields beyond the reference that join other fields (`plan`: the plan's settings)."""
        self.takes_setting()
        if not self.audio_codes and not self.continue_codes:
            self._check(check_plan_start, plan)
        self.lyric_heads()
        try:
            check_lead(self.lrc_lead)
        except InputError as e:
            raise RequestError(f"lrc_lead: {e}") from None
        last = MAX_SONGS * MAX_TAKES * MAX_ENDING_ROUNDS - 1  # takes are numbered over the songs and rounds
        if not -1 <= self.lm_take <= last:
            raise RequestError(f"lm_take must be -1 (none) or a take number 0..{last}, got {self.lm_take}")
        if self.continue_codes:
            if self.audio_codes:
                raise RequestError("a request has either audio_codes (render them) or continue_codes (plan after "
                                   "them), not both")
            self._check(check_plan_start, plan, check_codes_syntax(self.continue_codes) - 1)
        if self.source_codes:
            check_codes_syntax(self.source_codes)
            if not self.repaints:
                raise RequestError("source_codes is only used by a repaint (repaint_start and repaint_end)")
        if self.source_lyrics:
            if not self.source_codes:
                raise RequestError("source_lyrics is only used with source_codes (a repaint that changed the words)")
            from ..plan.prompt import size_problem, text_problem

            problem = text_problem("source_lyrics", self.source_lyrics) or size_problem("lyrics", self.source_lyrics)
            if problem:
                raise RequestError(problem)
        for i, t in enumerate(self.lyric_times):
            if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                                  or t < 0):
                raise RequestError(f"lyric_times[{i}] must be seconds (at least 0) or null, got {json.dumps(t)}")
        if self.repaints:
            if not self.audio_codes:
                raise RequestError("a repaint needs the song's audio_codes (render or plan it first)")
            self.repaint_settings()
            if self.repaint_seed < -1 or self.repaint_seed > SEED_MAX:
                raise RequestError(f"repaint_seed must be -1 (random) or 0..{SEED_MAX}, got {self.repaint_seed}")

    @staticmethod
    def _check(check, *args):
        try:
            check(*args)
        except ValueError as e:
            raise RequestError(str(e)) from None

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
            elif f.type == "bool":
                ok = isinstance(v, bool)
            elif f.type == "list":
                ok = isinstance(v, list)
            else:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok:
                kind = {"str": "a string", "int": "an integer", "dict": "an object", "bool": "true or false",
                        "list": "a list"}.get(
                    f.type, "a number")
                raise RequestError(f"{f.name} must be {kind}, got {v!r}")

    def resolve_seeds(self) -> "MM3Request":
        """A copy whose -1 seeds are replaced by random ones (written back into replay files)."""
        return replace(self, seed=resolve_seed(self.seed), lm_seed=resolve_seed(self.lm_seed),
                       repaint_seed=resolve_seed(self.repaint_seed) if self.repaints else self.repaint_seed)

    def replay(self, audio_codes: str, song: int = 0, variation: int = 0, lm_seed: int | None = None,
               take: int | None = None) -> "MM3Request":
        """The request that re-renders one track: its codes, its exact seeds, batch sizes 1.
        `lm_seed`/`take`: the seed and number of the candidate kept among takes."""
        seeds = dict(seed=self.seed + variation)
        if self.repaints:  # the kept part stays the source's; the variations differ in the repainted part
            seeds = dict(seed=self.seed, repaint_seed=self.repaint_seed + variation)
        return replace(self, audio_codes=audio_codes, continue_codes="",
                       lm_seed=self.lm_seed + song if lm_seed is None else lm_seed,
                       lm_take=self.lm_take if take is None else take, lm_batch_size=1, synth_batch_size=1, **seeds)


def shaping_of(source, min_duration: float = 0.0) -> Shaping:
    """The `mm3.plan.settings.Shaping` of the lm_* fields of `source` (a request, or the nodes' sampling
    options, which name them alike); the penalty strength counts only with a penalty."""
    return Shaping(temperature=source.lm_temperature, top_p=source.lm_top_p, penalty=source.lm_penalty,
                   penalty_strength=source.lm_penalty_strength if source.lm_penalty != "none" else 0.0,
                   penalty_window=source.lm_penalty_window, min_match=source.lm_dry_min_match,
                   min_frames=int(min_duration * FRAME_RATE))


def plan_fields(settings, takes) -> dict:
    """The request fields that record a plan (`mm3.plan.settings.PlanSettings`) and its takes
    (`mm3.plan.settings.Takes`): the inverse of `MM3Request.plan_settings` and `takes_setting`, for one song."""
    sh = settings.shaping
    return dict(duration=float(settings.duration), lm_seed=settings.lm_seed, lm_cfg=float(settings.lm_cfg),
                lm_top_k=int(settings.top_k), lm_temperature=float(sh.temperature), lm_top_p=float(sh.top_p),
                lm_penalty=sh.penalty, lm_penalty_strength=float(sh.penalty_strength) if sh.penalty != "none" else 0.0,
                lm_penalty_window=int(sh.penalty_window), lm_dry_min_match=int(sh.min_match),
                min_duration=sh.min_frames / settings.frame_rate, takes=takes.takes,
                require_ending=takes.require_ending, ending_rounds=takes.rounds if takes.require_ending else 1)


def model_mismatch(request: MM3Request, field: str, name: str, fingerprint: str) -> str | None:
    """Why the file `name` (with `fingerprint`) used for `field` (lm_model, ...) may not be the one
    that made `request` (read from a replay file), or None. Files are compared by fingerprint
    where the request records one, else by name."""
    recorded, want = getattr(request, field), request.model_fingerprints.get(field)
    if want:
        if want == fingerprint:
            return None
        what = f"{recorded}, fingerprint {want}" if recorded else f"fingerprint {want}"
        return (f"{field}: {name} (fingerprint {fingerprint}) is not the file that made this song ({what}); the audio "
                "can differ")
    if recorded and os.path.basename(recorded) != os.path.basename(name):
        return f"{field}: this song was made with {recorded}, this run uses {name}; the audio can differ"
    return None


def check_output_format(name) -> str:
    """`name` if it is an output format, else the reference server's error."""
    if name not in OUTPUT_FORMATS:
        raise RequestError(f"Invalid output_format (use: {', '.join(OUTPUT_FORMATS)}), got {json.dumps(name)}")
    return name


def check_codes_syntax(text: str) -> int:
    """Number of frames in a flat `audio_codes` list (syntax and count only: code ranges depend on
    the models and are checked before they are loaded, `Pipeline.preflight`)."""
    try:
        return count_code_frames(text)
    except AudioCodesError as e:
        raise RequestError(str(e)) from None
