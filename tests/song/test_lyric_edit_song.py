"""A song edited by its lyrics from the command line (`repaint --line/--section [--words]`, tiny
model, CPU): outside the range the codes and the audio stay the original's bit for bit, inside it
the codes are planned again, and the edit's replay JSON renders the same file again."""

import json

import numpy as np
import pytest

from mm3.commands.main import main as cli_main
from mm3.constants import FRAME_RATE

LYRICS = "[verse]\nhello there my friend\nsing along tonight\n[chorus]\nla la la\noh oh oh"
# "[start]", "[verse]", the 2 verse lines, "[chorus]", the 2 chorus lines: where each starts
TIMES = [0.0, 0.2, 0.4, 1.2, 2.0, 2.2, 2.6]
pytestmark = pytest.mark.usefixtures("one_thread")


def _cli(tiny, *args):
    return cli_main([args[0], "--models", str(tiny.gguf), *args[1:], "--quiet"])


def _codes(req: dict) -> np.ndarray:
    return np.array([int(x) for x in req["audio_codes"].split(",")]).reshape(-1, 8)


def _wav32(path) -> np.ndarray:
    data = path.read_bytes()
    at = data.index(b"data")
    n = int.from_bytes(data[at + 4:at + 8], "little")
    return np.frombuffer(data[at + 8:at + 8 + n], dtype="<f4").reshape(-1, 2)


@pytest.fixture(scope="module")
def song(tiny, tmp_path_factory):
    """A 3 s song with its lyric timestamps recorded in its replay JSON."""
    folder = tmp_path_factory.mktemp("edit")
    out = folder / "song.wav"
    assert _cli(tiny, "generate", "--caption", "warm pop", "--lyrics", LYRICS, "--duration", "3", "--steps", "2",
                "--lm-seed", "1", "--seed", "2", "--format", "wav32", "--out", str(out)) == 0
    req = json.loads(out.with_suffix(".json").read_text())
    (folder / "timed.json").write_text(json.dumps(req | {"lyric_times": TIMES}))
    return folder, out, req


def test_changing_a_line_keeps_the_rest_and_rerenders_bit_for_bit(tiny, song):
    folder, original, before = song
    out = folder / "edit.wav"
    assert _cli(tiny, "repaint", "--request", str(folder / "timed.json"), "--line", "2", "--words", "sing a new song",
                "--repaint-seed", "5", "--replan-lm-seed", "7", "--format", "wav32", "--out", str(out)) == 0
    after = json.loads(out.with_suffix(".json").read_text())
    # line 2 starts at 1.2, the next line ([chorus]) at 2.0; widened by 0.5 s, at most half-way into the
    # neighbours: back to 0.8 (line 1 starts at 0.4), on to 2.1 (the line after [chorus] starts at 2.2)
    start, end = 0.8, 2.1
    assert after["lyrics"] == LYRICS.replace("sing along tonight", "sing a new song")
    assert after["source_lyrics"] == LYRICS and after["source_codes"] == before["audio_codes"]
    assert after["lyric_edit"] == {"line": 2, "text": "sing along tonight", "start": start, "end": end,
                                   "words": "sing a new song", "replaced": "sing along tonight", "lm_seed": 7}
    assert (after["repaint_start"], after["repaint_end"], after["repaint_seed"]) == (start, end, 5)
    assert "lyric_times" not in after  # the new line's timing is not known
    # codes: rows a + 1 .. b (the frames heard from a / 25 s to b / 25 s) planned again, the rest kept
    a, b = int(start * FRAME_RATE), int(end * FRAME_RATE)
    old, new = _codes(before), _codes(after)
    assert old.shape == new.shape
    changed = np.nonzero((old != new).any(1))[0]
    assert changed.min() >= a + 1 and changed.max() <= b and len(changed) > (b - a) // 2
    # audio: the latents outside [start, end) are kept exactly; the vocoder spreads the change by less
    # than 0.15 s around the range, and everything beyond that is the original's sample for sample
    x, y = _wav32(original), _wav32(out)
    differs = np.nonzero((x != y).any(1))[0] / 44100
    assert start - 0.15 < differs.min() and differs.max() < end + 0.15 and len(differs) > 0.5 * 44100 * (end - start)
    again = folder / "again.wav"
    assert _cli(tiny, "render", "--request", str(out.with_suffix(".json")), "--out", str(again)) == 0
    assert again.read_bytes() == out.read_bytes()


