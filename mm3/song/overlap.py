"""Planning and synthesis overlapped: each window is rendered as soon as the AR has planned its frames.

`plan_and_render` plans the songs (`mm3.plan.ar.plan`) and, after every frame, feeds each song's codes
to its teacher-forced replay (`mm3.plan.replay.Replayer`) and renders the windows that became settled
(`mm3.synth.flow.settled_windows`): condition, DiT (`mm3.synth.flow.WindowSampler`, the noise drawn per window
from the seed) and vocoder, each window's audio handed on at once. One thread, one fixed order,
the same shapes: the results are those of the stages run one after another (`mm3.song.stages`) bit for
bit. All five models are resident together. The reference RNG (one generator draws the AR and then
the DiT noise) and takes (which take is kept is known only at the end) cannot overlap; the
pipeline renders those stage by stage.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import torch

from ..plan.ar import max_frames_for, plan
from ..synth.audio import decode_windows, stitch_piece
from ..components import check_compatible
from ..backends.cpu.choice import at_threads
from ..backends.device import free_bytes
from ..synth.flow import WindowSampler, encode_window, settled_windows, window_bounds
from ..plan.lyrics_align import LyricHeads
from .numerics import FAST, Numerics
from ..progress import Progress
from ..plan.replay import Replayer
from ..plan.sampling import resolve_seed
from .stages import (
    STORE, Audio, Conditions, Latents, ModelFile, PromptText, Song, Windows, _check_hiddens, _stored,
    set_ar_numerics, stitch_windows, unchanged, watched)
from ..plan.codes import AudioCodes
from .settings import PlanSettings, SynthSettings, Takes

RESERVE_BYTES = 1 << 30  # memory left free beyond the five models' weights when they are resident together


def fits_together(weight_bytes: int, device, resident_bytes: int = 0) -> bool:
    """Whether the five models (`weight_bytes` as stored) can be resident at once on `device` with
    RESERVE_BYTES to spare, counting the `resident_bytes` already loaded as free; an unknown free
    memory answers no (stage by stage, one model group at a time, is the safe way)."""
    free = free_bytes(torch.device(device))
    return free is not None and weight_bytes + RESERVE_BYTES <= free + resident_bytes


@dataclass
class Models:
    """The five engine models of a render, and the file each was loaded from (by kind)."""

    lm: torch.nn.Module
    depth: torch.nn.Module
    cond: torch.nn.Module
    dit: torch.nn.Module
    vae: torch.nn.Module
    files: dict[str, ModelFile]

    def networks(self) -> tuple:
        return self.lm, self.depth, self.cond, self.dit, self.vae


@dataclass
class Rendered:
    """Each song's stitched audio (with its stage chain), and the seconds spent per stage:
    "plan" (sampling and replay), "dit" (conditions and DiT), "vae" (vocoder)."""

    audio: list[Audio]
    seconds: dict[str, float] = field(default_factory=dict)


class _SongRender:
    """One song's windows rendered as its frames come."""

    def __init__(self, job: "_Job", index: int, sampler: WindowSampler):
        self.job, self.index, self.sampler = job, index, sampler
        self.replayer: Replayer | None = None
        self.conds: list[torch.Tensor] = []
        self.latents: list[torch.Tensor] = []
        self.waves: list[torch.Tensor] = []

    def advance(self, frames: int, final: bool, codes) -> None:
        job = self.job
        if frames <= job.prefix_frames:  # none of its own yet: the plan may still fail with zero frames
            return
        ready = settled_windows(frames, final)
        if ready <= len(self.waves):
            return
        with at_threads(job.threads):  # the caller's count, whatever the planning thread runs at
            self._render(frames, final, codes, ready)

    def _render(self, frames: int, final: bool, codes, ready: int) -> None:
        job = self.job
        if self.replayer is None:
            self.replayer = Replayer(job.models.lm, job.models.depth, job.prompt.prompt, job.capacity,
                                     device=job.device, dtype=job.dtype, progress=job.quiet,
                                     lyric_heads=job.lyric_heads)
        self.replayer.feed(codes(self.index), final)
        bounds = window_bounds(frames)[:ready]
        for k in range(len(self.waves), ready):
            last = final and k == len(bounds) - 1
            self._window(k, bounds[k], last, len(bounds) if final else None)

    def _window(self, k: int, bounds: tuple[int, int], last: bool, windows: int | None) -> None:
        job, (s, e) = self.job, bounds
        start = time.perf_counter()
        hiddens = self.replayer.hiddens[s:e]
        if not bool(torch.isfinite(hiddens).all()):  # names the frame, as the staged run does before the DiT
            _check_hiddens(AudioCodes(torch.zeros(0), self.replayer.hiddens[:e], None, job.lm_seed(self.index)),
                           "planning")
        cond = encode_window(job.models.cond, hiddens, device=job.device, dtype=job.dtype).to(STORE)
        self.conds.append(cond)
        latent = self.sampler.window(k, cond)
        self.latents.append(latent.to(STORE))
        mid = time.perf_counter()
        (wave,) = decode_windows(job.models.vae, [latent], hop=job.hop, device=job.vae_device, progress=job.quiet,
                                 exact=job.numerics.exact)
        self.waves.append(wave.float().to(STORE))
        job.progress.on_progress("vae", k + 1, job.windows, {"window": k, "windows": job.windows, "song": self.index})
        # stitch_piece crops a window's end unless it is the last; a window before the end has a next one.
        piece = stitch_piece(self.waves[-1], k, k + 1 if last else k + 2, job.hop)
        job.seconds["dit"] += mid - start
        job.seconds["vae"] += time.perf_counter() - mid
        if job.on_audio is not None:
            unchanged(*job.models.networks())  # a window made over a file cut short is not heard
            job.on_audio(self.index, k, windows, piece, job.sample_rate)


