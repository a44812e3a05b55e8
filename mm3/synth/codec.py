"""`python -m mm3 encode | decode`: a recording <-> the vocoder's latents, from the command line.

encode: a WAV, MP3 or FLAC file -> its latents (`mm3.synth.audio.encode_audio`, as MM3 Vocoder Encode runs
it: the recording at its rate, mono doubled to stereo) in a safetensors file. decode: such a file ->
a stereo WAV at the vocoder's rate, as long as the recording (`mm3.synth.audio.decode_timeline`). The file
holds one tensor, `latents` [C, L] float32, and string metadata (`save_latents`; the README, Tools).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError

FORMAT = "mm3-latents"
VERSION = "1"
AUDIO_SUFFIXES = (".wav", ".mp3", ".flac")
WAV_FORMATS = ("wav32", "wav16", "wav24")
ENCODER_TENSOR = "encoder.conv_in.weight"  # present when the vocoder file carries its encoder


# -- reading recordings ----------------------------------------------------------------------------
def read_audio(path: str | os.PathLike) -> tuple[torch.Tensor, int]:
    """A recording -> (float32 [channels, samples], its rate), decoded as ComfyUI's Load Audio does
    (PyAV: integer PCM over 2**15 or 2**31, float as stored); without PyAV, 8/16/24/32-bit PCM
    WAV through the standard library."""
    path = Path(path)
    if path.suffix.lower() not in AUDIO_SUFFIXES:
        raise InputError(f"{path}: expected a {', '.join(AUDIO_SUFFIXES)} file")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        import av
    except ImportError:
        av = None
    if av is not None:
        wave, rate = _read_av(av, path)
    elif path.suffix.lower() == ".wav":
        wave, rate = _read_pcm_wav(path)
    else:
        raise InputError(f"{path}: reading {path.suffix.lower()} needs PyAV (pip install av); "
                         "without it only PCM WAV is read")
    if wave.shape[-1] == 0:
        raise InputError(f"{path}: no audio samples")
    if wave.shape[0] not in (1, 2):
        raise InputError(f"{path}: {wave.shape[0]} channels; the vocoder encodes mono or stereo")
    return wave, rate


def _read_av(av, path: Path) -> tuple[torch.Tensor, int]:
    try:
        with av.open(str(path)) as f:
            if not f.streams.audio:
                raise InputError(f"{path}: no audio stream")
            stream = f.streams.audio[0]
            rate, channels = stream.codec_context.sample_rate, stream.channels
            frames = []
            for frame in f.decode(streams=stream.index):
                buf = torch.from_numpy(frame.to_ndarray())
                frames.append(buf if buf.shape[0] == channels else buf.view(-1, channels).t())
    except av.error.FFmpegError as e:
        raise InputError(f"{path}: cannot decode the audio ({e})") from None
    if not frames:
        raise InputError(f"{path}: no audio samples")
    wave = torch.cat(frames, dim=1)
    if wave.dtype == torch.int16:
        wave = wave.float() / 2**15
    elif wave.dtype == torch.int32:
        wave = wave.float() / 2**31
    elif wave.dtype == torch.uint8:
        wave = (wave.float() - 128) / 128
    return wave.float(), int(rate)


def _read_pcm_wav(path: Path) -> tuple[torch.Tensor, int]:
    import wave

    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            data = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as e:
        raise InputError(f"{path}: not a PCM WAV file the standard library reads ({e}); install PyAV") from None
    raw = np.frombuffer(data, np.uint8)
    if width == 1:
        x = (raw.astype(np.float32) - 128) / 128
    elif width == 2:
        x = raw.view("<i2").astype(np.float32) / 2**15
    elif width == 3:
        x = (np.pad(raw.reshape(-1, 3), ((0, 0), (1, 0))).view("<i4").reshape(-1)).astype(np.float32) / 2**31
    else:
        x = raw.view("<i4").astype(np.float32) / 2**31
    return torch.from_numpy(np.ascontiguousarray(x.reshape(-1, channels).T)), int(rate)


# -- the vocoder file ------------------------------------------------------------------------------
def has_encoder(path: str) -> bool:
    """Whether a vocoder file carries the encoder's tensors (header read)."""
    from ..files.opener import read_component

    return any(name == ENCODER_TENSOR for name, _, _ in read_component(path, "vae").file.tensor_infos())


