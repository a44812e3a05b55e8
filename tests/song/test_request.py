"""MM3Request: defaults, JSON in and out, and every validation error in the reference's words."""

import json

import pytest

from mm3.song.request import MM3Request, RequestError, check_codes_syntax

BASE = {"caption": "dark synth", "lyrics": "[verse]\nhello"}


def req(**over):
    return MM3Request.from_dict({**BASE, **over})


def test_defaults_equal_an_empty_request():
    r = MM3Request.from_json("{}")
    assert r == MM3Request()
    assert (r.duration, r.steps, r.seed, r.lm_seed, r.lm_cfg, r.lm_top_k, r.dit_cfg, r.peak_clip,
            r.output_format, r.mp3_bitrate, r.synth_batch_size) == (60.0, 30, -1, -1, 1.5, 50, 1.7, 10, "mp3", 128, 1)


def test_round_trip_and_unknown_fields_ignored():
    r = req(duration=12, steps=8, seed=3, lm_seed=4, dit_model="x.gguf")
    assert isinstance(r.duration, float)
    again = MM3Request.from_json(r.to_json())
    assert again == r
    assert MM3Request.from_dict({**BASE, "future_field": 1}) == MM3Request(**BASE)


def test_corpus_requests_parse_and_validate(corpus):
    for name, data in corpus.items():
        r = MM3Request.from_json(json.dumps(data)).validate()
        assert r.caption == data["caption"] and r.duration == float(data.get("duration", 60.0)), name


@pytest.mark.parametrize("text, message", [
    ("{not json", "Malformed JSON"),
    ("[1, 2]", "Malformed JSON"),
    ('{"caption": "", "lyrics": "x"}', "caption is required"),
    ('{"lyrics": "x"}', "caption is required"),
    ('{"caption": "x", "lyrics": "y", "duration": 0}', "duration must be positive"),
    ('{"caption": "x", "lyrics": "y", "duration": -3.5}', "duration must be positive"),
    ('{"caption": "x", "lyrics": "y", "duration": 400}', "duration must be at most 360 seconds (9000 frames), got 400"),
    ('{"caption": "x", "lyrics": "y", "steps": 1}', "steps must be at least 2"),
    ('{"caption": "x", "lyrics": "y", "steps": 30.0}', "steps must be an integer, got 30.0"),
    ('{"caption": "x", "lyrics": "y", "steps": "30"}', 'steps must be an integer, got "30"'),
    ('{"caption": "x", "lyrics": "y", "duration": "long"}', 'duration must be a number, got "long"'),
    ('{"caption": 5, "lyrics": "y"}', "caption must be a string, got 5"),
    ('{"caption": "x", "lyrics": "y", "lm_batch_size": 0}', "lm_batch_size must be between 1 and 16, got 0"),
    ('{"caption": "x", "lyrics": "y", "synth_batch_size": 0}', "synth_batch_size must be between 1 and 9"),
    ('{"caption": "x", "lyrics": "y", "synth_batch_size": 10}', "synth_batch_size must be between 1 and 9"),
    ('{"caption": "x", "lyrics": "y", "audio_codes": "1,2,x"}', "Invalid audio_codes"),
    ('{"caption": "x", "lyrics": "y", "audio_codes": "1,2,3"}',
     "audio_codes needs 8 codes per frame, at least 2 frames"),
    ('{"caption": "x", "lyrics": "y", "audio_codes": "1,2,3,4,5,6,7,8"}',
     "audio_codes needs 8 codes per frame, at least 2 frames"),
    ('{"caption": "x", "lyrics": "y", "output_format": "flac"}', "Invalid output_format (use: mp3, wav16, wav24, wav32)"),
    ('{"caption": "x", "lyrics": "y", "lm_top_k": 0}', "lm_top_k must be at least 1, got 0"),
    ('{"caption": "x", "lyrics": "y", "mp3_bitrate": 100}', "mp3_bitrate must be one of 32, 40"),
    ('{"caption": "x", "lyrics": "y", "seed": -2}', "seed must be -1 (random) or 0..4294967295, got -2"),
    ('{"caption": "x", "lyrics": "y", "min_duration": -1}', "min_duration must be between 0 and the duration"),
])
def test_validation_errors(text, message):
    with pytest.raises(RequestError) as e:
        MM3Request.from_json(text).validate()
    assert str(e.value).startswith(message)


def test_codes_syntax():
    assert check_codes_syntax(",".join(["1"] * 16)) == 2
    assert check_codes_syntax(" 1, 2,3,4,5,6,7,8,\n9,10,11,12,13,14,15,16,") == 2
    for bad in ("1,,2," + ",".join(["1"] * 14), "1-2," + ",".join(["1"] * 15)):
        with pytest.raises(RequestError, match="Invalid audio_codes"):
            check_codes_syntax(bad)


def test_seeds_resolve_and_replay():
    r = req(seed=-1, lm_seed=-1, lm_batch_size=2, synth_batch_size=3).resolve_seeds()
    assert 0 <= r.seed <= 2**32 - 1 and 0 <= r.lm_seed <= 2**32 - 1
    rep = r.replay("1,2", song=1, variation=2)
    assert (rep.lm_seed, rep.seed, rep.lm_batch_size, rep.synth_batch_size, rep.audio_codes) == (
        r.lm_seed + 1, r.seed + 2, 1, 1, "1,2")
    fixed = req(seed=7, lm_seed=9).resolve_seeds()
    assert (fixed.seed, fixed.lm_seed) == (7, 9)


def test_one_seed_resolver(monkeypatch):
    """The request's -1 seeds and the plan's (`PlanSettings.lm_seed` None or -1) are drawn by the
    same resolver, over the same range 0..SEED_MAX."""
    import secrets

    from mm3.plan.sampling import resolve_seed

    monkeypatch.setattr(secrets, "randbelow", lambda n: n - 1)
    r = req(seed=-1, lm_seed=-1, repaint_seed=-1).resolve_seeds()
    assert (r.seed, r.lm_seed, r.repaint_seed) == (2**32 - 1, 2**32 - 1, -1)  # no repaint: repaint_seed unused
    assert resolve_seed(None) == resolve_seed(-1) == 2**32 - 1 and resolve_seed(5) == 5


def test_plan_fields_invert_plan_settings():
    """The request <-> plan mapping both front ends use: a request's plan and takes, recorded
    again, are the request's own fields; the nodes' sampling options map through the same code."""
    from types import SimpleNamespace

    from mm3.song.request import plan_fields, shaping_of

    r = req(duration=12.0, lm_seed=4, lm_cfg=2.5, lm_top_k=50, lm_temperature=0.9, lm_top_p=0.95, lm_penalty="dry",
            lm_penalty_strength=1.1, lm_penalty_window=300, lm_dry_min_match=20, min_duration=6.0, takes=3,
            require_ending=True, ending_rounds=2).validate()
    fields_ = plan_fields(r.plan_settings(), r.takes_setting())
    assert {k: getattr(r, k) for k in fields_} == fields_
    options = SimpleNamespace(**{k: getattr(r, k) for k in fields_ if k.startswith("lm_")})
    assert shaping_of(options, 6.0) == r.shaping()
    assert shaping_of(SimpleNamespace(**vars(options) | {"lm_penalty": "none"})).penalty_strength == 0.0
