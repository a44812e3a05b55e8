"""Natural endings: several takes of a song planned together, keeping those that ended by themselves.

With `takes` K each of the S songs gets K candidates (candidate n from seed lm_seed + n, planned
in batches). The kept songs are the candidates that ended before the duration cap, in seed order,
then capped ones; with `require_ending` only ended ones, planning up to `rounds` rounds at the
next seeds before failing. One take without `require_ending` is the plain plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .ar import plan, plan_and_replay
from .replay import replay
from .codes import AudioCodes
from ..constants import MAX_SONGS
from ..errors import RunError
from .sampling import resolve_seed
from .settings import MAX_ENDING_ROUNDS, MAX_TAKES, Takes  # noqa: F401 (importable here too)


class NoEndingError(RunError):
    """Fewer candidates than songs ended naturally within the rounds allowed."""


@dataclass(frozen=True)
class Candidate:
    """One planned take: its number n (seed lm_seed + n), length and whether it ended by itself."""

    take: int
    seed: int
    frames: int
    ended: bool
    kept: bool = False

    def describe(self, frame_rate: float) -> str:
        how = f"ended at {self.frames / frame_rate:.2f} s" if self.ended else f"reached the cap ({self.frames / frame_rate:.2f} s)"
        return f"take {self.take} (lm_seed {self.seed}): {how}{', kept' if self.kept else ''}"


def plan_takes(plan_batch: Callable, settings, takes: Takes) -> tuple[list[AudioCodes], list[Candidate]]:
    """The songs of `settings` (a `mm3.plan.settings.PlanSettings`: songs S, lm_seed) chosen among takes.

    `plan_batch(settings)` plans `settings.songs` songs from `settings.lm_seed` on (`mm3.plan.ar.plan`
    with the models bound). Returns the kept songs (S, in seed order) and every candidate planned."""
    if takes.is_plain:
        songs = plan_batch(settings)
        return songs, [Candidate(i, s.lm_seed, s.frames, s.ended_naturally, True) for i, s in enumerate(songs)]
    base = resolve_seed(settings.lm_seed)
    wanted, per_round = settings.songs, settings.songs * takes.takes
    planned: list[tuple[int, AudioCodes]] = []
    rounds = takes.rounds if takes.require_ending else 1
    for r in range(rounds):
        first = r * per_round
        for start in range(first, first + per_round, MAX_SONGS):
            count = min(MAX_SONGS, first + per_round - start)
            songs = plan_batch(replace(settings, lm_seed=base + start, songs=count))
            planned += [(start + i, s) for i, s in enumerate(songs)]
        if takes.require_ending and sum(s.ended_naturally for _, s in planned) >= wanted:
            break
    ended = [(n, s) for n, s in planned if s.ended_naturally]
    kept = ended[:wanted]
    if len(kept) < wanted:
        if takes.require_ending:
            done = len(planned) // per_round
            raise NoEndingError(
                f"no candidate ended naturally within {done} round(s) of {per_round} take(s)" if not ended else
                f"only {len(ended)} of {wanted} songs ended naturally within {done} round(s) of {per_round} take(s)")
        kept += [(n, s) for n, s in planned if not s.ended_naturally][:wanted - len(kept)]
    kept.sort(key=lambda ns: ns[0])
    chosen = {n for n, _ in kept}
    report = [Candidate(n, s.lm_seed, s.frames, s.ended_naturally, n in chosen) for n, s in planned]
    return [replace(s, take=n) for n, s in kept], report


def plan_and_replay_takes(lm, depth, prompt, settings, takes: Takes, *, device, dtype, progress=None,
                          weight_budget: int | None = None, prefix=None,
                          lyric_heads=None) -> tuple[list[AudioCodes], list[Candidate]]:
    """`mm3.plan.ar.plan_and_replay` over takes: every candidate sampled for its codes only, the kept
    ones replayed (`lyric_heads`: with their lyric attention). One take without `require_ending`
    is `plan_and_replay` itself (no report)."""
    kw = dict(device=device, dtype=dtype, progress=progress)
    if takes.is_plain:
        return plan_and_replay(lm, depth, prompt, settings, weight_budget=weight_budget, prefix=prefix,
                               lyric_heads=lyric_heads, **kw), []
    kept, report = plan_takes(lambda st: plan(lm, depth, prompt, st, weight_budget=weight_budget, prefix=prefix,
                                              keep_hiddens=False, **kw), settings, takes)
    return [replace(replay(lm, depth, prompt, s.codes, lm_seed=s.lm_seed, ended=s.ended_naturally,
                           lyric_heads=lyric_heads, **kw), take=s.take) for s in kept], report
