"""A song's stages as typed results, each carrying what it was made from.

PromptText -> Song (audio codes) -> Conditions -> Latents -> Windows -> Audio. Every result holds
its parent, its stage's settings (`mm3.song.settings`) and the model file it ran
(`ModelFile`), so `request_of` reads the chain back into the request that remakes it: the one
place a replay request is assembled. The command line (`mm3.song.pipeline`) and the ComfyUI nodes call
these functions with the models each loaded its own way. Result tensors wait on the CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from ..plan.ar import plan
from ..synth.audio import CROP_LEFT_LATENTS, CROP_RIGHT_LATENTS, decode_windows, encode_audio, stitch, stitch_piece
from ..plan.codes import AudioCodes
from ..components import MODEL_FIELDS, check_compatible
from ..constants import FRAME_RATE
from ..filewatch import check
from ..weights.layers import set_many_rows_bf16
from ..synth.flow import NonFiniteError, encode_conditions, repaint_keep, sample_latents, windows_from_timeline
from ..plan.lyrics_align import LyricHeads
from ..lora.keys import KINDS as LORA_KINDS
from ..lora.use import lora_mismatch
from .numerics import FAST, Numerics
from ..progress import Progress
from ..plan.prompt import Prompt
from ..plan.replay import replay
from .request import MM3Request, model_mismatch, plan_fields
from .settings import PlanSettings, RepaintSettings, SynthSettings, Takes
from ..plan.takes import Candidate, plan_and_replay_takes

STORE = torch.device("cpu")  # where results wait between stages
MODEL_CHECKS = ("warn", "refuse")  # what a stage does when its file is not the one a song's request records
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFile:
    """A component file a stage ran: its kind, its name in the models folder, its content
    fingerprint (`mm3.formats.fingerprint`) and hyper-parameters (what `check_compatible` reads); for the LM
    and the DiT, the adapters its model ran with (`mm3.lora.use.LoraUse`s, in order)."""

    kind: str
    name: str
    fingerprint: str
    hparams: dict = field(repr=False, compare=False)
    adapters: tuple = ()

    @property
    def request_field(self) -> str:
        return MODEL_FIELDS[self.kind]


@dataclass
class PromptText:
    """The LM's prompt and the texts it was built from, with the LM whose tokenizer built it."""

    prompt: Prompt
    caption: str
    lyrics: str
    lm: ModelFile


@dataclass
class Song:
    """One song's audio codes and frame hiddens (CPU). `plan`: the settings that sampled it here;
    None when its codes were given and replayed. `origin`: the request it was made from, which
    stands for every field no stage sets (a replay file's, the command line's); `model_check`:
    for a song read from a file, "warn" or "refuse" when a later stage's file differs from the
    one `origin` records."""

    codes: AudioCodes
    prompt: PromptText
    depth: ModelFile
    plan: PlanSettings | None = None
    takes: Takes = Takes()
    index: int = 0
    count: int = 1
    origin: MM3Request | None = None
    model_check: str | None = None

    @property
    def frames(self) -> int:
        return self.codes.frames

    def summary(self, frame_rate: float) -> str:
        how = "ended by the model" if self.codes.ended_naturally else "stopped at the duration"
        return (f"song {self.index + 1}/{self.count}: {self.frames} frames ({self.frames / frame_rate:.2f} s), "
                f"lm_seed {self.codes.lm_seed}, {how}")


@dataclass
class Conditions:
    """The DiT condition of every window [1, L_k, D] (CPU), in window order."""

    song: Song
    conds: list[torch.Tensor]
    hop: int  # the condition encoder's output_hop_length: audio samples per latent
    cond: ModelFile
    warnings: list[str] = field(default_factory=list)


@dataclass
class Latents:
    """Denoised latents of every window [V, C, L_k] (CPU, uncropped). `synth`: the DiT run that
    made them (its seed drew the noise); None for latents encoded from a recording by `vae`
    (`covered`: the timeline latents the recording covers). A repaint keeps `source` outside
    `repaint`'s range. `rng`: "reference" when the noise came from the AR stage's generator."""

    conditions: Conditions
    latents: list[torch.Tensor]
    synth: SynthSettings | None
    dit: ModelFile | None = None
    repaint: RepaintSettings | None = None
    source: "Latents | None" = None
    rng: str = "independent"
    vae: ModelFile | None = None
    covered: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def variations(self) -> int:
        return int(self.latents[0].shape[0])


