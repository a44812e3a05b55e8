"""MM3 Lyric Timestamps in a real ComfyUI (tiny models): the LRC of each planned song, saved by
MM3 Save Song beside it, equal to what `python -m mm3 align` makes of the saved replay JSON; bad
head lists refused when queued, a head the LM lacks refused when run, before the plan upstream."""

from __future__ import annotations

import copy
import re

import pytest

from mm3.commands.main import main
from tests.helpers.comfy_server import executed_nodes
from tests.helpers.comfyui import CAPTION, LYRICS, audio_entries, needs_comfy, run, tiny_workflow

HEADS = "1:*,0:2"


def _with_lyric_timestamps(comfy, **inputs):
    wf = tiny_workflow(comfy, "text_to_song", fmt="wav16", **{"2": {"caption": CAPTION, "lyrics": LYRICS},
                                                              "3": {"lm_seed": 12, "songs": 2},
                                                              "8": {"filename_prefix": "mm3/lrc"}})
    wf["20"] = {"class_type": "MM3LyricTimestamps",
                "inputs": {"lm": ["1", 0], "depth": ["1", 1], "codes": ["3", 0], "lead": 0.5, "heads": HEADS} | inputs}
    wf["8"]["inputs"]["lyrics_lrc"] = ["20", 0]
    return wf


@needs_comfy
def test_lyric_timestamps_are_saved_beside_each_song(comfy, tmp_path):
    info = comfy.get("/object_info/MM3LyricTimestamps")["MM3LyricTimestamps"]
    assert info["output"] == ["STRING"] and info["output_name"] == ["lyrics_lrc"]
    assert info["input_order"] == {"required": ["lm", "depth", "codes", "lead"], "optional": ["heads"]}
    save = comfy.get("/object_info/MM3SaveSong")["MM3SaveSong"]["input"]["optional"]["lyrics_lrc"]
    assert save[0] == "STRING" and save[1]["forceInput"]

    entry, _ = run(comfy, _with_lyric_timestamps(comfy))
    songs = audio_entries(entry, "8")
    texts = entry["outputs"]["20"]["text"]
    assert len(songs) == 2 and len(texts) == 2
    for song, shown in zip(songs, texts):
        folder = comfy.base / "output" / song["subfolder"]
        stem = song["filename"][:-4]
        lrc = (folder / f"{stem}.lrc").read_text(encoding="utf-8")
        assert lrc == shown and lrc.count("\n") >= 1
        assert all(re.fullmatch(r"\[\d\d:\d\d\.\d\d\].+", line) for line in lrc.splitlines())
        assert "neon" not in lrc and lrc.splitlines()[-1].endswith(("[verse]", "Rain on the window, coffee in my hand",
                                                                   "[chorus]", "Slow it down"))
        # the command line makes the same LRC from the saved replay JSON
        out = tmp_path / f"{stem}.lrc"
        assert main(["align", "--models", str(comfy.base / "models" / "mm3"), "--request", str(folder / f"{stem}.json"),
                     "--lrc-heads", HEADS, "--lrc-lead", "0.5", "--out", str(out), "--quiet", "--device", "cpu"]) == 0
        assert out.read_text(encoding="utf-8") == lrc


@needs_comfy
def test_bad_lyric_heads_are_refused(comfy):
    with pytest.raises(AssertionError, match=r"lyric head '12' is not LAYER:HEAD or LAYER:\*"):
        comfy.queue(_with_lyric_timestamps(comfy, heads="12"))
    wf = _with_lyric_timestamps(comfy, heads="")  # the released LM's heads: the tiny LM has 2 layers
    ws = comfy.ws()
    try:
        events = ws.events(comfy.queue(copy.deepcopy(wf)), timeout=120)
    finally:
        ws.close()
    error = [e for e in events if e["type"] == "execution_error"]
    assert error and error[0]["data"]["node_id"] == "20", events[-3:]
    message = error[0]["data"]["exception_message"]
    assert "layer 12 is not in this LM: it has 2 layers (0-1)" in message
    assert "name others with this node's heads input" in message and "--lrc-heads" not in message
    assert "3" not in executed_nodes(events)  # refused before the AR plan ran (the codes input is lazy)
