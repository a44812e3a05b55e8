"""The main job end to end on the tiny model: files, replay, batches, the reference RNG, errors."""

import json
import os
import signal
import subprocess
import sys
import time
import wave
from pathlib import Path

import pytest
import torch

from mm3.commands.main import main as cli_main
from mm3.formats.gguf import ComponentError
from mm3.song.pipeline import Pipeline
from mm3.progress import Cancelled, Progress
from mm3.song.request import MM3Request

REPO = Path(__file__).resolve().parents[2]
CAPTION = "## Mood\n- **dark** synth pop\n<|bpm 120|>"
LYRICS = "[Verse] dropped\nneon lights ^ falling rain\n[Chorus]\nwe run"


def read_wav(path):
    with wave.open(str(path)) as w:
        return w.getnchannels(), w.getframerate(), w.getnframes(), w.readframes(w.getnframes())


def generate(tiny, out, *extra):
    return cli_main(["generate", "--models", str(tiny.gguf), "--caption", CAPTION, "--lyrics", LYRICS,
                     "--out", str(out), "--quiet", *extra])


def test_generate_then_render_reproduces_bit_for_bit(tiny, tmp_path):
    out = tmp_path / "song.wav"
    # --min-duration 10: the song may not end before the 10 s cap, so it has exactly 250 frames
    assert generate(tiny, out, "--duration", "10", "--min-duration", "10", "--steps", "4", "--seed", "11",
                    "--lm-seed", "3") == 0
    channels, rate, frames, data = read_wav(out)
    assert (channels, rate) == (2, 44100)
    replay = json.loads((tmp_path / "song.json").read_text())
    assert replay["seed"] == 11 and replay["lm_seed"] == 3 and replay["output_format"] == "wav16"
    assert len(replay["audio_codes"].split(",")) // 8 - 1 == 250
    assert frames == 440832  # two windows (689 + 516 latents), of which 431 + 430 are kept, x 512
    again = tmp_path / "again.wav"
    assert cli_main(["render", "--models", str(tiny.gguf), "--request", str(tmp_path / "song.json"),
                     "--out", str(again), "--quiet"]) == 0
    assert again.read_bytes() == out.read_bytes()


def test_batches_are_numbered_song_major(tiny, tmp_path):
    out = tmp_path / "b.mp3"
    assert generate(tiny, out, "--duration", "1", "--steps", "2", "--seed", "100", "--lm-seed", "7",
                    "--songs", "2", "--variations", "2") == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["b_01.json", "b_01.mp3", "b_02.json", "b_02.mp3", "b_03.json", "b_03.mp3",
                     "b_04.json", "b_04.mp3"]
    seeds = [(r["lm_seed"], r["seed"]) for r in
             (json.loads((tmp_path / f"b_0{i}.json").read_text()) for i in range(1, 5))]
    assert seeds == [(7, 100), (7, 101), (8, 100), (8, 101)]
    assert all((tmp_path / f"b_0{i}.mp3").read_bytes()[:3] in (b"ID3", b"\xff\xfb") or
               (tmp_path / f"b_0{i}.mp3").read_bytes()[0] == 0xFF for i in range(1, 5))


def test_plan_then_render(tiny, tmp_path):
    assert cli_main(["plan", "--models", str(tiny.gguf), "--caption", CAPTION, "--lyrics", LYRICS,
                     "--duration", "2", "--lm-seed", "21", "--out", str(tmp_path / "p.json"), "--quiet"]) == 0
    req = MM3Request.from_json((tmp_path / "p.json").read_text())
    assert req.lm_seed == 21 and req.audio_codes
    assert cli_main(["render", "--models", str(tiny.gguf), "--request", str(tmp_path / "p.json"),
                     "--steps", "3", "--seed", "5", "--out", str(tmp_path / "r.wav"), "--quiet"]) == 0
    replay = json.loads((tmp_path / "r.json").read_text())
    assert (replay["steps"], replay["seed"], replay["audio_codes"]) == (3, 5, req.audio_codes)