@dataclass
class Windows:
    """Each window decoded whole [V, 2, hop * L_k] float32 (CPU), before the crop-and-join."""

    latents: Latents
    waves: list[torch.Tensor]
    hop: int
    sample_rate: int
    vae: ModelFile
    warnings: list[str] = field(default_factory=list)

    @property
    def variations(self) -> int:
        return int(self.waves[0].shape[0])


@dataclass
class Audio:
    """The stitched song: planar stereo [V, 2, T] float32 (CPU) at `sample_rate`, one replay
    request per variation."""

    waveform: torch.Tensor
    sample_rate: int
    windows: Windows

    @property
    def requests(self) -> list[MM3Request]:
        return replay_requests(self.windows)


# -- provenance -----------------------------------------------------------------------------------
def _chain(result) -> tuple:
    """(prompt, song, conditions, latents, windows) up to `result`, None past it."""
    windows = result if isinstance(result, Windows) else None
    latents = windows.latents if windows else result if isinstance(result, Latents) else None
    conditions = latents.conditions if latents else result if isinstance(result, Conditions) else None
    song = conditions.song if conditions else result if isinstance(result, Song) else None
    prompt = song.prompt if song else result if isinstance(result, PromptText) else None
    return prompt, song, conditions, latents, windows


def files_of(result) -> dict[str, ModelFile]:
    """Every model file that made `result`, by kind."""
    prompt, song, conditions, latents, windows = _chain(result)
    found = [prompt and prompt.lm, song and song.depth, conditions and conditions.cond, latents and latents.dit,
             latents and latents.vae, windows and windows.vae]
    while latents is not None and latents.source is not None:  # a repaint's kept part
        latents = latents.source
        found += [latents.dit, latents.vae]
    return {f.kind: f for f in found if f}


def request_of(result) -> MM3Request:
    """The request that remakes `result` (every variation, batch of songs 1): the song's origin
    for what no stage sets, then each stage's settings and model file."""
    prompt, song, _, latents, _ = _chain(result)
    base = song.origin if song is not None and song.origin is not None else MM3Request()
    fields = dict(caption=prompt.caption, lyrics=prompt.lyrics)
    if song is not None:
        if song.plan is not None and song.origin is None:
            fields |= plan_fields(song.plan, song.takes)
        codes = song.codes
        fields |= dict(audio_codes=codes.to_request_codes(), continue_codes="", lm_batch_size=1,
                       lm_seed=base.lm_seed if codes.lm_seed is None else codes.lm_seed,
                       lm_take=codes.take if song.plan is not None else base.lm_take)
    if latents is not None:
        fields |= _synth_fields(latents, song)
    prints = dict(base.model_fingerprints)
    files = files_of(result)
    for f in files.values():
        fields[f.request_field] = f.name
        prints[f.request_field] = f.fingerprint
    return replace(base, **fields, model_fingerprints=prints, loras=_lora_entries(base, files))


def _lora_entries(base: MM3Request, files: dict[str, ModelFile]) -> list[dict]:
    """The request's adapters, the LM's then the DiT's: those of the models that ran, and the
    origin's for a component that did not run here (a plan keeps the DiT's for its render)."""
    ran = [k for k in LORA_KINDS if k in files]
    kept = [e for e in base.loras if not ran or e.get("component", ran[0]) not in ran]
    entries = kept + [u.to_dict() for k in ran for u in files[k].adapters]
    return sorted(entries, key=lambda e: LORA_KINDS.index(e["component"]) if e.get("component") in LORA_KINDS else -1)


