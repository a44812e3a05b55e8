"""Hearing a song while ComfyUI makes it, in a real ComfyUI (COMFYUI_PATH) on the tiny models: each
decoded window reaches the client that queued the prompt as an "mm3.window" message naming a WAV in
the temp folder, before the prompt completes; the windows of a song joined are its AUDIO bit for
bit. MM3 Generate (planning and synthesis overlapped) sends its first window while the plan is still
going on, and its song is the one the stage nodes make with the same settings."""

from __future__ import annotations

import json
import os
import urllib.parse

import pytest
import torch

from tests.helpers.comfy_server import ComfyServer, WebSocket
from tests.helpers.comfyui import CAPTION, COMFYUI_PATH, LYRICS, needs_comfy

SETTINGS = dict(duration=9.0, lm_seed=3, seed=5, steps=2, lm_cfg=1.5, dit_cfg=1.7, variations=2)


@pytest.fixture(scope="module")
def server():
    """A ComfyUI whose torch computes on one thread: the tiny models' hundreds of frames are quickest so."""
    if not COMFYUI_PATH:
        pytest.skip("COMFYUI_PATH is not set (a ComfyUI checkout to run)")
    s = ComfyServer(COMFYUI_PATH, os.environ.get("COMFYUI_PYTHON"), env={"OMP_NUM_THREADS": "1"}).start()
    yield s
    s.stop()


def _prompt() -> dict:
    """MM3 Generate (node 10) and the stage nodes (2-7) from one model set, the same settings, each
    song saved as 32-bit float WAV (the rendered samples)."""
    s = SETTINGS
    set_ = {"class_type": "MM3LoadModelSet", "inputs": {f"{k}_model": "auto" for k in ("lm", "depth", "cond", "dit",
                                                                                         "vae")} | {"keep_loaded": False}}
    sockets = {k: ["1", i] for i, k in enumerate(("lm", "depth", "cond", "dit", "vae"))}
    save = lambda audio, prefix: {"class_type": "MM3SaveSong", "inputs": {  # noqa: E731
        "audio": audio, "filename_prefix": prefix, "format": "wav32", "mp3_bitrate": "128", "peak_clip": 10}}
    return {
        "1": set_,
        "2": {"class_type": "MM3PromptAssemble", "inputs": {"lm": sockets["lm"], "caption": CAPTION, "lyrics": LYRICS}},
        "3": {"class_type": "MM3ARPlan", "inputs": {"lm": sockets["lm"], "depth": sockets["depth"], "prompt": ["2", 0],
                                                    "duration": s["duration"], "lm_seed": s["lm_seed"],
                                                    "lm_cfg": s["lm_cfg"], "songs": 1}},
        "4": {"class_type": "MM3ConditionEncode", "inputs": {"cond": sockets["cond"], "codes": ["3", 0]}},
        "5": {"class_type": "MM3FlowSampler", "inputs": {"dit": sockets["dit"], "condition": ["4", 0], "seed": s["seed"],
                                                         "steps": s["steps"], "dit_cfg": s["dit_cfg"],
                                                         "variations": s["variations"]}},
        "6": {"class_type": "MM3VocoderDecode", "inputs": {"vae": sockets["vae"], "latents": ["5", 0]}},
        "7": {"class_type": "MM3Stitch", "inputs": {"windows": ["6", 0]}},
        "8": save(["7", 0], "live/staged"),
        "10": {"class_type": "MM3Generate", "inputs": {**sockets, "caption": CAPTION, "lyrics": LYRICS, **s}},
        "11": save(["10", 0], "live/generate"),
    }


def _wav(server, entry: dict, tmp_path) -> torch.Tensor:
    from mm3.synth.codec import read_audio

    path = tmp_path / entry["filename"]
    path.write_bytes(server.view(entry))
    audio, rate = read_audio(path)
    assert rate == 44100
    return audio


@needs_comfy
def test_windows_reach_the_client_as_they_are_decoded_and_join_to_the_song(server, tmp_path):
    listener = server.ws()
    bystander = WebSocket("127.0.0.1", server.port, "/ws?clientId=someone-else")
    try:
        pid = server.queue(_prompt())
        events = listener.events(pid, timeout=900)
    finally:
        listener.close()
    entry = server.wait(pid, timeout=60)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    windows = [e for e in events if e["type"] == "mm3.window"]
    done = [i for i, e in enumerate(events) if e["type"] == "execution_success"][0]
    assert windows and all(events.index(w) < done for w in windows)
    for node, saved in (("6", "8"), ("10", "11")):
        mine = [w["data"] for w in windows if w["data"]["node"] == node]
        assert {m["variation"] for m in mine} == {0, 1} and all(m["sample_rate"] == 44100 for m in mine)
        assert all(m["noise"] is True for m in mine)  # the tiny vocoder: the player says noise, plays it quietly
        files = entry["outputs"][saved]["audio"]
        for j, file in enumerate(files):
            pieces = sorted((m for m in mine if m["variation"] == j), key=lambda m: m["window"])
            assert [m["window"] for m in pieces] == [0, 1] and pieces[-1]["last"] and pieces[-1]["windows"] == 2
            assert [m["start"] for m in pieces] == [0, pieces[0]["samples"]]
            joined = torch.cat([_wav(server, m["file"], tmp_path) for m in pieces], dim=-1)
            assert torch.equal(joined, _wav(server, file, tmp_path))
    a, b = (entry["outputs"][n]["audio"] for n in ("8", "11"))
    for x, y in zip(a, b):  # MM3 Generate's song is the stage nodes'
        assert torch.equal(_wav(server, x, tmp_path), _wav(server, y, tmp_path))
    first = events.index(next(w for w in windows if w["data"]["node"] == "10"))
    planning_after = [e for e in events[first:] if e["type"] == "progress" and e["data"].get("node") == "10"
                      and e["data"]["max"] == 225 and e["data"]["value"] > 201]
    assert planning_after, "MM3 Generate's first window came after its plan was done"
    with pytest.raises(OSError):  # nothing for a client that did not queue the prompt (a timeout)
        while True:
            msg = bystander.recv(timeout=2)
            assert not (isinstance(msg, dict) and msg.get("type") == "mm3.window"), msg
    bystander.close()
    q = urllib.parse.urlencode(windows[0]["data"]["file"])
    assert server.get(f"/view?{q}")[:4] == b"RIFF"