def test_corpus_request_renders(tiny_qwen3, tmp_path, corpus):
    """A minimaxmusic.cpp request, tokenised with the real Qwen3 vocabulary."""
    tiny = tiny_qwen3
    data = dict(corpus["vocal-01"], duration=0.5, steps=2, seed=1, lm_seed=1)
    path = tmp_path / "req.json"
    path.write_text(json.dumps(data))
    assert cli_main(["generate", "--models", str(tiny.gguf), "--request", str(path),
                     "--out", str(tmp_path / "v.mp3"), "--quiet"]) == 0
    replay = json.loads((tmp_path / "v.json").read_text())
    assert (replay["caption"], replay["lyrics"], replay["output_format"]) == (data["caption"], data["lyrics"], "mp3")
    frames = len(replay["audio_codes"].split(",")) // 8 - 1
    assert 1 <= frames <= 12  # 0.5 s at 25 frames per second
    from mm3.files.opener import open_component
    from mm3.models.cond import ConditionEncoder

    samples = 512 * ConditionEncoder.load(open_component(tiny.file("mm3-cond"), "cond")).latent_length(frames)
    miniaudio = pytest.importorskip("miniaudio")
    dec = miniaudio.decode_file(str(tmp_path / "v.mp3"), output_format=miniaudio.SampleFormat.SIGNED16)
    assert (dec.nchannels, dec.sample_rate) == (2, 44100)
    assert samples <= dec.num_frames <= samples + 3 * 1152  # the song's samples plus the encoder's delay
    assert max(abs(v) for v in dec.samples) > 0.9 * 32767  # peak-normalised, not silence


def test_user_errors_are_clear_and_write_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "x.wav"
    assert generate(tiny, out, "--duration", "0") == 2
    assert "duration must be positive" in capsys.readouterr().err
    assert generate(tiny, out, "--dit-model", "nope.gguf", "--duration", "1") == 2
    err = capsys.readouterr().err
    assert "unknown mm3-dit model 'nope.gguf'" in err and "MiniMax-Music3-tiny-transformer-F32.gguf" in err
    out.write_bytes(b"keep me")
    assert generate(tiny, out, "--duration", "1") == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == b"keep me"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert cli_main(["render", "--models", str(tiny.gguf), "--request", str(bad), "--out",
                     str(tmp_path / "y.wav")]) == 2
    assert "Malformed JSON" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "x.wav"]


def test_strict_memory_releases_the_ar_group(tiny):
    pipe = Pipeline(tiny.gguf, device="cpu")
    req = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=0.5, steps=2, seed=0, lm_seed=0)
    songs, _ = pipe.plan(req)
    assert pipe.store.resident() == ["depth", "lm"]
    pipe.synthesize(req, pipe.replay(req, codes=songs[0].codes.codes))
    assert pipe.store.resident() == ["cond", "dit", "vae"]
    keep = Pipeline(tiny.gguf, device="cpu", keep_loaded=True)
    keep.run(req)
    assert keep.store.resident() == ["cond", "depth", "dit", "lm", "vae"]
    with pytest.raises(ComponentError, match="unknown mm3-lm model"):
        pipe.run(MM3Request(caption="a", lyrics="b", lm_model="other.gguf"))


def test_cancel_between_frames(tiny):
    pipe = Pipeline(tiny.gguf, device="cpu")
    seen = []

    def on_progress(stage, done, total, info):
        seen.append((stage, done))

    stop = Progress(on_progress=on_progress, should_stop=lambda: len(seen) >= 5)
    with pytest.raises(Cancelled):
        pipe.run(MM3Request(caption="a", lyrics="b", duration=30, lm_seed=1, seed=1), stop)
    assert len(seen) == 5
    assert pipe.run(MM3Request(caption="a", lyrics="b", duration=0.5, steps=2, lm_seed=1, seed=1))  # still usable


