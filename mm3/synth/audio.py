"""Latents <-> audio: vocoder decode per window, the stitch of the windows, and the encoder path.

Decoding follows diffusers 0.42.1 `decoders.py`: each window is decoded whole, then the samples of
the first 86 latents are dropped from every window but the first and those of the last 258 from
every window but the last (hop = 512 samples per latent), the pieces are concatenated and clamped
to [-1, 1]. The result is planar stereo float32 at the vocoder's rate (44100 Hz). A latent timeline
of any length (an encoded recording) is decoded the same way, in windows of the reference's size
(`decode_timeline`).
"""

from __future__ import annotations

import torch

from ..progress import Cancelled, Progress

CROP_LEFT_LATENTS = 86  # decoders.py _CROP_LEFT_LATENT: dropped at the start of windows 1..
CROP_RIGHT_LATENTS = 258  # decoders.py _CROP_RIGHT_LATENT: dropped at the end of windows ..n-2
TIMELINE_WINDOW_LATENTS = 689  # `decode_timeline`'s window: the latents of a 200-frame (8 s) DiT window


def as_stereo(wave: torch.Tensor) -> torch.Tensor:
    """[C, T] -> [2, T]: mono is doubled; more than two channels is an error."""
    if wave.dim() != 2 or wave.shape[0] not in (1, 2):
        raise ValueError(f"expected mono or stereo audio [1 or 2, T], got shape {list(wave.shape)}")
    return wave.expand(2, -1) if wave.shape[0] == 1 else wave


