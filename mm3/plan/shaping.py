"""Optional shaping of the semantic draw: temperature, nucleus (top-p), repetition penalties and a
minimum song length. The reference has none of these; at their defaults nothing here runs and the
draw is the reference's bit for bit. Only the semantic code (codebook 0) is shaped. Per frame: CFG
and the conditional top-k pre-filter (as the reference, END masked before `min_frames`) -> penalty
subtracted from the guided logits -> divided by the temperature -> top-k softmax (as the reference)
-> nucleus over those survivors -> the draw. All state lives on the compute device and is updated
without host synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..constants import MAX_AUDIO_FRAMES

PENALTIES = ("none", "dry", "frequency", "presence")
DEFAULT_PENALTY_WINDOW = 320  # frames: ~13 s, a few bars of a loop at typical tempi
DEFAULT_DRY_MIN_MATCH = 15  # frames: 0.6 s, shorter repeats are musical (a held note, a beat)
MAX_TEMPERATURE = 5.0
MAX_PENALTY_STRENGTH = {"dry": 2.0, "frequency": 10.0, "presence": 10.0}

_NEG_INF = -float("inf")


@dataclass(frozen=True)
class Shaping:
    """What shapes the semantic draw; the defaults are the reference (nothing shaped)."""

    temperature: float = 1.0
    top_p: float = 1.0
    penalty: str = "none"
    penalty_strength: float = 0.0
    penalty_window: int = DEFAULT_PENALTY_WINDOW
    min_match: int = DEFAULT_DRY_MIN_MATCH
    min_frames: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and 0 < self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"lm_temperature must be in (0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"lm_top_p must be in (0, 1], got {self.top_p}")
        if self.penalty not in PENALTIES:
            raise ValueError(f"lm_penalty must be one of {', '.join(PENALTIES)}, got {self.penalty!r}")
        if self.penalty != "none":
            low, high = (1.0, MAX_PENALTY_STRENGTH["dry"]) if self.penalty == "dry" else (0.0, MAX_PENALTY_STRENGTH[self.penalty])
            if not (math.isfinite(self.penalty_strength) and low <= self.penalty_strength <= high):
                raise ValueError(f"lm_penalty_strength for {self.penalty} must be in [{low:g}, {high:g}], "
                                 f"got {self.penalty_strength}")
        for name, value in (("lm_penalty_window", self.penalty_window), ("lm_dry_min_match", self.min_match)):
            if not 1 <= value <= MAX_AUDIO_FRAMES:  # a window past the longest song only costs memory
                raise ValueError(f"{name} must be between 1 and {MAX_AUDIO_FRAMES} frames, got {value}")
        if self.min_frames < 0:
            raise ValueError(f"min_frames must be at least 0, got {self.min_frames}")

    @property
    def is_reference(self) -> bool:
        return (self.temperature == 1.0 and self.top_p == 1.0 and self.penalty == "none"
                and self.min_frames == 0)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [..., N] -> the smallest set of the most likely ones whose mass reaches top_p (at
    least one), renormalised; the others 0."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more likely ones
    keep_sorted = before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True).clamp_min(1e-12)


class SemanticShaper:
    """Per-song state of the shaping over one batch of songs, on `device`.

    `codes_cols`: the columns of the sampler's logits [songs, C] holding semantic codes 0.. (a
    slice), `end_col`: END's column (None if not there). `history`: codes already in each song
    (a prefix being continued, frame 0 included) as [songs, P + 1], or None.
    """

    def __init__(self, shaping: Shaping, songs: int, capacity: int, num_semantic: int, codes_cols: slice,
                 end_col: int | None, device: torch.device, history: torch.Tensor | None = None):
        self.s, self.num_semantic, self.cols, self.end_col = shaping, num_semantic, codes_cols, end_col
        known = 0 if history is None else history.shape[1]
        self.capacity = capacity + known
        self.pos = torch.arange(self.capacity, device=device)
        self.hist = torch.full((songs, self.capacity), -1, dtype=torch.long, device=device)
        self.match = torch.zeros_like(self.hist)  # DRY: repeat length that code hist[j] would extend
        self.length = torch.zeros((), dtype=torch.long, device=device)
        # Frames the song would have if it ended now: frame 0 is not emitted.
        self.frames = torch.full((), known - 1, dtype=torch.long, device=device)
        if history is not None:
            for j in range(known):
                self.observe(history[:, j].to(device))
            self.frames.fill_(known - 1)

    def observe(self, codes: torch.Tensor):
        """Append each song's semantic code [songs] (0..num_semantic-1)."""
        if self.s.penalty == "dry":
            same = self.hist[:, :-1] == codes[:, None]
            self.match[:, 1:] = torch.where(same, self.match[:, :-1] + 1, 0)
            self.match[:, 0] = 0
        self.hist.scatter_(1, self.length.expand(codes.shape[0], 1), codes[:, None])
        self.length += 1
        self.frames += 1

    def _penalty(self) -> torch.Tensor:
        """[songs, num_semantic] float32 amount to subtract from each code's logit, from the last
        `penalty_window` frames. "dry": a code that would extend a verbatim repeat of `length` >=
        `min_match` frames loses `strength ** (length - min_match)`, so short echoes are free and long
        loops are pushed out quickly; "frequency": `strength` per occurrence; "presence": `strength` once."""
        recent = (self.pos >= self.length - self.s.penalty_window) & (self.pos < self.length)
        songs = self.hist.shape[0]
        index = self.hist.clamp_min(0)
        if self.s.penalty == "dry":
            extends = torch.where(recent & (self.match >= self.s.min_match), self.match, -1)
            longest = torch.full((songs, self.num_semantic), -1, dtype=torch.long, device=self.hist.device)
            longest.scatter_reduce_(1, index, extends, reduce="amax")
            pen = torch.pow(self.s.penalty_strength, (longest - self.s.min_match).float())
            return torch.where(longest >= self.s.min_match, pen, 0.0)
        counts = torch.zeros((songs, self.num_semantic), dtype=torch.float32, device=self.hist.device)
        counts.scatter_add_(1, index, recent.expand(songs, -1).float())
        if self.s.penalty == "presence":
            counts = (counts > 0).float()
        return counts * self.s.penalty_strength

    def _mask_end(self, logits: torch.Tensor) -> torch.Tensor:
        if self.s.min_frames == 0 or self.end_col is None:
            return logits
        logits = logits.clone()
        early = self.frames < self.s.min_frames
        logits[:, self.end_col] = torch.where(early, _NEG_INF, logits[:, self.end_col])
        return logits

    def block_end(self, cond: torch.Tensor, uncond: torch.Tensor):
        """END's logits set to -inf while the song is shorter than `min_frames`, before the top-k
        pre-filter (so the next candidate takes its place)."""
        return self._mask_end(cond), self._mask_end(uncond)

    def logits(self, guided: torch.Tensor) -> torch.Tensor:
        """Guided logits [songs, C] (float32) -> the shaped logits the top-k softmax takes."""
        guided = self._mask_end(guided)  # guidance of two -inf values is NaN
        if self.s.penalty != "none":
            pen = self._penalty()
            width = guided[:, self.cols].shape[1]
            guided = guided.clone()
            guided[:, self.cols] = guided[:, self.cols] - pen[:, :width]
        if self.s.temperature != 1.0:
            guided = guided / self.s.temperature
        return guided

    def probs(self, probs: torch.Tensor) -> torch.Tensor:
        return nucleus(probs, self.s.top_p) if self.s.top_p < 1.0 else probs
