"""Caption and lyrics -> the token ids the LM is prefilled with.

`clean_caption` and `normalize_lyrics` reproduce diffusers 0.42.1 (`encoders._clean_caption`,
`_normalize_lyrics`) character for character; the template has no chat wrapper, BOS or EOS:
    <|im_start|><|caption_start|>{caption}<|caption_end|><|lyrics_start|>{lyrics}<|lyrics_end|><|im_end|><|audio_start|>
The unconditional stream has the same length with every id but the first and the last two
replaced by <|audio_cfg|>.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..constants import MAX_PROMPT_TOKENS
from ..errors import InputError
from ..tokenizer import CodeSpace, MM3Tokenizer

_TAG = re.compile(r"<\|([^|]*)\|>")  # <|key C|> style tags in captions
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+")
_BULLET = re.compile(r"^\s*[*+-]\s+")
_STAR_BULLET = re.compile(r"^\s*\*\s+")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")  # the reference's pattern (see _unwrap_bold)
_STARS = re.compile(r"(\*+)")
_ITALIC = re.compile(r"(?<!\*)\*([^*\n]+)\*(?!\*)")
_RULE_LINE = re.compile(r"^\s*[-*_]{3,}\s*$", flags=re.MULTILINE)  # the reference's pattern
_RULE_AT = re.compile(r"\s*[-*_]{3,}\s*$", flags=re.MULTILINE)  # the same after its ^, tried at one line start
_SPACES = re.compile(r"\s*")
_LEADING_TAGS = re.compile(r"^[ \t]*((?:\[[^\]]+\][ \t]*)+)")  # "[Verse][Chorus] ..." at a line start
_BRACKETED = re.compile(r"\[([^\]]+)\]")
_TAG_LINE = re.compile(r"(\[[^\]]*\])+")  # a line of section tags only: "[verse]", "[verse][chorus]"


class PromptError(InputError):
    """The caption or lyrics cannot make a prompt (empty, not text, or over the token budget)."""


# Refused in a caption or lyrics: unpaired surrogates, and C0/C1 control characters except the
# whitespace the cleaning rules know about (tab, newline, carriage return).
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def text_problem(name: str, text: str, *, controls: bool = True) -> str | None:
    """Why `text` cannot be a caption / lyrics, or None. Unpaired surrogates (from a JSON "\\ud800")
    are not Unicode text and cannot be tokenized; with `controls`, control characters other than
    tab, newline and carriage return (NUL, ESC, form feed, NEL, ...) are refused too, not stripped,
    so the prompt is never silently different from what was sent."""
    m = _SURROGATE.search(text)
    if m:
        return f"{name} contains an unpaired surrogate U+{ord(m.group()):04X} at position {m.start()} (not valid Unicode text)"
    m = _CONTROL.search(text) if controls else None
    if m:
        i = m.start()
        line, col = text.count("\n", 0, i) + 1, i - (text.rfind("\n", 0, i) + 1) + 1
        return (f"{name} contains the control character U+{ord(m.group()):04X} at position {i} (line {line}, "
                f"column {col}); only tab, newline and carriage return are allowed: remove it")
    return None


def _tag_as_words(m: re.Match) -> str:
    inner = m.group(1).strip()
    head_tail = inner.split(None, 1)
    return f"{head_tail[0]} is {head_tail[1]}" if len(head_tail) == 2 else inner


def _unwrap_markdown(line: str) -> str:
    line = _HEADING.sub("", line)
    line = _BULLET.sub("", line)
    line = _STAR_BULLET.sub("", line)
    if "**" in line:  # nested / repeated bold, until nothing changes
        line = _unwrap_bold(line)
    return _ITALIC.sub(r"\1", line).rstrip()


def _unwrap_bold(line: str) -> str:
    """The reference's `_BOLD.sub` repeated until nothing changes, without rescanning the line on
    every round (quadratic: one layer of "**" per round, so k nested layers took k scans).

    The line is star runs and the text between them. A round unwraps text whose star run on
    either side has two stars it has not used that round: the text's left run needs 4 when the
    text before it was unwrapped in the same round (that took the run's first two), else 2; the
    right run needs 2. Unwrapping takes 2 stars from each run; a run between texts that empties
    joins them. Text that fails a round fails every later round (runs only shrink) unless it
    was joined, so each round looks only at the texts that changed."""
    pieces = _STARS.split(line)  # text, stars, text, ..., text
    texts, runs, stars = [], [], 0  # runs[i] / runs[i + 1]: the stars left / right of texts[i]
    for i, piece in enumerate(pieces):
        if i % 2:
            stars += len(piece)
        elif piece:
            texts.append(piece)
            runs.append(stars)
            stars = 0
    runs.append(stars)
    last = len(runs) - 1
    right = {i: i + 1 for i in range(len(texts))}  # text (by its left run) -> its right run
    left = {i + 1: i for i in range(len(texts))}  # right run -> the text's left run
    candidates = set(right)
    while candidates:
        unwrapped, taken = [], None  # the right run of the text last unwrapped this round
        for a in sorted(candidates):
            b = right[a]
            if runs[a] >= (4 if taken == a else 2) and runs[b] >= 2:
                unwrapped.append(a)
                taken = b
        candidates, touched = set(unwrapped), set()
        for a in unwrapped:
            runs[a] -= 2
            runs[right[a]] -= 2
            touched.update((a, right[a]))
        for run in sorted(touched):
            if 0 < run < last and not runs[run]:  # an emptied run between two texts joins them
                head, tail = left.pop(run), right.pop(run)
                right[head], left[tail] = tail, head
                candidates.discard(run)
                candidates.add(head)
    out = ["*" * runs[0]]
    for text, n in zip(texts, runs[1:]):
        out += [text, "*" * n]
    return "".join(out)


def _drop_rule_lines(text: str) -> str:
    """`_RULE_LINE.sub("", text)` in linear time. The pattern's leading \\s* spans lines, so the
    regex engine retries it from every line start of a blank run (quadratic: a caption of 256 Ki
    newlines took minutes). Every line start of one whitespace run meets the same first visible
    character, so they all fail or the first matches: after a failure the run is skipped."""
    out, kept, pos = [], 0, 0
    while True:
        m = _RULE_AT.match(text, pos)
        if m:
            out.append(text[kept:pos])
            kept = end = m.end()
            if text[end - 1] == "\n":  # the match ends at a line start: try there
                pos = end
                continue
            after = end
        else:
            after = _SPACES.match(text, pos).end()
        nl = text.find("\n", after)
        if nl < 0:
            break
        pos = nl + 1
    out.append(text[kept:])
    return "".join(out)


def _lower_tags(text: str) -> str:
    """Every [tag] lower-cased, as `_BRACKETED.sub` does, in linear time: no match starts after
    the last "]", where the regex would scan to the end from every "[" (quadratic)."""
    end = text.rfind("]") + 1
    return _BRACKETED.sub(lambda m: f"[{m.group(1).lower()}]", text[:end]) + text[end:]


def clean_caption(caption: str) -> str:
    """Markdown-ish caption -> plain lines: `<|a b|>` -> "a is b", headings, bullets, bold and
    italics unwrapped, rule lines dropped, "• " and 4-space runs deleted, blank lines collapsed."""
    text = _TAG.sub(_tag_as_words, caption)
    text = "\n".join(_unwrap_markdown(line) for line in text.splitlines())
    text = _drop_rule_lines(text)
    text = text.replace("• ", "").replace("    ", "")
    return re.sub(r"\n{2,}", "\n", text)


def normalize_lyrics(lyrics: str) -> str:
    """Tags on their own lines and lower-cased, " ^ " as a line break, "[start]\\n" in front. A line
    that starts with tags keeps only the tags (the reference drops the rest of that line)."""
    lines = []
    for line in lyrics.split("\n"):
        m = _LEADING_TAGS.match(line)
        lines.append(m.group(1).strip() if m else line)
    text = "\n".join(lines).replace("] ", "]\n").replace(" [", "\n[").replace(" ^ ", "\n")
    text = _lower_tags(text)
    return "[start]\n" + text


@dataclass(frozen=True)
class LyricLine:
    """A line of the normalised lyrics that has visible text: its tokens sit at prompt positions
    `first` .. `stop` - 1; `tag`: a line of section tags such as "[verse]"."""

    text: str
    first: int
    stop: int
    tag: bool


@dataclass
class Prompt:
    """An assembled prompt: `ids` [2, S] int64, row 0 conditional, row 1 unconditional.
    `lyric_span`: the positions (first, stop) of the lyric tokens (between <|lyrics_start|> and
    <|lyrics_end|>); `lines`: the lyric lines in order, "[start]" (always prepended) first."""

    ids: torch.Tensor
    caption: str  # after clean_caption
    lyrics: str  # after normalize_lyrics
    codes: CodeSpace  # where the LM's audio codes live (from the tokenizer that built the prompt)
    lyric_span: tuple[int, int] = (0, 0)
    lines: tuple[LyricLine, ...] = ()

    @property
    def cond(self) -> torch.Tensor:
        return self.ids[0]

    @property
    def uncond(self) -> torch.Tensor:
        return self.ids[1]

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[1])


def unconditional_ids(ids: torch.Tensor, cfg_id: int) -> torch.Tensor:
    """Copy of `ids` [..., S] with positions 1 .. S-3 set to `cfg_id` (keeps <|im_start|> and the
    trailing <|im_end|><|audio_start|>)."""
    out = ids.clone()
    out[..., 1:-2] = cfg_id
    return out


def _assemble(tokenizer: MM3Tokenizer, cap_ids: list[int], lyr_ids: list[int]) -> list[int]:
    """The template around the ids of a cleaned caption and of normalised lyrics."""
    sp = tokenizer.special
    return ([sp.im_start, sp.caption_start] + cap_ids + [sp.caption_end, sp.lyrics_start]
            + lyr_ids + [sp.lyrics_end, sp.im_end, sp.audio_start])


def lyric_lines(lyrics: str, offsets: list[tuple[int, int]], first: int) -> tuple[LyricLine, ...]:
    """The lines of normalised `lyrics` that have visible text, each with the prompt positions of
    its tokens (token i, characters `offsets[i]`, sits at position `first + i`). A token belongs
    to the line of its first visible character; tokens of whitespace alone belong to none."""
    starts, spans = [], []
    at = 0
    for line in lyrics.split("\n"):
        starts.append(at)
        spans.append([None, None])
        at += len(line) + 1
    line_no = 0
    for i, (a, b) in enumerate(offsets):
        visible = next((c for c in range(a, b) if not lyrics[c].isspace()), None)
        if visible is None:
            continue
        while line_no + 1 < len(starts) and starts[line_no + 1] <= visible:
            line_no += 1
        span = spans[line_no]
        span[0] = first + i if span[0] is None else span[0]
        span[1] = first + i + 1
    out = []
    for line, (a, b) in zip(lyrics.split("\n"), spans):
        if a is not None:
            text = line.strip()
            out.append(LyricLine(text, a, b, bool(_TAG_LINE.fullmatch(text))))
    return tuple(out)


def count_tokens(tokenizer: MM3Tokenizer, caption: str, lyrics: str) -> int:
    """Tokens of the prompt `build_prompt` would assemble (no checks: for a count while typing)."""
    return len(_assemble(tokenizer, tokenizer.encode(clean_caption(caption or "")),
                         tokenizer.encode(normalize_lyrics(lyrics or ""))))


def build_prompt(tokenizer: MM3Tokenizer, caption: str, lyrics: str, *,
                 max_tokens: int = MAX_PROMPT_TOKENS) -> Prompt:
    """Clean, normalise, assemble and tokenize; raises `PromptError` for an empty caption or lyrics
    (as the reference) or a prompt longer than `max_tokens`."""
    missing = [name for name, v in (("caption", caption), ("lyrics", lyrics))
               if not isinstance(v, str) or not v.strip()]
    if missing:
        raise PromptError(f"caption and lyrics are required ({' and '.join(missing)} empty)")
    for name, text in (("caption", caption), ("lyrics", lyrics)):
        problem = text_problem(name, text, controls=False)  # control characters pass: the reference keeps them
        if problem:
            raise PromptError(problem)
    cap, lyr = clean_caption(caption), normalize_lyrics(lyrics)
    cap_ids = tokenizer.encode(cap)
    lyr_ids, offsets = tokenizer.encode_with_offsets(lyr)
    ids = _assemble(tokenizer, cap_ids, lyr_ids)
    first = len(cap_ids) + 4  # <|im_start|><|caption_start|> caption <|caption_end|><|lyrics_start|>
    sp = tokenizer.special
    if len(ids) > max_tokens:
        raise PromptError(f"Prompt exceeds the {max_tokens} token budget: the assembled prompt has {len(ids)} "
                          f"tokens (caption {len(cap)} chars, lyrics {len(lyr)} chars): shorten the caption or lyrics")
    cond = torch.tensor([ids], dtype=torch.long)
    return Prompt(torch.cat([cond, unconditional_ids(cond, sp.audio_cfg)]), cap, lyr, tokenizer.codes,
                  (first, first + len(lyr_ids)), lyric_lines(lyr, offsets, first))