def test_a_section_is_repainted_from_timestamps_computed_when_none_are_recorded(tiny, song, capsys):
    folder, original, before = song
    out = folder / "section.wav"
    rc = cli_main(["repaint", "--models", str(tiny.gguf), "--request", str(original.with_suffix(".json")),
                   "--section", "verse", "--lrc-heads", "1:*", "--margin", "0", "--repaint-seed", "3", "--format",
                   "wav32", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    after = json.loads(out.with_suffix(".json").read_text())
    edit = after["lyric_edit"]
    assert edit["section"] == "verse 1" and edit["text"] == "[verse]" and "words" not in edit
    assert f"repainting section verse 1 '[verse]': {edit['start']:.2f}-{edit['end']:.2f} s" in err
    assert (after["repaint_start"], after["repaint_end"]) == (edit["start"], edit["end"])
    assert after["audio_codes"] == before["audio_codes"] and after["lrc_heads"] == "1:*"


@pytest.mark.parametrize("flags,message", [
    (["--line", "5"], "line 5 is not in the lyrics: they have 4 sung line(s)"),
    (["--section", "bridge"], "section 'bridge' is not in the lyrics; their sections: verse 1, chorus 1"),
    (["--line", "1", "--words", "two\nlines"], "the new words must be one sung line"),
    (["--section", "chorus", "--words", "x"], "--words replaces the words of one line: name it with --line N"),
    (["--line", "1", "--start", "1", "--end", "2"], "--line chooses the range: leave out --start and --end"),
    ([], "repaint needs --start and --end (seconds), or --line N or --section NAME"),
])
def test_bad_choices_are_refused_before_any_work(tiny, song, capsys, flags, message):
    folder, _, _ = song
    out = folder / "refused.wav"
    rc = cli_main(["repaint", "--models", str(tiny.gguf), "--request", str(folder / "timed.json"), *flags,
                   "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_an_instrumental_and_words_over_the_prompt_budget_are_refused(tiny, song, capsys):
    folder, _, before = song
    inst = folder / "inst.json"
    inst.write_text(json.dumps(before | {"lyrics": ""}))
    rc = cli_main(["repaint", "--models", str(tiny.gguf), "--request", str(inst), "--line", "1", "--quiet",
                   "--out", str(folder / "x.wav")])
    assert rc == 2 and "this song has no lyrics (an instrumental)" in capsys.readouterr().err
    # lyrics just under the 5000-token budget (3 tokens per "la " in the tiny vocabulary), words that pass it
    full = folder / "full.json"
    lyrics = "[verse]\nshort line\n" + "\n".join(["la " * 150] * 10)
    full.write_text(json.dumps(before | {"lyrics": lyrics, "lyric_times": [0.0, 0.1, 0.2] + [None] * 10}))
    rc = cli_main(["repaint", "--models", str(tiny.gguf), "--request", str(full), "--line", "1", "--words",
                   "la " * 300, "--quiet", "--out", str(folder / "y.wav")])
    err = capsys.readouterr().err
    assert rc == 2 and "line 1 with the new words: Prompt exceeds the 5000 token budget" in err, err
    assert not (folder / "y.wav").exists()


def test_plan_with_lrc_records_the_timestamps_a_repaint_reads(tiny, song, capsys):
    folder, _, _ = song
    out = folder / "planned.json"
    assert _cli(tiny, "plan", "--caption", "warm pop", "--lyrics", LYRICS, "--duration", "2", "--lm-seed", "1",
                "--lrc", "--lrc-heads", "1:*", "--out", str(out)) == 0
    times = json.loads(out.read_text())["lyric_times"]
    lrc = out.with_suffix(".lrc").read_text()
    assert len(times) == 7 and times[0] == 0.7  # "[start]" (at the 0.7 s lead) and the six lines
    assert lrc.count("\n") == sum(t is not None for t in times[1:])  # the LRC gives the lines it timed


def test_a_line_planned_again_without_new_words_records_its_seed(tiny, song):
    folder, _, before = song
    out = folder / "replanned.wav"
    assert _cli(tiny, "repaint", "--request", str(folder / "timed.json"), "--line", "3", "--replan-lm-seed", "4",
                "--repaint-seed", "6", "--format", "wav32", "--out", str(out)) == 0
    after = json.loads(out.with_suffix(".json").read_text())
    # line 3 ("la la la") starts at 2.2, after [chorus] at 2.0; the next line at 2.6
    assert after["lyric_edit"] == {"line": 3, "text": "la la la", "start": 2.1, "end": 2.8, "lm_seed": 4}
    assert after["lyrics"] == LYRICS and "source_lyrics" not in after and "lyric_times" not in after
    assert after["source_codes"] == before["audio_codes"] != after["audio_codes"]
