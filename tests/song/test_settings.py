"""Every stage's settings object checks its own ranges and types where it is built, with the one-line
error the request gives for the same field; the request checks its stages by building them."""

import math

import numpy as np
import pytest

from mm3.constants import MAX_CFG, MAX_DURATION, MAX_SONGS, SEMANTIC_VOCAB_SIZE
from mm3.song.request import MM3Request, RequestError
from mm3.song.settings import (
    MAX_ENDING_ROUNDS, MAX_TAKES, OutputSettings, PlanSettings, RepaintSettings, Shaping, SynthSettings, Takes,
    check_plan_start)

# (settings object, the keywords that break it, the start of its error); the same field in a request
# (`REQUEST`) is refused with the same words.
REFUSED = [
    (PlanSettings, {"duration": 0.0}, "duration must be positive, got 0"),
    (PlanSettings, {"duration": math.nan}, "duration must be a finite number, got nan"),
    (PlanSettings, {"duration": "60"}, "duration must be a number, got '60'"),
    (PlanSettings, {"duration": MAX_DURATION + 1}, "duration must be at most 360 seconds (9000 frames), got 361"),
    (PlanSettings, {"duration": 0.01}, "duration must be at least 0.04 seconds (one frame), got 0.01"),
    (PlanSettings, {"songs": 0}, f"lm_batch_size must be between 1 and {MAX_SONGS}, got 0"),
    (PlanSettings, {"songs": 2.0}, "lm_batch_size must be an integer, got 2.0"),
    (PlanSettings, {"top_k": 0}, "lm_top_k must be at least 1, got 0"),
    (PlanSettings, {"top_k": SEMANTIC_VOCAB_SIZE + 1}, f"lm_top_k must be between 1 and {SEMANTIC_VOCAB_SIZE}"),
    (PlanSettings, {"top_k": True}, "lm_top_k must be an integer, got True"),
    (PlanSettings, {"lm_cfg": -0.5}, f"lm_cfg must be between 0 and {MAX_CFG:g}, got -0.5"),
    (PlanSettings, {"lm_cfg": math.inf}, "lm_cfg must be a finite number, got inf"),
    (PlanSettings, {"lm_seed": -2}, "lm_seed must be -1 or None (random) or a seed of at least 0, got -2"),
    (PlanSettings, {"lm_seed": 1.5}, "lm_seed must be -1 or None (random) or a seed of at least 0, got 1.5"),
    (Shaping, {"temperature": 0.0}, "lm_temperature must be in (0, 5], got 0.0"),
    (Shaping, {"top_p": 1.5}, "lm_top_p must be in (0, 1], got 1.5"),
    (Shaping, {"penalty": "loud"}, "lm_penalty must be one of none, dry, frequency, presence, got 'loud'"),
    (Shaping, {"penalty": "dry", "penalty_strength": 0.5}, "lm_penalty_strength for dry must be in [1, 2], got 0.5"),
    (Shaping, {"penalty_window": 0}, "lm_penalty_window must be between 1 and 9000 frames, got 0"),
    (Shaping, {"min_match": 2.5}, "lm_dry_min_match must be between 1 and 9000 frames, got 2.5"),
    (Takes, {"takes": MAX_TAKES + 1}, f"takes must be between 1 and {MAX_TAKES}, got {MAX_TAKES + 1}"),
    (Takes, {"rounds": 0}, f"ending_rounds must be between 1 and {MAX_ENDING_ROUNDS}, got 0"),
    (Takes, {"require_ending": 1}, "require_ending must be true or false, got 1"),
    (SynthSettings, {"steps": 1}, "steps must be at least 2, got 1"),
    (SynthSettings, {"steps": 201}, "steps must be between 2 and 200, got 201"),
    (SynthSettings, {"steps": 30.0}, "steps must be an integer, got 30.0"),
    (SynthSettings, {"variations": 10}, "synth_batch_size must be between 1 and 9, got 10"),
    (SynthSettings, {"dit_cfg": math.nan}, "dit_cfg must be a finite number, got nan"),
    (SynthSettings, {"shift": -1.0}, "dit_shift must be in (0, 30] (or 0: automatic), got -1.0"),
    (SynthSettings, {"seed": -1}, "seed must be an integer in 0..4294967295, got -1"),
    (RepaintSettings, {"start": 3.0, "end": 2.0}, "repaint needs 0 <= repaint_start < repaint_end (seconds)"),
    (RepaintSettings, {"fade": 11.0}, "repaint_fade must be between 0 and 10, got 11"),
    (RepaintSettings, {"end": math.inf}, "repaint_end must be a finite number, got inf"),
    (OutputSettings, {"format": "flac"}, "output_format must be one of mp3, wav16, wav24, wav32, got 'flac'"),
    (OutputSettings, {"mp3_bitrate": 100}, "mp3_bitrate must be one of 32, 40"),
    (OutputSettings, {"peak_clip": 1000}, "peak_clip must be between 0 and 999, got 1000"),
]
VALID = {PlanSettings: {"duration": 10.0}, Shaping: {}, Takes: {}, SynthSettings: {"seed": 0},
         RepaintSettings: {"start": 1.0, "end": 2.0}, OutputSettings: {}}


