"""Captions in the layout the released model was trained on.

Every caption of the model's demo prompts (the corpus) has three section headings, Global Metadata,
Vocal Details and Arrangement, each followed by one "Label: text" line per aspect (`LABELS`), e.g.
"Basic Attributes: bpm is 84. key is Eb, and scale is major. Pop / Blues.". `build_caption` writes it
from the fields a user is likely to set; `parse_caption` reads it back; `caption_warning` says when a
caption has none of its headings (a tag list is far from anything the model saw). `PRESETS`: field
values copied from corpus captions (caption_presets.json, each with the request it came from).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..errors import InputError
from ..plan.prompt import clean_caption

SECTIONS = ("Global Metadata", "Vocal Details", "Arrangement")
# The labels of each section in corpus order. Every corpus caption has all of them, except that 22
# of the 61 give Primary / Secondary other names ("Primary Harmonic Layer", "Secondary Layering", ...).
LABELS = {
    "Global Metadata": ("Basic Attributes", "Global Emotional Progression", "Application Scenarios & Imagery",
                        "Sonics & Production Profile"),
    "Vocal Details": ("Vocal Gender & Timbre", "Vocal Style", "Harmony/Backing Vocals", "Vocal FX"),
    "Arrangement": ("Instrument Lifecycle Description (Primary/Secondary Layering)", "Primary", "Secondary",
                    "Groove & Foundation Progression", "Embellishments, Textures & Spatial FX"),
}
LAYERING = LABELS["Arrangement"][0]  # a label line with no text of its own, above Primary / Secondary

# Key names as the corpus spells them (Eb, Ab, Db, Bb, Gb, F# appear), with the other enharmonics.
KEYS = ("C", "C#", "Db", "D", "D#", "Eb", "E", "F", "F#", "Gb", "G", "G#", "Ab", "A", "A#", "Bb", "B")
SCALES = ("major", "minor")
VOCAL_GENDERS = ("male", "female")
# The corpus spans 68..168 bpm; these bounds only catch typos, not unusual tempos.
BPM_MIN, BPM_MAX = 40, 250

PRESETS_FILE = Path(__file__).with_name("caption_presets.json")

_KEY_BY_LOWER = {k.lower(): k for k in KEYS}
# "[Global Metadata]" and "[Global Metadata" occur too (2 corpus captions).
_SECTION_LINE = re.compile(r"^\[?(" + "|".join(map(re.escape, SECTIONS)) + r")\]?:?$", re.IGNORECASE)
_LABEL_LINE = re.compile(r"^([^:.\n]{1,80}):[ \t]*(.*)$")  # a label is short and has no full stop
_KNOWN_LABEL = re.compile(r"^(" + "|".join(re.escape(x) for v in LABELS.values() for x in v) + r")\s*:",
                          re.IGNORECASE)
_END_PUNCTUATION = ".!?\"')\u201d\u2019"


class CaptionError(InputError):
    """A caption field that cannot be written in the trained format (bad bpm, key, scale ...)."""


@dataclass(frozen=True)
class CaptionFields:
    """What `build_caption` writes; empty / None is left out. Texts are sentences, written as given."""

    bpm: int | None = None
    key: str = ""
    scale: str = ""
    genres: tuple[str, ...] = ()
    mood_arc: str = ""  # Global Emotional Progression
    production: str = ""  # Sonics & Production Profile
    vocal_gender: str = ""  # written "Male." / "Female.", the corpus's commonest opening (19 of 61)
    vocal_timbre: str = ""
    vocal_style: str = ""
    instruments: str = ""  # Arrangement, Primary


FIELD_NAMES = tuple(f.name for f in fields(CaptionFields))


def split_genres(text: str) -> tuple[str, ...]:
    """"Pop Rock / Power Pop" or "pop, soul" -> the genre names (the corpus joins them with " / ")."""
    return tuple(g.strip() for g in re.split(r"[/,\n]", text) if g.strip())


def _sentence(text: str) -> str:
    # One line per label: a newline inside a text would start a line the model reads as a new label.
    text = " ".join(text.split())
    return text if not text or text[-1] in _END_PUNCTUATION else text + "."


def _bpm(bpm) -> str:
    if isinstance(bpm, bool) or not isinstance(bpm, int) or not BPM_MIN <= bpm <= BPM_MAX:
        raise CaptionError(f"bpm must be a whole number {BPM_MIN}..{BPM_MAX}, got {bpm!r}")
    return f"bpm is {bpm}."


def _choice(name: str, value, options: tuple[str, ...], canonical: dict[str, str]) -> str:
    found = canonical.get(value.strip().lower()) if isinstance(value, str) else None
    if found is None:
        raise CaptionError(f"{name} must be one of {', '.join(options)}, got {value!r}")
    return found


def _basic_attributes(f: CaptionFields) -> str:
    parts = [_bpm(f.bpm)] if f.bpm is not None else []
    key = _choice("key", f.key, KEYS, _KEY_BY_LOWER) if f.key else ""
    scale = _choice("scale", f.scale, SCALES, {s: s for s in SCALES}) if f.scale else ""
    if key and scale:
        parts.append(f"key is {key}, and scale is {scale}.")  # the corpus's one wording
    elif key or scale:
        parts.append(f"key is {key}." if key else f"scale is {scale}.")
    if isinstance(f.genres, str) or not all(isinstance(g, str) for g in f.genres):
        raise CaptionError(f"genres must be a list of genre names, got {f.genres!r}")
    genres = [" ".join(g.split()) for g in f.genres if g.strip()]
    if genres:
        parts.append(" / ".join(genres) + ".")
    return " ".join(parts)


def _gender_and_timbre(f: CaptionFields) -> str:
    gender = _choice("vocal_gender", f.vocal_gender, VOCAL_GENDERS, {g: g for g in VOCAL_GENDERS}) \
        if f.vocal_gender else ""
    return " ".join(x for x in (gender.capitalize() + "." if gender else "", _sentence(f.vocal_timbre)) if x)


def build_caption(f: CaptionFields) -> str:
    """The caption of `f` in the trained layout: sections with nothing set, and unset labels, left out;
    sections apart by a blank line (as 36 of the 61 corpus captions; `clean_caption` drops it anyway).
    Raises `CaptionError` naming a bad value, or when nothing at all is set."""
    sections = {
        "Global Metadata": [("Basic Attributes", _basic_attributes(f)),
                            ("Global Emotional Progression", _sentence(f.mood_arc)),
                            ("Sonics & Production Profile", _sentence(f.production))],
        "Vocal Details": [("Vocal Gender & Timbre", _gender_and_timbre(f)), ("Vocal Style", _sentence(f.vocal_style))],
        "Arrangement": [("Primary", _sentence(f.instruments))],
    }
    blocks = []
    for name, lines in sections.items():
        lines = [f"{label}: {text}" for label, text in lines if text]
        if lines:
            head = [name, f"{LAYERING}:"] if name == "Arrangement" else [name]
            blocks.append("\n".join(head + lines))
    if not blocks:
        raise CaptionError(f"nothing to write: choose a preset or set at least one of {', '.join(FIELD_NAMES)}")
    return "\n\n".join(blocks)


def parse_caption(caption: str) -> dict[str, dict[str, str]]:
    """{section: {label: text}} of a caption in the trained layout, in order. Lines before the first
    heading go under section "", lines that are not "Label: text" under label "" (joined by newlines);
    a label line without its colon ("Instrument Lifecycle Description (...)", 2 corpus captions) counts."""
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in caption.splitlines():
        line = line.strip()
        if not line:
            continue
        m = _SECTION_LINE.match(line)
        if m:
            section = next(s for s in SECTIONS if s.lower() == m.group(1).lower())
            out.setdefault(section, {})
            continue
        m = _LABEL_LINE.match(line)
        if m:
            label, text = m.group(1).strip(), m.group(2).strip()
        else:
            label, text = (LAYERING, "") if line == LAYERING else ("", line)
        entries = out.setdefault(section, {})
        entries[label] = f"{entries[label]}\n{text}" if label in entries else text
    return out


def has_format_headings(caption: str) -> bool:
    """Whether the caption, as the model sees it (after `clean_caption`), has at least one line that is
    a section heading or starts with one of the format's labels."""
    return any(_SECTION_LINE.match(line.strip()) or _KNOWN_LABEL.match(line.strip())
               for line in clean_caption(caption).splitlines())