def _synth_fields(latents: Latents, song: Song) -> dict:
    synth = latents.synth
    if synth is None:  # encoded from a recording: no DiT run of its own
        return {}
    out = dict(steps=synth.steps, dit_cfg=float(synth.dit_cfg), synth_batch_size=synth.variations,
               dit_shift=float(synth.shift), rng=latents.rng)
    if latents.repaint is None:
        return out | dict(seed=synth.seed, repaint_start=-1.0, repaint_end=-1.0, repaint_seed=-1, source_codes="",
                          source_lyrics="")
    source = latents.source
    kept_seed = source.synth.seed if source.synth is not None else (song.origin or MM3Request()).seed
    kept = source.conditions.song.codes
    r = latents.repaint
    return out | dict(seed=kept_seed, repaint_seed=synth.seed, repaint_start=float(r.start),
                      repaint_end=float(r.end), repaint_fade=float(r.fade),
                      source_codes="" if torch.equal(kept.codes, song.codes.codes) else kept.to_request_codes(),
                      source_lyrics=_source_lyrics(source.conditions.song, song),
                      **({"lyric_edit": dict(r.chosen)} if r.chosen else {}))


def _source_lyrics(kept: Song, song: Song) -> str:
    """The lyrics the kept part was made with, where a repaint changed the words ("" otherwise)."""
    return "" if kept.prompt.lyrics == song.prompt.lyrics else kept.prompt.lyrics


def replay_requests(result: Song | Windows) -> list[MM3Request]:
    """One request per variation (a song alone: one) that renders it again: its codes, exact
    seeds, batch sizes 1."""
    r = request_of(result)
    return [r.replay(r.audio_codes, variation=j) for j in range(getattr(result, "variations", 1))]


def _file_warnings(song: Song, *files: ModelFile) -> list[str]:
    """For a song read from a file: each file against the one its request records; "refuse"
    raises ValueError, "warn" logs and returns the warnings."""
    if song.model_check is None or song.origin is None:
        return []
    found = [m for f in files if (m := model_mismatch(song.origin, f.request_field, f.name, f.fingerprint))]
    found += [m for f in files if f.kind in LORA_KINDS and (m := lora_mismatch(song.origin.loras, f.kind, f.adapters))]
    if found and song.model_check == "refuse":
        raise ValueError(found[0] + " (refused: model_check is refuse)")
    for m in found:
        log.warning("MM3: %s", m)
    return found


def _fits(result, new: ModelFile) -> None:
    check_compatible(files_of(result) | {new.kind: new})


def _stored(song: AudioCodes) -> AudioCodes:
    return replace(song, frame_hiddens=None if song.frame_hiddens is None else song.frame_hiddens.to(STORE))


def set_ar_numerics(lm_model, depth_model, numerics: Numerics, *, device, dtype: torch.dtype) -> None:
    """Set the LM's and depth decoder's many-row products (prefill, replay) to the dtype
    `numerics` gives them for `dtype` inputs on `device` (`Numerics.many_rows_bf16`); every
    caller of the AR stage sets it, so one run's setting never carries into the next."""
    set_many_rows_bf16([lm_model, depth_model], numerics.many_rows_bf16(device, dtype, lm_model))


def watched(progress: Progress | None, *models) -> Progress:
    """`progress` for a stage that reads `models`: whether a file they were built from (and still
    map) was rewritten in place is checked now, before the stage, and at every poll between its
    units, ending the stage with `FileChanged` (`mm3.filewatch`) instead of a fault or garbage;
    the stage's end checks again (`unchanged`)."""
    progress = progress or Progress()
    paths = _paths(models)
    if not paths:
        return progress
    check(*paths)

    def should_stop() -> bool:
        check(*paths)
        return progress.should_stop()

    return Progress(progress.on_progress, should_stop)


def unchanged(*models) -> None:
    """As a stage ends: `FileChanged` where a file `models` map was changed or cut short while its
    last unit read it (`mm3.filewatch.check`), so that unit's result never leaves the stage."""
    check(*_paths(models))


def checked(on_window, *models):
    """`on_window` (a `WindowStream`, or None) called only once `models` are `unchanged`: a window
    denoised over a file cut short is not heard."""
    if on_window is None:
        return None

    def call(k: int, latent: torch.Tensor) -> None:
        unchanged(*models)
        on_window(k, latent)

    return call


