"""Editing a song by its lyrics in a real ComfyUI (tiny models): MM3 Change a Line gives one line new
words (edit_a_line), MM3 Repaint takes its range from a lyric line; outside the range the codes and
the audio stay the original's, and the command line renders the edit's replay JSON to the same file.

The tiny LM has no heads that follow the lyrics (its weights are random): the lyric timestamps are
read from all heads of its last layer here, and the line chosen is one those heads time."""

from __future__ import annotations

import copy
import json

import numpy as np

from mm3.commands.main import main
from mm3.constants import FRAME_RATE
from tests.helpers.comfyui import audio_entries, needs_comfy, run, tiny_workflow

SONG = {"2": {"lyrics": "[verse]\nhello there my friend\nsing along tonight\n[chorus]\nla la la"},
        "6": {"heads": "1:*", "line": 1, "words": "a brand new line"}}
DURATION = 3.0


def _wav32(data: bytes) -> np.ndarray:
    at = data.index(b"data")
    n = int.from_bytes(data[at + 4:at + 8], "little")
    return np.frombuffer(data[at + 8:at + 8 + n], dtype="<f4").reshape(-1, 2)


def _codes(req: dict) -> np.ndarray:
    return np.array([int(x) for x in req["audio_codes"].split(",")]).reshape(-1, 8)


def _replay(comfy, song: dict) -> dict:
    return json.loads(comfy.view({**song, "filename": song["filename"][:-4] + ".json"}))


@needs_comfy
def test_edit_a_line_keeps_the_rest_and_the_command_line_renders_it_again(comfy, tmp_path):
    info = comfy.get("/object_info/MM3ChangeLine")["MM3ChangeLine"]
    assert info["output_name"] == ["codes", "start", "end"] and info["output"][1:] == ["FLOAT", "FLOAT"]
    wf = tiny_workflow(comfy, "edit_a_line", duration=DURATION, fmt="wav32", **copy.deepcopy(SONG))
    wf |= {"12": {"class_type": "MM3VocoderDecode", "inputs": {"vae": ["1", 4], "latents": ["5", 0]}},
           "13": {"class_type": "MM3Stitch", "inputs": {"windows": ["12", 0]}},
           "14": {"class_type": "MM3SaveSong", "inputs": wf["11"]["inputs"] | {"audio": ["13", 0],
                                                                              "filename_prefix": "mm3/original"}}}
    entry, _ = run(comfy, wf, timeout=300)
    original, edited = (audio_entries(entry, n)[0] for n in ("14", "11"))  # the original saved for this test
    before, after = _replay(comfy, original), _replay(comfy, edited)
    edit = after["lyric_edit"]
    assert edit["line"] == 1 and edit["text"] == "hello there my friend" and edit["lm_seed"] == 5
    assert edit["words"] == "a brand new line" and edit["replaced"] == "hello there my friend"
    assert after["lyrics"] == SONG["2"]["lyrics"].replace("hello there my friend", "a brand new line")
    assert after["source_lyrics"] == SONG["2"]["lyrics"] and after["source_codes"] == before["audio_codes"]
    start, end = after["repaint_start"], after["repaint_end"]
    assert (start, end) == (edit["start"], edit["end"]) and 0 <= start < end <= DURATION
    text = "".join(entry["outputs"]["6"]["text"])
    assert entry["outputs"]["6"]["lyrics_lrc"][0].splitlines()[1].endswith("hello there my friend")  # for players
    assert "line 1 'hello there my friend'" in text and "now sings 'a brand new line' (lm_seed 5)" in text
    # the codes outside the range are the original's; inside, planned again
    old, new = _codes(before), _codes(after)
    changed = np.nonzero((old != new).any(1))[0]
    assert len(changed) and changed.min() >= int(start * FRAME_RATE) + 1 and changed.max() <= int(end * FRAME_RATE)
    # the audio: the original's sample for sample beyond the vocoder's reach (0.15 s) around the range
    x, y = _wav32(comfy.view(original)), _wav32(comfy.view(edited))
    differs = np.nonzero((x != y).any(1))[0] / 44100
    assert x.shape == y.shape and len(differs) and start - 0.15 < differs.min() and differs.max() < end + 0.15
    # the command line renders the edit's replay JSON to the same bytes
    request = tmp_path / "edited.json"
    request.write_text(json.dumps(after))
    out = tmp_path / "again.wav"
    assert main(["render", "--models", str(comfy.base / "models" / "mm3"), "--request", str(request), "--out", str(out),
                 "--quiet", "--device", "cpu"]) == 0
    assert out.read_bytes() == comfy.view(edited)


