"""Lyric timestamps: the prompt's lyric lines, the read-only attention tap in the replay, the
monotonic alignment, LRC text and the head ranking, on the tiny model and on a tiny LM whose
attention is constructed so that each frame attends a known lyric line."""

import json
import math
import re

import numpy as np
import pytest
import torch

import mm3.plan.replay
from mm3.plan.ar import PlanSettings, plan, plan_and_replay
from mm3.plan.replay import replay
from mm3.errors import InputError
from mm3.plan.lyrics_align import (
    DEFAULT_HEADS, HeadStats, LyricHeads, LyricHeadsError, LyricTime, check_lead, head_scores, line_onsets,
    lrc_stamp, lrc_text, lyric_times, rank_heads, song_lrc)
from mm3.models.depth import RVQDepthDecoder
from mm3.models.lm import Qwen3LM
from mm3.files.opener import open_component
from mm3.plan.prompt import LyricLine, build_prompt
from mm3.tokenizer import MM3Tokenizer

CAPTION = "a bright synth pop song"
# Each line holds a character no other lyric line has (the prepended "[start]" has "a"): the
# constructed keys sit on those tokens.
LYRICS = "[verse]\nxyz\nqj\n[chorus]\nkw"
UNIQUE = ["a", "v", "x", "q", "h", "k"]  # one per line: [start], [verse], xyz, qj, [chorus], kw
BIG, GAIN = 100.0, 10.0


@pytest.fixture(scope="module")
def files(tiny):
    lm_c = open_component(tiny.file("mm3-lm"), expect="lm")
    d_c = open_component(tiny.file("mm3-depth"), expect="depth")
    yield lm_c, d_c, MM3Tokenizer.from_component(lm_c)
    lm_c.close()
    d_c.close()


def models(files, numerics="reference"):
    lm_c, d_c, _ = files
    return Qwen3LM.load(lm_c, numerics=numerics), RVQDepthDecoder.load(d_c, numerics=numerics)


def _edit(slot_owner, fn, name="weight"):
    w = slot_owner.stored(name).clone()
    fn(w)
    slot_owner.set_float(name, w)