@dataclass
class _Job:
    models: Models
    prompt: PromptText
    device: torch.device
    vae_device: torch.device
    dtype: torch.dtype
    numerics: Numerics
    progress: Progress
    on_audio: object
    capacity: int  # the most frames a song can have
    prefix_frames: int
    hop: int
    sample_rate: int
    windows: int  # the most windows a song can have (for progress reports)
    first_seed: int | None  # lm_seed of song 0
    lyric_heads: LyricHeads | None = None  # the replay also keeps each song's lyric attention
    threads: int = 1  # torch threads for the windows (the planning thread's count may differ)
    seconds: dict[str, float] = field(default_factory=lambda: {"plan": 0.0, "dit": 0.0, "vae": 0.0})

    @property
    def quiet(self) -> Progress:
        return Progress(should_stop=self.progress.should_stop)

    def lm_seed(self, song: int) -> int | None:
        return None if self.first_seed is None else self.first_seed + song


@torch.inference_mode()
def plan_and_render(models: Models, prompt: PromptText, settings: PlanSettings, synth: SynthSettings,
                    takes: Takes = Takes(), *, device, dtype: torch.dtype, numerics: Numerics = FAST,
                    progress: Progress | None = None,
                    prefix: torch.Tensor | None = None, origin=None, weight_budget: int | None = None,
                    weight_cache: int | None = None, vae_device=None, on_audio=None,
                    lyric_heads: LyricHeads | None = None) -> Rendered:
    """The songs of `settings` (song i from lm_seed + i; `prefix`: codes to continue), each
    rendered in `synth.variations` variations while it is planned. `on_audio(song, k, windows,
    samples [V, 2, T_k] float32 CPU, sample_rate)` as each window is decoded, in order per song;
    `windows` is the song's window count, None while it is still being planned. The audio, codes
    and replay requests are those of `mm3.song.stages.plan_songs` then encode, sample and decode.
    `weight_budget` / `weight_cache`: bytes of dequantized AR / DiT weight copies (None: their rules);
    `vae_device`: where the vocoder runs (None: `device`); `lyric_heads`: each song's codes also carry
    their lyric attention, as `mm3.plan.replay.replay` gives it."""
    if numerics.reference:
        raise ValueError("the reference numerics render stage by stage (their RNG draws the DiT noise after the AR)")
    if not takes.is_plain:
        raise ValueError("takes are chosen once every take is planned: render them stage by stage")
    files = models.files
    check_compatible(dict(files))
    settings = replace(settings, lm_seed=resolve_seed(settings.lm_seed))
    device = torch.device(device)
    progress = watched(progress, *models.networks())
    capacity = max_frames_for(settings.duration, prompt.prompt.num_tokens, models.lm.max_positions,
                              settings.frame_rate)
    hop = int(files["cond"].hparams["output_hop_length"])
    job = _Job(models, prompt, device, torch.device(vae_device or device), dtype, numerics, progress, on_audio,
               capacity,
               0 if prefix is None else prefix.shape[0] - 1, hop, int(files["vae"].hparams["sampling_rate"]),
               len(window_bounds(capacity)), settings.lm_seed, lyric_heads, torch.get_num_threads())
    set_ar_numerics(models.lm, models.depth, numerics, device=device, dtype=dtype)
    start = time.perf_counter()
    with ExitStack() as stack:
        renders = []
        for i in range(settings.songs):  # the first sampler keeps the DiT's weight copies for all of them
            sampler = WindowSampler(models.dit, windows=job.windows, steps=synth.steps, dit_cfg=synth.dit_cfg,
                                    seed=synth.seed, variations=synth.variations, device=device, dtype=dtype,
                                    progress=progress, weight_cache=weight_cache,
                                    **numerics.sampler(synth.steps, synth.shift))
            renders.append(_SongRender(job, i, stack.enter_context(sampler)))

        def on_frames(frames: list[int], final: list[bool], codes) -> None:
            for render, n, done in zip(renders, frames, final):
                render.advance(n, done, codes)

        planned = plan(models.lm, models.depth, prompt.prompt, settings, device=device, dtype=dtype,
                       progress=progress, weight_budget=weight_budget, prefix=prefix, keep_hiddens=False,
                       on_frames=on_frames)
    unchanged(*models.networks())
    total = time.perf_counter() - start
    job.seconds["plan"] = total - job.seconds["dit"] - job.seconds["vae"]
    audio = [_song_audio(job, render, c, settings, takes, synth, i, len(planned), origin)
             for i, (render, c) in enumerate(zip(renders, planned))]
    return Rendered(audio, job.seconds)


def _song_audio(job: _Job, render: _SongRender, planned: AudioCodes, settings: PlanSettings, takes: Takes,
                synth: SynthSettings, index: int, count: int, origin) -> Audio:
    """The stage chain of one rendered song, as the stages would have made it."""
    files = job.models.files
    frames = planned.frames
    if len(render.waves) != len(window_bounds(frames)) or render.replayer.replayed != frames:
        raise RuntimeError(f"song {index}: {len(render.waves)} windows rendered of {len(window_bounds(frames))}")
    hiddens = render.replayer.hiddens
    codes = AudioCodes(planned.codes, hiddens.clone() if hiddens.shape[0] < job.capacity else hiddens,
                       planned.prompt, planned.lm_seed, planned.ended_naturally,
                       lyric_attention=render.replayer.lyric_attention())
    _check_hiddens(codes, "planning")
    song = Song(_stored(codes), job.prompt, files["depth"], settings, takes, index, count, origin)
    conditions = Conditions(song, render.conds, job.hop, files["cond"])
    latents = Latents(conditions, render.latents, synth, files["dit"])
    return stitch_windows(Windows(latents, render.waves, job.hop, job.sample_rate, files["vae"]))