@needs_comfy
def test_repaint_takes_its_range_from_a_lyric_line(comfy):
    wf = tiny_workflow(comfy, "repaint_range", duration=DURATION, fmt="wav32", **{"2": SONG["2"]})
    wf["13"] = {"class_type": "MM3LyricTimestamps",  # a lead of its own: not the cached node of another test
                "inputs": {"lm": ["1", 0], "depth": ["1", 1], "codes": ["3", 0], "lead": 0.75, "heads": "1:*"}}
    wf["9"]["inputs"].update(lyrics_lrc=["13", 0], line=1)
    entry, _ = run(comfy, wf, timeout=300)
    lrc = entry["outputs"]["13"]["text"][0]
    first = next(line for line in lrc.splitlines() if line.endswith("hello there my friend"))
    seconds = int(first[1:3]) * 60 + float(first[4:9])
    replay = _replay(comfy, audio_entries(entry, "12")[0])
    start, end = replay["repaint_start"], replay["repaint_end"]
    assert seconds - 0.5 <= start <= seconds < end  # from the line's start, widened by at most the margin
    assert replay["lyric_edit"] == {"line": 1, "text": "hello there my friend", "start": start, "end": end}
    text = "".join(entry["outputs"]["9"]["text"])
    assert text == f"repainted line 1 'hello there my friend': {start:g}-{end:g} s with seed 8", (text, lrc)


@needs_comfy
def test_a_line_outside_the_lyrics_is_refused_when_the_node_runs(comfy):
    wf = tiny_workflow(comfy, "edit_a_line", duration=DURATION, fmt="wav32",
                       **(copy.deepcopy(SONG) | {"6": {"heads": "1:*", "line": 9, "words": "x"}}))
    ws = comfy.ws()
    try:
        events = ws.events(comfy.queue(wf), timeout=300)
    finally:
        ws.close()
    error = [e for e in events if e["type"] == "execution_error"]
    assert error and error[0]["data"]["node_id"] == "6", events[-3:]
    assert "line 9 is not in the lyrics: they have 3 sung line(s)" in error[0]["data"]["exception_message"]


@needs_comfy
def test_an_edit_made_on_the_command_line_renders_the_same_in_comfyui(comfy, tmp_path):
    """The command line's edit (repaint --line --words) and its original, as replay JSONs pasted into
    MM3 Audio Codes From Text: the original's latents as MM3 Repaint's source, the edit's codes (under
    its new lyrics) as its condition, the range and seeds the edit's JSON records: the same file."""
    models = str(comfy.base / "models" / "mm3")
    first = tmp_path / "song.wav"
    assert main(["generate", "--models", models, "--caption", "warm pop", "--lyrics", SONG["2"]["lyrics"],
                 "--duration", "3", "--steps", "2", "--lm-seed", "1", "--seed", "2", "--format", "wav32",
                 "--out", str(first), "--quiet", "--device", "cpu"]) == 0
    song = json.loads(first.with_suffix(".json").read_text())
    timed = tmp_path / "timed.json"
    timed.write_text(json.dumps(song | {"lyric_times": [0.0, 0.2, 0.4, 1.2, 2.0, 2.2]}))
    edit = tmp_path / "edit.wav"
    assert main(["repaint", "--models", models, "--request", str(timed), "--line", "2", "--words", "sing a new song",
                 "--replan-lm-seed", "7", "--repaint-seed", "5", "--format", "wav32", "--out", str(edit), "--quiet",
                 "--device", "cpu"]) == 0
    req = json.loads(edit.with_suffix(".json").read_text())
    assert req["lyric_edit"]["words"] == "sing a new song" and req["source_lyrics"] == song["lyrics"]

    def codes(node, text):
        return {node: {"class_type": "MM3AudioCodesFromText",
                       "inputs": {"lm": ["1", 0], "depth": ["1", 1], "replay_json": text, "model_check": "refuse"}}}

    loaders = {f"{k}_model": "auto" for k in ("lm", "depth", "cond", "dit", "vae")} | {"keep_loaded": False}
    wf = {"1": {"class_type": "MM3LoadModelSet", "inputs": loaders},
          **codes("2", json.dumps(song)), **codes("3", json.dumps(req)),
          "4": {"class_type": "MM3ConditionEncode", "inputs": {"cond": ["1", 2], "codes": ["2", 0]}},
          "5": {"class_type": "MM3FlowSampler", "inputs": {"dit": ["1", 3], "condition": ["4", 0], "seed": ["2", 1],
                                                           "steps": ["2", 2], "dit_cfg": ["2", 3], "variations": 1}},
          "6": {"class_type": "MM3ConditionEncode", "inputs": {"cond": ["1", 2], "codes": ["3", 0]}},
          "7": {"class_type": "MM3Repaint", "inputs": {
              "dit": ["1", 3], "condition": ["6", 0], "source": ["5", 0], "start": req["repaint_start"],
              "end": req["repaint_end"], "fade": req.get("repaint_fade", 0.25), "seed": req["repaint_seed"],
              "steps": req["steps"], "dit_cfg": req["dit_cfg"], "variations": 1}},
          "8": {"class_type": "MM3VocoderDecode", "inputs": {"vae": ["1", 4], "latents": ["7", 0]}},
          "9": {"class_type": "MM3Stitch", "inputs": {"windows": ["8", 0]}},
          "10": {"class_type": "MM3SaveSong", "inputs": {"audio": ["9", 0], "filename_prefix": "mm3/cli_edit",
                                                         "format": "wav32", "mp3_bitrate": "192", "peak_clip": 10}}}
    entry, _ = run(comfy, wf, timeout=300)
    saved = audio_entries(entry, "10")[0]
    assert comfy.view(saved) == edit.read_bytes()
    again = _replay(comfy, saved)
    for key in ("audio_codes", "lyrics", "source_codes", "source_lyrics", "repaint_start", "repaint_end",
                "repaint_seed", "seed"):
        assert again[key] == req[key], key
