"""Audio handed on window by window as the DiT finishes each one: the pieces, played in order, are
the song bit for bit, and the result is the staged run's."""

from __future__ import annotations

import torch

from mm3.song import stages
from mm3.plan.codes import AudioCodes
from mm3.backends.cpu.matmul import _flag
from mm3.song.pipeline import Pipeline
from mm3.song.request import MM3Request
from tests.helpers.comfyui import CAPTION, LYRICS


def _song(pipe: Pipeline, frames: int) -> stages.Song:
    request = MM3Request(caption="c", lyrics="l")
    dp = pipe.model_file("depth", request).hparams
    hiddens = torch.randn(frames, int(dp["num_codebooks"]), int(dp["hidden_size"]),
                          generator=torch.Generator().manual_seed(3))
    codes = AudioCodes(torch.zeros(frames + 1, int(dp["num_codebooks"]), dtype=torch.long), hiddens, None, 1)
    return stages.Song(codes, stages.PromptText(None, "c", "l", pipe.model_file("lm", request)),
                       pipe.model_file("depth", request))


def test_streamed_windows_are_the_song(tiny):
    """Three windows (frames 0-200, 100-300, 200-310), two variations: each piece arrives in order
    with the window count, and their join equals the staged synthesis exactly."""
    pipe = Pipeline(str(tiny.gguf), device="cpu")
    request = MM3Request(caption="c", lyrics="l", seed=8, steps=2, synth_batch_size=2)
    song = _song(pipe, 310)
    heard = []
    streamed = pipe.synthesize(request, song, on_audio=lambda k, n, piece, rate: heard.append((k, n, piece, rate)))
    staged = pipe.synthesize(request, song)
    assert [(k, n, rate) for k, n, _, rate in heard] == [(0, 3, 44100), (1, 3, 44100), (2, 3, 44100)]
    assert all(piece.shape[:2] == (2, 2) and piece.dtype == torch.float32 for _, _, piece, _ in heard)
    assert torch.equal(torch.cat([p for _, _, p, _ in heard], dim=-1), staged.waveform)
    assert torch.equal(streamed.waveform, staged.waveform)
    assert [r.to_dict() for r in streamed.requests] == [r.to_dict() for r in staged.requests]


def test_run_streams_every_song(tiny):
    """`Pipeline.run(on_audio=...)`: the pieces of each song join to its tracks, and the tracks and
    replay requests are those of a run without streaming."""
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=0.8, lm_seed=2, seed=4, steps=2, lm_batch_size=2)
    heard: dict[int, list] = {}
    tracks = Pipeline(str(tiny.gguf), device="cpu").run(
        request, on_audio=lambda song, k, n, piece, rate: heard.setdefault(song, []).append(piece))
    plain = Pipeline(str(tiny.gguf), device="cpu").run(request)
    assert sorted(heard) == [0, 1]
    for t, p in zip(tracks, plain):
        assert torch.equal(t.audio, p.audio) and t.request == p.request
        assert torch.equal(torch.cat(heard[t.song], dim=-1)[t.variation], t.audio)


def test_window_callback_runs_outside_the_samplers_float32_setting(tiny):
    """The sampler's oneDNN float32 setting (forced on here) holds inside each window only: a
    vocoder window decoded from the callback computes as it would alone."""
    from mm3.synth.flow import sample_latents
    from mm3.files.opener import open_component
    from mm3.models import build_model

    flags = _flag()
    dit = build_model(open_component(str(tiny.file("mm3-dit")), expect="dit"))
    before = None if flags is None else flags.fp32_precision
    seen = []
    conds = [torch.randn(1, 12, dit.condition_dim, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    sample_latents(dit, conds, steps=2, seed=1, fast_matmul=True, device="cpu",
                   on_window=lambda k, x: seen.append(None if flags is None else flags.fp32_precision))
    assert seen == [before, before]


def test_cli_stream_dir_writes_each_window_as_it_comes(tiny, tmp_path, capsys):
    """`generate --stream-dir`: one float WAV per window and track, which joined are the track's
    samples (the final wav32 file holds the same float samples), and a line saying when the first
    came."""
    from mm3.commands.main import main
    from mm3.synth.codec import read_audio

    out, live = tmp_path / "song.wav", tmp_path / "live"
    args = ["generate", "--models", str(tiny.gguf), "--caption", CAPTION, "--lyrics", LYRICS, "--duration", "0.8",
            "--lm-seed", "1", "--seed", "2", "--steps", "2", "--variations", "2", "--format", "wav32", "--out",
            str(out), "--device", "cpu", "--stream-dir", str(live)]
    assert main(args) == 0
    assert "first audio in" in capsys.readouterr().err
    names = sorted(p.name for p in live.iterdir())
    assert names == ["song_01_001.wav", "song_02_001.wav"]
    for n in (1, 2):
        piece, rate = read_audio(live / f"song_{n:02d}_001.wav")
        whole, _ = read_audio(tmp_path / f"song_{n:02d}.wav")
        assert rate == 44100 and piece.shape[0] == 2 and torch.equal(piece, whole)


def test_cli_stream_dir_that_cannot_be_made_is_refused_before_work(tiny, tmp_path, capsys):
    from mm3.commands.main import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    args = ["generate", "--models", str(tiny.gguf), "--caption", CAPTION, "--lyrics", LYRICS, "--duration", "0.4",
            "--out", str(tmp_path / "s.wav"), "--device", "cpu", "--stream-dir", str(blocker / "live")]
    assert main(args) == 2
    assert "--stream-dir" in capsys.readouterr().err
    assert not (tmp_path / "s.wav").exists()
