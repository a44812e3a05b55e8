"""What each MM3 node does besides its schema, without ComfyUI: one call of the engine's stage API
(`mm3.ar.plan_and_replay`, `mm3.flow.encode_conditions`, `mm3.flow.sample_latents`,
`mm3.audio.decode_windows`, `mm3.audio.stitch`, the very calls `mm3.pipeline.Pipeline` makes), plus
the request each result carries so the last node can write the replay JSON, and the checks of a
song's files against those a replay file records. Results wait between nodes on the CPU.

The node classes fetch their models from ComfyUI's memory manager and call these; the tests call
them directly.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from mm3.ar import PlanSettings, replay
from mm3.audio import as_stereo, decode_windows, encode_audio, stitch
from mm3.codes import AudioCodes, parse_audio_codes
from mm3.components import check_compatible
from mm3.constants import MAX_PROMPT_TOKENS
from mm3.flow import AUTO_SHIFT, encode_conditions, repaint_keep, sample_latents, windows_from_timeline
from mm3.numerics import FAST, Numerics
from mm3.output import atomic_write, write_audio
from mm3.progress import Progress
from mm3.prompt import build_prompt
from mm3.request import MM3Request, RequestError, model_mismatch, plan_fields
from mm3.takes import Takes, plan_and_replay_takes
from mm3.tokenizer import MM3Tokenizer
from .handles import ComponentHandle, ConditionBundle, LatentsBundle, PlannedSong, PromptBundle, WindowsBundle, part

STORE = torch.device("cpu")  # where stage results wait between nodes
AUDIO_REQUESTS_KEY = "mm3_requests"  # extra key of an AUDIO dict: one replay request per batch item
MODEL_CHECKS = ("warn", "refuse")  # what a node does when a file differs from the one that made a song
log = logging.getLogger("mm3")


def with_model(request: MM3Request, field: str, handle: ComponentHandle) -> MM3Request:
    """`request` recording `handle`'s file in `field` (lm_model, ...) with its fingerprint."""
    prints = dict(request.model_fingerprints) | {field: handle.fingerprint}
    return replace(request, **{field: handle.name}, model_fingerprints=prints)


def check_models(song: "PlannedSong", request: MM3Request, **handles: ComponentHandle) -> list[str]:
    """For a song loaded from a file (`song.model_check` set): each handle's file against the one
    the file records. "refuse" raises ValueError; "warn" logs and returns the warnings."""
    if song.model_check is None:
        return []
    found = [m for field, h in handles.items() if (m := model_mismatch(request, field, h.name, h.fingerprint))]
    if found and song.model_check == "refuse":
        raise ValueError(found[0] + " (refused: model_check is refuse)")
    for m in found:
        log.warning("MM3: %s", m)
    return found


def check_parts(parts: dict, **handles: ComponentHandle) -> dict:
    """Check that the new components fit those a result was made with; returns the union."""
    merged = dict(parts) | {kind: part(h) for kind, h in handles.items()}
    check_compatible(merged)
    return merged


def assemble_prompt(lm: ComponentHandle, caption: str, lyrics: str) -> PromptBundle:
    tokenizer = MM3Tokenizer.from_component(lm.component())
    return PromptBundle(build_prompt(tokenizer, caption, lyrics, max_tokens=MAX_PROMPT_TOKENS), caption, lyrics)


def _stored(song: AudioCodes) -> AudioCodes:
    return replace(song, frame_hiddens=song.frame_hiddens.to(STORE))


