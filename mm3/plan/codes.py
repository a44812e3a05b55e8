"""AudioCodes: what the AR stage hands to synthesis, and its text form in the request JSON.

Codes are [F + 1, 8] int64: row k = [c0 (semantic), c1 .. c7 (acoustic)] of frame k. Frame 0 is
sampled and fed back to the LM but is not emitted: frame hidden k - 1 belongs to code row k, so F
rows of frame hiddens [F, 8, H] go with F + 1 rows of codes. The request's `audio_codes` is the
flat list "c0,c1,..,c7,c0,..." of all F + 1 rows (minimaxmusic.cpp writes the same).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import InputError
from .prompt import Prompt

# Codes per frame in the request's flat list: c0 then c1..c7.
REQUEST_CODES_PER_FRAME = 8
MIN_REQUEST_FRAMES = 2  # frame 0 (fed back only) plus at least one emitted frame
_NOT_CODE_TEXT = re.compile(r"[^0-9,\- \t\r\n]")
_MAX_DIGITS = 18  # every 18-digit value fits int64, so range errors can name the value exactly


class AudioCodesError(InputError):
    """An `audio_codes` text that cannot be replayed; the message is the reference server's."""


@dataclass
class AudioCodes:
    """One planned (or replayed) song.

    codes: [F + 1, num_codebooks] int64, row 0 = frame 0; frame_hiddens: [F, num_codebooks, H]
    float (conditional row: the LM hidden that predicted the frame, then the 7 depth states), or
    None when only the codes are known; prompt: the Prompt it came from; lm_seed: the seed of its
    generator (None for an explicit generator); ended_naturally: the LM chose END before the cap;
    lyric_attention: [F, lyric tokens] float32, each frame's attention onto the lyrics when the
    replay was asked for it (`mm3.plan.lyrics_align.LyricAttention`), else None.
    """

    codes: torch.Tensor
    frame_hiddens: torch.Tensor | None
    prompt: Prompt | None
    lm_seed: int | None = None
    ended_naturally: bool = False
    take: int = -1  # the candidate it is among its request's takes (`mm3.plan.takes`); -1: no takes
    lyric_attention: torch.Tensor | None = None

    @property
    def frames(self) -> int:
        """Emitted frames (rows of frame hiddens): codes rows minus frame 0."""
        return int(self.codes.shape[0]) - 1

    def to_request_codes(self) -> str:
        """The flat comma list of every code row, frame 0 included."""
        return ",".join(str(int(c)) for c in self.codes.reshape(-1).tolist())


def parse_audio_codes(text: str, semantic_vocab: int, audio_vocab: int,
                      codes_per_frame: int = REQUEST_CODES_PER_FRAME) -> torch.Tensor:
    """Flat `audio_codes` text -> codes [F + 1, codes_per_frame] int64.

    Digits, commas, '-' and whitespace only, otherwise "Invalid audio_codes"; a multiple of
    `codes_per_frame` values and at least two frames, otherwise "audio_codes needs 8 codes per frame,
    at least 2 frames"; c0 in [0, semantic_vocab) and c1.. in [0, audio_vocab), otherwise an error that
    names the frame, the position and the value.
    """
    values = _parse_values(text, codes_per_frame)
    n = codes_per_frame
    limits = [semantic_vocab] + [audio_vocab] * (n - 1)
    for i, v in enumerate(values):  # in Python ints: a huge value must not overflow int64 first
        f, p = divmod(i, n)
        if not 0 <= v < limits[p]:
            kind = "semantic code c0" if p == 0 else f"acoustic code c{p}"
            raise AudioCodesError(f"audio_codes frame {f} position {p}: {kind} {v} is out of range "
                                  f"0..{limits[p] - 1}")
    return torch.tensor(values, dtype=torch.long).view(-1, n)


def count_code_frames(text: str, codes_per_frame: int = REQUEST_CODES_PER_FRAME) -> int:
    """Rows (frame 0 included) of an `audio_codes` text, checking its syntax and count only: the
    code ranges depend on the models (`parse_audio_codes`)."""
    return len(_parse_values(text, codes_per_frame)) // codes_per_frame


def _parse_values(text: str, n: int) -> list[int]:
    if not isinstance(text, str):
        raise AudioCodesError(f"Invalid audio_codes: expected a string of comma-separated integers, got "
                              f"{type(text).__name__}")
    bad = _NOT_CODE_TEXT.search(text)
    if bad:
        raise AudioCodesError(f"Invalid audio_codes: character {bad.group()!r} at position {bad.start()} (expected "
                              "digits, commas, '-' and whitespace)")
    items = [s.strip() for s in text.split(",")]
    if items and items[-1] == "":
        items.pop()  # a trailing comma is tolerated
    values = []
    for i, s in enumerate(items):
        body = s[1:] if s.startswith("-") else s
        if not (body.isascii() and body.isdigit()):
            shown = repr(s) if s else "an empty item"
            raise AudioCodesError(f"Invalid audio_codes: item {i} is {shown}, expected an integer")
        if len(body) > _MAX_DIGITS:  # beyond int64 (and Python's int-from-text digit limit): no code is
            raise AudioCodesError(f"Invalid audio_codes: item {i} has {len(body)} digits ({s[:12]}...), far "
                                  "beyond any code")
        values.append(int(s))
    if len(values) % n or len(values) < MIN_REQUEST_FRAMES * n:
        raise AudioCodesError(f"audio_codes needs {n} codes per frame, at least {MIN_REQUEST_FRAMES} frames "
                              f"(got {len(values)} codes)")
    return values
