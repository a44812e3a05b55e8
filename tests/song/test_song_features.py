"""Beyond the reference: the semantic draw's shaping, takes and natural endings, the flow shift,
continuing and repainting songs; each at its default is the reference path (tiny model, CPU)."""

import json
import types

import pytest
import torch

from mm3.plan.ar import PlanSettings, plan
from mm3.plan.replay import replay
from mm3.commands.main import main as cli_main
from mm3.files.opener import open_component
from mm3.synth.flow import (
    AUTO_SHIFT, Keep, encode_conditions, flow_sigmas, repaint_keep, sample_latents, schedule_shift, timeline_length,
    window_offsets, windows_from_timeline)
from mm3.models import build_model
from mm3.models.depth import RVQDepthDecoder
from mm3.models.lm import Qwen3LM
from mm3.plan.prompt import build_prompt
from mm3.song.request import MM3Request, RequestError
from mm3.plan.shaping import SemanticShaper, Shaping, nucleus
from mm3.plan.takes import NoEndingError, Takes, plan_takes
from mm3.tokenizer import MM3Tokenizer


@pytest.fixture(scope="module")
def m(tiny, one_thread):
    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    tok = MM3Tokenizer.from_component(lm_c)
    ns = types.SimpleNamespace(lm=Qwen3LM.load(lm_c), depth=RVQDepthDecoder.load(d_c), lm_c=lm_c,
                               prompt=build_prompt(tok, "warm synth pop", "[verse]\nhello there"),
                               cond=build_model(open_component(tiny.file("mm3-cond"), expect="cond")),
                               dit=build_model(open_component(tiny.file("mm3-dit"), expect="dit")))
    yield ns
    lm_c.close()
    d_c.close()


def _ending_lm(m):
    """The tiny LM with END's head row set to code 10's: END then comes when that code would."""
    lm = Qwen3LM.load(m.lm_c)
    cs = m.prompt.codes
    w = lm.lm_head.get("weight", torch.float32).clone()
    w[cs.end_id - lm.head_ids[0]] = w[cs.code_offset + 10 - lm.head_ids[0]]
    lm.lm_head.set_float("weight", w)
    return lm


# -- shaping ----------------------------------------------------------------------------------------

def _dry_oracle(hist, window, min_match, strength, num):
    """Brute force: for each earlier occurrence j, the repeat its follower would extend."""
    n = len(hist)
    pen = [0.0] * num
    for j in range(max(0, n - window), n):
        k = 0
        while k < j and hist[j - 1 - k] == hist[n - 1 - k]:
            k += 1
        if k >= min_match:
            pen[hist[j]] = max(pen[hist[j]], strength ** (k - min_match))
    return pen


def _penalty(shaper: SemanticShaper, width: int) -> list[float]:
    """What each code's logit loses to the penalty: the shaped logits of all-zero guided ones."""
    return [0.0 - v for v in shaper.logits(torch.zeros(1, width))[0].tolist()]


@pytest.mark.parametrize("window", [5, 40])
def test_dry_penalty_equals_brute_force(window):
    g = torch.Generator().manual_seed(0)
    loop = torch.randint(0, 12, (7,), generator=g).tolist()
    hist = (loop * 5)[:31] + torch.randint(0, 12, (4,), generator=g).tolist() + loop[:5]
    s = Shaping(penalty="dry", penalty_strength=1.2, penalty_window=window, min_match=3)
    sh = SemanticShaper(s, 1, 8, 12, slice(0, 12), None, torch.device("cpu"), torch.tensor([hist]))
    got = _penalty(sh, 12)
    assert got == pytest.approx(_dry_oracle(hist, window, 3, 1.2, 12), rel=1e-6)
    assert any(got) == (window == 40)  # the repeat is found only when its start is in the window


def test_frequency_and_presence_count_the_window():
    hist = [1, 2, 2, 3, 2, 1]
    for mode, want in (("frequency", [0, 2, 3, 1]), ("presence", [0, 1, 1, 1])):
        s = Shaping(penalty=mode, penalty_strength=0.5, penalty_window=6)
        sh = SemanticShaper(s, 1, 4, 4, slice(0, 4), None, torch.device("cpu"), torch.tensor([hist]))
        assert _penalty(sh, 4) == [0.5 * w for w in want]


def test_nucleus_keeps_the_smallest_set_reaching_p():
    p = torch.tensor([[0.5, 0.2, 0.3, 0.0]])
    assert nucleus(p, 0.6)[0].tolist() == pytest.approx([0.5 / 0.8, 0.0, 0.3 / 0.8, 0.0])
    assert nucleus(p, 0.4).tolist() == [[1.0, 0.0, 0.0, 0.0]]  # at least the most likely one
    assert torch.equal(nucleus(p, 1.0), p / p.sum())


