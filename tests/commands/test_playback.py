"""`generate --play`: the first track on the default audio device while it is rendered (sounddevice,
optional). Without the package or an output device: one clear line, before any work. With a
stand-in for sounddevice whose device pulls samples as fast as it can: what it played, the silence
of the moments the render lagged left out, is the track."""

from __future__ import annotations

import sys
import threading
import time
import types

import numpy as np
import pytest
import torch

from mm3.commands import playback
from mm3.commands.main import main
from tests.helpers.comfyui import CAPTION, LYRICS

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(tiny, out, *extra):
    return ["generate", "--models", str(tiny.gguf), "--caption", CAPTION, "--lyrics", LYRICS, "--duration", "9",
            "--lm-seed", "1", "--seed", "2", "--steps", "2", "--format", "wav32", "--out", str(out), "--device", "cpu",
            "--play", "--quiet", *extra]


class _Device(types.ModuleType):
    """sounddevice as far as `mm3.commands.playback` uses it; its stream pulls 256 samples every millisecond."""

    def __init__(self, fail: Exception | None = None):
        super().__init__("sounddevice")
        self.fail, self.streams = fail, []

    def query_devices(self, kind=None):
        if self.fail is not None:
            raise self.fail
        return {"name": "test output", "max_output_channels": 2}

    def OutputStream(self, samplerate, channels, dtype, callback, latency):  # noqa: N802 (sounddevice's name)
        stream = _Stream(samplerate, channels, callback)
        self.streams.append(stream)
        return stream


class _Stream:
    latency = 0.01

    def __init__(self, samplerate, channels, callback):
        self.samplerate, self.channels, self.callback = samplerate, channels, callback
        self.blocks, self.running, self.thread = [], False, None

    def start(self):
        self.running, self.started = True, time.time()

        def pull():
            while self.running:
                block = np.full((256, self.channels), np.nan, dtype=np.float32)
                self.callback(block, 256, None, None)
                self.blocks.append(block)
                time.sleep(0.001)

        self.thread = threading.Thread(target=pull, daemon=True)
        self.thread.start()

    def stop(self):
        self.running = False
        self.thread.join()

    def close(self):
        pass


def test_play_without_sounddevice_is_refused_before_work(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # import fails as when it is not installed
    assert main(_args(tiny, tmp_path / "song.wav")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --play needs the optional sounddevice package (pip install sounddevice)"]
    assert not list(tmp_path.iterdir())


def test_play_without_an_output_device_is_refused_before_work(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sounddevice", _Device(ValueError("No output device matching ''\nmore")))
    assert main(_args(tiny, tmp_path / "song.wav")) == 2
    assert capsys.readouterr().err.strip() == "error: --play: no audio output device (No output device matching '')"
    assert not list(tmp_path.iterdir())


def test_play_hands_the_device_the_track_as_it_is_rendered(tiny, tmp_path, monkeypatch):
    """Two songs: the device plays the first one's windows back to back, starting before the
    render is done (the second song's are not played); silence only where the render lagged."""
    from mm3.synth.codec import read_audio

    device = _Device()
    monkeypatch.setitem(sys.modules, "sounddevice", device)
    players = []

    class Recorded(playback.DevicePlayer):
        def __init__(self, sd):
            super().__init__(sd)
            players.append(self)

    monkeypatch.setattr(playback, "DevicePlayer", Recorded)
    assert main(_args(tiny, tmp_path / "song.wav", "--songs", "2")) == 0
    (stream,) = device.streams
    assert stream.samplerate == 44100 and stream.channels == 2 and not stream.running
    assert stream.started < (tmp_path / "song_01.wav").stat().st_mtime  # playing before the files were written
    played = np.concatenate(stream.blocks)
    assert not np.isnan(played).any()  # every sample of every block was written
    keep = np.ones(played.shape[0], dtype=bool)
    for at, n in players[0].underruns:
        assert not played[at:at + n].any()
        keep[at:at + n] = False
    track, rate = read_audio(tmp_path / "song_01.wav")
    heard = torch.from_numpy(played[keep][:track.shape[-1]].T.copy())
    assert torch.equal(heard, track)
    assert not played[keep][track.shape[-1]:].any()  # then silence to the end