@torch.no_grad()
def plan_songs(lm_model, depth_model, lm: ComponentHandle, depth: ComponentHandle, prompt: PromptBundle,
               settings: PlanSettings, *, device, dtype: torch.dtype, progress: Progress | None = None,
               weight_budget: int | None = None, takes: Takes = Takes(),
               prior: PlannedSong | None = None) -> tuple[list[PlannedSong], list]:
    """`mm3.ar.plan_and_replay`: the songs of `settings` (song i from lm_seed + i) with the hiddens
    their codes replay to, as the command line makes them, so a saved codes file renders the same
    audio. `weight_budget`: bytes of dequantized weight copies the AR stage may keep (None: its
    own rule). `takes`: candidates kept by their endings (`mm3.takes`); `prior`: a song to continue
    (its codes, then new frames up to the duration). Returns the songs and every take planned."""
    parts = check_parts({}, lm=lm, depth=depth)
    request = MM3Request(caption=prompt.caption, lyrics=prompt.lyrics, **plan_fields(settings, takes),
                         continue_codes="" if prior is None else prior.codes.to_request_codes())
    request = with_model(with_model(request, "lm_model", lm), "depth_model", depth)
    try:
        request.validate()
    except RequestError as e:
        raise ValueError(str(e)) from None
    songs, candidates = plan_and_replay_takes(lm_model, depth_model, prompt.prompt, settings, takes, device=device,
                                              dtype=dtype, progress=progress, weight_budget=weight_budget,
                                              prefix=None if prior is None else prior.codes.codes)
    out = []
    for i, s in enumerate(songs):
        req = replace(request, lm_seed=s.lm_seed, audio_codes=s.to_request_codes(), continue_codes="", lm_take=s.take)
        out.append(PlannedSong(_stored(s), req, parts, i, len(songs)))
    return out, candidates


def read_codes_request(text: str, source: str, lm: ComponentHandle, depth: ComponentHandle):
    """A replay request's JSON -> (request, prompt, codes [F + 1, ncb]); every check that needs no
    model weights, so a bad file fails before anything loads."""
    try:
        request = MM3Request.from_json(text).validate()
    except RequestError as e:
        raise ValueError(f"{source}: {e}") from None
    if not request.audio_codes:
        raise ValueError(f"{source} holds no audio_codes (write one with Save Audio Codes or Save Song)")
    check_parts({}, lm=lm, depth=depth)
    prompt = assemble_prompt(lm, request.caption, request.lyrics)
    hp = depth.hparams
    try:
        codes = parse_audio_codes(request.audio_codes, prompt.prompt.codes.num_semantic, int(hp["audio_vocab_size"]))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if codes.shape[1] != int(hp["num_codebooks"]):
        raise ValueError(f"{source}: {codes.shape[1]} codes per frame, {depth.name} makes {hp['num_codebooks']}")
    return request, prompt, codes


def codes_file_problems(request: MM3Request, lm: ComponentHandle, depth: ComponentHandle) -> list[str]:
    """What keeps a replay file from rendering its original audio in these nodes: other LM or
    depth files than those that made it, or the reference RNG (which the nodes do not run)."""
    found = [m for field, h in (("lm_model", lm), ("depth_model", depth))
             if (m := model_mismatch(request, field, h.name, h.fingerprint))]
    if request.rng != "independent":
        found.append(f"this song was rendered with the {request.rng} RNG (one generator for the AR sampling and the "
                     "DiT noise); the nodes draw the DiT noise from the seed alone, so the audio differs: render it "
                     "with `python -m mm3 render --request FILE` to reproduce it")
    return found


@torch.no_grad()
def replay_codes(lm_model, depth_model, lm: ComponentHandle, depth: ComponentHandle, request: MM3Request,
                 prompt: PromptBundle, codes: torch.Tensor, *, device, dtype: torch.dtype,
                 progress: Progress | None = None, model_check: str = "warn") -> PlannedSong:
    """The song of a replay file: its codes' frame hiddens by teacher forcing. The file's request
    (with the files and fingerprints it records for cond/DiT/vocoder) travels on, so the later
    nodes check their own files against it (`model_check`: "warn" or "refuse")."""
    if model_check not in MODEL_CHECKS:
        raise ValueError(f"model_check must be one of {', '.join(MODEL_CHECKS)}, got {model_check!r}")
    song = _stored(replay(lm_model, depth_model, prompt.prompt, codes, device=device, dtype=dtype, progress=progress,
                          lm_seed=request.lm_seed))
    req = replace(request, lm_batch_size=1, synth_batch_size=1)
    req = with_model(with_model(req, "lm_model", lm), "depth_model", depth)
    return PlannedSong(song, req, check_parts({}, lm=lm, depth=depth), model_check=model_check)


