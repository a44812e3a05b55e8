"""`generate --play`: the first track heard on the default audio device while it is rendered.

Each decoded window is queued as it comes; the device pulls the samples in its own callback
(sounddevice, an optional package over PortAudio), so the engine never waits on the sound card
and the windows play back to back. Where the render falls behind the playhead the device plays
silence until the next window arrives (`underruns` records where).
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from ..errors import InputError

LATENCY = "high"  # the device's buffering: robust against a busy CPU rather than quick to react


class PlaybackError(InputError):
    """No way to play: the optional package or an output device is missing."""


def open_output():
    """The sounddevice module, after checking that it loads and that a default output device
    exists; `PlaybackError` (one line) otherwise. Called before any work."""
    try:
        import sounddevice
    except ImportError:
        raise PlaybackError("--play needs the optional sounddevice package (pip install sounddevice)") from None
    except OSError as e:  # the package without its PortAudio library
        raise PlaybackError(f"--play: sounddevice cannot load PortAudio ({e})") from None
    try:
        sounddevice.query_devices(kind="output")
    except Exception as e:  # PortAudioError / ValueError: no default output device
        raise PlaybackError(f"--play: no audio output device ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                            ) from None
    return sounddevice


class DevicePlayer:
    """`Pipeline.run`'s `on_audio` callback that plays song 0's first variation on the default
    output device, starting with its first window; `finish()` waits until it has been heard."""

    def __init__(self, sounddevice):
        self.sd = sounddevice
        self.queue: collections.deque[np.ndarray] = collections.deque()  # [n, 2] float32 pieces
        self.lock = threading.Lock()
        self.stream = None
        self.played = 0  # samples handed to the device
        self.underruns: list[tuple[int, int]] = []  # (output sample, silent samples) where the render lagged
        self.complete = False  # every window queued

    def __call__(self, song: int, k: int, windows: int | None, samples, sample_rate: int) -> None:
        if song != 0:
            return
        piece = np.ascontiguousarray(samples[0].T.numpy(), dtype=np.float32)  # [T, 2]
        with self.lock:
            self.queue.append(piece)
            self.complete = windows is not None and k == windows - 1
        if self.stream is None:
            self.stream = self.sd.OutputStream(samplerate=sample_rate, channels=2, dtype="float32",
                                               callback=self._fill, latency=LATENCY)
            self.stream.start()

    def _fill(self, out, frames: int, time_info, status) -> None:
        """The device's callback: the next `frames` samples, silence where none are queued yet."""
        done = 0
        with self.lock:
            while done < frames and self.queue:
                head = self.queue[0]
                n = min(frames - done, head.shape[0])
                out[done:done + n] = head[:n]
                if n == head.shape[0]:
                    self.queue.popleft()
                else:
                    self.queue[0] = head[n:]
                done += n
            if done < frames:
                out[done:] = 0
                if not self.complete:
                    self.underruns.append((self.played + done, frames - done))
            self.played += frames

    def pending(self) -> int:
        with self.lock:
            return sum(p.shape[0] for p in self.queue)

    def finish(self, should_stop=lambda: False, poll: float = 0.05) -> None:
        """Wait until every queued sample has been played (or `should_stop()`), then close."""
        stream = self.stream
        if stream is None:
            return
        with self.lock:
            self.complete = True
        try:
            while self.pending() and not should_stop():
                time.sleep(poll)
            if not should_stop():  # the device's own buffer
                time.sleep(stream.latency if isinstance(stream.latency, float) else 0.2)
        finally:
            self.stream = None
            stream.stop()
            stream.close()
