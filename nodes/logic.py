"""What the MM3 nodes do besides their schemas and one engine call, without ComfyUI: the prompt from
a loaded LM, a plan's checks before it runs, a replay file read and checked, a recording from
ComfyUI's AUDIO, the AUDIO handed on and the files written. The stage results are the engine's
(`mm3.song.stages`); each node calls one stage there, as `mm3.song.pipeline.Pipeline` does.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from mm3.song import stages
from mm3.synth.audio import as_stereo
from mm3.song.captions import caption_warning
from mm3.plan.codes import parse_audio_codes
from mm3.components import check_compatible
from mm3.constants import FRAME_RATE, MAX_PROMPT_TOKENS
from mm3.errors import InputError
from mm3.plan.lyric_edit import LyricRange, choose_range, replace_line, times_from_lrc
from mm3.plan.lyrics_align import LyricHeads, song_lrc
from mm3.song.numerics import FAST, Numerics
from mm3.synth.output import atomic_write, write_audio
from mm3.progress import Progress
from mm3.lora.use import lora_mismatch
from mm3.plan.prompt import build_prompt, lyrics_sent
from mm3.song.request import MM3Request, RequestError, model_mismatch
from mm3.song.settings import OutputSettings, PlanSettings, Takes, check_plan_start
from mm3.song.stages import Conditions, Latents, PromptText, Song, Windows
from mm3.tokenizer import MM3Tokenizer
from .handles import ComponentHandle
from .validation import prompt_texts

AUDIO_REQUESTS_KEY = "mm3_requests"  # extra key of an AUDIO dict: one replay request per batch item
log = logging.getLogger("mm3")


def linked_seed(seed: int, top: int, name: str) -> int:
    """A seed wired in from another node (ComfyUI checks a widget's range, not a link's): one past
    `top` wraps around into 0..top, so a seed node with a wider range (ComfyUI-Distributed's
    Distributed Seed draws up to 2^50) still gives distinct, recorded seeds. Negative: refused."""
    if seed < 0:
        raise InputError(f"{name} must be 0..{top}, got {seed}")
    if seed <= top:
        return seed
    folded = seed % (top + 1)
    log.info("MM3: %s %d is past %d: %d is used (and recorded in the replay JSON)", name, seed, top, folded)
    return folded


def assemble_prompt(lm: ComponentHandle, caption: str, lyrics: str) -> PromptText:
    """The prompt of `caption` and `lyrics` (empty: an instrumental, `mm3.plan.prompt.lyrics_sent`, which
    the replay JSON records as sent). Text no prompt may carry (`validation.prompt_texts`: the
    caption, and linked lyrics, were not seen when the prompt was queued) is refused first."""
    problem = prompt_texts(caption=caption, lyrics=lyrics)
    if problem:
        raise ValueError(problem)
    tokenizer = MM3Tokenizer.from_component(lm.component())
    return PromptText(build_prompt(tokenizer, caption, lyrics, max_tokens=MAX_PROMPT_TOKENS), caption,
                      lyrics_sent(lyrics), lm.file())


def prompt_summary(prompt: PromptText, limit: int) -> str:
    """The token count, a caption warning (second line, when there is one), the cleaned texts."""
    warning = caption_warning(prompt.caption)
    return (f"{prompt.prompt.num_tokens} / {limit} prompt tokens\n" + (f"warning: {warning}\n" if warning else "")
            + f"\ncaption (cleaned):\n{prompt.prompt.caption}\n\nlyrics (normalised):\n{prompt.prompt.lyrics}")


def plan_songs(lm_model, depth_model, lm: ComponentHandle, depth: ComponentHandle, prompt: PromptText,
               settings: PlanSettings, *, device, dtype: torch.dtype, progress: Progress | None = None,
               weight_budget: int | None = None, takes: Takes = Takes(),
               prior: Song | None = None, numerics: Numerics = FAST) -> tuple[list[Song], list]:
    """`mm3.song.stages.plan_songs` after the checks that join its settings (`check_plan`); `prior`:
    the song to continue."""
    check_plan(settings, prior)
    return stages.plan_songs(lm_model, depth_model, prompt, depth.file(), settings, takes, device=device, dtype=dtype,
                             progress=progress, weight_budget=weight_budget,
                             prefix=None if prior is None else prior.codes.codes, lm=lm.file(), numerics=numerics)


def check_plan(settings: PlanSettings, prior: Song | None = None) -> None:
    """The checks of a plan that join several inputs (a min_duration past the duration, a song to
    continue longer than it), which ComfyUI's per-input ranges cannot make: a node calls it before
    it loads anything. Each input's own range was checked when its settings object was built, and
    the prompt's texts when the prompt was."""
    check_plan_start(settings, None if prior is None else prior.codes.frames)