def vocoder_path(models: str, name: str, *, need_encoder: bool, memory: int | None = None) -> str:
    """The vocoder file `name` in the folder `models` ("auto": the one `auto` picks; for encoding,
    among the files that carry the encoder). Refused, naming the file, when it has no encoder."""
    from ..files.registry import AUTO, Registry, pick_usable

    if not Path(models).is_dir():
        raise InputError(f"--models {models} is not a folder")
    registry = Registry.scan(models)
    registry.memory = memory
    if need_encoder and name in ("", AUTO):
        names = registry.buckets["vae"]
        able = [registry.paths[n] for n in names if has_encoder(registry.paths[n])]
        if names and not able:
            raise InputError(f"no vocoder file in {models} carries the encoder (encoder.* tensors): "
                             f"{', '.join(names)}; convert the vocoder with its training checkpoint to encode audio")
        if able:
            return pick_usable(able, memory, "vae", {registry.paths[n]: n for n in names})
    path = registry.resolve("vae", name)
    if need_encoder and not has_encoder(path):
        raise InputError(f"{registry.name_of(path)} holds no encoder (encoder.* tensors): convert the vocoder with "
                         "its training checkpoint to encode audio, or name another file with --vocoder")
    return path


def _load_vocoder(path: str, device, *, with_encoder: bool):
    from ..files.opener import open_component
    from ..models import build_model

    return build_model(open_component(path, expect="vae"), with_encoder=with_encoder).to(device)


# -- the latents file ------------------------------------------------------------------------------
def save_latents(path, latents: torch.Tensor, *, vocoder, vocoder_file: str, length: int, source_rate: int,
                 source_channels: int) -> Path:
    """Write [C, L] latents and their metadata (format, version, rates, length, source, vocoder file and
    fingerprint) atomically to `path`."""
    from safetensors.torch import save

    from ..formats.fingerprint import file_fingerprint
    from .output import atomic_write

    meta = {"format": FORMAT, "version": VERSION, "sample_rate": str(vocoder.sampling_rate),
            "hop": str(vocoder.hop), "latent_rate": repr(vocoder.sampling_rate / vocoder.hop),
            "length": str(int(length)), "channels": "2", "source_sample_rate": str(int(source_rate)),
            "source_channels": str(int(source_channels)), "vocoder": os.path.basename(vocoder_file),
            "vocoder_fingerprint": file_fingerprint(vocoder_file)}
    data = save({"latents": latents.detach().to("cpu", torch.float32).contiguous()}, metadata=meta)
    return atomic_write(path, data)


