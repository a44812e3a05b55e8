"""The ComfyUI node logic without ComfyUI: the stages chained as the nodes chain them give the same
audio and the same replay JSON as `mm3.song.pipeline.Pipeline.run` (itself checked against diffusers),
the loaders refuse what the command line refuses, and Save Song's files read back right."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import pytest
import torch

from mm3.plan.ar import PlanSettings
from mm3.plan.codes import AudioCodes
from mm3.formats.gguf.errors import ComponentError
from mm3.song.pipeline import Pipeline
from mm3.song.request import MM3Request
from mm3.song.settings import SynthSettings
from tests.helpers.comfyui import CAPTION, LYRICS, import_pack

ROOT = Path(__file__).resolve().parents[2]

@pytest.fixture(scope="module")
def pack():
    """The repository imported as a package, as ComfyUI imports it."""
    return import_pack


def _handles(pack, tiny):
    h = pack("nodes.handles")
    return {kind: h.ComponentHandle(kind, tiny.file(arch).name, str(tiny.file(arch)))
            for kind, arch in (("lm", "mm3-lm"), ("depth", "mm3-depth"), ("cond", "mm3-cond"), ("dit", "mm3-dit"),
                               ("vae", "mm3-vae"))}


def test_node_chain_matches_pipeline(pack, tiny):
    """Prompt -> plan -> condition -> sample -> decode -> stitch, as the nodes run it, equals the
    pipeline's tracks bit for bit (2 songs x 2 variations) with the same replay JSON, and each
    replay request renders its track."""
    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    from mm3.song import stages

    m = {k: h.model() for k, h in hs.items()}
    prompt = logic.assemble_prompt(hs["lm"], CAPTION, LYRICS)
    songs, _ = logic.plan_songs(m["lm"], m["depth"], hs["lm"], hs["depth"], prompt,
                                PlanSettings(duration=0.8, lm_seed=11, songs=2), device="cpu", dtype=torch.float32)
    ours = []
    for song in songs:
        cond = stages.encode(m["cond"], hs["cond"].file(), song, device="cpu", dtype=torch.float32)
        lat = stages.sample(m["dit"], hs["dit"].file(), cond, SynthSettings(seed=5, steps=3, dit_cfg=1.7, variations=2),
                            device="cpu", dtype=torch.float32)
        audio = logic.stitch_audio(stages.decode(m["vae"], hs["vae"].file(), lat, device="cpu"))
        assert audio["waveform"].dtype == torch.float32 and audio["waveform"].shape[:2] == (2, 2)
        ours += [(audio["waveform"][j], audio[logic.AUDIO_REQUESTS_KEY][j]) for j in range(2)]
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=0.8, lm_seed=11, seed=5, steps=3,
                         lm_batch_size=2, synth_batch_size=2)
    tracks = Pipeline(str(tiny.gguf)).run(request)
    assert len(tracks) == len(ours) == 4
    for track, (wave_, req) in zip(tracks, ours):
        assert torch.equal(track.audio, wave_)
        assert req == track.request.to_dict()
    # A replay request renders its own track again.
    again = Pipeline(str(tiny.gguf)).run(MM3Request.from_dict(ours[3][1]))
    assert torch.equal(again[0].audio, ours[3][0])


def test_split_synthesis_matches_pipeline_over_windows(pack, tiny):
    """Songs longer than one DiT window (200 frames): conditions computed per window up front, the
    sampler fed from them, windows decoded one by one and then stitched, equal the pipeline's
    synthesis (overlap carry, crops and all). Frame hiddens are random: no AR needed."""
    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    from mm3.song import stages

    m = {k: h.model() for k, h in hs.items() if k in ("cond", "dit", "vae")}
    dp = hs["depth"].hparams
    frames = 210  # windows [0, 200) and [100, 210)
    hiddens = torch.randn(frames, int(dp["num_codebooks"]), int(dp["hidden_size"]),
                          generator=torch.Generator().manual_seed(3))
    codes = AudioCodes(torch.zeros(frames + 1, int(dp["num_codebooks"]), dtype=torch.long), hiddens, None, 1)
    request = MM3Request(caption="c", lyrics="l", seed=8, steps=2, synth_batch_size=1)
    song = stages.Song(codes, stages.PromptText(None, "c", "l", hs["lm"].file()), hs["depth"].file())
    cond = stages.encode(m["cond"], hs["cond"].file(), song, device="cpu", dtype=torch.float32)
    assert len(cond.conds) == 2
    lat = stages.sample(m["dit"], hs["dit"].file(), cond, SynthSettings(seed=8, steps=2, dit_cfg=1.7), device="cpu",
                        dtype=torch.float32)
    ours = logic.stitch_audio(stages.decode(m["vae"], hs["vae"].file(), lat, device="cpu"))["waveform"]
    want = Pipeline(str(tiny.gguf)).synthesize(request, song).waveform
    assert torch.equal(ours, want)


def test_vocoder_decode_sends_each_window_as_a_wav_and_a_message(pack, tiny, tmp_path):
    """Vocoder Decode with a live preview (nodes/live.py): the same windows as without one; per
    window and variation one float WAV in the folder and one message naming it, its place in the
    song in samples; the WAVs joined are the stitched song. A folder that cannot be written
    leaves the render alone (no preview, a warning)."""
    logic, live, hs = pack("nodes.logic"), pack("nodes.live"), _handles(pack, tiny)
    from mm3.song import stages
    from mm3.synth.codec import read_audio

    m = {k: h.model() for k, h in hs.items() if k in ("cond", "dit", "vae")}
    dp = hs["depth"].hparams
    hiddens = torch.randn(230, int(dp["num_codebooks"]), int(dp["hidden_size"]),
                          generator=torch.Generator().manual_seed(4))
    codes = AudioCodes(torch.zeros(231, int(dp["num_codebooks"]), dtype=torch.long), hiddens, None, 1)
    song = stages.Song(codes, stages.PromptText(None, "c", "l", hs["lm"].file()), hs["depth"].file())
    cond = stages.encode(m["cond"], hs["cond"].file(), song, device="cpu", dtype=torch.float32)
    lat = stages.sample(m["dit"], hs["dit"].file(), cond, SynthSettings(seed=2, steps=2, dit_cfg=1.7, variations=2),
                        device="cpu", dtype=torch.float32)
    sent = []
    preview = live.WindowPreview(lambda event, data: sent.append((event, data)), tmp_path / "live", "6", "p-1",
                                 duration=9.2)
    streamed = logic.decode_streamed(m["vae"], hs["vae"].file(), lat, preview, device="cpu")
    plain = stages.decode(m["vae"], hs["vae"].file(), lat, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(streamed.waves, plain.waves))
    song_audio = logic.stitch_audio(plain)["waveform"]
    assert [(e, d["window"], d["variation"], d["windows"], d["last"]) for e, d in sent] == [
        ("mm3.window", 0, 0, 2, False), ("mm3.window", 0, 1, 2, False),
        ("mm3.window", 1, 0, 2, True), ("mm3.window", 1, 1, 2, True)]
    for j in range(2):
        mine = [d for _, d in sent if d["variation"] == j]
        assert [d["start"] for d in mine] == [0, mine[0]["samples"]] and mine[0]["duration"] == 9.2
        assert all(d["file"]["type"] == "temp" and d["file"]["subfolder"] == live.SUBFOLDER for d in mine)
        pieces = [read_audio(tmp_path / "live" / d["file"]["filename"])[0] for d in mine]
        assert torch.equal(torch.cat(pieces, dim=-1), song_audio[j])
    blocked = tmp_path / "file"
    blocked.write_text("x")
    quiet = live.WindowPreview(lambda *a: sent.append(a), blocked / "live", "6", "p-2")
    again = logic.decode_streamed(m["vae"], hs["vae"].file(), lat, quiet, device="cpu")
    assert quiet.failed and len(sent) == 4 and all(torch.equal(a, b) for a, b in zip(again.waves, plain.waves))


def test_load_codes_rejects_bad_files(pack, tiny):
    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    with pytest.raises(ValueError, match="holds no audio_codes"):
        logic.read_codes_request(json.dumps({"caption": "a", "lyrics": "b"}), "x.json", hs["lm"], hs["depth"])
    with pytest.raises(ValueError, match="x.json: .*out of range"):
        logic.read_codes_request(json.dumps({"caption": "a", "lyrics": "b", "audio_codes": ",".join(["99999"] * 16)}),
                                 "x.json", hs["lm"], hs["depth"])
    h = pack("nodes.handles")
    with pytest.raises(Exception, match="is mm3-dit, expected mm3-lm"):
        h.ComponentHandle("lm", "dit.gguf", str(tiny.file("mm3-dit")))


def test_loader_refuses_what_the_command_line_refuses(pack, tiny, tmp_path):
    """A DiT with one tensor of a GGML type the engine cannot dequantize (Q8_1) is refused when the
    loader node runs, naming the file and the tensor, as the command line refuses it before
    loading anything (it used to fail in the first DiT forward, after the whole AR stage)."""
    import gguf
    import numpy as np
    from tests.helpers.gguf_util import rewrite

    h = pack("nodes.handles")
    bad = rewrite(tiny.file("mm3-dit"), tmp_path / "bad-dit.gguf", drop={"proj_in.weight"},
                  tensors={"proj_in.weight": (gguf.GGMLQuantizationType.Q8_1, np.zeros((64, 80), np.uint8))})
    with pytest.raises(ComponentError,
                       match=r"bad-dit.gguf: tensor proj_in.weight is Q8_1, which this engine cannot dequantize"):
        h.handle_for("dit", "bad-dit.gguf", str(bad))


def test_loaded_codes_check_the_files_that_made_them(pack, tiny, tmp_path):
    """A song read from a replay file records each file's fingerprint; a later node whose file
    differs warns (logged, on the node), or refuses with model_check "refuse"."""
    import shutil

    logic, hs, handles = pack("nodes.logic"), _handles(pack, tiny), pack("nodes.handles")
    from mm3.song import stages

    m = {k: hs[k].model() for k in ("lm", "depth", "cond")}
    prompt = logic.assemble_prompt(hs["lm"], CAPTION, LYRICS)
    (song,), _ = logic.plan_songs(m["lm"], m["depth"], hs["lm"], hs["depth"], prompt,
                                  PlanSettings(duration=0.4, lm_seed=3), device="cpu", dtype=torch.float32)
    req = stages.request_of(song)
    assert req.model_fingerprints == {"lm_model": hs["lm"].fingerprint, "depth_model": hs["depth"].fingerprint}
    req = stages.request_of(stages.encode(m["cond"], hs["cond"].file(), song, device="cpu", dtype=torch.float32))
    other = tmp_path / "other-cond.gguf"
    shutil.copy(tiny.file("mm3-cond"), other)
    with open(other, "r+b") as f:  # same tensors and header, other first weight bytes
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x3f")
    other_h = handles.ComponentHandle("cond", other.name, str(other))
    assert logic.codes_file_problems(req, hs["lm"], hs["depth"]) == []
    _, prompt2, codes = logic.read_codes_request(req.to_json(), "f.json", hs["lm"], hs["depth"])
    for check, same in (("warn", hs["cond"]), ("warn", other_h), ("refuse", other_h)):
        loaded = logic.replay_codes(m["lm"], m["depth"], hs["depth"], req, prompt2, codes,
                                    device="cpu", dtype=torch.float32, model_check=check)
        if check == "refuse":
            with pytest.raises(ValueError, match="cond_model: other-cond.gguf .* is not the file that made this song"):
                stages.encode(other_h.model(), other_h.file(), loaded, device="cpu", dtype=torch.float32)
            continue
        out = stages.encode(same.model(), same.file(), loaded, device="cpu", dtype=torch.float32)
        assert bool(out.warnings) == (same is other_h)
        made = stages.request_of(out)
        assert made.cond_model == same.name and made.model_fingerprints["cond_model"] == same.fingerprint
    # A file rendered with the reference RNG cannot be reproduced by the nodes: said, not hidden.
    from dataclasses import replace

    assert "reference RNG" in logic.codes_file_problems(replace(req, rng="reference"), hs["lm"], hs["depth"])[0]


def test_write_track_reads_back(pack, tmp_path):
    logic = pack("nodes.logic")
    wave_ = torch.linspace(-0.5, 0.5, 2 * 4410).reshape(2, -1)
    req = MM3Request(caption="c", lyrics="l", audio_codes="1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8")
    paths = logic.write_track(tmp_path / "a.wav", wave_, 44100, "wav16", mp3_bitrate=128, peak_clip=10,
                              request=req.to_dict())
    with wave.open(str(paths[0])) as w:
        assert (w.getnchannels(), w.getframerate(), w.getsampwidth(), w.getnframes()) == (2, 44100, 2, 4410)
    assert json.loads(paths[1].read_text())["output_format"] == "wav16"
    mono = logic.write_track(tmp_path / "m.wav", wave_[:1], 44100, "wav24", mp3_bitrate=128, peak_clip=10, request=None)
    assert len(mono) == 1 and wave.open(str(mono[0])).getnchannels() == 2


def test_prompt_over_the_budget_is_refused_with_the_count(pack, tiny):
    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    with pytest.raises(ValueError, match=r"Prompt exceeds the 5000 token budget: the assembled prompt has \d+ tokens "
                                         r"\(caption \d+ chars, lyrics \d+ chars\): shorten the caption or lyrics$"):
        logic.assemble_prompt(hs["lm"], CAPTION, "[verse]\n" + "la " * 3000)


def test_a_plan_continues_a_song_from_the_graph(pack, tiny):
    """AR Plan with prior codes: the new song starts with the prior's codes, its replay request
    holds them all (no continue_codes left), and it is planned past the prior's length; a plan no
    longer than the prior is refused before it runs, while a min_duration past the duration is not."""
    from mm3.song import stages
    from mm3.song.settings import Shaping

    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    m = {k: hs[k].model() for k in ("lm", "depth")}
    prompt = logic.assemble_prompt(hs["lm"], CAPTION, LYRICS)
    (first,), _ = logic.plan_songs(m["lm"], m["depth"], hs["lm"], hs["depth"], prompt,
                                   PlanSettings(duration=0.4, lm_seed=3), device="cpu", dtype=torch.float32)
    (longer,), _ = logic.plan_songs(m["lm"], m["depth"], hs["lm"], hs["depth"], prompt,
                                    PlanSettings(duration=0.8, lm_seed=4), device="cpu", dtype=torch.float32,
                                    prior=first)
    n = first.codes.codes.shape[0]
    assert torch.equal(longer.codes.codes[:n], first.codes.codes) and longer.frames > first.frames
    made = stages.request_of(longer)
    assert made.continue_codes == "" and made.audio_codes == longer.codes.to_request_codes()
    with pytest.raises(ValueError, match=f"continue_codes already hold {first.frames} frames"):
        logic.plan_songs(m["lm"], m["depth"], hs["lm"], hs["depth"], prompt,
                         PlanSettings(duration=first.frames / 25, lm_seed=4), device="cpu", dtype=torch.float32,
                         prior=first)
    logic.check_plan(PlanSettings(duration=0.8, shaping=Shaping(min_frames=40)), prior=first)


def test_lyric_timestamps_of_a_planned_song(pack, tiny, tmp_path):
    """MM3 Lyric Timestamps' engine call: the LRC of a planned song equals the one the command
    line's run makes from the same codes; Save Song writes it beside the song; a bad head list is
    said in words at queue time."""
    from mm3.plan.lyrics_align import LyricHeads, song_lrc

    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    m = {k: hs[k].model() for k in ("lm", "depth")}
    prompt = logic.assemble_prompt(hs["lm"], CAPTION, LYRICS)
    (song,), _ = logic.plan_songs(m["lm"], m["depth"], hs["lm"], hs["depth"], prompt,
                                  PlanSettings(duration=2.0, lm_seed=9), device="cpu", dtype=torch.float32)
    heads = LyricHeads.parse("1:*")
    text = logic.lyric_timestamps(m["lm"], m["depth"], hs["depth"], song, heads, 0.25, device="cpu",
                                  dtype=torch.float32)
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=2.0, lm_seed=9, steps=2)
    (track,) = Pipeline(str(tiny.gguf)).run(request, lyric_heads=heads)
    assert torch.equal(track.codes.codes, song.codes.codes)
    assert text and text == song_lrc(track.codes, lead=0.25)
    paths = logic.write_track(tmp_path / "s.wav", track.audio, 44100, "wav16", mp3_bitrate=128, peak_clip=10,
                              request=track.request.to_dict(), lrc=text)
    assert [p.name for p in paths] == ["s.wav", "s.json", "s.lrc"] and paths[2].read_text() == text
    assert logic.heads_problem("12:3,19:*") is None and logic.heads_problem(None) is None
    assert "lyric head '12' is not LAYER:HEAD" in logic.heads_problem("12")


def test_a_linked_seed_past_the_range_wraps_into_it(pack):
    """A seed node with a wider range than ours (ComfyUI checks a widget's range, not a link's):
    in range it is used as it is, past it wrapped (still distinct per worker), negative refused."""
    logic = pack("nodes.logic")
    from mm3.constants import MAX_SONGS, SEED_MAX

    top = SEED_MAX - (MAX_SONGS - 1)  # AR Plan's lm_seed range
    assert logic.linked_seed(0, top, "lm_seed") == 0 and logic.linked_seed(top, top, "lm_seed") == top
    distributed = 1125899906842623  # a Distributed Seed near the top of its 2^50 range
    seeds = [logic.linked_seed(distributed + i, top, "lm_seed") for i in range(3)]
    assert all(0 <= s <= top for s in seeds) and len(set(seeds)) == 3
    assert seeds[0] == distributed % (top + 1)
    with pytest.raises(Exception, match=r"lm_seed must be 0\.\.\d+, got -3"):
        logic.linked_seed(-3, top, "lm_seed")


def test_empty_lyrics_make_an_instrumental_in_the_nodes(pack, tiny):
    """MM3 Prompt / MM3 Generate with empty lyrics: the prompt of "[instrumental]", and the songs'
    replay requests record it (the plan's checks accept it)."""
    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    tagged = logic.assemble_prompt(hs["lm"], CAPTION, "[instrumental]")
    prompt = logic.assemble_prompt(hs["lm"], CAPTION, "")
    assert torch.equal(prompt.prompt.ids, tagged.prompt.ids) and prompt.lyrics == "[instrumental]"
    from mm3.song import stages

    (song,), _ = logic.plan_songs(hs["lm"].model(), hs["depth"].model(), hs["lm"], hs["depth"], prompt,
                                  PlanSettings(duration=0.4, lm_seed=3), device="cpu", dtype=torch.float32)
    assert stages.replay_requests(song)[0].lyrics == "[instrumental]"


def test_node_checks_name_one_input_and_take_any_value(pack, tiny):
    """What the nodes check without ComfyUI's help: the lyrics' size bound at queue time (fast on
    megabytes), the caption and the plan's two-input rules when the node runs (before anything
    loads), and values ComfyUI could not convert (text for a number) passed on for ComfyUI to
    report rather than raising."""
    import time

    logic, validation, hs = pack("nodes.logic"), pack("nodes.validation"), _handles(pack, tiny)
    start = time.perf_counter()
    problem = validation.prompt_texts(lyrics="[verse]\n" + "la la la " * 1_200_000)
    assert time.perf_counter() - start < 2
    assert problem.startswith("MM3 Prompt: lyrics is 10,800,008 characters long; a prompt of at most 5000 tokens")
    with pytest.raises(ValueError, match="MM3 Prompt: caption contains the control character U\\+001B at position 4"):
        logic.assemble_prompt(hs["lm"], "dark\x1b[31m synth", LYRICS)
    from mm3.song.settings import Shaping

    late = PlanSettings(duration=1.0, lm_seed=1, shaping=Shaping(min_frames=50))
    with pytest.raises(ValueError, match="min_duration must be between 0 and the duration 1 s, got 2"):
        logic.check_plan(late)
    assert validation.repaint_range("abc", 1.0) is None and validation.repaint_range(0.8, 0.4)
    from types import SimpleNamespace

    start_input = SimpleNamespace(id="start", min=0.0, max=9.0)
    node = SimpleNamespace(define_schema=lambda: SimpleNamespace(inputs=[start_input]))
    assert validation.out_of_range(node, start="abc") is None and "start must be between 0 and 9" in \
        validation.out_of_range(node, start=-1.0)