def test_default_shaping_is_the_reference_draw(m):
    assert Shaping().is_reference
    a = plan(m.lm, m.depth, m.prompt, PlanSettings(duration=1.5, lm_seed=4))[0]
    b = plan(m.lm, m.depth, m.prompt, PlanSettings(duration=1.5, lm_seed=4, shaping=Shaping(temperature=1.0)))[0]
    assert torch.equal(a.codes, b.codes) and torch.equal(a.frame_hiddens, b.frame_hiddens)


def test_shaping_changes_only_the_semantic_draw_as_asked(m):
    def codes(**kw):
        return plan(m.lm, m.depth, m.prompt, PlanSettings(duration=4.0, lm_seed=3, shaping=Shaping(**kw)))[0].codes

    base = codes()
    cold, penalised = codes(temperature=0.05), codes(penalty="presence", penalty_strength=5.0)
    distinct = lambda c: len(set(c[1:, 0].tolist()))  # noqa: E731
    assert distinct(cold) < distinct(base) < distinct(penalised)
    assert not torch.equal(codes(top_p=0.3), base)


def test_min_duration_holds_the_ending_off(m):
    lm = _ending_lm(m)
    free = [plan(lm, m.depth, m.prompt, PlanSettings(duration=8.0, lm_seed=s))[0] for s in range(4)]
    early = min((s for s in free if s.ended_naturally), key=lambda s: s.frames)
    held = plan(lm, m.depth, m.prompt, PlanSettings(duration=8.0, lm_seed=early.lm_seed,
                                                      shaping=Shaping(min_frames=early.frames + 5)))[0]
    assert held.frames >= early.frames + 5
    assert torch.equal(held.codes[:early.frames + 1], early.codes[:early.frames + 1])  # same draws until then


# -- takes ------------------------------------------------------------------------------------------

def test_takes_keep_the_ended_candidates_in_seed_order(m):
    lm = _ending_lm(m)

    def batch(st):
        return plan(lm, m.depth, m.prompt, st)

    single = [batch(PlanSettings(duration=8.0, lm_seed=10 + n))[0] for n in range(4)]
    kept, report = plan_takes(batch, PlanSettings(duration=8.0, lm_seed=10), Takes(takes=4, require_ending=True))
    ended = [s for s in single if s.ended_naturally]
    assert ended and torch.equal(kept[0].codes, ended[0].codes) and kept[0].lm_seed == ended[0].lm_seed
    assert [c.ended for c in report] == [s.ended_naturally for s in single]
    assert [c.kept for c in report].count(True) == 1


def test_require_ending_fails_after_its_rounds(m):
    calls = []

    def batch(st):
        calls.append((st.lm_seed, st.songs))
        return plan(m.lm, m.depth, m.prompt, st)  # the tiny LM never ends within 1 s

    with pytest.raises(NoEndingError, match=r"no candidate ended naturally within 2 round\(s\) of 2 take\(s\)"):
        plan_takes(batch, PlanSettings(duration=1.0, lm_seed=5), Takes(takes=2, require_ending=True, rounds=2))
    assert calls == [(5, 2), (7, 2)]  # the second round at the next seeds


def test_one_take_is_todays_plan(m):
    songs, report = plan_takes(lambda st: plan(m.lm, m.depth, m.prompt, st), PlanSettings(duration=1.0, lm_seed=2),
                               Takes())
    ref = plan(m.lm, m.depth, m.prompt, PlanSettings(duration=1.0, lm_seed=2))
    assert torch.equal(songs[0].codes, ref[0].codes) and len(report) == 1


# -- the flow shift ---------------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [4, 10, 29])
def test_shifted_schedule_equals_the_reference_scheduler(steps):
    diffusers = pytest.importorskip("diffusers")
    import numpy as np

    shift = schedule_shift(steps)
    assert shift == pytest.approx(29 / (steps - 1))
    sch = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=shift, invert_sigmas=True)
    sch.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps), device="cpu")
    assert torch.equal(flow_sigmas(steps, shift), sch.sigmas)


def test_automatic_shift_is_off_from_30_steps():
    assert schedule_shift(30) == 1.0 and schedule_shift(50) == 1.0 and schedule_shift(30, 2.5) == 2.5
    assert torch.equal(flow_sigmas(30, schedule_shift(30)), flow_sigmas(30))
    with pytest.raises(ValueError, match="dit_shift must be in"):
        flow_sigmas(10, -1.0)