def _paths(models) -> list[str]:
    return [path for m in models if (path := getattr(m, "source_file", None))]


# -- the stages -----------------------------------------------------------------------------------
@torch.inference_mode()
def plan_songs(lm_model, depth_model, prompt: PromptText, depth: ModelFile, settings: PlanSettings,
               takes: Takes = Takes(), *, device, dtype: torch.dtype, progress=None, weight_budget: int | None = None,
               prefix: torch.Tensor | None = None, generators: list[torch.Generator] | None = None,
               origin: MM3Request | None = None, lm: ModelFile | None = None,
               lyric_heads: LyricHeads | None = None, numerics: Numerics = FAST) -> tuple[list[Song], list[Candidate]]:
    """The songs of `settings` (song i from lm_seed + i), each with the hiddens its codes replay
    to, so its replay request renders the same audio; `prefix`: codes to continue. With
    `generators` (the reference RNG) each song is sampled from its generator with the reference's
    op shapes, and the generators are left where the DiT noise continues. `lm`: the LM file as it
    ran (with its adapters), when not the one that built the prompt. `lyric_heads`: each song also
    carries its lyric attention (`mm3.plan.lyrics_align`), from the replay, or without one (the
    reference RNG) from a replay of the LM alone. `numerics`: whether the many-row products (prefill,
    replay) multiply in bfloat16 (`Numerics.many_rows_bf16`). Returns the songs and every take planned."""
    prompt = prompt if lm is None else replace(prompt, lm=lm)
    check_compatible({"lm": prompt.lm, "depth": depth})
    progress = watched(progress, lm_model, depth_model)
    set_ar_numerics(lm_model, depth_model, numerics, device=device, dtype=dtype)
    kw = dict(device=device, dtype=dtype, progress=progress)
    if generators is not None:
        codes, candidates = plan(lm_model, depth_model, prompt.prompt, settings, generators=generators, **kw), []
        if lyric_heads is not None:
            codes = [replace(c, lyric_attention=replay(lm_model, depth_model, prompt.prompt, c.codes, hiddens=False,
                                                       lyric_heads=lyric_heads, **kw).lyric_attention) for c in codes]
    else:
        codes, candidates = plan_and_replay_takes(lm_model, depth_model, prompt.prompt, settings, takes,
                                                  weight_budget=weight_budget, prefix=prefix,
                                                  lyric_heads=lyric_heads, **kw)
    unchanged(lm_model, depth_model)
    for c in codes:
        _check_hiddens(c, "planning")
    return [Song(_stored(c), prompt, depth, settings, takes, i, len(codes), origin) for i, c in enumerate(codes)], \
        candidates


@torch.inference_mode()
def replan(lm_model, depth_model, prompt: PromptText, codes: torch.Tensor, start: float, end: float,
           settings: PlanSettings, *, device, dtype: torch.dtype, progress=None, numerics: Numerics = FAST,
           frame_rate: float = FRAME_RATE) -> torch.Tensor:
    """`codes` [F + 1, ncb] with the frames of seconds [start, end) sampled anew under `prompt`
    (from `settings.lm_seed`, after the frames before them, END held off until the range is full);
    the frames after the range are kept. `settings`: the song's plan settings (its shaping)."""
    n = codes.shape[0] - 1
    a, b = int(start * frame_rate + 1e-6), min(n, int(end * frame_rate + 1e-6))
    if not 0 <= a < b:
        raise ValueError(f"the range {start:g}..{end:g} s holds no frame of this {n / frame_rate:.2f} s song")
    settings = replace(settings, duration=(b + 0.5) / frame_rate, songs=1,
                       shaping=replace(settings.shaping, min_frames=b))
    progress = watched(progress, lm_model, depth_model)
    set_ar_numerics(lm_model, depth_model, numerics, device=device, dtype=dtype)
    (song,) = plan(lm_model, depth_model, prompt.prompt, settings, device=device, dtype=dtype, progress=progress,
                   prefix=codes[:a + 1] if a > 0 else None)
    unchanged(lm_model, depth_model)
    return torch.cat([song.codes.cpu(), codes[b + 1:]])


