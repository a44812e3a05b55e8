"""Editing a song by its lyrics: the seconds of one sung line or section, and the lyrics with one
line's words replaced.

Lines are counted as a singer reads the lyrics: the sung lines (not the section tags, not the
"[start]" the prompt prepends) from 1, in the order of the normalised lyrics (`mm3.plan.prompt`).
Sections are named by their tag and its occurrence: "chorus 2" is the second "[chorus]"; "chorus"
alone is the first. A range reaches `margin` seconds past the line's (or section's) own start and
end into its neighbours, at most half-way into them, since the timestamps of the LM's attention
(`mm3.plan.lyrics_align`) are approximate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InputError
from .lyrics_align import LEAD_SECONDS, LyricTime, lyric_times
from .prompt import INSTRUMENTAL_LYRICS, LyricLine, lyrics_sent, normalize_lyrics

DEFAULT_MARGIN = 0.5  # seconds the range reaches past the line into its neighbours
MAX_MARGIN = 10.0
MAX_WORDS_CHARS = 1000  # one sung line; the prompt's token budget is checked on the whole prompt
_LRC_LINE = re.compile(r"^\[(\d+):(\d{1,2})(?:[.:](\d{1,3}))?\](.*)$")


class LyricEditError(InputError):
    """A line or section the lyrics do not have, words that cannot replace a line, or a song with
    no lyrics to choose from."""


@dataclass(frozen=True)
class LyricRange:
    """Seconds [start, end) to repaint, chosen by a lyric line or section: `index` its line in the
    prompt's lines, `label` what was chosen ("line 3" or "section chorus 2"), `text` its words."""

    start: float
    end: float
    index: int
    label: str
    text: str

    def describe(self) -> str:
        return f"{self.label} {self.text!r}: {self.start:.2f}-{self.end:.2f} s"

    def record(self) -> dict:
        """What a replay request records of the choice (`lyric_edit`)."""
        key, _, value = self.label.partition(" ")
        return {key: int(value) if key == "line" else value, "text": self.text, "start": self.start, "end": self.end}


def has_lyrics(lyrics: str) -> bool:
    """Whether `lyrics` hold words to choose from (not empty, not the instrumental tag)."""
    return lyrics_sent(lyrics) != INSTRUMENTAL_LYRICS


def sung_lines(lines: tuple[LyricLine, ...] | list) -> list[int]:
    """Indices into `lines` (a prompt's lines, "[start]" first) of the sung lines, in order."""
    return [i for i, line in enumerate(lines) if i > 0 and not line.tag]


def section_name(tag: str) -> str:
    """"[Chorus]" -> "chorus"; "[verse][chorus]" -> "verse chorus"."""
    return " ".join(t.strip().lower() for t in re.findall(r"\[([^\]]*)\]", tag) if t.strip())


def sections(lines) -> list[tuple[str, int]]:
    """("chorus 2", index) for every section tag line of `lines`, numbered per name from 1."""
    seen: dict[str, int] = {}
    out = []
    for i, line in enumerate(lines):
        if i > 0 and line.tag:
            name = section_name(line.text)
            seen[name] = seen.get(name, 0) + 1
            out.append((f"{name} {seen[name]}", i))
    return out


def _no_lyrics(lines) -> None:
    if not sung_lines(lines):
        raise LyricEditError("this song has no lyrics to choose a line from (an instrumental): choose the range "
                             "in seconds (--start/--end)")


def line_index(lines, line: int) -> int:
    """The index in `lines` of sung line `line` (from 1), else `LyricEditError` saying how many there are."""
    _no_lyrics(lines)
    sung = sung_lines(lines)
    if isinstance(line, bool) or not isinstance(line, int) or not 1 <= line <= len(sung):
        raise LyricEditError(f"line {line} is not in the lyrics: they have {len(sung)} sung line(s), numbered 1 to "
                             f"{len(sung)} (section tags are not counted)")
    return sung[line - 1]


def section_index(lines, name: str) -> int:
    """The index in `lines` of section `name` ("chorus 2"; "chorus" is "chorus 1")."""
    _no_lyrics(lines)
    wanted = " ".join(str(name).lower().replace("[", " ").replace("]", " ").split())
    found = dict(sections(lines))
    for label in (wanted, f"{wanted} 1"):  # "chorus 2", then a tag that holds a number: "[verse 2]"
        if wanted and label in found:
            return found[label]
    have = ", ".join(found) or "none (the lyrics have no [section] tags)"
    raise LyricEditError(f"section {name!r} is not in the lyrics; their sections: {have}")


def _timed(times: list[LyricTime], i: int) -> float | None:
    return times[i].seconds if 0 <= i < len(times) else None