def test_ctrl_c_stops_and_writes_nothing(tiny, tmp_path):
    out = tmp_path / "long.wav"
    cmd = [sys.executable, "-m", "mm3", "generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b",
           "--duration", "300", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    buf = ""
    deadline = time.time() + 120
    while "planning" not in buf and time.time() < deadline:  # wait until frames are being sampled
        buf += proc.stderr.read(1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "nothing was written" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("duration, steps", [(3.0, 4), (8.4, 2)])
def test_reference_rng_reproduces_diffusers_audio(tiny, one_thread, duration, steps):
    """One generator seeded lm_seed drives AR then DiT noise, as the diffusers pipeline."""
    pytest.importorskip("diffusers")
    from tests.helpers.reference_ar import patched_constants

    from diffusers import ModularPipeline

    seed = 4
    ref_pipe = ModularPipeline.from_pretrained(str(tiny.diffusers))
    ref_pipe.load_components(dtype=torch.float32)
    with patched_constants(tiny.diffusers):
        ref = ref_pipe(prompt=CAPTION, lyrics=LYRICS, audio_duration=duration, num_inference_steps=steps,
                       generator=torch.Generator().manual_seed(seed), output_type="pt", output="audios")
    ours = Pipeline(tiny.gguf, device="cpu", dtype="float32")
    req = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=duration, steps=steps, lm_seed=seed, seed=0)
    (track,) = ours.run(req, rng="reference")
    assert track.audio.shape == ref[0].shape
    assert float((track.audio - ref[0]).abs().max()) <= 1e-5
    windows = 1 if ref.shape[-1] <= 352768 else 2
    assert windows == (1 if duration < 8 else 2) or track.codes.ended_naturally


def test_generate_with_auto_skips_a_truncated_file(tiny, tmp_path):
    """A truncated DiT under a published name beside the good one: `generate` with every model on
    auto runs, on the good DiT, and says once which file it skipped and why."""
    from tests.helpers.gguf_util import models_with_truncated_dit

    models = tmp_path / "mm3"
    good, bad = models_with_truncated_dit(tiny, models)
    out = tmp_path / "song.wav"
    run = subprocess.run([sys.executable, "-m", "mm3", "generate", "--models", str(models), "--caption", CAPTION,
                          "--lyrics", LYRICS, "--duration", "0.5", "--steps", "2", "--out", str(out), "--quiet"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    skips = [line for line in run.stderr.splitlines() if bad.name in line]
    assert len(skips) == 1 and "skips" in skips[0] and "truncated: tensor" in skips[0] and good in skips[0], run.stderr
    assert json.loads(out.with_suffix(".json").read_text())["dit_model"] == good


def test_demo_writes_the_tiny_model_once_and_says_where_the_song_is(tmp_path, capsys):
    """`python -m mm3 demo`: the tiny model is written where its five components are not all
    present (found by architecture, whatever the files are called), then a song is generated and
    its path printed; before and after, the demo says that the song is loud noise from random
    weights."""
    from mm3.commands.demo import has_model

    folder = tmp_path / "demo"
    args = ["demo", "--dir", str(folder), "--duration", "1", "--steps", "2", "--quiet"]
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    assert "wrote the tiny random-weight model" in captured.err
    assert f"the song: {folder / 'song.mp3'}" in captured.out
    assert "its song is loud noise (full scale), not music: turn the volume down" in captured.err
    assert "it is noise from random weights" in captured.out
    assert has_model(folder) and (folder / "song.mp3").read_bytes()[:1] in (b"I", b"\xff")
    assert json.loads((folder / "song.json").read_text())["audio_codes"]
    for i, p in enumerate(sorted(folder.glob("*.gguf"))):  # other names: still the model, not rebuilt
        p.rename(folder / f"renamed_{i}.gguf")
    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.gguf")}
    assert cli_main(args) == 0
    assert "wrote the tiny" not in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.gguf")} == before


def test_numerics_follow_the_rng_mode_not_the_generator(tiny):
    """The numerics are chosen from the random-stream mode (or given); a generator passed for the
    DiT noise does not switch a render to the reference's numerics."""
    from dataclasses import replace

    from mm3.song.numerics import Numerics
    from mm3.plan.sampling import make_generator

    pipe = Pipeline(str(tiny.gguf))
    assert pipe.numerics("reference") == Numerics("reference", pipe.dtype)
    assert pipe.numerics("independent") == Numerics("fast", pipe.dit_dtype)
    req = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=1.0, steps=2, seed=4, lm_seed=1).validate()
    (song,), _ = pipe.plan(req)
    fast = pipe.synthesize(req, song, generator=make_generator(4)).waveform
    again = pipe.synthesize(req, song, generator=make_generator(4), numerics=pipe.numerics("independent")).waveform
    assert torch.equal(fast, again)
    ref = pipe.synthesize(req, song, generator=make_generator(4), numerics=pipe.numerics("reference")).waveform
    assert torch.equal(ref, pipe.synthesize(replace(req, rng="reference"), song, generator=make_generator(4)).waveform)


def test_numerics_choice():
    from mm3.song.numerics import FAST, Numerics

    ref = Numerics("reference", torch.float32)
    assert (ref.cfg_batch, ref.exact, ref.models, ref.shift(2)) == (False, True, "reference", 1.0)
    assert (FAST.cfg_batch, FAST.exact, FAST.models, FAST.shift(2)) == (True, False, "fast", 29.0)
    assert ref.shift(2, 3.0) == FAST.shift(2, 3.0) == 3.0
    with pytest.raises(ValueError, match="numerics must be one of fast, reference, got 'exact'"):
        Numerics("exact")
    with pytest.raises(ValueError, match="rng must be one of independent, reference, got 'x'"):
        Numerics.for_rng("x")
