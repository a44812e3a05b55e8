"""Optional shaping of the semantic draw: temperature, nucleus (top-p), repetition penalties and a
minimum song length. The reference has none of these; at their defaults nothing here runs and the
draw is the reference's bit for bit. Only the semantic code (codebook 0) is shaped. Per frame: CFG
and the conditional top-k pre-filter (as the reference, END masked before `min_frames`) -> penalty
subtracted from the guided logits -> divided by the temperature -> top-k softmax (as the reference)
-> nucleus over those survivors -> the draw. All state lives on the compute device and is updated
without host synchronisation. The settings (`Shaping`) are `mm3.plan.settings`'.
"""

from __future__ import annotations

import torch

from .settings import (  # noqa: F401 (the settings stay importable here)
    DEFAULT_DRY_MIN_MATCH, DEFAULT_PENALTY_WINDOW, MAX_PENALTY_STRENGTH, MAX_TEMPERATURE, PENALTIES, Shaping)

_NEG_INF = -float("inf")


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