def constructed(files, layer=0, head=0):
    """The tiny LM and depth decoder with `layer`/`head` rebuilt so that a frame whose semantic
    code is k attends the lyric token of line k's unique character and no other lyric token.

    Line k's key and code k's query point at angle 2 pi k / lines in the slowest RoPE pair of the
    head (dims 7 and 15, where the relative rotation over the song is under 1e-3 rad): the score
    is 4 GAIN^2 cos(angle difference), 400 on the line's token, at most 200 on another line's, 0
    on lyric tokens with no key."""
    lm, depth = models(files)
    tok = files[2]
    prompt = build_prompt(tok, CAPTION, LYRICS)
    lines = len(prompt.lines)
    assert [line.text for line in prompt.lines] == ["[start]", "[verse]", "xyz", "qj", "[chorus]", "kw"]
    a, b = prompt.lyric_span
    lyric_ids = sorted(set(prompt.ids[0, a:b].tolist()))
    targets = [tok.encode(ch)[0] for ch in UNIQUE]
    for k, line in enumerate(prompt.lines):  # each target token sits in its line and nowhere else in the lyrics
        assert prompt.ids[0, a:b].tolist().count(targets[k]) == 1
        assert targets[k] in prompt.ids[0, line.first:line.stop].tolist()
    angle = [2 * math.pi * k / lines for k in range(lines)]
    off = prompt.codes.code_offset

    def embeddings(w):
        w[lyric_ids, 0:2] = 0
        for k in range(lines):
            w[targets[k], 0:2] = BIG * torch.tensor([math.cos(angle[k]), math.sin(angle[k])])
            w[off + k, 2:4] = BIG * torch.tensor([math.cos(angle[k]), math.sin(angle[k])])

    _edit(lm.model.embed_tokens, embeddings)
    _edit(depth.audio_embeddings, lambda w: w[:, 2:4].zero_())
    block = lm.model.layers[layer]
    attn = block.self_attn
    hd, group = attn.head_dim, attn.heads // attn.kv_heads
    q0, k0 = head * hd, (head // group) * hd

    def rows(w, first, src):
        w[first:first + hd] = 0
        w[first + 7, src] = 1
        w[first + 15, src + 1] = 1

    _edit(block.input_layernorm, lambda w: w.fill_(1))
    _edit(attn.q_proj, lambda w: rows(w, q0, 2))
    _edit(attn.k_proj, lambda w: rows(w, k0, 0))
    for norm in (attn.q_norm, attn.k_norm):
        _edit(norm, lambda w: (w.zero_(), w.__setitem__(7, GAIN), w.__setitem__(15, GAIN)))
    return lm, depth, prompt


def codes_for(line_of_frame: list[int], seed: int = 0) -> torch.Tensor:
    """Codes [F + 1, 8]: row e's semantic code is the line frame e attends; acoustic codes random."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (len(line_of_frame) + 1, 8), generator=g)
    codes[:-1, 0] = torch.tensor(line_of_frame)
    return codes


def expected_onsets(line_of_frame, lines):
    return [line_of_frame.index(k) if k in line_of_frame else None for k in range(lines)]


# -- the constructed alignment ---------------------------------------------------------------------
@pytest.mark.parametrize("durations", [[10, 3, 12, 7, 1, 20], [4, 9, 30, 6]], ids=["every line", "ends early"])
def test_constructed_attention_gives_the_constructed_timestamps(files, durations, monkeypatch):
    monkeypatch.setattr(mm3.plan.replay, "REPLAY_CHUNK", 16)  # several passes over the frames
    lm, depth, prompt = constructed(files)
    line_of_frame = [k for k, n in enumerate(durations) for _ in range(n)]
    song = replay(lm, depth, prompt, codes_for(line_of_frame), lyric_heads=LyricHeads.parse("0:0"))
    att = song.lyric_attention
    assert att.shape == (len(line_of_frame), prompt.lyric_span[1] - prompt.lyric_span[0])
    a0 = prompt.lyric_span[0]
    targets = [prompt.ids[0].tolist().index(files[2].encode(ch)[0], a0) - a0 for ch in UNIQUE]
    picked = att[torch.arange(len(line_of_frame)), torch.tensor([targets[k] for k in line_of_frame])]
    assert picked.min() > 1 - 1e-6  # frame e attends its line's token and nothing else of the lyrics

    times = lyric_times(att, prompt, lead=0.0)
    want = expected_onsets(line_of_frame, len(prompt.lines))
    assert [t.seconds for t in times] == [None if f is None else f / 25 for f in want]
    assert [t.line for t in times] == list(prompt.lines)
    stamps = [f"[00:{f * 4 // 100:02d}.{f * 4 % 100:02d}]{line.text}\n" for f, line in zip(want, prompt.lines)
              if f is not None][1:]  # "[start]" is not written
    assert lrc_text(times) == "".join(stamps)
    assert song_lrc(song, lead=0.0) == "".join(stamps)


def test_the_lead_moves_every_stamp(files):
    lm, depth, prompt = constructed(files)
    line_of_frame = [k for k, n in enumerate([10, 3, 12, 7, 1, 20]) for _ in range(n)]
    song = replay(lm, depth, prompt, codes_for(line_of_frame), lyric_heads=LyricHeads.parse("0:0"))
    plain = lyric_times(song.lyric_attention, prompt, lead=0.0)
    led = lyric_times(song.lyric_attention, prompt)  # HOT-Step's 0.7 s
    assert [t.seconds for t in led] == [s + 0.7 for s in (t.seconds for t in plain)]
    assert lrc_text(led).splitlines()[0] == "[00:01.10][verse]"  # frame 10: 0.40 s + 0.70 s


def test_head_ranking_finds_the_constructed_head(files):
    lm, depth, prompt = constructed(files, layer=0, head=3)  # key head 1: the GQA mapping
    runs = []
    for seed, durations in enumerate([[10, 3, 12, 7, 1, 20], [2, 8, 8, 20, 5, 9]]):
        line_of_frame = [k for k, n in enumerate(durations) for _ in range(n)]
        stats = HeadStats(prompt, 2, 4, len(line_of_frame))
        replay(lm, depth, prompt, codes_for(line_of_frame, seed), tap=stats, hiddens=False)
        runs.append(head_scores(stats))
    ranked = rank_heads(runs)
    best = ranked[0]
    assert (best.layer, best.head) == (0, 3)
    assert best.monotonic > 0.95 and best.sharpness > 0.999 and best.travel > 0.5  # ties of a step: below 1
    assert best.score > 1.5 * ranked[1].score  # head 2 reads the same keys with the shared q_norm: half made
    assert len(ranked) == 8 and [(s.layer, s.head) for s in ranked].count((0, 3)) == 1


# -- the tap changes nothing -----------------------------------------------------------------------
@pytest.mark.parametrize("numerics", ["reference", "fast"])
def test_replay_hiddens_are_bit_identical_with_the_tap(files, numerics, monkeypatch):
    lm, depth = models(files, numerics)
    prompt = build_prompt(files[2], CAPTION, LYRICS)
    (song,) = plan(lm, depth, prompt, PlanSettings(duration=3.0, lm_seed=3), keep_hiddens=False)
    for chunk in (7, 512):
        monkeypatch.setattr(mm3.plan.replay, "REPLAY_CHUNK", chunk)
        plain = replay(lm, depth, prompt, song.codes)
        tapped = replay(lm, depth, prompt, song.codes, lyric_heads=LyricHeads.parse("0:*,1:1"))
        assert plain.lyric_attention is None and tapped.lyric_attention is not None
        assert torch.equal(plain.frame_hiddens, tapped.frame_hiddens)
    # attention only: no depth passes, no layer past the deepest tapped one; the same attention
    heads = LyricHeads.parse("0:1,0:3")
    monkeypatch.setattr(mm3.plan.replay, "REPLAY_CHUNK", 7)
    whole = replay(lm, depth, prompt, song.codes, lyric_heads=heads)
    alone = replay(lm, depth, prompt, song.codes, lyric_heads=heads, hiddens=False)
    assert alone.frame_hiddens is None and torch.equal(whole.lyric_attention, alone.lyric_attention)
    rows = whole.lyric_attention.sum(1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5)


def test_plan_and_replay_with_lyric_heads_keeps_the_same_songs(files):
    lm, depth = models(files, "fast")
    prompt = build_prompt(files[2], CAPTION, LYRICS)
    settings = PlanSettings(duration=2.0, lm_seed=5, songs=2)
    plain = plan_and_replay(lm, depth, prompt, settings)
    timed = plan_and_replay(lm, depth, prompt, settings, lyric_heads=LyricHeads.parse("1:0"))
    for a, b in zip(plain, timed):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.frame_hiddens, b.frame_hiddens)
        assert b.lyric_attention.shape[0] == b.frames
        stamps = re.findall(r"^\[(\d\d):(\d\d)\.(\d\d)\](.+)$", song_lrc(b), flags=re.MULTILINE)
        seconds = [int(m) * 60 + int(s) + int(c) / 100 for m, s, c, _ in stamps]
        texts = [line.text for line in prompt.lines[1:]]
        assert 0 < len(stamps) <= len(texts) and [t for *_, t in stamps] == texts[:len(stamps)]
        assert seconds == sorted(seconds) and seconds[-1] <= b.frames / 25 + 0.7


def test_the_tap_is_the_attention_renormalised_over_its_span():
    """What a tap sees equals the layer's full attention (softmax over every key it may see, the
    key head of each query head as grouped-query attention picks it) restricted to the span and
    renormalised; a query that sees none of the span gets 0."""
    from mm3.models.lm import AttentionTap, Qwen3Attention

    class Seen(AttentionTap):
        def __init__(self):
            self.heads, self.keys, self.seen = {3: (0, 2, 5)}, (4, 9), []

        def observe(self, layer, position, weights):
            self.seen.append((layer, position, weights))

    attn = Qwen3Attention.__new__(Qwen3Attention)
    torch.nn.Module.__init__(attn)
    attn.heads, attn.kv_heads, attn.head_dim = 6, 2, 8
    g = torch.Generator().manual_seed(1)
    for s, n, case in ((10, 10, "causal"), (5, 12, "mask"), (1, 12, "none")):
        tap = Seen()
        attn.taps = (tap,)
        q, keys = torch.randn(2, 6, s, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
        start = n - s
        visible = torch.arange(n)[None] <= torch.arange(start, n)[:, None]
        attn.show_taps(q, keys, visible if case == "mask" else None, case == "causal", start, 3)
        ((layer, position, w),) = tap.seen
        assert (layer, position) == (3, start) and w.shape == (2, 3, s, 5)
        full = torch.matmul(q, keys.repeat_interleave(3, dim=1).transpose(-1, -2)) / 8 ** 0.5
        full = full.masked_fill(~visible, -float("inf")).softmax(-1)[:, [0, 2, 5], :, 4:9]
        total = full.sum(-1, keepdim=True)
        want = torch.where(total > 0, full / total, 0.0)
        assert torch.allclose(w, want, atol=1e-6), case
        if case == "causal":
            assert (w[:, :, :4] == 0).all() and torch.allclose(w[:, :, 4:].sum(-1), torch.ones(2, 3, 6))


# -- heads -----------------------------------------------------------------------------------------
def test_heads_parse_and_print():
    assert LyricHeads.parse("").pairs == DEFAULT_HEADS and LyricHeads.parse("  ").is_default
    assert str(LyricHeads()) == "12:27,19:7,24:29"
    h = LyricHeads.parse(" 19:* , 12:3,12:3, 19:4,2:0")
    assert str(h) == "2:0,12:3,19:*" and not h.is_default
    assert h.resolve({"num_hidden_layers": 36, "num_attention_heads": 4}) == {2: (0,), 12: (3,), 19: (0, 1, 2, 3)}
    assert LyricHeads.parse(str(h)) == h


@pytest.mark.parametrize("text, message", [
    ("12", "lyric head '12' is not LAYER:HEAD or LAYER:*"),
    ("12:3,", "lyric head '' is not LAYER:HEAD"),
    ("a:1", "lyric head 'a:1' is not"),
    ("-1:2", "lyric head '-1:2' is not"),
])
def test_bad_head_lists_are_refused(text, message):
    with pytest.raises(LyricHeadsError, match=message):
        LyricHeads.parse(text)


def test_a_head_the_lm_lacks_is_refused_naming_the_count():
    cfg = {"num_hidden_layers": 21, "num_attention_heads": 32}
    with pytest.raises(LyricHeadsError, match=r"lyric head 24:29: layer 24 is not in this LM: it has 21 layers "
                                              r"\(0-20\) \(the default heads are the released LM's"):
        LyricHeads().resolve(cfg)
    with pytest.raises(LyricHeadsError, match=r"head 32 of layer 3 is not in this LM: it has 32 heads a layer"):
        LyricHeads.parse("3:32").resolve(cfg)
    assert issubclass(LyricHeadsError, InputError)


def test_the_replay_refuses_the_default_heads_on_the_tiny_lm(files):
    lm, depth = models(files)
    prompt = build_prompt(files[2], CAPTION, LYRICS)
    with pytest.raises(LyricHeadsError, match="layer 12 is not in this LM: it has 2 layers"):
        replay(lm, depth, prompt, codes_for([0, 0, 1]), lyric_heads=LyricHeads())
    with pytest.raises(ValueError, match=r"layer 2 is not in this LM: it has 2 layers \(0-1\)"):
        with lm.tapped(HeadStats(prompt, 6, 4, 3)):
            pass


def test_lead_is_checked():
    assert check_lead(0.7) == 0.7
    for bad in (float("nan"), 11, True, "1"):
        with pytest.raises(InputError, match="lyric lead must be seconds"):
            check_lead(bad)


# -- the alignment and LRC -------------------------------------------------------------------------
def test_line_onsets_follow_the_lines_in_order():
    shares = np.full((12, 4), 0.01)
    for f, line in enumerate([0, 0, 1, 1, 1, 3, 3, 2, 2, 2, 3, 3]):  # a jump back is not followed
        shares[f, line] = 0.97
    shares[5:7, 1] = 0.02  # the frames of the jump stay on the line before
    assert line_onsets(shares) == [0, 2, 7, 10]
    shares[5:7, 1:3] = [0.01, 0.02]  # ... or go on to the next, whichever the shares favour
    assert line_onsets(shares) == [0, 2, 5, 10]
    shares = np.full((6, 5), 0.01)
    shares[:, 0] = 0.5
    shares[3:, 1] = 0.9
    assert line_onsets(shares) == [0, 3, None, None, None]  # the song ends on line 1
    assert line_onsets(np.zeros((0, 3))) == [None, None, None]
    assert line_onsets(np.full((3, 5), 0.2)) == [0, None, None, None, None]  # no evidence: stay
    assert line_onsets(np.full((2, 5), 0.2))[0] == 0


def test_lrc_stamps():
    assert lrc_stamp(0) == "[00:00.00]"
    assert lrc_stamp(0.825) == "[00:00.83]" and lrc_stamp(0.824) == "[00:00.82]"  # half up, as written
    assert lrc_stamp(1.005) == "[00:01.01]" and lrc_stamp(2.675) == "[00:02.68]"
    assert lrc_stamp(59.994) == "[00:59.99]" and lrc_stamp(59.995) == "[01:00.00]"
    assert lrc_stamp(61.5) == "[01:01.50]" and lrc_stamp(3725.25) == "[62:05.25]"  # past an hour
    assert lrc_stamp(6000) == "[100:00.00]" and lrc_stamp(-0.3) == "[00:00.00]"
    assert lrc_stamp(7 / 25 + 0.7) == "[00:00.98]"


def test_lrc_text_skips_start_and_untimed_lines():
    line = lambda text, tag=False: LyricLine(text, 0, 1, tag)  # noqa: E731
    times = [LyricTime(line("[start]", True), 0.7), LyricTime(line("[verse]", True), 1.0),
             LyricTime(line("hello there"), 1.24), LyricTime(line("[chorus]", True), None)]
    assert lrc_text(times) == "[00:01.00][verse]\n[00:01.24]hello there\n"


def test_prompt_lyric_lines(files):
    tok = files[2]
    p = build_prompt(tok, CAPTION, "[Verse]\nhello wörld, café\n\n   la la  \n[chorus][bridge]\nsing ^ ñ 日本")
    a, b = p.lyric_span
    assert p.ids[0, a - 1] == tok.special.lyrics_start and p.ids[0, b] == tok.special.lyrics_end
    assert [(line.text, line.tag) for line in p.lines] == [
        ("[start]", True), ("[verse]", True), ("hello wörld, café", False), ("la la", False),
        ("[chorus][bridge]", True), ("sing", False), ("ñ 日本", False)]
    for line in p.lines:
        assert tok.decode(p.ids[0, line.first:line.stop].tolist()).strip() == line.text
        assert a <= line.first < line.stop <= b
    assert all(x.stop <= y.first for x, y in zip(p.lines, p.lines[1:]))


def test_lyric_times_checks_the_shape(files):
    prompt = build_prompt(files[2], CAPTION, LYRICS)
    with pytest.raises(ValueError, match="does not fit the prompt's"):
        lyric_times(torch.zeros(5, 3), prompt)


# -- the command line ------------------------------------------------------------------------------
CLI_LYRICS = "[verse]\nneon lights\n[chorus]\nwe run, we run"


def _lrc_lines(path):
    text = path.read_text(encoding="utf-8")
    stamps = re.findall(r"^\[(\d\d):(\d\d)\.(\d\d)\](.+)$", text, flags=re.MULTILINE)
    assert len(stamps) == text.count("\n") and stamps
    seconds = [int(m) * 60 + int(s) + int(c) / 100 for m, s, c, _ in stamps]
    assert seconds == sorted(seconds)
    return [t for *_, t in stamps]


def test_generate_lrc_and_align_end_to_end(tiny, tmp_path, capsys):
    from mm3.commands.main import main

    out = tmp_path / "s.wav"
    args = ["--models", str(tiny.gguf), "--device", "cpu", "--quiet"]
    assert main(["generate", *args, "--caption", CAPTION, "--lyrics", CLI_LYRICS, "--duration", "3", "--steps", "2",
                 "--songs", "2", "--lm-seed", "4", "--out", str(out), "--lrc", "--lrc-heads", "1:*, 0:1"]) == 0
    for n in (1, 2):
        texts = _lrc_lines(tmp_path / f"s_0{n}.lrc")
        assert texts == ["[verse]", "neon lights", "[chorus]", "we run, we run"][:len(texts)]
        assert json.loads((tmp_path / f"s_0{n}.json").read_text())["lrc_heads"] == "0:1,1:*"
    # the replay JSON reproduces the LRC: align from the file, and render again with --lrc
    assert main(["align", *args, "--request", str(tmp_path / "s_02.json"), "--out", str(tmp_path / "a.lrc")]) == 0
    assert (tmp_path / "a.lrc").read_bytes() == (tmp_path / "s_02.lrc").read_bytes()
    assert main(["render", *args, "--request", str(tmp_path / "s_02.json"), "--steps", "2", "--lrc",
                 "--out", str(tmp_path / "r.wav")]) == 0
    assert (tmp_path / "r.lrc").read_bytes() == (tmp_path / "s_02.lrc").read_bytes()
    # the default output sits beside the request; it is not overwritten without --overwrite
    led = _stamps(tmp_path / "s_01.lrc")
    assert main(["align", *args, "--request", str(tmp_path / "s_01.json"), "--lrc-lead", "0"]) == 2
    assert _stamps(tmp_path / "s_01.lrc") == led
    assert main(["align", *args, "--request", str(tmp_path / "s_01.json"), "--lrc-lead", "0", "--overwrite"]) == 0
    plain = _stamps(tmp_path / "s_01.lrc")
    assert len(plain) == len(led) and all(abs(a - b - 0.7) < 1e-9 for a, b in zip(led, plain))

    capsys.readouterr()
    assert main(["align", *args, "--discover", "--request", str(tmp_path / "s_01.json"), str(tmp_path / "s_02.json"),
                 "--top", "3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("8 heads (2 layers x 4) over 2 song(s)")
    assert len(printed) == 2 + 3 + 1 and re.fullmatch(r"--lrc-heads \d:\d,\d:\d,\d:\d", printed[-1])


def _stamps(path):
    return [int(m) * 60 + int(s) + int(c) / 100
            for m, s, c in re.findall(r"^\[(\d\d):(\d\d)\.(\d\d)\]", path.read_text(), flags=re.MULTILINE)]


def test_cli_refuses_bad_heads_before_any_work(tiny, tmp_path, capsys):
    from mm3.commands.main import main

    args = ["--models", str(tiny.gguf), "--device", "cpu", "--quiet", "--caption", CAPTION, "--lyrics", CLI_LYRICS,
            "--duration", "1", "--steps", "2"]
    out = tmp_path / "s.wav"
    capsys.readouterr()
    assert main(["generate", *args, "--out", str(out), "--lrc"]) == 2
    assert "lyric head 12:27: layer 12 is not in this LM: it has 2 layers (0-1)" in capsys.readouterr().err
    assert main(["generate", *args, "--out", str(out), "--lrc", "--lrc-heads", "1:4"]) == 2
    assert "head 4 of layer 1 is not in this LM: it has 4 heads a layer (0-3)" in capsys.readouterr().err
    assert main(["generate", *args, "--out", str(out), "--lrc", "--lrc-heads", "1;4"]) == 2
    assert "lyric head '1;4' is not LAYER:HEAD or LAYER:*" in capsys.readouterr().err
    assert main(["generate", *args, "--out", str(out), "--lrc-heads", "1:1"]) == 2
    assert "--lrc-heads needs --lrc" in capsys.readouterr().err
    assert main(["plan", *args[:-2], "--out", str(tmp_path / "p.json"), "--lrc", "--lrc-lead", "30"]) == 2
    assert "lyric lead must be seconds between -10 and 10" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["plan", *args[:-2], "--out", str(tmp_path / "p.json"), "--lrc", "--lrc-heads", "0:0"]) == 0
    assert _lrc_lines(tmp_path / "p.lrc")
    assert main(["align", "--models", str(tiny.gguf), "--request", str(tmp_path / "p.json"), "--lrc-heads", "2:0",
                 "--out", str(tmp_path / "q.lrc")]) == 2
    assert "layer 2 is not in this LM: it has 2 layers (0-1)" in capsys.readouterr().err
    assert not (tmp_path / "q.lrc").exists()


def test_every_stamp_lies_inside_the_song(files):
    """A line whose start with the lead falls at or after the song's end was never heard: it is left
    out (None, and no LRC line), so no timestamp lies past the end."""
    lm, depth, prompt = constructed(files)
    durations = [10, 3, 12, 7, 20, 1]  # the last line starts at frame 52 of 53 (2.08 s of 2.12 s)
    line_of_frame = [k for k, n in enumerate(durations) for _ in range(n)]
    song = replay(lm, depth, prompt, codes_for(line_of_frame), lyric_heads=LyricHeads.parse("0:0"))
    end = len(line_of_frame) / 25
    plain = lyric_times(song.lyric_attention, prompt, lead=0.0)
    assert plain[-1].seconds == 52 / 25  # heard, without the lead
    led = lyric_times(song.lyric_attention, prompt)  # 2.78 s: past the end
    assert led[-1].seconds is None and all(t.seconds < end for t in led[:-1])
    assert all(s < end for s in (t.seconds for t in led) if s is not None)
    assert prompt.lines[-1].text not in lrc_text(led) and lrc_text(led).count("\n") == len(prompt.lines) - 2


def test_an_lrc_that_times_nothing_is_written_with_a_warning(tiny, tmp_path, capsys):
    """A lead past the song's end leaves every line untimed: the LRC is written empty, and the
    command line says why rather than leaving an empty file without a word."""
    from mm3.commands.main import main
    from mm3.plan.lyrics_align import untimed_warning

    out = tmp_path / "s.wav"
    capsys.readouterr()
    assert main(["generate", "--models", str(tiny.gguf), "--device", "cpu", "--quiet", "--caption", CAPTION,
                 "--lyrics", CLI_LYRICS, "--duration", "1", "--steps", "2", "--lm-seed", "4", "--out", str(out),
                 "--lrc", "--lrc-heads", "1:*", "--lrc-lead", "9"]) == 0
    assert (tmp_path / "s.lrc").read_text() == ""
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 's.lrc'}: no lyric line was timed, so the LRC is empty" in err
    assert "--lrc-heads" in err and err.count("\n") == 1
    assert untimed_warning("[00:01.00]la\n") is None
    assert "the heads input" in untimed_warning("", where="the heads input")
