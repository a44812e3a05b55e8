"""The end-to-end job used by the command line and the ComfyUI nodes: a request in, tracks out.

load what the request names -> prompt -> plan (or replay codes) -> release the AR group ->
condition + flow DiT -> vocoder + stitch. Every track carries its replay request (the request
with its codes and exact seeds), which renders the same audio again.

Random streams: by default the AR stage draws from a generator seeded `lm_seed + song` and the
DiT noise from one seeded `seed + variation`, so the two seeds are independent. With
`rng="reference"` one CPU generator seeded `lm_seed + song` drives the AR sampling and then the DiT
noise, exactly as the diffusers pipeline, so its audio is reproduced for the same seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .ar import plan, replay
from .audio import decode_windows
from .codes import AudioCodes, parse_audio_codes
from .device import pick_device, pick_dtype
from .flow import sample_latents
from .progress import Progress
from .prompt import Prompt, PromptError, build_prompt
from .registry import Registry
from .request import MODEL_FIELDS, MM3Request, RequestError
from .sampling import make_generator
from .store import ModelStore

RNG_MODES = ("independent", "reference")


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


class Pipeline:
    """Models from `models_dir` (one folder or several), on `device` in `dtype` (auto by default)."""

    def __init__(self, models_dir, *, device: str | torch.device | None = None, dtype: str | None = None,
                 keep_loaded: bool = False):
        folders = models_dir if isinstance(models_dir, (list, tuple)) else [models_dir]
        self.registry = Registry.scan(*folders)
        self.device = device if isinstance(device, torch.device) else pick_device(device)
        self.dtype = pick_dtype(self.device, dtype)
        self.store = ModelStore(self.registry, self.device, keep_loaded=keep_loaded)
        self.timings = Timings()

    # -- stages -----------------------------------------------------------------------------------
    def prompt(self, request: MM3Request) -> Prompt:
        tokenizer = self.store.tokenizer(request.lm_model)
        try:
            return build_prompt(tokenizer, request.caption, request.lyrics)
        except PromptError as e:
            raise RequestError(str(e)) from None

    def _ar_models(self, request: MM3Request):
        return self.store.model("lm", request.lm_model), self.store.model("depth", request.depth_model)

    def plan(self, request: MM3Request, progress: Progress | None = None,
             rng: str = "independent") -> tuple[list[AudioCodes], list[torch.Generator] | None]:
        """Sample the request's songs; with `rng="reference"` also returns each song's generator,
        left where the AR stage stopped drawing (the DiT noise continues from there)."""
        if rng not in RNG_MODES:
            raise ValueError(f"rng must be one of {', '.join(RNG_MODES)}, got {rng!r}")
        prompt = self.prompt(request)
        lm, depth = self._ar_models(request)
        start = time.perf_counter()
        gens = None
        if rng == "reference":
            gens = [make_generator(request.lm_seed + i) for i in range(request.lm_batch_size)]
        songs = plan(lm, depth, prompt, duration=request.duration, lm_seed=request.lm_seed,
                     lm_cfg=request.lm_cfg, top_k=request.lm_top_k, lm_batch_size=request.lm_batch_size,
                     generators=gens, progress=progress, dtype=self.dtype,
                     reference_numerics=rng == "reference")  # the reference's op shapes: its exact hiddens
        self.timings.add("plan", time.perf_counter() - start)
        return songs, gens

    def replay(self, request: MM3Request, progress: Progress | None = None,
               codes: torch.Tensor | None = None, lm_seed: int | None = None) -> AudioCodes:
        """Frame hiddens of known codes by teacher forcing (no sampling): `codes` [F + 1, 8], or
        the request's `audio_codes` text."""
        prompt = self.prompt(request)
        lm, depth = self._ar_models(request)
        if codes is None:
            codes = parse_audio_codes(request.audio_codes, prompt.codes.num_semantic, depth.audio_vocab)
        if codes.shape[1] != depth.num_codebooks:
            raise RequestError(f"audio_codes has {codes.shape[1]} codes per frame, the depth decoder "
                               f"makes {depth.num_codebooks}")
        start = time.perf_counter()
        song = replay(lm, depth, prompt, codes, dtype=self.dtype, progress=progress,
                      lm_seed=request.lm_seed if lm_seed is None else lm_seed)
        self.timings.add("replay", time.perf_counter() - start)
        return song

    def _resample(self, request: MM3Request, progress) -> tuple[list[AudioCodes], list[torch.Generator]]:
        """Reference mode for known codes: sample again from lm_seed (same generator, same codes)
        so the DiT noise continues from the same generator state; the codes must agree."""
        songs, gens = self.plan(request, progress, "reference")
        wanted = parse_audio_codes(request.audio_codes, songs[0].prompt.codes.num_semantic, 1 << 62)
        if not torch.equal(songs[0].codes, wanted):
            raise RequestError(f"lm_seed {request.lm_seed} does not sample these audio_codes on this device and "
                               "dtype, so the reference RNG cannot continue from it; render without --rng reference")
        return songs, gens

    def synthesize(self, request: MM3Request, song: AudioCodes, progress: Progress | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
        """Audio [V, 2, T] float32 on the CPU for `request.synth_batch_size` variations of `song`."""
        cond = self.store.model("cond", request.cond_model)
        dit = self.store.model("dit", request.dit_model)
        start = time.perf_counter()
        frame_hiddens = song.frame_hiddens.reshape(song.frames, -1)  # [F, layers * hidden], layer-major
        latents = sample_latents(cond, dit, frame_hiddens, steps=request.steps, dit_cfg=request.dit_cfg,
                                 seed=None if generator is not None else request.seed, generator=generator,
                                 variations=request.synth_batch_size, device=self.device, dtype=self.dtype,
                                 progress=progress, cfg_batch=generator is None)  # reference: its two CFG calls
        self.timings.add("dit", time.perf_counter() - start)
        vae = self.store.model("vae", request.vae_model)
        start = time.perf_counter()
        audio = decode_windows(vae, latents, hop=int(cond.hp["output_hop_length"]), progress=progress)
        self.timings.add("vae", time.perf_counter() - start)
        return audio.float().cpu()

    # -- the whole job ------------------------------------------------------------------------
    def run(self, request: MM3Request, progress: Progress | None = None, rng: str = "independent") -> list[Track]:
        """Every track of the request, song-major (song 0 variation 0, 0/1, ..., 1/0, ...)."""
        request = request.validate().resolve_seeds()
        for kind, fname in MODEL_FIELDS.items():
            self.registry.resolve(kind, getattr(request, fname))  # unknown names fail before any work
        if rng == "reference" and request.synth_batch_size != 1:
            raise RequestError("the reference RNG renders one variation per song (synth_batch_size 1)")
        if request.audio_codes:
            if rng == "reference":
                songs, gens = self._resample(request, progress)
            else:
                songs, gens = [self.replay(request, progress)], None
        else:
            songs, gens = self.plan(request, progress, rng)
            if rng == "independent":
                # Synthesise from the hiddens the codes replay to, so rendering a track's replay
                # request gives the same audio bit for bit (sampled and replayed hiddens differ by
                # float rounding of the batch shape only).
                songs = [self.replay(request, progress, codes=s.codes, lm_seed=s.lm_seed) for s in songs]
        tracks = []
        sample_rate = None
        for i, song in enumerate(songs):
            audio = self.synthesize(request, song, progress, generator=gens[i] if gens else None)
            sample_rate = self.store.model("vae", request.vae_model).sampling_rate
            codes_text = song.to_request_codes()
            for j in range(audio.shape[0]):
                replay_request = request.replay(codes_text, song=0 if request.audio_codes else i, variation=j)
                tracks.append(Track(audio[j], sample_rate, replay_request, i, j, song))
        if not self.store.keep_loaded:
            self.store.release_all()
        return tracks
