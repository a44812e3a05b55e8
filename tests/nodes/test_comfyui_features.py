"""The workflows beyond the reference in a real ComfyUI: natural endings with takes, continuing a
song, repainting a range (tiny models, posted through /prompt)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.comfyui import audio_entries, needs_comfy, read_wav, run, tiny_workflow


@needs_comfy
def test_natural_ending_workflow_reports_its_takes(comfy):
    wf = tiny_workflow(comfy, "natural_ending_takes", fmt="wav16", **{"3": {"require_ending": False}})
    entry, _ = run(comfy, wf)
    assert len(audio_entries(entry, "8")) == 1
    text = "".join(entry["outputs"]["3"]["text"])
    assert [f"take {n} (lm_seed {42 + n})" in text for n in range(4)] == [True] * 4 and "kept" in text
    replay = json.loads(comfy.view({**audio_entries(entry, "8")[0], "filename": audio_entries(entry, "8")[0]["filename"][:-4] + ".json"}))
    assert replay["takes"] == 4 and replay["lm_take"] in range(4) and replay["lm_seed"] == 42 + replay["lm_take"]


@needs_comfy
def test_continue_workflow_extends_the_first_plan(comfy):
    entry, _ = run(comfy, tiny_workflow(comfy, "continue_song", fmt="wav16"))
    song = audio_entries(entry, "8")[0]
    replay = json.loads(comfy.view({**song, "filename": song["filename"][:-4] + ".json"}))
    frames = len(replay["audio_codes"].split(",")) // 8 - 1
    assert frames == int(2 * 1.2 * 25) and replay["lm_seed"] == 43 and "continue_codes" not in replay
    text = "".join(entry["outputs"]["3"]["text"])
    assert "30 frames" in text  # the prior plan, kept as the start of the continuation


@needs_comfy
def test_repaint_workflow_keeps_the_outside_of_the_range(comfy):
    entry, _ = run(comfy, tiny_workflow(comfy, "repaint_range", fmt="wav32"))
    original, repainted = (read_wav_samples(comfy.view(audio_entries(entry, n)[0])) for n in ("8", "12"))
    assert original.shape == repainted.shape
    rate, n = 44100, original.shape[-1]
    head, mid = slice(0, int(0.2 * rate)), slice(int(0.5 * rate), int(0.7 * rate))
    assert torch.allclose(original[:, head], repainted[:, head], atol=1e-2)  # the same latents there
    assert not torch.allclose(original[:, mid], repainted[:, mid], atol=1e-2)
    song = audio_entries(entry, "12")[0]
    replay = json.loads(comfy.view({**song, "filename": song["filename"][:-4] + ".json"}))
    assert replay["repaint_seed"] == 8 and replay["repaint_end"] == pytest.approx(0.8) and n > 0


def read_wav_samples(data: bytes) -> torch.Tensor:
    """[2, frames] float32 of a 32-bit float stereo WAV."""
    channels, rate, bits, frames = read_wav(data)
    assert (channels, bits) == (2, 32)
    return torch.frombuffer(bytearray(data[44:44 + frames * 8]), dtype=torch.float32).view(-1, 2).T.clone()