def test_sampler_feeds_the_shifted_times(m):
    seen = []
    real = m.dit.forward

    def spy(x, t, cond):
        seen.append(float(t[0]))
        return real(x, t, cond)

    song = replay(m.lm, m.depth, m.prompt, plan(m.lm, m.depth, m.prompt, PlanSettings(duration=1.0, lm_seed=1))[0].codes)
    conds = encode_conditions(m.cond, song.frame_hiddens)
    m.dit.forward = spy
    try:
        sample_latents(m.dit, conds, steps=5, seed=0, shift=schedule_shift(5))
    finally:
        del m.dit.forward
    assert seen == pytest.approx(flow_sigmas(5, 29 / 4)[:-1].tolist())


# -- continue and repaint -----------------------------------------------------------------------------

def test_continue_extends_the_prior_codes(m):
    prior = plan(m.lm, m.depth, m.prompt, PlanSettings(duration=9.0, lm_seed=3))[0]
    ext = plan(m.lm, m.depth, m.prompt, PlanSettings(duration=12.0, lm_seed=8), prefix=prior.codes)[0]
    assert ext.frames == 300 and torch.equal(ext.codes[:prior.codes.shape[0]], prior.codes)
    a = replay(m.lm, m.depth, m.prompt, prior.codes)
    b = replay(m.lm, m.depth, m.prompt, ext.codes)
    ca, cb = encode_conditions(m.cond, a.frame_hiddens), encode_conditions(m.cond, b.frame_hiddens)
    la, lb = sample_latents(m.dit, ca, steps=3, seed=4), sample_latents(m.dit, cb, steps=3, seed=4)
    # Window 0 (frames 0-199) lies inside the prior part: the same latents up to float rounding.
    assert ((la[0] - lb[0]).norm() / la[0].norm()) < 1e-4
    with pytest.raises(ValueError, match="leaves no frame to add"):
        plan(m.lm, m.depth, m.prompt, PlanSettings(duration=9.0, lm_seed=8), prefix=prior.codes)


def test_repaint_keeps_the_rest_exactly(m):
    song = replay(m.lm, m.depth, m.prompt, plan(m.lm, m.depth, m.prompt, PlanSettings(duration=9.0, lm_seed=3))[0].codes)
    conds = encode_conditions(m.cond, song.frame_hiddens)
    original = sample_latents(m.dit, conds, steps=3, seed=1)
    lengths = [x.shape[-1] for x in original]
    keep = Keep.range(original, 100, 300, fade=10)
    assert keep.masks[0][99] == 1 and keep.masks[0][100] < 1 and keep.masks[0][150] == 0
    assert bool((keep.masks[1] == 1).all())  # window 1 starts at 345: nothing to repaint there
    calls = []
    real = m.dit.forward
    m.dit.forward = lambda *a: calls.append(1) or real(*a)
    try:
        new = sample_latents(m.dit, conds, steps=3, seed=2, keep=keep)
    finally:
        del m.dit.forward
    assert len(calls) == 3  # window 1 was not sampled
    kept = keep.masks[0] == 1
    assert torch.equal(new[0][..., kept], original[0][..., kept]) and torch.equal(new[1], original[1])
    assert not torch.allclose(new[0][..., 120:280], original[0][..., 120:280])
    assert window_offsets(lengths) == [0, lengths[0] - 344] and timeline_length(lengths) == 345 + lengths[1]


def test_repaint_keep_is_set_up_in_one_place():
    """`repaint_keep` (the command line's and the nodes' one set-up): seconds at the encoder's rate,
    the first variation kept, latents of other windows refused before any sampling."""
    conds = [torch.zeros(1, 689, 8), torch.zeros(1, 430, 8)]
    original = [torch.randn(2, 4, 689), torch.randn(2, 4, 430)]
    keep = repaint_keep(conds, original, 1.0, 2.0, 0.25, 44100, 512)
    want = Keep.seconds([x[:1] for x in original], 1.0, 2.0, 0.25, 44100 / 512)
    assert all(torch.equal(a, b) for a, b in zip(keep.latents + keep.masks, want.latents + want.masks))
    assert keep.latents[0].shape[0] == 1
    with pytest.raises(ValueError, match=r"latents to keep \(\[689, 430\] per window\) were not made for this "
                                         r"song's windows \(\[689, 431\]\)"):
        repaint_keep([conds[0], torch.zeros(1, 431, 8)], original, 1.0, 2.0, 0.25, 44100, 512)