def resampled_length(samples: int, sample_rate: int, target_rate: int) -> int:
    """Samples that `encode_audio`'s resampling (torchaudio's) makes of `samples` at `sample_rate`."""
    return samples if sample_rate == target_rate else -(-samples * target_rate // sample_rate)


def stitch(waves: list[torch.Tensor], hop: int) -> torch.Tensor:
    """Per-window waveforms [B, 2, hop * L_k] -> [B, 2, T] float32 in [-1, 1]."""
    return torch.cat([stitch_piece(w, k, len(waves), hop) for k, w in enumerate(waves)], dim=-1)


def stitch_piece(wave: torch.Tensor, k: int, windows: int, hop: int) -> torch.Tensor:
    """The samples of window k (of `windows`) that `stitch` keeps, float32 in [-1, 1]: the overlaps
    with its neighbours cropped, so the pieces played in order are the song."""
    left = 0 if k == 0 else CROP_LEFT_LATENTS * hop
    right = 0 if k == windows - 1 else CROP_RIGHT_LATENTS * hop
    return wave[..., left:wave.shape[-1] - right].float().clamp(-1.0, 1.0)


def stitched_length(latent_lengths: list[int], hop: int) -> int:
    """Samples per channel that `stitch` returns for windows of these latent lengths."""
    n = len(latent_lengths)
    keep = [L - (k > 0) * CROP_LEFT_LATENTS - (k < n - 1) * CROP_RIGHT_LATENTS for k, L in enumerate(latent_lengths)]
    return hop * sum(keep)


@torch.inference_mode()
def decode_windows(vocoder, windows: list[torch.Tensor], *, hop: int | None = None, max_rows: int = 2,
                   device=None, dtype: torch.dtype | None = None, progress: Progress | None = None,
                   exact: bool = False) -> list[torch.Tensor]:
    """Decode each window's latents [B, C, L_k] whole: -> per window [B, 2, hop * L_k] float32 on
    `device` (default: the latents'), for `stitch`. `hop` must equal the vocoder's upsampling
    factor. `max_rows`: mono streams per call; the default 2 (a song's two sides, the reference's
    batch) keeps a variation the same alone or in a batch, 1 halves the peak memory. `dtype`: of
    the vocoder (default: its weights'). `exact`: the reference's convolutions, bit for bit.
    """
    if hop is not None and hop != vocoder.hop:
        raise ValueError(f"condition encoder hop {hop} != vocoder upsampling factor {vocoder.hop}")
    progress = progress or Progress()
    if dtype is None:
        dtype = next(iter(vocoder.parameters())).dtype
        dtype = dtype if dtype.is_floating_point else torch.float32
    waves = []
    for k, lat in enumerate(windows):
        if progress.should_stop():
            raise Cancelled(f"cancelled before decoding window {k + 1}/{len(windows)}")
        b, c, length = lat.shape
        if c != vocoder.latent_channels:
            raise ValueError(f"window {k} latents have {c} channels, the vocoder expects {vocoder.latent_channels}")
        at = lat.device if device is None else torch.device(device)
        rows = lat.to(device=at, dtype=dtype).reshape(b * 2, c // 2, length)  # row 2b = left, 2b + 1 = right
        step = max(1, int(max_rows))
        out = torch.cat([vocoder.decode_sides(rows[r:r + step], exact) for r in range(0, rows.shape[0], step)])
        waves.append(out.reshape(b, 2, -1).float())
        progress.on_progress("vae", k + 1, len(windows), {"window": k, "windows": len(windows)})
    return waves


def timeline_windows(total: int, window: int = TIMELINE_WINDOW_LATENTS) -> list[int]:
    """Latent lengths of windows of at most `window` latents whose stitch covers a timeline of
    `total` latents exactly (`mm3.synth.flow.window_offsets`: neighbours share the 344 latents the stitch
    crops, 258 at the end of one and 86 at the start of the next)."""
    overlap = CROP_LEFT_LATENTS + CROP_RIGHT_LATENTS
    if total < 1 or window <= overlap:
        raise ValueError(f"need at least one latent and a window over {overlap} latents, got {total}, {window}")
    if total <= window:
        return [total]
    full = -(-(total - window) // (window - overlap))  # whole windows before the last one
    return [window] * full + [total - full * (window - overlap)]


@torch.inference_mode()
def decode_timeline(vocoder, latents: torch.Tensor, *, window: int = TIMELINE_WINDOW_LATENTS, device=None,
                    progress: Progress | None = None) -> torch.Tensor:
    """Latents on one timeline [B, C, T] (`encode_audio`'s) -> audio [B, 2, hop * T] float32 in
    [-1, 1]: split into windows (`timeline_windows`), each decoded whole and stitched as a song's."""
    from .flow import split_timeline

    windows = split_timeline(latents, timeline_windows(latents.shape[-1], window))
    return stitch(decode_windows(vocoder, windows, device=device, progress=progress), vocoder.hop)


@torch.inference_mode()
def encode_audio(vocoder, audio: torch.Tensor, sample_rate: int, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stereo audio [2, T] or [B, 2, T] at any rate -> posterior-mean latents [B, C, ceil(T' / hop)].

    The audio is resampled to the vocoder's rate with torchaudio (T' samples there) and padded with
    silence at the end to a whole number of latents; left stays on channels 0..C/2-1.
    """
    if audio.dim() == 2:
        audio = audio.unsqueeze(0)
    if audio.dim() != 3 or audio.shape[1] != 2:
        raise ValueError(f"audio must be stereo [2, T] or [B, 2, T], got {list(audio.shape)}")
    if sample_rate <= 0 or audio.shape[-1] == 0:
        raise ValueError(f"need a positive sample_rate and at least one sample, got {sample_rate} Hz, "
                         f"{audio.shape[-1]} samples")
    if vocoder.encoder is None:
        return vocoder.encode(audio)  # raises: names the file without an encoder
    x = audio.to(device=next(iter(vocoder.encoder.parameters())).device, dtype=torch.float32)
    if int(sample_rate) != vocoder.sampling_rate:
        import torchaudio.functional as AF  # only this path needs torchaudio

        x = AF.resample(x, int(sample_rate), vocoder.sampling_rate)
    pad = -x.shape[-1] % vocoder.hop
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    if dtype is not None:
        x = x.to(dtype)
    return vocoder.encode(x)
