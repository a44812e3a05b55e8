"""Planning and synthesis overlapped (`mm3.song.overlap`): a window is rendered as soon as its frames are
planned, and the audio, codes and replay requests are the staged run's bit for bit; runs that
cannot overlap (takes, the reference RNG, models that do not fit together) are rendered by stages."""

from __future__ import annotations

import shutil

import pytest
import torch

from mm3.song import overlap
from mm3.plan.replay import REPLAY_CHUNK, Replayer, replay
from mm3.synth.flow import WINDOW_FRAMES, WINDOW_HOP, settled_windows, window_bounds
from mm3.song.pipeline import Pipeline
from mm3.progress import Progress
from mm3.song.request import MM3Request
from tests.helpers.comfyui import CAPTION, LYRICS

pytestmark = pytest.mark.usefixtures("one_thread")  # several hundred frames: one thread is the quickest here


def test_settled_windows_never_change_and_come_as_soon_as_they_can():
    """With `frames` planned (every count up to 1000): window k is settled exactly when no song
    length from `frames` on (the song may end now) could change its bounds or make it the song's
    last (the stitch crops each end as it will); so the settled windows of any longer song are
    its first ones, never its last. A complete song has every window settled."""
    horizon = WINDOW_FRAMES + WINDOW_HOP + 2  # beyond it no window's status can change
    for frames in range(1, 1001):
        n = settled_windows(frames, False)
        futures = [window_bounds(f) for f in range(frames, frames + horizon)]
        fixed = 0
        while all(fixed < len(b) - 1 and b[fixed] == futures[0][fixed] for b in futures):
            fixed += 1
        assert n == fixed, frames
        for final in (frames, frames + 1, frames + 99, frames + 100, frames + 101, frames + 450):
            ends = window_bounds(final)
            assert window_bounds(frames)[:n] == ends[:n] and n < len(ends)
        assert settled_windows(frames, True) == len(window_bounds(frames))
    assert settled_windows(0, True) == settled_windows(0, False) == 0


def test_replay_fed_chunk_by_chunk_is_the_replay(tiny):
    """The replay of a song fed as its codes come, in uneven steps, into a buffer sized for a
    longer song, has the hiddens of the replay of the whole codes, bit for bit."""
    pipe = Pipeline(str(tiny.gguf), device="cpu")
    request = MM3Request(caption=CAPTION, lyrics=LYRICS)
    lm, depth = pipe.store.model("lm"), pipe.store.model("depth")
    prompt = pipe.prompt(request)
    g = torch.Generator().manual_seed(0)
    n = 2 * REPLAY_CHUNK + 37
    codes = torch.cat([torch.randint(0, prompt.codes.num_semantic, (n + 1, 1), generator=g),
                       torch.randint(0, depth.audio_vocab, (n + 1, 7), generator=g)], dim=1)
    with torch.no_grad():
        whole = replay(lm, depth, prompt, codes).frame_hiddens
        fed = Replayer(lm, depth, prompt, n + 150)
        seen = [fed.feed(codes[:m + 1]) for m in range(1, n + 1, 13)]
        fed.feed(codes, final=True)
    assert seen[-1] == 2 * REPLAY_CHUNK and all(s % REPLAY_CHUNK == 0 for s in seen)
    assert torch.equal(fed.hiddens, whole)


def _ending(pipe: Pipeline) -> Pipeline:
    """`pipe` (models kept loaded) with the tiny LM's END head row set to code 10's, so a song
    ends by itself about as often as that code is drawn (the tiny LM's own END row is zero)."""
    lm = pipe.store.model("lm")
    ids = pipe.prompt(MM3Request(caption=CAPTION, lyrics=LYRICS)).codes
    w = lm.lm_head.get("weight", torch.float32).clone()
    w[ids.end_id - lm.head_ids[0]] = w[ids.code_offset + 10 - lm.head_ids[0]]
    lm.lm_head.set_float("weight", w)
    return pipe


def _streamed(pipe: Pipeline, request: MM3Request):
    """The tracks of a streamed run, each piece heard (song, k, windows, samples) and the order of
    the AR's frame reports and the pieces."""
    events, pieces = [], []

    def on_progress(stage, done, total, info):
        if stage == "ar":
            events.append("ar")

    def heard(song, k, windows, samples, rate):
        events.append("audio")
        pieces.append((song, k, windows, samples))

    tracks = pipe.run(request, Progress(on_progress=on_progress), on_audio=heard)
    return tracks, pieces, events


def _same(streamed, staged, pieces, variations):
    assert len(streamed) == len(staged)
    for t, s in zip(streamed, staged):
        assert torch.equal(t.audio, s.audio) and t.request == s.request
        assert torch.equal(t.codes.codes, s.codes.codes) and torch.equal(t.codes.frame_hiddens, s.codes.frame_hiddens)
        mine = [p for song, _, _, p in pieces if song == t.song]
        assert torch.equal(torch.cat(mine, dim=-1)[t.variation], t.audio)
        assert t.audio.shape[0] == 2 and len(streamed) % variations == 0