@pytest.mark.parametrize("cls, kw, message", REFUSED, ids=[f"{c.__name__}-{m[:30]}" for c, _, m in REFUSED])
def test_each_settings_object_refuses_what_its_stage_cannot_use(cls, kw, message):
    with pytest.raises(ValueError) as e:
        cls(**VALID[cls] | kw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# The request fields of the same faults: the request refuses them through the settings objects.
REQUEST = [({"lm_batch_size": 0}, "lm_batch_size must be between 1 and 16, got 0"),
           ({"lm_top_k": SEMANTIC_VOCAB_SIZE + 1}, "lm_top_k must be between 1 and 16384"),
           ({"lm_cfg": 10.5}, "lm_cfg must be between 0 and 10, got 10.5"),
           ({"lm_temperature": 0.0}, "lm_temperature must be in (0, 5], got 0.0"),
           ({"lm_penalty": "dry", "lm_penalty_strength": 0.5}, "lm_penalty_strength for dry must be in [1, 2]"),
           ({"takes": 17}, "takes must be between 1 and 16, got 17"),
           ({"steps": 201}, "steps must be between 2 and 200, got 201"),
           ({"dit_shift": -1.0}, "dit_shift must be in (0, 30] (or 0: automatic), got -1.0"),
           ({"peak_clip": 1000}, "peak_clip must be between 0 and 999, got 1000"),
           ({"min_duration": 90.0}, "min_duration must be between 0 and the duration 60 s, got 90"),
           ({"audio_codes": ",".join(["1"] * 16), "repaint_start": 1.0, "repaint_end": 2.0, "repaint_fade": 11.0},
            "repaint_fade must be between 0 and 10, got 11")]


@pytest.mark.parametrize("fields, message", REQUEST, ids=[m[:30] for _, m in REQUEST])
def test_a_request_is_refused_in_its_settings_words(fields, message):
    with pytest.raises(RequestError) as e:
        MM3Request(caption="dark synth", **fields).validate()
    assert str(e.value).startswith(message)


def test_the_limits_themselves_are_accepted():
    plan = PlanSettings(duration=MAX_DURATION, lm_seed=None, lm_cfg=MAX_CFG, top_k=SEMANTIC_VOCAB_SIZE,
                        songs=MAX_SONGS, shaping=Shaping(temperature=5.0, penalty="presence", penalty_strength=10.0))
    assert plan.frames == 9000
    assert PlanSettings(duration=0.04, lm_seed=-1, lm_cfg=0.0, top_k=np.int64(1)).frames == 1  # numpy ints: integers
    assert Takes(takes=MAX_TAKES, require_ending=True, rounds=MAX_ENDING_ROUNDS).takes == MAX_TAKES
    assert SynthSettings(seed=2**32 - 1, steps=200, dit_cfg=0.0, variations=9, shift=30.0).steps == 200
    assert RepaintSettings(0.0, 0.04, 10.0).fade == 10.0 and OutputSettings("wav32", 320, 0).peak_clip == 0


def test_a_replay_request_keeps_a_duration_no_plan_may_have():
    """A replay (audio_codes) plans nothing, so its duration is the song's: past 360 s and under one
    frame pass, while its plan's other settings are still checked."""
    codes = ",".join(["1"] * 16)
    assert MM3Request(caption="x", audio_codes=codes, duration=400.0).validate().duration == 400.0
    assert MM3Request(caption="x", audio_codes=codes, duration=0.01).validate().duration == 0.01
    with pytest.raises(RequestError, match="lm_cfg must be between 0 and 10, got 11"):
        MM3Request(caption="x", audio_codes=codes, duration=400.0, lm_cfg=11.0).validate()
    with pytest.raises(RequestError, match="duration must be at most 360 seconds"):
        MM3Request(caption="x", duration=400.0).plan_settings()


def test_where_a_plan_starts():
    """A new song may not hold its ending off past its duration; a continued one must have frames
    left to add; a continued one may hold its ending off past the duration (it then runs to it)."""
    held = PlanSettings(duration=1.0, shaping=Shaping(min_frames=50))
    with pytest.raises(ValueError, match="min_duration must be between 0 and the duration 1 s, got 2"):
        check_plan_start(held)
    check_plan_start(held, prior_frames=10)
    check_plan_start(PlanSettings(duration=2.0, shaping=Shaping(min_frames=50)))
    with pytest.raises(ValueError, match=r"continue_codes already hold 25 frames \(1.00 s\): the duration 1 s must be"):
        check_plan_start(PlanSettings(duration=1.0), prior_frames=25)
    codes = ",".join(["1"] * 8 * 26)  # 25 frames after frame 0
    with pytest.raises(RequestError, match="continue_codes already hold 25 frames"):
        MM3Request(caption="x", duration=1.0, continue_codes=codes).validate()
    assert MM3Request(caption="x", duration=1.5, continue_codes=codes, min_duration=9.0).validate()


def test_the_old_homes_of_the_plan_settings_still_import_them():
    from mm3.plan import ar, shaping, takes
    from mm3.plan import settings

    assert ar.PlanSettings is settings.PlanSettings and takes.Takes is settings.Takes
    assert shaping.Shaping is settings.Shaping and takes.MAX_TAKES == settings.MAX_TAKES


def test_the_settings_are_plain_objects():
    """Every stage's settings import without torch or a model module, so a front end (a node's
    check, a flag) builds and checks them before anything heavy loads."""
    import subprocess
    import sys

    code = "import sys, mm3.song.settings; print(sorted(m for m in sys.modules if m in ('torch', 'numpy', 'mm3.models')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