@torch.inference_mode()
def change_words(lm_model, depth_model, song: Song, prompt: PromptText, start: float, end: float, lm_seed: int,
                 edit: dict, *, device, dtype: torch.dtype, progress=None, numerics: Numerics = FAST) -> Song:
    """`song` singing other words in seconds [start, end): `prompt` holds its lyrics with one line
    changed (`mm3.plan.lyric_edit.replace_line`); the frames of the range are planned again under it
    from `lm_seed` (`replan`), the codes after the range kept, and the whole song replayed under it.
    Its replay request records `edit` (`lyric_edit`) with the song's own plan and seeds."""
    origin = request_of(song)
    settings = replace(song.plan if song.plan is not None else origin.plan_settings(), lm_seed=lm_seed)
    codes = replan(lm_model, depth_model, prompt, song.codes.codes, start, end, settings, device=device, dtype=dtype,
                   progress=progress, numerics=numerics)
    origin = replace(origin, lyric_edit=dict(edit), lyric_times=[])
    return replay_song(lm_model, depth_model, prompt, song.depth, codes, lm_seed=origin.lm_seed, device=device,
                       dtype=dtype, progress=progress, origin=origin, numerics=numerics)


@torch.inference_mode()
def replay_song(lm_model, depth_model, prompt: PromptText, depth: ModelFile, codes: torch.Tensor, *, lm_seed: int,
                device, dtype: torch.dtype, progress=None, origin: MM3Request | None = None,
                model_check: str | None = None, lm: ModelFile | None = None,
                lyric_heads: LyricHeads | None = None, hiddens: bool = True, tap=None,
                numerics: Numerics = FAST) -> Song:
    """The song of known codes [F + 1, ncb]: its frame hiddens by teacher forcing (no sampling);
    `lm` and `numerics` as in `plan_songs`. `lyric_heads`, `tap`, `hiddens` False: the lyric
    attention, another attention tap, the attention alone (`mm3.plan.replay.replay`)."""
    if model_check is not None and model_check not in MODEL_CHECKS:
        raise ValueError(f"model_check must be one of {', '.join(MODEL_CHECKS)}, got {model_check!r}")
    prompt = prompt if lm is None else replace(prompt, lm=lm)
    check_compatible({"lm": prompt.lm, "depth": depth})
    progress = watched(progress, lm_model, depth_model)
    set_ar_numerics(lm_model, depth_model, numerics, device=device, dtype=dtype)
    song = replay(lm_model, depth_model, prompt.prompt, codes, device=device, dtype=dtype, progress=progress,
                  lm_seed=lm_seed, lyric_heads=lyric_heads, hiddens=hiddens, tap=tap)
    unchanged(lm_model, depth_model)
    _check_hiddens(song, "replaying codes")
    return Song(_stored(song), prompt, depth, origin=origin, model_check=model_check)


@torch.inference_mode()
def encode(cond_model, cond: ModelFile, song: Song, *, device, dtype: torch.dtype, progress=None) -> Conditions:
    """The DiT condition of every window of `song` (`mm3.synth.flow.encode_conditions`)."""
    if song.codes.frame_hiddens is None:
        raise ValueError("these audio codes carry no frame hiddens; replay them first (Load Audio Codes replays them)")
    _fits(song, cond)
    progress = watched(progress, cond_model)
    warnings = _file_warnings(song, cond)
    conds = encode_conditions(cond_model, song.codes.frame_hiddens, device=device, dtype=dtype, progress=progress)
    unchanged(cond_model)
    return Conditions(song, [c.to(STORE) for c in conds], int(cond.hparams["output_hop_length"]), cond, warnings)