def caption_warning(caption: str) -> str | None:
    """A warning for a caption with none of the format's headings (an empty one is refused elsewhere)."""
    if not isinstance(caption, str) or not caption.strip() or has_format_headings(caption):
        return None
    return ("the caption has none of the headings of the format the model was trained on "
            "(Global Metadata, Basic Attributes: bpm is ..., Vocal Details, Arrangement); "
            "MM3 Caption Builder writes one")


def _load_presets() -> tuple[dict[str, CaptionFields], dict[str, str]]:
    raw = json.loads(PRESETS_FILE.read_text(encoding="utf-8"))
    presets = {name: CaptionFields(**{k: tuple(v) if k == "genres" else v for k, v in p["fields"].items()})
               for name, p in raw.items()}
    return presets, {name: p["source"] for name, p in raw.items()}


PRESETS, PRESET_SOURCES = _load_presets()


def caption_fields(preset: str = "", **values) -> CaptionFields:
    """The fields of `preset` ("" for none) with each value in `values` that is set (not None, "" or
    empty) put over them; `genres` may be a string ("Pop / Soul")."""
    unknown = sorted(set(values) - set(FIELD_NAMES))
    if unknown:
        raise TypeError(f"unknown caption fields {unknown}; expected some of {', '.join(FIELD_NAMES)}")
    if preset and preset not in PRESETS:
        raise CaptionError(f"unknown caption preset {preset!r}; expected one of {', '.join(PRESETS)}")
    if isinstance(values.get("genres"), str):
        values["genres"] = split_genres(values["genres"])
    given = {k: v for k, v in values.items() if v is not None and not (isinstance(v, (str, tuple, list)) and not v)}
    if isinstance(given.get("genres"), list):
        given["genres"] = tuple(given["genres"])
    return replace(PRESETS[preset] if preset else CaptionFields(), **given)