def load_latents(path) -> tuple[torch.Tensor, dict]:
    """(latents [C, L] float32, metadata) of a file `save_latents` wrote; anything else is refused."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            if meta.get("format") != FORMAT or "latents" not in names:
                raise InputError(f"{path}: not an MM3 latents file (format {meta.get('format')!r}, tensors "
                                 f"{names}); make one with `python -m mm3 encode`")
            latents = f.get_tensor("latents")
    except (SafetensorError, OSError) as e:
        raise InputError(f"{path}: cannot read it as safetensors ({e})") from None
    if meta.get("version") != VERSION:
        raise InputError(f"{path}: latents file version {meta.get('version')!r}, this build reads {VERSION}")
    try:
        for key in ("sample_rate", "hop", "length"):
            meta[key] = int(meta[key])
    except (KeyError, ValueError):
        raise InputError(f"{path}: metadata needs integer sample_rate, hop and length, got {meta}") from None
    need = math.ceil(meta["length"] / meta["hop"])
    if latents.dim() != 2 or not latents.is_floating_point() or latents.shape[-1] != need:
        raise InputError(f"{path}: latents {list(latents.shape)} {latents.dtype} do not cover length {meta['length']} "
                         f"at hop {meta['hop']} (expected [C, {need}] float)")
    return latents.float(), meta


# -- commands --------------------------------------------------------------------------------------
def _device(name):
    from ..backends.device import pick_device, total_bytes

    try:
        device = pick_device(name)
    except ValueError as e:
        raise InputError(str(e)) from None
    return device, total_bytes(device)


def _check_target(out: Path, overwrite: bool, suffix: str):
    if out.suffix.lower() != suffix:
        raise InputError(f"{out}: the output file should end in {suffix}")
    if out.is_dir():
        raise InputError(f"cannot write {out}: it is a folder")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (choose another name or pass --overwrite)")


def cmd_encode(args) -> int:
    from .audio import as_stereo, encode_audio, resampled_length

    out = Path(args.out)
    _check_target(out, args.overwrite, ".safetensors")
    device, memory = _device(args.device)
    path = vocoder_path(args.models, args.vocoder, need_encoder=True, memory=memory)  # before reading audio
    wave, rate = read_audio(args.input)
    vocoder = _load_vocoder(path, device, with_encoder=True)
    latents = encode_audio(vocoder, as_stereo(wave).to(device), rate)[0]
    length = resampled_length(wave.shape[-1], rate, vocoder.sampling_rate)
    save_latents(out, latents, vocoder=vocoder, vocoder_file=path, length=length, source_rate=rate,
                 source_channels=wave.shape[0])
    if not args.quiet:
        print(f"wrote {out}: {latents.shape[0]} x {latents.shape[1]} latents ({length / vocoder.sampling_rate:.2f} s "
              f"at {vocoder.sampling_rate} Hz) with {os.path.basename(path)}", file=sys.stderr)
    return 0


def cmd_decode(args) -> int:
    from .audio import decode_timeline
    from ..formats.fingerprint import file_fingerprint
    from .output import write_audio

    out = Path(args.out)
    _check_target(out, args.overwrite, ".wav")
    latents, meta = load_latents(args.input)
    device, memory = _device(args.device)
    path = vocoder_path(args.models, args.vocoder, need_encoder=False, memory=memory)
    vocoder = _load_vocoder(path, device, with_encoder=False)
    if latents.shape[0] != vocoder.latent_channels or meta["hop"] != vocoder.hop or \
            meta["sample_rate"] != vocoder.sampling_rate:
        raise InputError(f"{args.input}: {latents.shape[0]} latent channels at hop {meta['hop']}, "
                         f"{meta['sample_rate']} Hz; {os.path.basename(path)} decodes {vocoder.latent_channels} "
                         f"at hop {vocoder.hop}, {vocoder.sampling_rate} Hz")
    if meta.get("vocoder_fingerprint") != file_fingerprint(path):
        print(f"warning: {args.input} was encoded with {meta.get('vocoder')} ({meta.get('vocoder_fingerprint')}), "
              f"decoding with {os.path.basename(path)} ({file_fingerprint(path)})", file=sys.stderr)
    audio = decode_timeline(vocoder, latents.unsqueeze(0).to(device))[0, :, :meta["length"]].cpu()
    write_audio(out, audio, args.format, sample_rate=vocoder.sampling_rate)
    if not args.quiet:
        print(f"wrote {out} ({audio.shape[-1] / vocoder.sampling_rate:.2f} s, {audio.shape[-1]} samples per channel "
              f"at {vocoder.sampling_rate} Hz)", file=sys.stderr)
    return 0


def _common(p):
    p.add_argument("--models", required=True, help="folder holding the vocoder file")
    p.add_argument("--vocoder", default="auto",
                   help="vocoder file name in --models (default auto: the most precise that fits"
                        "; for encode, among the files with the encoder)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, xpu, mps or cpu (default: the best available)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument("--quiet", action="store_true", help="no summary line")


def add_cli(sub):
    p = sub.add_parser("encode", help="a recording (WAV, MP3, FLAC) -> the vocoder's latents (.safetensors)",
                       description="Encode a recording with the vocoder's encoder (as MM3 Vocoder Encode); the "
                                   "latents file is described in the README (Tools).")
    p.add_argument("input", metavar="IN", help="recording: .wav, .mp3 or .flac, any rate, mono or stereo")
    p.add_argument("out", metavar="OUT", help="latents file to write (.safetensors)")
    _common(p)
    p.set_defaults(func=cmd_encode)
    p = sub.add_parser("decode", help="latents (.safetensors from encode) -> a stereo WAV",
                       description="Decode latents written by `encode` with the vocoder: stereo at its rate, the "
                                   "recording's length.")
    p.add_argument("input", metavar="IN", help="latents file written by `python -m mm3 encode`")
    p.add_argument("out", metavar="OUT", help="WAV file to write")
    p.add_argument("--format", choices=WAV_FORMATS, default="wav32",
                   help="wav32: float, the decoded levels (default); wav16 / wav24: PCM, peak-normalised")
    _common(p)
    p.set_defaults(func=cmd_decode)