def choose_range(times: list[LyricTime], song_seconds: float, *, line: int | None = None,
                 section: str | None = None, margin: float = DEFAULT_MARGIN) -> LyricRange:
    """The seconds of sung line `line` or of section `section` in a song of `song_seconds` whose
    lines start at `times` (`mm3.plan.lyrics_align.lyric_times`): from its start to the start of the
    next timed line (for a section: the next section tag), or the song's end, widened by `margin`."""
    if (line is None) == (section is None):
        raise LyricEditError("choose either a line or a section")
    if not 0 <= margin <= MAX_MARGIN:
        raise LyricEditError(f"the margin must be 0..{MAX_MARGIN:g} seconds, got {margin:g}")
    lines = [t.line for t in times]
    if line is not None:
        i, label = line_index(lines, line), f"line {line}"
        ends = [j for j in range(i + 1, len(lines)) if _timed(times, j) is not None]
    else:
        i = section_index(lines, section)
        label = "section " + next(s for s, k in sections(lines) if k == i)
        ends = [j for j in range(i + 1, len(lines)) if lines[j].tag and _timed(times, j) is not None]
    start = _timed(times, i)
    if start is None:
        raise LyricEditError(f"{label} {lines[i].text!r} was not timed: the song ends before it is reached (or its "
                             "timestamps do not follow the lyrics); choose the range in seconds")
    end = _timed(times, ends[0]) if ends else song_seconds
    before = [_timed(times, j) for j in range(i - 1, 0, -1) if _timed(times, j) is not None]
    prev = before[0] if before else 0.0
    after = [_timed(times, j) for j in range(ends[0] + 1, len(lines)) if _timed(times, j) is not None] if ends else []
    following = after[0] if after else song_seconds
    a = max(0.0, start - min(margin, (start - prev) / 2))
    b = min(song_seconds, end + min(margin, max(0.0, following - end) / 2))
    if not a < b:
        raise LyricEditError(f"{label} {lines[i].text!r} holds no time in this {song_seconds:.2f} s song")
    return LyricRange(round(a, 3), round(b, 3), i, label, lines[i].text)


def check_words(words: str) -> str:
    """`words` as one sung line, else `LyricEditError`."""
    if not isinstance(words, str) or not words.strip():
        raise LyricEditError("the new words are empty: give the words the line should sing")
    if "\n" in words or "\r" in words or " ^ " in f" {words} " or re.search(r"\[[^\]]*\]", words):
        raise LyricEditError("the new words must be one sung line: no line breaks, ' ^ ' or [section] tags")
    if len(words) > MAX_WORDS_CHARS:
        raise LyricEditError(f"the new words are {len(words)} characters long; one line holds at most "
                             f"{MAX_WORDS_CHARS}")
    return words.strip()


def _parts(raw_line: str) -> list[str]:
    """The normalised lines one line of the lyrics as written becomes (`normalize_lyrics`)."""
    return normalize_lyrics(raw_line).split("\n")[1:]


def replace_line(lyrics: str, line: int, words: str) -> tuple[str, str]:
    """(the lyrics with sung line `line` replaced by `words`, the words it had). The other lines
    stay as written; a written line that normalises to several (" ^ ") is rewritten as its parts,
    one per line, which normalise the same."""
    words = check_words(words)
    if not has_lyrics(lyrics):
        raise LyricEditError("this song has no lyrics (an instrumental): there is no line to change")
    raw = lyrics.split("\n")
    count = 0
    for r, text in enumerate(raw):
        parts = _parts(text)
        for p, part in enumerate(parts):
            stripped = part.strip()
            if not stripped or re.fullmatch(r"(\[[^\]]*\])+", stripped):
                continue
            count += 1
            if count == line:
                old = stripped
                if len(parts) == 1:
                    lead = text[:len(text) - len(text.lstrip())]
                    raw[r] = lead + words
                else:
                    parts[p] = words
                    raw[r] = "\n".join(parts)
                return "\n".join(raw), old
    raise LyricEditError(f"line {line} is not in the lyrics: they have {count} sung line(s), numbered 1 to {count} "
                         "(section tags are not counted)")


def times_from_lrc(lrc: str, lines) -> list[LyricTime]:
    """The lines of a prompt ("[start]" first) with the starts an LRC text gives them: its stamped
    lines are matched to the prompt's lines in order by their text ("[start]" at 0); a line the LRC
    does not give has None."""
    seconds: list[float | None] = [None] * len(lines)
    if lines:
        seconds[0] = 0.0
    at = 1
    for raw in str(lrc or "").splitlines():
        m = _LRC_LINE.match(raw.strip())
        if not m:
            continue
        frac = int(m.group(3)) / 10 ** len(m.group(3)) if m.group(3) else 0.0
        t, text = int(m.group(1)) * 60 + int(m.group(2)) + frac, m.group(4).strip()
        for j in range(at, len(lines)):
            if lines[j].text == text:
                seconds[j], at = t, j + 1
                break
    return [LyricTime(line, s) for line, s in zip(lines, seconds)]


def times_from_record(recorded: list, lines) -> list[LyricTime] | None:
    """The lines' starts a replay request records (`lyric_times`: one number or null per line,
    "[start]" first), or None where they were recorded for other lyrics (another count of lines)."""
    if not isinstance(recorded, list) or len(recorded) != len(lines):
        return None
    return [LyricTime(line, None if s is None else float(s)) for line, s in zip(lines, recorded)]


def record_times(codes, lead: float = LEAD_SECONDS) -> list:
    """What a replay request records of replayed codes' lyric timestamps (`lyric_times`): each
    line's start in seconds (None where the song never reached it), "[start]" first."""
    if codes.lyric_attention is None or codes.prompt is None:
        raise ValueError("these codes carry no lyric attention: replay them with lyric heads first")
    return [None if t.seconds is None else round(t.seconds, 3)
            for t in lyric_times(codes.lyric_attention, codes.prompt, lead=lead)]