@torch.no_grad()
def encode_condition(cond_model, cond: ComponentHandle, song: PlannedSong, *, device, dtype: torch.dtype,
                     progress: Progress | None = None) -> ConditionBundle:
    """`mm3.flow.encode_conditions`: the condition of every DiT window, kept on the CPU."""
    if song.codes.frame_hiddens is None:
        raise ValueError("these audio codes carry no frame hiddens; load codes with Load Audio Codes (it replays them)")
    parts = check_parts(song.parts, cond=cond)
    conds = encode_conditions(cond_model, song.codes.frame_hiddens, device=device, dtype=dtype, progress=progress)
    hop = int(cond.hparams["output_hop_length"])
    warnings = check_models(song, song.request, cond_model=cond)
    return ConditionBundle(song, [c.to(STORE) for c in conds], hop, with_model(song.request, "cond_model", cond),
                           parts, warnings)


@torch.no_grad()
def sample(dit_model, dit: ComponentHandle, condition: ConditionBundle, *, seed: int, steps: int, dit_cfg: float,
           variations: int, device, dtype: torch.dtype, progress: Progress | None = None,
           weight_cache: int | None = None, shift: float = AUTO_SHIFT, numerics: Numerics = FAST) -> LatentsBundle:
    """`mm3.flow.sample_latents` over the bundle's conditions. `weight_cache`: bytes of dequantized
    DiT weights the sampler may keep (None: its own rule). `shift`: of the flow schedule (0:
    automatic, `mm3.flow.schedule_shift`). `numerics`: how the DiT computes (`mm3.numerics`)."""
    parts = check_parts(condition.parts, dit=dit)
    warnings = check_models(condition.song, condition.song.request, dit_model=dit)
    latents = sample_latents(dit_model, condition.conds, steps=steps, dit_cfg=dit_cfg, seed=seed,
                             variations=variations, device=device, dtype=dtype, progress=progress,
                             weight_cache=weight_cache, **numerics.sampler(steps, shift))
    request = replace(condition.request, seed=int(seed), steps=int(steps), dit_cfg=float(dit_cfg),
                      synth_batch_size=int(variations), dit_shift=float(shift))
    return LatentsBundle(condition, [x.to(STORE) for x in latents], with_model(request, "dit_model", dit), parts,
                         warnings)


@torch.no_grad()
def repaint(dit_model, dit: ComponentHandle, condition: ConditionBundle, source: LatentsBundle, *, start: float,
            end: float, fade: float, seed: int, steps: int, dit_cfg: float, variations: int, device, dtype: torch.dtype,
            shift: float = AUTO_SHIFT, progress: Progress | None = None,
            weight_cache: int | None = None, numerics: Numerics = FAST) -> LatentsBundle:
    """Seconds [start, end) of the song sampled anew (noise from seed + j for variation j), the rest
    kept from `source` (its first variation): latents of the same codes' windows, from the Flow DiT
    Sampler or from recorded audio (MM3 Vocoder Encode)."""
    parts = check_parts(condition.parts, dit=dit)
    warnings = check_models(condition.song, condition.song.request, dit_model=dit) + list(source.warnings)
    keep = repaint_keep(condition.conds, source.latents, start, end, fade,
                        condition.parts["cond"].hparams["output_sampling_rate"], condition.hop, source.covered)
    latents = sample_latents(dit_model, condition.conds, steps=steps, dit_cfg=dit_cfg, seed=seed,
                             variations=variations, device=device, dtype=dtype, progress=progress,
                             weight_cache=weight_cache, keep=keep, **numerics.sampler(steps, shift))
    src = source.request
    request = replace(condition.request, seed=src.seed, steps=int(steps), dit_cfg=float(dit_cfg),
                      synth_batch_size=int(variations), dit_shift=float(shift), repaint_start=float(start),
                      repaint_end=float(end), repaint_fade=float(fade), repaint_seed=int(seed),
                      source_codes="" if src.audio_codes == condition.request.audio_codes else src.audio_codes)
    if source.covered is not None or src.steps != steps or src.dit_shift != shift or src.dit_cfg != dit_cfg:
        warnings.append("the kept part comes from recorded audio or from other DiT settings: the replay JSON of this "
                        "repaint renders the kept part with these settings instead")
    return LatentsBundle(condition, [x.to(STORE) for x in latents], with_model(request, "dit_model", dit), parts,
                         warnings)


