"""The output stage: peak normalisation and WAV / MP3 files (as minimaxmusic.cpp writes them).

Audio arrives as planar stereo float [2, T] at 44100 Hz. Every format but float WAV is first
normalised to a high percentile of |x| (`peak_clip` parts per million are allowed to clip), which
also raises quiet audio. Files are written under a temporary name in the target folder and then
renamed, so an interrupted write never leaves a partial file under the final name.
"""

from __future__ import annotations

import os
import struct
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..constants import DEFAULT_MP3_BITRATE, DEFAULT_PEAK_CLIP, MAX_PEAK_CLIP, MP3_BITRATES, OUTPUT_FORMATS
from ..errors import MM3Error

SAMPLE_RATE = 44100  # the vocoder's rate; the reference output is never resampled
SILENCE = 1e-6  # below this reference level the audio is left as is


def _as_planar(audio) -> np.ndarray:
    """[2, T] float32 numpy (copy) from a tensor or array; a leading batch of 1 is dropped."""
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().to("cpu", torch.float32).numpy()
    a = np.array(audio, dtype=np.float32, copy=True)
    if a.ndim == 3 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or a.shape[0] != 2:
        raise ValueError(f"audio must be planar stereo [2, T], got shape {list(a.shape)}")
    return a


def normalize_peak(audio, peak_clip: float = DEFAULT_PEAK_CLIP) -> np.ndarray:
    """x / ref clamped to [-1, 1], ref = the (1 - peak_clip / 1e6) order statistic of |x| over both
    channels (index floor((n - 1) * pct) of the ascending sort); unchanged when ref < 1e-6."""
    a = _as_planar(audio)
    np.nan_to_num(a, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
    pc = min(max(float(peak_clip), 0.0), MAX_PEAK_CLIP)
    mag = np.abs(a).reshape(-1)
    if mag.size == 0:
        return a
    idx = int((mag.size - 1) * (1.0 - pc / 1e6))
    ref = float(np.partition(mag, idx)[idx])
    if ref < SILENCE:
        return a
    return np.clip(a / np.float32(ref), -1.0, 1.0)


def _pcm_int(a: np.ndarray, scale: int) -> np.ndarray:
    """trunc(clamp(x, -1, 1) * scale) as int32, NaN/Inf -> 0 (the C++ writer's rounding)."""
    a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    return np.trunc(np.clip(a, -1.0, 1.0) * np.float32(scale)).astype(np.int32)


def wav_bytes(audio, bits: int, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 44-byte-header RIFF WAV, 2 channels interleaved: 16/24-bit PCM or 32-bit IEEE float (raw)."""
    a = _as_planar(audio)
    if bits == 16:
        data = _pcm_int(a, 32767).T.astype("<i2").tobytes()
        tag = 1
    elif bits == 24:
        v = _pcm_int(a, 8388607).T.reshape(-1).astype("<i4")
        data = v.view(np.uint8).reshape(-1, 4)[:, :3].tobytes()  # low three bytes, little-endian
        tag = 1
    elif bits == 32:
        data = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0).T.astype("<f4").tobytes()
        tag = 3
    else:
        raise ValueError(f"WAV bits must be 16, 24 or 32, got {bits}")
    block = 2 * bits // 8
    header = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, tag, 2, sample_rate, sample_rate * block, block, bits)
    header += b"data" + struct.pack("<I", len(data))
    return header + data


def mp3_bytes(audio, bitrate: int = DEFAULT_MP3_BITRATE, sample_rate: int = SAMPLE_RATE) -> bytes:
    """CBR MPEG-1 Layer III at `bitrate` kbps (LAME via lameenc; joint stereo is LAME's stereo mode)."""
    if bitrate not in MP3_BITRATES:
        raise ValueError(f"mp3_bitrate must be one of {', '.join(map(str, MP3_BITRATES))}, got {bitrate}")
    import lameenc  # only the MP3 path needs it

    pcm = _pcm_int(_as_planar(audio), 32767).T.astype("<i2")  # interleaved L R
    enc = lameenc.Encoder()
    enc.set_bit_rate(int(bitrate))
    enc.set_in_sample_rate(int(sample_rate))
    enc.set_out_sample_rate(int(sample_rate))
    enc.set_channels(2)
    enc.set_quality(2)  # LAME's "high quality" preset (0 best .. 9 fastest)
    return bytes(enc.encode(pcm.tobytes())) + bytes(enc.flush())


def render(audio, output_format: str = "mp3", *, peak_clip: float = DEFAULT_PEAK_CLIP,
           mp3_bitrate: int = DEFAULT_MP3_BITRATE, sample_rate: int = SAMPLE_RATE) -> bytes:
    """The file contents for `output_format` (mp3, wav16, wav24, wav32)."""
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"Invalid output_format {output_format!r} (use: {', '.join(OUTPUT_FORMATS)})")
    if output_format == "wav32":
        return wav_bytes(audio, 32, sample_rate)  # float WAV keeps the raw levels
    a = normalize_peak(audio, peak_clip)
    if output_format == "mp3":
        return mp3_bytes(a, mp3_bitrate, sample_rate)
    return wav_bytes(a, 16 if output_format == "wav16" else 24, sample_rate)


class OutputError(MM3Error, OSError):
    """An output file could not be written; the message names the file and the reason (no space,
    permission, not a folder). Nothing is left behind under the final name or as a temporary."""

    exit_code = 2


def _output_error(path: Path, e: OSError) -> OutputError:
    """`e` as an OutputError naming `path` (and the folder, when that is what failed); keeps errno."""
    if isinstance(e, OutputError):
        return e
    other = e.filename and Path(e.filename) != path and not str(e.filename).endswith(".part")
    err = OutputError(f"cannot write {path}: {e.strerror or e}" + (f" ({e.filename})" if other else ""))
    err.errno = e.errno
    return err


def _temp_name(path: Path) -> Path:
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"


def _write_temp(path: Path, data: bytes) -> Path:
    """`data` in a new temporary file beside `path`, flushed to disk; removed again on any failure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _output_error(path, e) from None
    tmp = _temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies, as for a plain open
    except OSError as e:
        raise _output_error(path, e) from None
    with _removed_on_failure(tmp, path):
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return tmp


@contextmanager
def _removed_on_failure(tmp: Path, path: Path):
    """On any failure remove `tmp`; an OSError becomes an OutputError naming `path`."""
    try:
        yield
    except BaseException as e:
        _unlink(tmp)
        if isinstance(e, OSError):
            raise _output_error(path, e) from None
        raise


def _unlink(p: Path):
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def atomic_write(path, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path`, flush it to disk, then rename it over `path`.
    Failures raise `OutputError` and leave neither the temporary nor a partial `path`."""
    path = Path(path)
    tmp = _write_temp(path, data)
    with _removed_on_failure(tmp, path):
        os.replace(tmp, path)
    return path


class FileBatch:
    """Files that appear together or not at all (a batch of tracks and their replay JSON).

    `add(path, data)` writes each file's bytes to a temporary beside it at once (so only one file's
    bytes are held in memory); `commit()` renames them all into place. Leaving the `with` block
    without committing (an error, Ctrl+C, a full disk on the fifth file) removes every temporary,
    and a failure while renaming also removes the targets this batch had already put in place
    (unless they replaced an existing file, which can no longer be restored). With `overwrite`
    False a target that appeared meanwhile is an error, never replaced."""

    def __init__(self, overwrite: bool = False):
        self.overwrite = overwrite
        self.staged: list[tuple[Path, Path]] = []  # (temporary, target)
        self.committed: list[Path] = []

    def __enter__(self):
        return self

    def add(self, path, data: bytes) -> Path:
        path = Path(path)
        if any(t == path for _, t in self.staged):
            raise OutputError(f"{path} is written twice in one batch")
        self.staged.append((_write_temp(path, data), path))
        return path

    def commit(self) -> list[Path]:
        created = []
        try:
            for tmp, path in self.staged:
                if not self.overwrite and os.path.lexists(path):
                    raise OutputError(f"{path} already exists (it appeared while the job ran; nothing was replaced)")
                existed = os.path.lexists(path)
                try:
                    os.replace(tmp, path)
                except OSError as e:
                    raise _output_error(path, e) from None
                self.committed.append(path)
                if not existed:
                    created.append(path)
        except BaseException:
            for p in created:
                _unlink(p)
            self.committed = []
            raise
        finally:
            for tmp, _ in self.staged:
                _unlink(tmp)
            self.staged = []
        return list(self.committed)

    def __exit__(self, *exc):
        for tmp, _ in self.staged:
            _unlink(tmp)
        self.staged = []


def write_audio(path, audio, output_format: str = "mp3", *, peak_clip: float = DEFAULT_PEAK_CLIP,
                mp3_bitrate: int = DEFAULT_MP3_BITRATE, sample_rate: int = SAMPLE_RATE) -> Path:
    """Encode planar stereo `audio` [2, T] and write it atomically to `path`; returns the path."""
    data = render(audio, output_format, peak_clip=peak_clip, mp3_bitrate=mp3_bitrate, sample_rate=sample_rate)
    return atomic_write(path, data)
