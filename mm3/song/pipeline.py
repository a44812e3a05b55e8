"""The command line's job: a request in, tracks out, as a composition of the stages (`mm3.song.stages`).

It checks what the request names before any model is loaded (its base, `mm3.song.resolve`),
loads it one model group at a time, and turns an out-of-memory error into one that names the
stage. `rng="independent"` (default) draws the AR stage from `lm_seed + song`
and the DiT noise from `seed + variation`; `rng="reference"` drives both from one generator, as
the diffusers pipeline, with the reference numerics (`mm3.song.numerics`), to reproduce its audio.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from dataclasses import dataclass, field, replace

import torch

from . import overlap, stages
from ..plan.codes import AudioCodes, AudioCodesError, parse_audio_codes
from ..components import DESCRIPTIONS, KINDS
from ..backends.cpu.bf16 import ruled
from ..backends.device import empty_cache, pick_device, pick_dtype, total_bytes
from ..errors import RunError
from ..plan.lyric_edit import times_from_record
from ..plan.lyrics_align import LyricHeads, LyricTime, lyric_times
from .numerics import FAST, Numerics
from ..progress import Cancelled, Progress
from ..plan.prompt import lyrics_sent
from ..files.registry import Registry
from .request import MODEL_FIELDS, MM3Request, RequestError
from .resolve import RequestedFiles
from ..plan.sampling import make_generator
from .stages import PromptText, Song
from ..files.store import ModelStore

log = logging.getLogger(__name__)

# What each stage is called in error messages, and the components it runs.
STAGE_NAMES = {"ar": "planning (LM + depth decoder)", "replay": "replaying codes (LM + depth decoder)",
               "dit": "DiT sampling (condition encoder + DiT)", "vae": "vocoder decoding",
               "overlap": "planning and synthesis together (all five models)"}
STAGE_KINDS = {"ar": ("lm", "depth"), "replay": ("lm", "depth"), "dit": ("cond", "dit"), "vae": ("vae",),
               "overlap": KINDS}


class DeviceOutOfMemory(RunError):
    """The device ran out of memory in a stage. Every model was released before this was raised,
    so the same Pipeline (or process) can run the next request."""


def _is_oom(e: BaseException) -> bool:
    # CUDA / ROCm raise torch.OutOfMemoryError; MPS and XPU a RuntimeError that says so.
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


class _Stage:
    """`with pipeline._stage("dit"):` turns an out-of-memory error into `DeviceOutOfMemory` naming
    the stage, where in it, and what to change; the failed stage's frames are cleared and every
    model released so that the memory is really free again for the next run."""

    def __init__(self, pipe: "Pipeline", stage: str):
        self.pipe, self.stage = pipe, stage

    def __enter__(self):
        self.pipe._last.pop(self.stage, None)
        self.pipe.store.loading = None
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not _is_oom(exc):
            return False
        where = self.pipe._where(self.stage)
        loading = self.pipe.store.loading
        traceback.clear_frames(tb)  # drop the tensors the failed frames still reference ...
        exc.__traceback__ = tb = None  # ... and the frames themselves (closures can hold models)
        self.pipe.store.release_all()
        gc.collect()
        empty_cache(self.pipe.device)
        raise DeviceOutOfMemory(self.pipe._oom_message(self.stage, where, loading, exc)) from None


@dataclass
class Track:
    """One rendered song variation: planar stereo audio [2, T] float32 (CPU) at `sample_rate`."""

    audio: torch.Tensor
    sample_rate: int
    request: MM3Request  # the replay request: codes + exact seeds, batch sizes 1
    song: int
    variation: int
    codes: AudioCodes


@dataclass
class Timings:
    stages: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float):
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def summary(self) -> str:
        total = sum(self.stages.values())
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in self.stages.items())
        return f"{parts}; total {total:.2f} s"


def _warn_lm_cfg(lm, request: MM3Request) -> None:
    trained = lm.cfg.get("trained_lm_cfg")
    if trained is not None and trained != request.lm_cfg:
        log.warning("%s was made for lm_cfg %g%s; this request asks for %g", request.lm_model or "the LM",
                    trained, " (its guidance is distilled)" if trained == 1.0 else "", request.lm_cfg)


class Pipeline(RequestedFiles):
    """Models from `models_dir` (one folder or several), on `device` in `dtype` (auto by default)."""

    def __init__(self, models_dir, *, device: str | torch.device | None = None, dtype: str | None = None,
                 keep_loaded: bool = False):
        folders = models_dir if isinstance(models_dir, (list, tuple)) else [models_dir]
        self.registry = Registry.scan(*folders)
        self.device = pick_device(device)
        self.registry.memory = total_bytes(self.device)  # "" / "auto" names: the most precise file that fits
        self.dtype = pick_dtype(self.device, dtype)
        # The DiT's forward: a named dtype; automatic, the rule's (None: timed on the DiT's products on
        # a CPU that multiplies bfloat16 natively, `mm3.backends.cpu.bf16`).
        self.dit_dtype = ruled(self.device, self.dtype) if dtype in (None, "", "auto") else self.dtype
        self.store = ModelStore(self.registry, self.device, keep_loaded=keep_loaded)
        self.timings = Timings()
        self._last: dict[str, tuple[int, int, dict]] = {}  # stage -> its latest progress report
        self.candidates = []  # the takes of the latest plan (`mm3.plan.takes.Candidate`)
        self.overlap = True  # a streamed run plans and synthesises together where it can (`can_overlap`)
        self.lora_folders = list(self.registry.folders)  # where a LoRA named by a request is looked for

    def numerics(self, rng: str) -> Numerics:
        """The numerics of random-stream mode `rng`: the reference's (the DiT in `dtype`) for
        "reference", else the fast ones (the DiT in `dit_dtype`)."""
        return Numerics.for_rng(rng, dtype=self.dtype, fast_dtype=self.dit_dtype)

    # -- stages -----------------------------------------------------------------------------------
    def prompt_text(self, request: MM3Request) -> PromptText:
        """The prompt and the texts its replay requests record: the lyrics sent (`lyrics_sent`)."""
        return PromptText(self.prompt(request), request.caption, lyrics_sent(request.lyrics),
                          self.model_file("lm", request))

    def _ar_models(self, request: MM3Request, numerics: Numerics = FAST):
        return (self._adapted(self.store.model("lm", request.lm_model, numerics.models), "lm", request, numerics),
                self.store.model("depth", request.depth_model, numerics.models))

    def plan(self, request: MM3Request, progress: Progress | None = None, rng: str | None = None,
             lyric_heads: LyricHeads | None = None) -> tuple[list[Song], list[torch.Generator] | None]:
        """Sample the request's songs (`rng` overrides `request.rng`). Independent streams: each
        song's hiddens are then those its codes replay to (`plan_and_replay`), so its replay request
        renders the same audio. The reference mode samples with the reference's op shapes (its exact
        hiddens) and also returns each song's generator, left where the AR stage stopped drawing
        (the DiT noise continues from there). `lyric_heads`: each song also carries its lyric
        attention (`mm3.plan.lyrics_align`)."""
        rng = request.rng if rng is None else rng
        numerics = self.numerics(rng)
        prompt = self.prompt_text(request)
        progress = self._track(progress)
        settings = request.plan_settings()
        takes = request.takes_setting()
        if rng == "reference" and (not takes.is_plain or request.continue_codes):
            raise RequestError("the reference RNG plans one take per song from the prompt alone: use rng independent "
                               "for takes, require_ending or continue_codes")
        with self._stage("ar"):
            lm, depth = self._ar_models(request, numerics)
            _warn_lm_cfg(lm, request)
            prefix = None
            if request.continue_codes:
                prefix = parse_audio_codes(request.continue_codes, prompt.prompt.codes.num_semantic,
                                           depth.audio_vocab)
            start = time.perf_counter()
            gens = ([make_generator(request.lm_seed + i) for i in range(request.lm_batch_size)]
                    if rng == "reference" else None)
            songs, self.candidates = stages.plan_songs(
                lm, depth, prompt, self.model_file("depth", request), settings, takes, device=self.device,
                dtype=self.dtype, progress=progress, prefix=prefix, generators=gens, origin=request,
                lyric_heads=lyric_heads, numerics=self.numerics(rng))
        self.timings.add("plan", time.perf_counter() - start)
        return songs, gens

    def replay(self, request: MM3Request, progress: Progress | None = None,
               codes: torch.Tensor | None = None, lm_seed: int | None = None, *,
               lyric_heads: LyricHeads | None = None, hiddens: bool = True, tap=None) -> Song:
        """Frame hiddens of known codes by teacher forcing (no sampling): `codes` [F + 1, 8], or
        the request's `audio_codes` text. `lyric_heads`, `tap`, `hiddens` False: the lyric
        attention, another attention tap, the attention alone (`mm3.plan.replay.replay`)."""
        prompt = self.prompt_text(request)
        progress = self._track(progress)
        with self._stage("replay"):
            lm, depth = self._ar_models(request)
            if codes is None:
                try:
                    codes = parse_audio_codes(request.audio_codes, prompt.prompt.codes.num_semantic,
                                              depth.audio_vocab)
                except AudioCodesError as e:
                    raise RequestError(str(e)) from None
            if codes.shape[1] != depth.num_codebooks:
                raise RequestError(f"audio_codes has {codes.shape[1]} codes per frame, the depth decoder "
                                   f"makes {depth.num_codebooks}")
            start = time.perf_counter()
            song = stages.replay_song(lm, depth, prompt, self.model_file("depth", request), codes,
                                      lm_seed=request.lm_seed if lm_seed is None else lm_seed, device=self.device,
                                      dtype=self.dtype, progress=progress, origin=request,
                                      lyric_heads=lyric_heads, hiddens=hiddens, tap=tap,
                                      numerics=self.numerics(request.rng))
        self.timings.add("replay", time.perf_counter() - start)
        return song

    def replan_range(self, request: MM3Request, start: float, end: float, lm_seed: int,
                     progress: Progress | None = None) -> str:
        """The request's audio_codes with the frames of seconds [start, end) sampled anew from
        `lm_seed` (after the frames before them, END held off until the range is full); the frames
        after the range are kept. Returns the new codes text."""
        prompt = self.prompt_text(request)
        with self._stage("ar"):
            lm, depth = self._ar_models(request)
            codes = parse_audio_codes(request.audio_codes, prompt.prompt.codes.num_semantic, depth.audio_vocab)
            try:
                settings = replace(request.plan_settings(), lm_seed=lm_seed)
                new = stages.replan(lm, depth, prompt, codes, start, end, settings, device=self.device,
                                    dtype=self.dtype, progress=self._track(progress),
                                    numerics=self.numerics(request.rng))
            except ValueError as e:
                raise RequestError(str(e)) from None
        return AudioCodes(new, None, prompt.prompt).to_request_codes()

    def lyric_times(self, request: MM3Request, progress: Progress | None = None) -> list[LyricTime]:
        """Each lyric line's start in the song of `request.audio_codes`: as the request records them
        (`lyric_times`, for these lyrics), else from the LM's attention at the request's lyric heads
        (`mm3.plan.lyrics_align`; the codes replayed through the LM only)."""
        prompt = self.prompt(request)
        recorded = times_from_record(request.lyric_times, prompt.lines)
        if recorded is not None:
            return recorded
        song = self.replay(request, progress, lyric_heads=request.lyric_heads(), hiddens=False)
        return lyric_times(song.codes.lyric_attention, prompt, lead=request.lrc_lead)

    def _resample(self, request: MM3Request, progress,
                  lyric_heads: LyricHeads | None = None) -> tuple[list[Song], list[torch.Generator]]:
        """Reference mode for known codes: sample again from lm_seed (same generator, same codes)
        so the DiT noise continues from the same generator state; the codes must agree, and the
        songs stand for the given codes (no plan of their own)."""
        songs, gens = self.plan(request, progress, "reference", lyric_heads)
        wanted = parse_audio_codes(request.audio_codes, songs[0].prompt.prompt.codes.num_semantic, 1 << 62)
        if not torch.equal(songs[0].codes.codes, wanted):
            raise RequestError(f"lm_seed {request.lm_seed} does not sample these audio_codes on this device and "
                               "dtype, so the reference RNG cannot continue from it; render it with --rng independent")
        return [replace(s, plan=None) for s in songs], gens

    def synthesize(self, request: MM3Request, song: Song, progress: Progress | None = None,
                   generator: torch.Generator | None = None, source: Song | None = None,
                   numerics: Numerics | None = None, on_audio=None) -> stages.Audio:
        """`request.synth_batch_size` variations of `song`. The DiT noise comes from `generator`
        where given (the reference RNG), else from `request.seed`; `numerics` default to those of
        `request.rng`. A repaint keeps the latents of `source` (default: `song`) rendered with
        `request.seed`. `on_audio(k, windows, samples, sample_rate)`: each window's audio as soon
        as it is decoded (`mm3.song.stages.WindowStream`); the result is the same."""
        numerics = self.numerics(request.rng) if numerics is None else numerics
        progress = self._track(progress)
        synth = request.synth_settings()
        run = dict(device=self.device, dtype=self.dtype, numerics=numerics, progress=progress)
        with self._stage("dit"):
            cond, dit = self.store.model("cond", request.cond_model), self.store.model("dit", request.dit_model)
            dit = self._adapted(dit, "dit", request, numerics)
            cond_file, dit_file = self.model_file("cond", request), self.model_file("dit", request)
            start = time.perf_counter()
            conditions = stages.encode(cond, cond_file, song, device=self.device, dtype=self.dtype, progress=progress)
            stream = None
            if on_audio is not None:
                stream = stages.WindowStream(self.store.model("vae", request.vae_model), self.model_file("vae", request),
                                             conditions, on_audio, device=self.device, numerics=numerics,
                                             progress=progress)
            if request.repaints:
                kept_from = conditions if source is None else stages.encode(cond, cond_file, source, device=self.device,
                                                                            dtype=self.dtype, progress=progress)
                kept = stages.sample(dit, dit_file, kept_from, replace(synth, seed=request.seed, variations=1), **run)
                try:
                    latents = stages.repaint(dit, dit_file, conditions, kept, request.repaint_settings(),
                                             replace(synth, seed=request.repaint_seed), on_window=stream, **run)
                except ValueError as e:
                    raise RequestError(str(e)) from None
            else:
                latents = stages.sample(dit, dit_file, conditions, synth, generator=generator, on_window=stream,
                                        **run)
        self.timings.add("dit", time.perf_counter() - start)
        with self._stage("vae"):
            vae = self.store.model("vae", request.vae_model)
            start = time.perf_counter()
            windows = stream.windows(latents) if stream is not None else stages.decode(
                vae, self.model_file("vae", request), latents, device=self.device, numerics=numerics,
                progress=progress)
            audio = stages.stitch_windows(windows)
        self.timings.add("vae", time.perf_counter() - start)
        return audio

    # -- the whole job ------------------------------------------------------------------------
    def run(self, request: MM3Request, progress: Progress | None = None, rng: str | None = None,
            on_audio=None, lyric_heads: LyricHeads | None = None) -> list[Track]:
        """Every track of the request, song-major (song 0 variation 0, 0/1, ..., 1/0, ...).
        `on_audio(song, k, windows, samples [V, 2, T_k], sample_rate)`: each window's audio of each
        song as soon as it is decoded; where the run plans and synthesises together (`can_overlap`)
        the windows come while the songs are planned, `windows` None until a song's length is known.
        `lyric_heads`: each track's codes also carry their lyric attention (`mm3.plan.lyrics_align.song_lrc`
        makes its LRC).

        `rng` overrides the request's random-stream mode (`request.rng`). Each track's replay
        request names the files used, with their fingerprints. Bad input fails before any model is
        loaded (`preflight`). Any failure, Ctrl+C included, leaves no model loaded (with
        `keep_loaded`, a cancelled run keeps them)."""
        if rng is not None:
            request = replace(request, rng=rng)
        request = request.validate().resolve_seeds()
        rng = request.rng
        if rng == "reference" and request.synth_batch_size != 1:
            raise RequestError("the reference RNG renders one variation per song (synth_batch_size 1)")
        self.preflight(request, lyric_heads=lyric_heads)
        request = self.pin_models(request)
        try:
            tracks = self._run(request, progress, rng, on_audio, lyric_heads)
        except BaseException as e:
            # The finished stage frames in the traceback still reference models and activations;
            # clear their locals so a caller that keeps the exception does not keep the memory.
            traceback.clear_frames(e.__traceback__)
            if not (isinstance(e, Cancelled) and self.store.keep_loaded):
                self.store.release_all()
            raise
        if not self.store.keep_loaded:
            self.store.release_all()
        return tracks

    def _run(self, request: MM3Request, progress, rng: str, on_audio=None, lyric_heads=None) -> list[Track]:
        source = None
        if request.audio_codes:
            if request.repaints and rng == "reference":
                raise RequestError("a repaint draws its noise from seed and repaint_seed: use rng independent")
            if rng == "reference":
                songs, gens = self._resample(request, progress, lyric_heads)
            else:
                songs, gens = [self.replay(request, progress, lyric_heads=lyric_heads)], None
            if request.source_codes:  # made with request.source_lyrics where the repaint changed the words
                made = replace(request, lyrics=request.source_lyrics) if request.source_lyrics else request
                source = self.replay(made, progress, codes=parse_audio_codes(
                    request.source_codes, songs[0].prompt.prompt.codes.num_semantic, 1 << 62))
        elif on_audio is not None and self.can_overlap(request):
            return self._overlapped(request, progress, on_audio, lyric_heads)
        else:
            songs, gens = self.plan(request, progress, rng, lyric_heads)
        tracks = []
        numerics = self.numerics(rng)
        for i, song in enumerate(songs):
            heard = None if on_audio is None else (lambda *piece, song=i: on_audio(song, *piece))
            audio = self.synthesize(request, song, progress, generator=gens[i] if gens else None, source=source,
                                    numerics=numerics, on_audio=heard)
            tracks += [Track(audio.waveform[j], audio.sample_rate, replay_request, i, j, song.codes)
                       for j, replay_request in enumerate(audio.requests)]
        return tracks

    def can_overlap(self, request: MM3Request) -> bool:
        """Whether a streamed run of `request` plans and synthesises together (`mm3.song.overlap`): new
        songs (no audio_codes), the independent RNG, one take without require_ending, and all five
        models fitting in the device's memory at once (else stage by stage, one group resident)."""
        if not self.overlap or request.audio_codes or request.rng != "independent" or \
                not request.takes_setting().is_plain:
            return False
        paths = {self.registry.resolve(kind, getattr(request, MODEL_FIELDS[kind])) for kind in KINDS}
        return overlap.fits_together(sum(os.path.getsize(p) for p in paths), self.device,
                                     self.store.resident_bytes())

    def _overlapped(self, request: MM3Request, progress, on_audio, lyric_heads=None) -> list[Track]:
        numerics = self.numerics(request.rng)
        prompt = self.prompt_text(request)
        progress = self._track(progress)
        for stage in ("ar", "dit"):
            self._last.pop(stage, None)
        with self._stage("overlap"):
            models = {kind: self.store.model(kind, getattr(request, MODEL_FIELDS[kind]),
                                             numerics.models if kind in ("lm", "depth") else "fast", together=True)
                      for kind in KINDS}
            _warn_lm_cfg(models["lm"], request)
            files = {kind: self.model_file(kind, request) for kind in KINDS}
            prefix = None
            if request.continue_codes:
                prefix = parse_audio_codes(request.continue_codes, prompt.prompt.codes.num_semantic,
                                           models["depth"].audio_vocab)
            rendered = overlap.plan_and_render(
                overlap.Models(**models, files=files), prompt, request.plan_settings(), request.synth_settings(),
                request.takes_setting(), device=self.device, dtype=self.dtype, numerics=numerics, progress=progress,
                prefix=prefix, origin=request, on_audio=on_audio, lyric_heads=lyric_heads)
        self.candidates = []
        for stage, seconds in rendered.seconds.items():
            self.timings.add(stage, seconds)
        songs = [audio.windows.latents.conditions.song for audio in rendered.audio]
        return [Track(audio.waveform[j], audio.sample_rate, replay_request, i, j, song.codes)
                for i, (audio, song) in enumerate(zip(rendered.audio, songs))
                for j, replay_request in enumerate(audio.requests)]

    # -- failure reporting ------------------------------------------------------------------------
    def _stage(self, stage: str) -> _Stage:
        return _Stage(self, stage)

    def _track(self, progress: Progress | None) -> Progress:
        """`progress` that also records each stage's latest report (for error messages)."""
        inner = progress or Progress()
        if getattr(inner, "_mm3_tracked", False):
            return inner

        def on_progress(stage, done, total, info):
            self._last[stage] = (done, total, info)
            inner.on_progress(stage, done, total, info)

        tracked = Progress(on_progress=on_progress, should_stop=inner.should_stop)
        tracked._mm3_tracked = True
        return tracked

    def _where(self, stage: str) -> str:
        """How far `stage` got: "after frame 12 of 250", "after step 3/30 of window 2/3", ..."""
        if stage == "overlap":
            return ", ".join(self._where(s) for s in ("ar", "dit") if s in self._last) or "before its first frame"
        last = self._last.get(stage)
        if last is None:
            return "before its first " + {"ar": "frame", "replay": "frame", "dit": "step", "vae": "window"}[stage]
        done, total, info = last
        if stage == "dit" and "window" in info:
            return f"after step {info.get('step', '?')}/{info.get('steps', '?')} of window {info['window'] + 1}/{info['windows']}"
        if stage == "vae":
            return f"after window {done}/{total}"
        return f"after frame {done} of {total}"

    def _oom_message(self, stage: str, where: str, loading: str | None, exc: BaseException) -> str:
        kinds = STAGE_KINDS[stage]
        during = f"while loading {loading}" if loading else where
        files = " and ".join(DESCRIPTIONS[k] for k in kinds)
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        msg = (f"out of {self.device.type} memory in {STAGE_NAMES[stage]} ({during}): {first_line}. "
               f"Every model was released. Try a lighter quant of the {files} (e.g. Q8_0 or Q4_K, made with "
               "`python -m mm3 quantize`)")
        if self.store.keep_loaded:
            msg += ", or run without --keep-loaded: the strict memory mode keeps only one model group resident"
        else:
            msg += ", or fewer songs/variations or a shorter duration"
        return msg