def test_windows_from_a_short_recording_are_padded(m):
    lengths = [689, 430]
    timeline = torch.randn(1, 4, 700)
    windows, covered = windows_from_timeline(timeline, lengths)
    assert covered == 700 and [w.shape[-1] for w in windows] == lengths
    assert torch.equal(windows[1][..., :355], timeline[..., 345:700]) and not windows[1][..., 355:].any()


# -- requests and the command line ----------------------------------------------------------------------

def test_new_fields_are_omitted_at_their_defaults_and_round_trip():
    plain = MM3Request(caption="c", lyrics="l")
    assert "lm_temperature" not in plain.to_dict() and "takes" not in plain.to_dict()
    req = MM3Request(caption="c", lyrics="l", lm_temperature=0.8, lm_penalty="dry", lm_penalty_strength=1.1, takes=3,
                     require_ending=True, ending_rounds=2, dit_shift=2.0)
    back = MM3Request.from_json(req.to_json())
    assert back == req and back.validate() is back


@pytest.mark.parametrize("fields,message", [
    ({"lm_temperature": 0.0}, r"lm_temperature must be in \(0, 5\]"),
    ({"lm_top_p": 1.5}, r"lm_top_p must be in \(0, 1\]"),
    ({"lm_penalty": "loud"}, "lm_penalty must be one of none, dry, frequency, presence"),
    ({"lm_penalty": "dry", "lm_penalty_strength": 0.5}, r"lm_penalty_strength for dry must be in \[1, 2\]"),
    ({"takes": 40}, "takes must be between 1 and 16"),
    ({"min_duration": 90.0}, "min_duration must be between 0 and the duration 60 s"),
    ({"dit_shift": -2.0}, "dit_shift must be in"),
    ({"require_ending": 1}, "require_ending must be true or false"),
    ({"repaint_start": 3.0, "repaint_end": 2.0, "audio_codes": "1,2,3,4,5,6,7,8," * 2}, "repaint needs 0 <= "),
    ({"repaint_start": 1.0, "repaint_end": 2.0}, "a repaint needs the song's audio_codes"),
])
def test_out_of_range_fields_are_refused(fields, message):
    with pytest.raises(RequestError, match=message):
        MM3Request.from_dict({"caption": "c", "lyrics": "l", **fields}).validate()


def _cli(tiny, *args):
    return cli_main([args[0], "--models", str(tiny.gguf), *args[1:], "--quiet"])


def test_cli_takes_continue_and_repaint_replay_byte_for_byte(tiny, tmp_path):
    a = tmp_path / "a.wav"
    assert _cli(tiny, "generate", "--caption", "warm pop", "--lyrics", "[verse] hi", "--duration", "2", "--steps", "3",
                "--lm-seed", "1", "--seed", "2", "--takes", "2", "--temperature", "0.9", "--out", str(a)) == 0
    ra = json.loads(a.with_suffix(".json").read_text())
    assert ra["takes"] == 2 and ra["lm_take"] == 0 and ra["lm_temperature"] == 0.9
    b = tmp_path / "b.wav"
    assert _cli(tiny, "continue", "--request", str(a.with_suffix(".json")), "--duration", "4", "--lm-seed", "9",
                "--steps", "3", "--out", str(b)) == 0
    rb = json.loads(b.with_suffix(".json").read_text())
    assert rb["audio_codes"].startswith(ra["audio_codes"]) and len(rb["audio_codes"].split(",")) == 101 * 8
    assert "continue_codes" not in rb
    c = tmp_path / "c.wav"
    assert _cli(tiny, "repaint", "--request", str(b.with_suffix(".json")), "--start", "1", "--end", "2.5",
                "--repaint-seed", "5", "--replan-lm-seed", "11", "--out", str(c)) == 0
    rc = json.loads(c.with_suffix(".json").read_text())
    assert rc["source_codes"] == rb["audio_codes"] != rc["audio_codes"] and rc["repaint_seed"] == 5
    for path in (b, c):  # each replay request renders its track again, bit for bit
        again = tmp_path / f"again_{path.name}"
        assert _cli(tiny, "render", "--request", str(path.with_suffix(".json")), "--out", str(again)) == 0
        assert again.read_bytes() == path.read_bytes()


def test_auto_shift_default_render_is_unchanged_at_30_steps(tiny, tmp_path):
    outs = []
    for shift in ("0", "1"):
        out = tmp_path / f"s{shift}.wav"
        assert _cli(tiny, "generate", "--caption", "warm pop", "--lyrics", "[verse] hi", "--duration", "1",
                    "--steps", "30", "--lm-seed", "1", "--seed", "2", "--shift", shift, "--out", str(out)) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert AUTO_SHIFT == 0.0
