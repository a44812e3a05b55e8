"""Lyric timestamps from the LM's own attention: each lyric line's start time, and LRC text.

While the replay teacher-forces a song's codes (`mm3.plan.replay.replay`), chosen heads of the LM show
how much each frame's query attends to each lyric token (`LyricAttention`, a read-only
`mm3.models.lm.AttentionTap`). Each head's weights over the lyric tokens, normalised to sum 1
per frame (as HOT-Step does), are averaged over the heads; a line's share is the sum over its tokens. A dynamic programme then
assigns the frames to the lines in order (each line at least one frame, starting at "[start]",
ending at any line: a song may stop before its last line), and a line starts at its first frame.

The frame whose feedback sits at prompt position P + e (P prompt tokens) computes the hidden that
predicts code row e + 1, the e-th emitted frame, which the audio plays from e / 25 s; its
attention dates that moment. HOT-Step found the default heads on the released LM and measured
that the attention reaches a line about 0.7 s before it is heard (`LEAD_SECONDS`, added to every
stamp). `HeadStats` and `rank_heads` rank every head for another LM (`align --discover`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

import numpy as np
import torch

from ..constants import FRAME_RATE
from ..errors import InputError
from ..models.lm import AttentionTap, head_problem
from .prompt import LyricLine, Prompt

# (layer, head) of the released LM whose frame-to-lyric attention HOT-Step found to track the
# lyric on every clip it screened, and the lead it measured (see the module docstring).
DEFAULT_HEADS = ((12, 27), (19, 7), (24, 29))
LEAD_SECONDS = 0.70
MAX_LEAD = 10.0
_ITEM = re.compile(r"\s*(\d+)\s*:\s*(\d+|\*)\s*")
_FLOOR = 1e-9  # added to a line's share before the log: a frame that attends none of it costs ~20.7


class LyricHeadsError(InputError):
    """A lyric-head list that cannot be read, or names a head the LM lacks."""


@dataclass(frozen=True)
class LyricHeads:
    """The heads whose attention times the lyrics: (layer, head) pairs, head None for every head
    of the layer. `str()` is the canonical "12:27,19:*" form the request records."""

    pairs: tuple[tuple[int, int | None], ...] = tuple(DEFAULT_HEADS)

    @classmethod
    def parse(cls, text: str) -> "LyricHeads":
        """"LAYER:HEAD" or "LAYER:*" items separated by commas; "" is the default heads."""
        if not isinstance(text, str):
            raise LyricHeadsError(f"lyric heads must be text such as \"12:3,19:*\", got {text!r}")
        if not text.strip():
            return cls()
        pairs = set()
        for item in text.split(","):
            m = _ITEM.fullmatch(item)
            if not m:
                raise LyricHeadsError(f"lyric head {item.strip()!r} is not LAYER:HEAD or LAYER:* (for example "
                                      "\"12:3,19:*\"; layers and heads count from 0)")
            pairs.add((int(m.group(1)), None if m.group(2) == "*" else int(m.group(2))))
        whole = {layer for layer, head in pairs if head is None}
        kept = sorted((p for p in pairs if p[1] is None or p[0] not in whole), key=lambda p: (p[0], -1 if p[1] is None else p[1]))
        return cls(tuple(kept))

    def __str__(self) -> str:
        return ",".join(f"{layer}:{'*' if head is None else head}" for layer, head in self.pairs)

    @property
    def is_default(self) -> bool:
        return self.pairs == tuple(DEFAULT_HEADS)

    def resolve(self, lm_config: dict) -> dict[int, tuple[int, ...]]:
        """{layer: heads} for an LM of this config, or `LyricHeadsError` naming the first head it
        lacks (with the LM's layer or head count)."""
        layers, heads = int(lm_config["num_hidden_layers"]), int(lm_config["num_attention_heads"])
        out: dict[int, list[int]] = {}
        for layer, head in self.pairs:
            problem = head_problem(layer, head, layers, heads)
            if problem:
                default = " (the default heads are the released LM's; name others with --lrc-heads, or find them " \
                          "with `align --discover`)" if self.is_default else ""
                raise LyricHeadsError(f"lyric head {layer}:{'*' if head is None else head}: {problem}{default}")
            out.setdefault(layer, []).extend(range(heads) if head is None else [head])
        return {layer: tuple(sorted(set(h))) for layer, h in sorted(out.items())}


def check_lead(lead: float) -> float:
    if isinstance(lead, bool) or not isinstance(lead, (int, float)) or not math.isfinite(lead) \
            or abs(lead) > MAX_LEAD:
        raise InputError(f"the lyric lead must be seconds between -{MAX_LEAD:g} and {MAX_LEAD:g}, got {lead!r}")
    return float(lead)


class _FrameTap(AttentionTap):
    """A tap over the lyric tokens of `prompt` that keeps only the queries of frames 0 .. frames - 1
    (the prompt's own queries, when tapped, are skipped)."""

    def __init__(self, prompt: Prompt, heads: dict[int, tuple[int, ...]], frames: int):
        self.heads, self.keys = heads, tuple(prompt.lyric_span)
        self.first_frame, self.frames = prompt.num_tokens, frames

    def frame_rows(self, position: int, weights: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(first frame, this call's shares [heads, s', T] of the conditional row: each head's
        attention over the lyric tokens, summing to 1)."""
        shares = weights[0]
        skip = max(0, self.first_frame - position)
        first = position + skip - self.first_frame
        return first, shares[:, skip:skip + max(0, self.frames - first)].cpu()


class LyricAttention(_FrameTap):
    """Each frame's attention onto the lyric tokens, averaged over `heads` ({layer: heads}): after
    the replay, `attention()` is [frames, lyric tokens] float32, each row summing to 1 (or 0)."""

    def __init__(self, prompt: Prompt, heads: dict[int, tuple[int, ...]], frames: int):
        super().__init__(prompt, heads, frames)
        self.total = torch.zeros(frames, self.keys[1] - self.keys[0])
        self.count = sum(len(h) for h in heads.values())

    def observe(self, layer: int, position: int, weights: torch.Tensor) -> None:
        first, shares = self.frame_rows(position, weights)
        self.total[first:first + shares.shape[1]] += shares.sum(0)

    def attention(self, frames: int | None = None) -> torch.Tensor:
        """[frames (default all it holds), lyric tokens]."""
        return self.total[:frames] / max(self.count, 1)


# -- alignment ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LyricTime:
    """A lyric line and the second it starts (None: the song ended before it)."""

    line: LyricLine
    seconds: float | None


def line_shares(attention: torch.Tensor, prompt: Prompt) -> np.ndarray:
    """[frames, lines]: how much of each frame's lyric attention falls on each line's tokens."""
    a0 = prompt.lyric_span[0]
    att = attention.double().numpy()
    return np.stack([att[:, line.first - a0:line.stop - a0].sum(1) for line in prompt.lines], axis=1)


def line_onsets(shares: np.ndarray) -> list[int | None]:
    """The first frame of each line on the best monotonic path through `shares` [frames, lines]:
    the path starts on line 0 at frame 0, stays or moves to the next line each frame, and may end
    on any line (the lines after it get None). Best: the largest sum of log shares."""
    frames, lines = shares.shape
    if frames == 0 or lines == 0:
        return [None] * lines
    cost = -np.log(shares + _FLOOR)
    best = np.full(lines, np.inf)
    best[0] = cost[0, 0]
    moved = np.zeros((frames, lines), dtype=bool)  # frame f entered its line from the one before
    for f in range(1, frames):
        advance = np.concatenate(([np.inf], best[:-1]))
        moved[f] = advance < best
        best = np.minimum(best, advance) + cost[f]
    onsets: list[int | None] = [None] * lines
    line = int(np.argmin(best))
    for f in range(frames - 1, 0, -1):
        if moved[f, line]:
            onsets[line] = f
            line -= 1
    onsets[0] = 0
    return onsets


def lyric_times(attention: torch.Tensor, prompt: Prompt, *, lead: float = LEAD_SECONDS,
                frame_rate: float = FRAME_RATE) -> list[LyricTime]:
    """Every lyric line of `prompt` (section tags included) with its start in seconds: its first
    frame / `frame_rate` + `lead`, at least 0."""
    if attention.ndim != 2 or attention.shape[1] != prompt.lyric_span[1] - prompt.lyric_span[0]:
        raise ValueError(f"lyric attention {list(attention.shape)} does not fit the prompt's "
                         f"{prompt.lyric_span[1] - prompt.lyric_span[0]} lyric tokens")
    onsets = line_onsets(line_shares(attention, prompt))
    return [LyricTime(line, None if f is None else max(0.0, f / frame_rate + lead))
            for line, f in zip(prompt.lines, onsets)]


def lrc_stamp(seconds: float) -> str:
    """"[mm:ss.xx]", hundredths rounded half up as the decimal reads (0.825 -> .83); minutes go
    past 59 (and past 99) rather than wrapping."""
    cs = int((Decimal(repr(max(0.0, float(seconds)))) * 100).quantize(Decimal(1), rounding=ROUND_HALF_UP))
    return f"[{cs // 6000:02d}:{cs // 100 % 60:02d}.{cs % 100:02d}]"


def lrc_text(times: list[LyricTime]) -> str:
    """LRC lines "[mm:ss.xx]text" for every timed line but the prepended "[start]"."""
    out = [f"{lrc_stamp(t.seconds)}{t.line.text}\n" for i, t in enumerate(times)
           if t.seconds is not None and not (i == 0 and t.line.text == "[start]")]
    return "".join(out)


def song_lrc(codes, *, lead: float = LEAD_SECONDS, frame_rate: float = FRAME_RATE) -> str:
    """The LRC of replayed codes (`mm3.plan.codes.AudioCodes` with `lyric_attention`)."""
    if codes.lyric_attention is None or codes.prompt is None:
        raise ValueError("these codes carry no lyric attention: replay them with lyric heads first")
    return lrc_text(lyric_times(codes.lyric_attention, codes.prompt, lead=lead, frame_rate=frame_rate))


# -- finding heads --------------------------------------------------------------------------------
class HeadStats(_FrameTap):
    """For every head of every layer, per frame: the lyric token it attends most and that token's
    share of its lyric attention (`align --discover`)."""

    def __init__(self, prompt: Prompt, layers: int, heads: int, frames: int):
        super().__init__(prompt, {layer: tuple(range(heads)) for layer in range(layers)}, frames)
        self.token = torch.zeros(layers, heads, frames, dtype=torch.int32)
        self.peak = torch.zeros(layers, heads, frames)

    def observe(self, layer: int, position: int, weights: torch.Tensor) -> None:
        first, shares = self.frame_rows(position, weights)
        peak, token = shares.max(-1)
        self.peak[layer, :, first:first + peak.shape[1]] = peak
        self.token[layer, :, first:first + peak.shape[1]] = token.int()


@dataclass(frozen=True)
class HeadScore:
    """How well one head's frame-to-lyric attention could time lyrics, over one or more songs:
    `sharpness` the mean share of its most-attended lyric token, `travel` the fraction of frames
    off its most frequent token (a head parked on one token has 0), `monotonic` the rank
    correlation of that token with time; `score` = sharpness x travel x max(monotonic, 0)."""

    layer: int
    head: int
    sharpness: float
    travel: float
    monotonic: float

    @property
    def score(self) -> float:
        return self.sharpness * self.travel * max(self.monotonic, 0.0)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0 .. n-1 with ties given their average rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]


def _rank_correlation(token: np.ndarray) -> float:
    a, b = _ranks(np.arange(len(token), dtype=float)), _ranks(token.astype(float))
    a, b = a - a.mean(), b - b.mean()
    norm = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / norm) if norm > 0 else 0.0


def head_scores(stats: HeadStats) -> list[HeadScore]:
    """Every head's score on the one song `stats` saw."""
    out = []
    layers, heads, frames = stats.token.shape
    for layer in range(layers):
        for head in range(heads):
            token = stats.token[layer, head].numpy()
            modal = np.bincount(token).argmax() if frames else 0
            out.append(HeadScore(layer, head, float(stats.peak[layer, head].mean()) if frames else 0.0,
                                 float((token != modal).mean()) if frames else 0.0, _rank_correlation(token)))
    return out


def rank_heads(songs: list[list[HeadScore]]) -> list[HeadScore]:
    """Heads best first by their worst song (a head that tracks one song only is not kept up by
    it); each head is reported with its scores from that worst song."""
    worst = {}
    for song in songs:
        for s in song:
            key = (s.layer, s.head)
            if key not in worst or s.score < worst[key].score:
                worst[key] = s
    return sorted(worst.values(), key=lambda s: (-s.score, s.layer, s.head))