def read_codes_request(text: str, source: str, lm: ComponentHandle, depth: ComponentHandle):
    """A replay request's JSON -> (request, prompt, codes [F + 1, ncb]); every check that needs no
    model weights, so a bad file fails before anything loads."""
    try:
        request = MM3Request.from_json(text).validate()
    except RequestError as e:
        raise ValueError(f"{source}: {e}") from None
    if not request.audio_codes:
        raise ValueError(f"{source} holds no audio_codes (write one with Save Audio Codes or Save Song)")
    check_compatible({"lm": lm.file(), "depth": depth.file()})
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
    depth files (or LM LoRAs) than those that made it, or the reference RNG (which the nodes do not run)."""
    found = [m for field, h in (("lm_model", lm), ("depth_model", depth))
             if (m := model_mismatch(request, field, h.name, h.fingerprint))]
    found += [m for m in (lora_mismatch(request.loras, "lm", lm.file().adapters),) if m]
    if request.rng != "independent":
        found.append(f"this song was rendered with the {request.rng} RNG (one generator for the AR sampling and the "
                     "DiT noise); the nodes draw the DiT noise from the seed alone, so the audio differs: render it "
                     "with `python -m mm3 render --request FILE` to reproduce it")
    return found


def replay_codes(lm_model, depth_model, depth: ComponentHandle, request: MM3Request, prompt: PromptText,
                 codes: torch.Tensor, *, device, dtype: torch.dtype, progress: Progress | None = None,
                 model_check: str = "warn", numerics: Numerics = FAST) -> Song:
    """The song of a replay file (`mm3.song.stages.replay_song`). The file's request travels on as the
    song's origin, so later stages check their files against those it records (`model_check`)."""
    return stages.replay_song(lm_model, depth_model, prompt, depth.file(), codes, lm_seed=request.lm_seed,
                              device=device, dtype=dtype, progress=progress,
                              origin=replace(request, synth_batch_size=1), model_check=model_check,
                              numerics=numerics)


def heads_problem(heads) -> str | None:
    """Why a lyric-head list cannot be read, or None (not checked against an LM here)."""
    if heads is None or not isinstance(heads, str):
        return None
    try:
        LyricHeads.parse(heads)
    except InputError as e:
        return str(e)
    return None


def lyric_timestamps(lm_model, depth_model, depth: ComponentHandle, song: Song, heads: LyricHeads, lead: float, *,
                     device, dtype: torch.dtype, progress: Progress | None = None, numerics: Numerics = FAST) -> str:
    """The LRC of a planned song: its codes replayed through the LM alone with the lyric heads
    (`mm3.song.stages.replay_song`, no frame hiddens), then timed (`mm3.plan.lyrics_align`)."""
    timed = stages.replay_song(lm_model, depth_model, song.prompt, depth.file(), song.codes.codes,
                               lm_seed=song.codes.lm_seed, device=device, dtype=dtype, progress=progress,
                               lyric_heads=heads, hiddens=False, numerics=numerics)
    return song_lrc(timed.codes, lead=lead)


def lyric_range(song: Song, lrc: str | None, *, line: int | None = None, section: str | None = None,
                margin: float) -> LyricRange:
    """The seconds of sung line `line` or section `section` of `song`, from its LRC (MM3 Lyric
    Timestamps: each line's start, matched to the song's prompt lines; `mm3.plan.lyric_edit`)."""
    if not lrc or not str(lrc).strip():
        raise ValueError("choosing the range by a lyric line needs the song's timestamps: wire lyrics_lrc from MM3 "
                         "Lyric Timestamps (of the same codes)")
    times = times_from_lrc(lrc, song.prompt.prompt.lines)
    return choose_range(times, song.frames / FRAME_RATE, line=line, section=section, margin=margin)