@torch.inference_mode()
def sample(dit_model, dit: ModelFile, conditions: Conditions, synth: SynthSettings, *, device, dtype: torch.dtype,
           numerics: Numerics = FAST, generator: torch.Generator | None = None, progress=None,
           weight_cache: int | None = None, on_window=None) -> Latents:
    """`mm3.synth.flow.sample_latents` over the conditions: variation j from `synth.seed + j`, or from
    `generator` (the reference RNG). `weight_cache`: bytes of dequantized DiT weights the sampler
    may keep (None: its own rule); `on_window`: a `WindowStream`."""
    _fits(conditions, dit)
    progress = watched(progress, dit_model)
    warnings = _file_warnings(conditions.song, dit)
    latents = sample_latents(dit_model, conditions.conds, steps=synth.steps, dit_cfg=synth.dit_cfg,
                             seed=None if generator is not None else synth.seed, generator=generator,
                             variations=synth.variations, device=device, dtype=dtype, progress=progress,
                             weight_cache=weight_cache, on_window=checked(on_window, dit_model), **numerics.sampler(synth.steps, synth.shift))
    unchanged(dit_model)
    return Latents(conditions, [x.to(STORE) for x in latents], synth, dit,
                   rng="reference" if generator is not None else "independent", warnings=warnings)


@torch.inference_mode()
def repaint(dit_model, dit: ModelFile, conditions: Conditions, source: Latents, settings: RepaintSettings,
            synth: SynthSettings, *, device, dtype: torch.dtype, numerics: Numerics = FAST, progress=None,
            weight_cache: int | None = None, on_window=None) -> Latents:
    """Seconds [start, end) of the song sampled anew (noise from synth.seed + j for variation j),
    the rest kept from `source`'s first variation: latents of the same codes' windows, from a DiT
    run or from a recording (`encode_recording`)."""
    _fits(conditions, dit)
    progress = watched(progress, dit_model)
    warnings = _file_warnings(conditions.song, dit) + list(source.warnings)
    keep = repaint_keep(conditions.conds, source.latents, settings.start, settings.end, settings.fade,
                        conditions.cond.hparams["output_sampling_rate"], conditions.hop, source.covered)
    latents = sample_latents(dit_model, conditions.conds, steps=synth.steps, dit_cfg=synth.dit_cfg, seed=synth.seed,
                             variations=synth.variations, device=device, dtype=dtype, progress=progress,
                             weight_cache=weight_cache, keep=keep, on_window=checked(on_window, dit_model),
                             **numerics.sampler(synth.steps, synth.shift))
    unchanged(dit_model)
    kept = source.synth
    if kept is None or (kept.steps, kept.shift, kept.dit_cfg) != (synth.steps, synth.shift, synth.dit_cfg):
        warnings.append("the kept part comes from recorded audio or from other DiT settings: the replay JSON of this "
                        "repaint renders the kept part with these settings instead")
    return Latents(conditions, [x.to(STORE) for x in latents], synth, dit, settings, source, warnings=warnings)


@torch.inference_mode()
def encode_recording(vae_model, vae: ModelFile, wave: torch.Tensor, sample_rate: int, conditions: Conditions, *,
                     device) -> Latents:
    """A recording [2, T] -> latents laid out as the windows of `conditions`' song, for a repaint
    that keeps parts of it; a recording shorter than the song is padded (the repaint samples
    that part anew)."""
    _fits(conditions, vae)
    watched(None, vae_model)
    if vae_model.encoder is None:
        raise ValueError(f"{vae.name} holds no encoder (encoder.* tensors): convert the vocoder with its encoder "
                         "checkpoint to encode audio")
    timeline = encode_audio(vae_model, wave.to(device), int(sample_rate)).cpu()
    unchanged(vae_model)
    windows, covered = windows_from_timeline(timeline, [c.shape[1] for c in conditions.conds])
    return Latents(conditions, [w.to(STORE) for w in windows], None, vae=vae, covered=covered)


@torch.inference_mode()
def decode(vae_model, vae: ModelFile, latents: Latents, *, device, numerics: Numerics = FAST,
           progress=None) -> Windows:
    """`mm3.synth.audio.decode_windows`: each window decoded whole."""
    _fits(latents, vae)
    progress = watched(progress, vae_model)
    warnings = _file_warnings(latents.conditions.song, vae)
    hop = latents.conditions.hop
    waves = decode_windows(vae_model, latents.latents, hop=hop, device=device, progress=progress,
                           exact=numerics.exact)
    unchanged(vae_model)
    return Windows(latents, [w.float().to(STORE) for w in waves], hop, int(vae.hparams["sampling_rate"]), vae,
                   warnings)