@torch.no_grad()
def encode_recording(vae_model, vae: ComponentHandle, audio: dict, condition: ConditionBundle, *,
                     device) -> LatentsBundle:
    """A recording (ComfyUI AUDIO, first item) -> latents laid out as the windows of `condition`'s
    song, for MM3 Repaint: the vocoder's encoder at its rate, stereo (mono doubled). A recording
    shorter than the song is padded; the repaint samples that part anew."""
    wave = audio["waveform"]
    if wave.dim() != 3 or wave.shape[0] < 1:
        raise ValueError(f"expected AUDIO waveform [batch, channels, samples], got {list(wave.shape)}")
    stereo = as_stereo(wave[0].float())
    if vae_model.encoder is None:
        raise ValueError(f"{vae.name} holds no encoder (encoder.* tensors): convert the vocoder with its encoder "
                         "checkpoint to encode audio")
    timeline = encode_audio(vae_model, stereo.to(device), int(audio["sample_rate"])).cpu()
    windows, covered = windows_from_timeline(timeline, [c.shape[1] for c in condition.conds])
    request = with_model(condition.request, "vae_model", vae)
    return LatentsBundle(condition, [w.to(STORE) for w in windows], request, check_parts(condition.parts, vae=vae),
                         covered=covered)


@torch.no_grad()
def decode(vae_model, vae: ComponentHandle, latents: LatentsBundle, *, device,
           progress: Progress | None = None, numerics: Numerics = FAST) -> WindowsBundle:
    """`mm3.audio.decode_windows`: each window decoded whole, kept on the CPU for Stitch."""
    check_parts(latents.parts, vae=vae)
    warnings = check_models(latents.condition.song, latents.condition.song.request, vae_model=vae)
    hop = latents.condition.hop
    waves = decode_windows(vae_model, latents.latents, hop=hop, device=device, progress=progress,
                           exact=numerics.exact)
    sample_rate = int(vae.hparams["sampling_rate"])
    return WindowsBundle([w.to(STORE) for w in waves], hop, sample_rate, with_model(latents.request, "vae_model", vae),
                         warnings)


def stitch_audio(windows: WindowsBundle) -> dict:
    """Standard ComfyUI AUDIO: waveform [V, 2, T] float32 on the CPU, the rate, and (extra key) each
    item's replay request for Save Song."""
    return {"waveform": stitch(windows.waves, windows.hop).contiguous(), "sample_rate": windows.sample_rate,
            AUDIO_REQUESTS_KEY: [r.to_dict() for r in windows.replay_requests()]}


def write_track(path: Path, wave: torch.Tensor, sample_rate: int, fmt: str, *, mp3_bitrate: int, peak_clip: int,
                request: dict | None) -> list[Path]:
    """The audio file (atomic) and, when the audio came from MM3 nodes, its replay request beside it
    (same name, .json) with the output settings used."""
    written = [write_audio(path, as_stereo(wave.float().cpu()), fmt, peak_clip=peak_clip, mp3_bitrate=mp3_bitrate,
                           sample_rate=int(sample_rate))]
    if request is not None:
        req = replace(MM3Request.from_dict(request), output_format=fmt, mp3_bitrate=int(mp3_bitrate),
                      peak_clip=int(peak_clip))
        written.append(atomic_write(path.with_suffix(".json"), req.to_json().encode("utf-8")))
    return written