def change_words(lm_model, depth_model, lm: ComponentHandle, song: Song, lrc: str | None, line: int, words: str,
                 lm_seed: int, margin: float, *, device, dtype: torch.dtype, progress: Progress | None = None,
                 numerics: Numerics = FAST) -> tuple[Song, LyricRange]:
    """`song` with sung line `line` singing `words` (`mm3.song.stages.change_words`): the lyrics
    with that line replaced make the prompt, the line's seconds (`lyric_range`) are planned again
    from `lm_seed`, the rest of the codes kept. Returns the new song and the range."""
    lyrics, old = replace_line(song.prompt.lyrics, line, words)
    try:
        prompt = assemble_prompt(lm, song.prompt.caption, lyrics)
    except ValueError as e:
        raise InputError(f"line {line} with the new words: {e}") from None
    chosen = lyric_range(song, lrc, line=line, margin=margin)
    edit = chosen.record() | {"words": words.strip(), "replaced": old, "lm_seed": lm_seed}
    new = stages.change_words(lm_model, depth_model, song, prompt, chosen.start, chosen.end,
                              lm_seed, edit, device=device, dtype=dtype, progress=progress, numerics=numerics)
    return new, chosen


def encode_recording(vae_model, vae: ComponentHandle, audio: dict, condition: Conditions, *, device) -> Latents:
    """A recording (ComfyUI AUDIO, first item; mono doubled) -> latents laid out as the windows of
    `condition`'s song, for MM3 Repaint (`mm3.song.stages.encode_recording`)."""
    wave = audio["waveform"]
    if wave.dim() != 3 or wave.shape[0] < 1:
        raise ValueError(f"expected AUDIO waveform [batch, channels, samples], got {list(wave.shape)}")
    return stages.encode_recording(vae_model, vae.file(), as_stereo(wave[0].float()), int(audio["sample_rate"]),
                                   condition, device=device)


def decode_streamed(vae_model, vae, latents: Latents, on_audio, *, device, progress: Progress | None = None) -> Windows:
    """`mm3.song.stages.decode`, each window's audio handed to `on_audio(k, windows, samples,
    sample_rate)` as soon as it is decoded (`mm3.song.stages.WindowStream`; None: `decode` itself)."""
    if on_audio is None:
        return stages.decode(vae_model, vae, latents, device=device, progress=progress)
    stream = stages.WindowStream(vae_model, vae, latents.conditions, on_audio, device=device, progress=progress)
    for k, latent in enumerate(latents.latents):
        stream(k, latent)
    return stream.windows(latents)


def stitch_audio(windows: Windows) -> dict:
    """Standard ComfyUI AUDIO: waveform [V, 2, T] float32 on the CPU, the rate, and (extra key) each
    item's replay request for Save Song."""
    return audio_output(stages.stitch_windows(windows))


def audio_output(audio: stages.Audio) -> dict:
    """A stitched song as ComfyUI AUDIO (see `stitch_audio`)."""
    return {"waveform": audio.waveform, "sample_rate": audio.sample_rate,
            AUDIO_REQUESTS_KEY: [r.to_dict() for r in audio.requests]}


def write_track(path: Path, wave: torch.Tensor, sample_rate: int, fmt: str, *, mp3_bitrate: int, peak_clip: int,
                request: dict | None, lrc: str | None = None) -> list[Path]:
    """The audio file (atomic) and, when the audio came from MM3 nodes, its replay request beside it
    (same name, .json) with the output settings used; `lrc`: the lyric timestamps, beside it as .lrc."""
    out = OutputSettings(fmt, int(mp3_bitrate), int(peak_clip))
    written = [write_audio(path, as_stereo(wave.float().cpu()), out.format, peak_clip=out.peak_clip,
                           mp3_bitrate=out.mp3_bitrate, sample_rate=int(sample_rate))]
    if request is not None:
        req = replace(MM3Request.from_dict(request), output_format=out.format, mp3_bitrate=out.mp3_bitrate,
                      peak_clip=out.peak_clip)
        written.append(atomic_write(path.with_suffix(".json"), req.to_json().encode("utf-8")))
    if lrc:
        written.append(atomic_write(path.with_suffix(".lrc"), lrc.encode("utf-8")))
    return written

