"""Output stage: percentile peak normalisation, WAV 16/24/32-float, MP3 (lameenc), atomic writes.

Files are read back by independent means: Python's `wave` module for PCM WAV, the RIFF header by
hand for float WAV, MPEG frame headers walked by hand for MP3 (plus a full decode when the optional
`miniaudio` package is present).
"""

import os
import struct
import wave

import numpy as np
import pytest
import torch

from mm3.synth import output
from mm3.synth.output import normalize_peak, render, write_audio

RATE = 44100


def _tones(n=RATE + 321, amp=(0.5, 0.25)):
    t = np.arange(n) / RATE
    return np.stack([amp[0] * np.sin(2 * np.pi * 440 * t), amp[1] * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)


def _oracle_normalize(a, peak_clip):
    """The order statistic by a full sort (numpy), as the reference server defines it."""
    mag = np.sort(np.abs(a).reshape(-1))
    ref = mag[int((mag.size - 1) * (1 - min(max(peak_clip, 0), 999) / 1e6))]
    return a if ref < 1e-6 else np.clip(a / np.float32(ref), -1, 1)


@pytest.mark.parametrize("peak_clip", [0, 10, 999, 5000, -3])
def test_normalize_matches_sorted_percentile(peak_clip):
    rng = np.random.default_rng(0)
    a = (0.1 * rng.standard_normal((2, 50000))).astype(np.float32)
    a[0, 123], a[1, 4567] = 0.9, -0.8  # outliers that a high percentile clips
    got = normalize_peak(torch.from_numpy(a), peak_clip)
    np.testing.assert_array_equal(got, _oracle_normalize(a, peak_clip))
    assert got.dtype == np.float32 and got.shape == a.shape and np.abs(got).max() <= 1.0


def test_normalize_quiet_audio():
    silent = np.full((2, 1000), 1e-7, dtype=np.float32)
    np.testing.assert_array_equal(normalize_peak(silent), silent)  # below 1e-6: left alone
    quiet = _tones(amp=(1e-3, 5e-4))
    assert abs(np.abs(normalize_peak(quiet, 0)).max() - 1.0) < 1e-6  # quiet audio is raised


def test_wav16_and_wav24_read_back(tmp_path):
    a = _tones()
    norm = _oracle_normalize(a, 0)
    for fmt, width, scale in (("wav16", 2, 32767), ("wav24", 3, 8388607)):
        path = write_audio(tmp_path / f"x.{fmt}.wav", torch.from_numpy(a), fmt, peak_clip=0)
        with wave.open(str(path)) as w:
            assert (w.getnchannels(), w.getframerate(), w.getsampwidth(), w.getnframes()) == (2, RATE, width, a.shape[1])
            raw = w.readframes(w.getnframes())
        if width == 2:
            pcm = np.frombuffer(raw, "<i2").astype(np.int32)
        else:
            b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
            pcm = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
            pcm = np.where(pcm >= 1 << 23, pcm - (1 << 24), pcm)
        pcm = pcm.reshape(-1, 2).T  # interleaved -> planar
        np.testing.assert_array_equal(pcm, np.trunc(norm * np.float32(scale)).astype(np.int32))
        assert pcm[0].max() == scale  # the left tone's peak reaches full scale


def test_wav32_is_raw_float(tmp_path):
    a = _tones(amp=(0.3, 1.5))  # float WAV: no normalisation, no clamp
    a[0, 5] = np.nan
    data = (write_audio(tmp_path / "f.wav", a, "wav32")).read_bytes()
    riff, size, wave_id, fmt_id, fmt_len = struct.unpack("<4sI4s4sI", data[:20])
    tag, ch, rate, byte_rate, block, bits = struct.unpack("<HHIIHH", data[20:36])
    data_id, data_len = struct.unpack("<4sI", data[36:44])
    assert (riff, wave_id, fmt_id, fmt_len, data_id) == (b"RIFF", b"WAVE", b"fmt ", 16, b"data")
    assert (tag, ch, rate, byte_rate, block, bits) == (3, 2, RATE, RATE * 8, 8, 32)
    assert size == len(data) - 8 and data_len == len(data) - 44
    got = np.frombuffer(data[44:], "<f4").reshape(-1, 2).T
    want = a.copy()
    want[0, 5] = 0.0  # NaN is written as silence
    np.testing.assert_array_equal(got, want)


MP3_KBPS = [None, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, None]


def _mp3_frames(data: bytes):
    """Walk MPEG audio frame headers; -> list of (version, layer, kbps, rate index, channel mode)."""
    frames, i = [], 0
    if data[:3] == b"ID3":
        i = 10 + ((data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | (data[9] & 0x7F))
    while i + 4 <= len(data):
        h = int.from_bytes(data[i:i + 4], "big")
        assert h >> 21 == 0x7FF, f"no frame sync at byte {i}"
        version, layer, kbps = (h >> 19) & 3, (h >> 17) & 3, MP3_KBPS[(h >> 12) & 15]
        rate_idx, pad, mode = (h >> 10) & 3, (h >> 9) & 1, (h >> 6) & 3
        frames.append((version, layer, kbps, rate_idx, mode))
        i += 144 * kbps * 1000 // RATE + pad  # MPEG-1 Layer III frame length
    assert i == len(data), "trailing bytes after the last frame"
    return frames


@pytest.mark.parametrize("kbps", [128, 320, 64])
def test_mp3_frames(tmp_path, kbps):
    a = _tones(n=2 * RATE + 123)
    path = write_audio(tmp_path / "x.mp3", a, "mp3", mp3_bitrate=kbps)
    frames = _mp3_frames(path.read_bytes())
    # MPEG-1 (3), Layer III (1), CBR at the asked rate, 44100 Hz (index 0), joint stereo (1); LAME
    # (lameenc exposes no mode setting) switches to plain stereo (0) at high rates such as 320
    assert {f[:4] for f in frames} == {(3, 1, kbps, 0)}
    modes = {f[4] for f in frames}
    if kbps <= 128:
        assert modes == {1}
    else:
        assert modes <= {0, 1}
    n = a.shape[1]
    assert -(-n // 1152) <= len(frames) <= -(-n // 1152) + 3  # the samples plus the encoder's delay
    assert abs(path.stat().st_size - kbps * 1000 / 8 * len(frames) * 1152 / RATE) < 2 * len(frames)


def test_mp3_decodes_to_the_same_tones(tmp_path):
    miniaudio = pytest.importorskip("miniaudio")
    a = _tones(n=2 * RATE)
    dec = miniaudio.decode(render(a, "mp3"), output_format=miniaudio.SampleFormat.SIGNED16)
    assert (dec.nchannels, dec.sample_rate) == (2, RATE)
    pcm = np.asarray(dec.samples, dtype=np.float32).reshape(-1, 2).T / 32767
    assert a.shape[1] <= pcm.shape[1] <= a.shape[1] + 3 * 1152
    for ch, hz in ((0, 440), (1, 660)):  # left stays left
        x = pcm[ch, 4096:4096 + RATE]
        spec = np.abs(np.fft.rfft(x * np.hanning(x.size)))
        assert abs(spec.argmax() * RATE / x.size - hz) <= 1
    assert 0.9 < np.abs(pcm[0]).max() <= 1.01  # normalised before encoding


def test_bad_format_and_bitrate():
    with pytest.raises(ValueError, match="Invalid output_format"):
        render(_tones(), "flac")
    with pytest.raises(ValueError, match="mp3_bitrate must be one of"):
        render(_tones(), "mp3", mp3_bitrate=100)
    with pytest.raises(ValueError, match=r"planar stereo \[2, T\]"):
        render(np.zeros((3, 10), np.float32), "wav16")


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "song.wav"
    write_audio(target, _tones(), "wav16")
    before = target.read_bytes()

    def broken_fsync(fd):
        raise KeyboardInterrupt  # as if the user stopped the run mid-write

    monkeypatch.setattr(output.os, "fsync", broken_fsync)
    with pytest.raises(KeyboardInterrupt):
        write_audio(target, _tones(amp=(0.1, 0.1)), "wav24")
    with pytest.raises(KeyboardInterrupt):
        write_audio(tmp_path / "new.mp3", _tones(), "mp3")
    assert target.read_bytes() == before  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["song.wav"]  # no partial or temporary file


def test_written_file_permissions_follow_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_audio(tmp_path / "p.wav", _tones(), "wav16")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