def test_overlapped_songs_are_the_staged_songs(tiny):
    """Two songs, two variations, one song ending by itself: the windows come while the AR is
    still planning (the first right after its 201st frame), in order per song, the window count
    given once the song's length is known; the tracks, codes, hiddens and replay requests are
    those of the run without streaming, and each song's pieces join to its tracks."""
    pipe = _ending(Pipeline(str(tiny.gguf), device="cpu", keep_loaded=True))
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=13.0, min_duration=9.0, lm_seed=3, seed=5,
                         steps=2, lm_batch_size=2, synth_batch_size=2)
    tracks, pieces, events = _streamed(pipe, request)
    staged = pipe.run(request)
    _same(tracks, staged, pieces, 2)
    frames = [tracks[0].codes.frames, tracks[2].codes.frames]
    assert any(t.codes.ended_naturally for t in tracks) and min(frames) < 325 and max(frames) > 300, frames
    assert events.index("audio") < len(events) - 1 - events[::-1].index("ar")  # heard before the AR is done
    assert events[:events.index("audio")].count("ar") == 202  # frame 0, then 201 emitted
    for song in (0, 1):
        mine = [(k, n) for s, k, n, _ in pieces if s == song]
        count = len(window_bounds(frames[song]))
        assert [k for k, _ in mine] == list(range(count)) and mine[-1][1] == count
        assert all(n is None for _, n in mine[:-1])


def test_overlapped_continuation_is_the_staged_one(tiny):
    """A song continued from the codes of another: its known frames are heard once the AR adds
    its first frame, and the result is the staged continuation's."""
    pipe = Pipeline(str(tiny.gguf), device="cpu", keep_loaded=True)
    first = pipe.run(MM3Request(caption=CAPTION, lyrics=LYRICS, duration=9.0, lm_seed=2, seed=1, steps=2))[0]
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=13.0, lm_seed=7, seed=9, steps=2,
                         continue_codes=first.request.audio_codes)
    tracks, pieces, events = _streamed(pipe, request)
    _same(tracks, pipe.run(request), pieces, 1)
    assert events.index("audio") == 1  # after the first frame of its own
    assert [k for _, k, _, _ in pieces] == [0, 1, 2]


@pytest.mark.parametrize("case", ["takes", "reference", "no room"])
def test_runs_that_cannot_overlap_are_streamed_by_stages(tiny, monkeypatch, case):
    """Takes with require_ending (the kept take is known at the end), the reference RNG (one
    generator draws the AR, then the DiT noise) and models that do not fit in memory together:
    every window is heard after the AR is done, and the tracks are those without streaming."""
    pipe = Pipeline(str(tiny.gguf), device="cpu", keep_loaded=True)
    fields = dict(caption=CAPTION, lyrics=LYRICS, duration=9.0, lm_seed=4, seed=2, steps=2)
    if case == "takes":
        pipe = _ending(pipe)
        fields.update(takes=2, require_ending=True, ending_rounds=4, duration=6.0)
    elif case == "reference":
        fields.update(rng="reference")
    else:
        monkeypatch.setattr(overlap, "free_bytes", lambda device: 0)
    request = MM3Request(**fields)
    assert not pipe.can_overlap(request.validate())
    tracks, pieces, events = _streamed(pipe, request)
    _same(tracks, pipe.run(request), pieces, 1)
    assert "ar" not in events[events.index("audio"):]


def test_overlap_with_quantized_weights_and_their_copies(tiny, tmp_path):
    """Q8_0 LM, depth decoder and DiT, whose float copies the stages keep within their budgets:
    the overlapped song is the staged one."""
    from mm3.tools.quantize import quantize_file

    for arch in ("mm3-lm", "mm3-depth", "mm3-dit"):
        src = tiny.file(arch)
        quantize_file(src, tmp_path / src.name.replace("F32", "Q8_0"), "Q8_0")
    for arch in ("mm3-cond", "mm3-vae"):
        shutil.copy(tiny.file(arch), tmp_path)
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=9.0, lm_seed=6, seed=3, steps=2)
    pipe = Pipeline(str(tmp_path), device="cpu")
    tracks, pieces, events = _streamed(pipe, request)
    assert events.index("audio") < len(events) - 1 - events[::-1].index("ar")
    _same(tracks, Pipeline(str(tmp_path), device="cpu").run(request), pieces, 1)


def test_overlapped_songs_keep_their_lyric_attention(tiny):
    """With lyric heads, a streamed run that overlaps the stages gives each song the lyric attention
    of the staged run (the LRC of `generate --lrc --stream-dir`), bit for bit."""
    from mm3.plan.lyrics_align import LyricHeads

    pipe = Pipeline(str(tiny.gguf), device="cpu", keep_loaded=True)
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=9.0, lm_seed=4, seed=2, steps=2)
    heads = LyricHeads.parse("0:*,1:1")
    assert pipe.can_overlap(request.validate())
    streamed = pipe.run(request, on_audio=lambda *piece: None, lyric_heads=heads)
    staged = pipe.run(request, lyric_heads=heads)
    assert streamed[0].codes.lyric_attention is not None
    assert streamed[0].codes.lyric_attention.shape[0] == streamed[0].codes.frames
    assert torch.equal(streamed[0].codes.lyric_attention, staged[0].codes.lyric_attention)
    assert torch.equal(streamed[0].audio, staged[0].audio)