class WindowStream:
    """Decodes each window the moment the sampler finishes it (`sample(..., on_window=stream)`)
    and hands on the samples the stitch keeps: `on_audio(k, windows, samples [V, 2, T_k] float32
    CPU, sample_rate)`, so the song is heard before its last window is denoised. `windows(latents)`
    is then the same `Windows` as `decode` makes, without decoding again."""

    def __init__(self, vae_model, vae: ModelFile, conditions: Conditions, on_audio, *, device,
                 numerics: Numerics = FAST, progress: Progress | None = None):
        _fits(conditions, vae)
        self.vae_model, self.vae, self.on_audio, self.device, self.numerics = vae_model, vae, on_audio, device, numerics
        self.progress = watched(progress, vae_model)
        self.count, self.hop = len(conditions.conds), conditions.hop
        self.sample_rate = int(vae.hparams["sampling_rate"])
        self.waves: list[torch.Tensor] = []

    def __call__(self, k: int, latent: torch.Tensor) -> None:
        quiet = Progress(should_stop=self.progress.should_stop)
        (wave,) = decode_windows(self.vae_model, [latent], hop=self.hop, device=self.device, progress=quiet,
                                 exact=self.numerics.exact)
        unchanged(self.vae_model)
        self.waves.append(wave.float().to(STORE))
        self.progress.on_progress("vae", k + 1, self.count, {"window": k, "windows": self.count})
        self.on_audio(k, self.count, stitch_piece(self.waves[-1], k, self.count, self.hop), self.sample_rate)

    def windows(self, latents: Latents) -> Windows:
        if len(self.waves) != len(latents.latents):
            raise RuntimeError(f"{len(self.waves)} windows decoded of {len(latents.latents)}")
        return Windows(latents, self.waves, self.hop, self.sample_rate, self.vae,
                       _file_warnings(latents.conditions.song, self.vae))


def stitch_windows(windows: Windows) -> Audio:
    """The windows cropped and joined (`mm3.synth.audio.stitch`); non-finite samples name their window."""
    audio = stitch(windows.waves, windows.hop).contiguous()
    _check_audio(audio, [lat.shape[-1] for lat in windows.latents.latents], windows.hop)
    return Audio(audio, windows.sample_rate, windows)


def _check_hiddens(song: AudioCodes, stage: str) -> None:
    """NaN/Inf in the AR hiddens would only show up later as a DiT failure; name the frame here."""
    h = song.frame_hiddens
    if h is None or bool(torch.isfinite(h).all()):
        return
    bad = (~torch.isfinite(h)).reshape(h.shape[0], -1).any(dim=1).nonzero()
    frame = int(bad[0]) + 1
    raise NonFiniteError(f"non-finite LM/depth hidden states in {stage} (LM + depth decoder) at frame {frame} of "
                         f"{h.shape[0]} (lm_seed {song.lm_seed}); the LM or depth decoder weights may be corrupt")


def _check_audio(audio: torch.Tensor, latent_lengths: list[int], hop: int) -> None:
    """NaN/Inf in the decoded audio (it would be written as silence): name the vocoder window."""
    finite = torch.isfinite(audio)
    if bool(finite.all()):
        return
    first = int((~finite).reshape(-1, audio.shape[-1]).any(dim=0).nonzero()[0])  # first bad sample index
    n, end = len(latent_lengths), 0
    for k, length in enumerate(latent_lengths):  # the samples each window keeps after the stitch
        end += hop * (length - (k > 0) * CROP_LEFT_LATENTS - (k < n - 1) * CROP_RIGHT_LATENTS)
        if first < end:
            break
    raise NonFiniteError(f"non-finite vocoder output in window {k + 1}/{n} (sample {first} of {audio.shape[-1]}); "
                         "the vocoder weights may be corrupt")
