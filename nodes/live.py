"""Each decoded window sent to the editor that queued the prompt, for the node's player (web/mm3_player.js).

A window's new samples (what the stitch keeps of it) are written as a 32-bit float WAV in ComfyUI's
temp folder and one small message names it (the `EVENT` event): which node, prompt, song and
variation, the window's place in the song in samples, and the file to fetch through `/view`. The
pieces of one song and variation, played back to back, are the node's AUDIO bit for bit.

No ComfyUI import here: `common.window_preview` binds it to the running prompt.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from mm3.synth.output import atomic_write, render

EVENT = "mm3.window"
SUBFOLDER = "mm3_live"  # in ComfyUI's temp folder (emptied when ComfyUI starts)
log = logging.getLogger("mm3")


class WindowPreview:
    """A `mm3.song.stages.WindowStream` / `mm3.song.overlap.plan_and_render` callback that writes each window
    and sends its message with `send(event, data)`. `song`: the song's place in a list (a node run
    once per item); `duration`: the longest the song can be, in seconds (the player's scale until
    the length is known)."""

    def __init__(self, send, folder: Path, node: str, prompt_id: str, *, song: int = 0,
                 duration: float | None = None):
        self.send, self.folder, self.node, self.prompt_id = send, Path(folder), str(node), str(prompt_id)
        self.song, self.duration = song, duration
        self.start: dict[int, int] = {}  # variation -> samples sent so far
        self.failed = False

    def __call__(self, k: int, windows: int | None, samples, sample_rate: int) -> None:
        if self.failed:
            return
        try:
            self._send(k, windows, samples, sample_rate)
        except OSError as e:  # a preview is a nicety: a full temp disk must not fail the render
            self.failed = True
            log.warning("MM3: no live preview (cannot write to %s: %s)", self.folder, e)

    def _send(self, k: int, windows: int | None, samples, sample_rate: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^0-9A-Za-z]+", "-", f"{self.prompt_id[:12]}_{self.node}_{self.song}")
        for j in range(samples.shape[0]):
            name = f"{stem}_{j}_{k:03d}.wav"
            atomic_write(self.folder / name, render(samples[j], "wav32", sample_rate=sample_rate))
            start = self.start.get(j, 0)
            self.start[j] = start + int(samples.shape[-1])
            self.send(EVENT, {
                "node": self.node, "prompt_id": self.prompt_id, "song": self.song, "variation": j,
                "variations": int(samples.shape[0]), "window": k, "windows": windows,
                "last": windows is not None and k == windows - 1, "start": start,
                "samples": int(samples.shape[-1]), "sample_rate": int(sample_rate), "duration": self.duration,
                "file": {"filename": name, "subfolder": SUBFOLDER, "type": "temp"},
            })

    def of_song(self, song: int, k: int, windows: int | None, samples, sample_rate: int) -> None:
        """The `plan_and_render` form (song first) for a node that renders one song."""
        self(k, windows, samples, sample_rate)
