"""Property tests (hypothesis): prompt normalisation against diffusers 0.42.1 and its invariants,
the `audio_codes` text round trip and its rejections, and that no input of any shape makes the
request or prompt code raise anything but its own clear error."""

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mm3.plan.codes import AudioCodes, AudioCodesError, count_code_frames, parse_audio_codes
from mm3.plan.prompt import PromptError, build_prompt, clean_caption, normalize_lyrics
from mm3.song.request import MM3Request, RequestError

enc = pytest.importorskip("diffusers.modular_pipelines.minimax_music3.encoders")

# Text built from the pieces the cleaning rules react to, mixed with arbitrary characters: random
# text alone almost never forms "## ", "<|a b|>" or "[Verse] ".
PIECES = ["## ", "# ", "####### ", "- ", "* ", "+ ", "**", "*", "---", "___", "<|", "|>", "<|key C|>", "[", "]",
          "[Verse]", "[CHORUS 2]", " ^ ", "^", "\n", "\r\n", "\r", "\n\n\n", "    ", "  ", "• ", "\t", " ", "İ",
          "ẞ", "Σ", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029", "word", "Ü"]
MARKDOWNISH = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)), max_size=25).map("".join)
pytestmark = pytest.mark.slow  # hundreds of examples per property
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- prompt normalisation -----------------------------------------------------------------------
@SETTINGS
@given(MARKDOWNISH)
def test_clean_caption_equals_diffusers_and_keeps_its_invariants(text):
    out = clean_caption(text)
    assert out == enc._clean_caption(text)
    assert "\n\n" not in out  # blank lines collapsed
    assert "    " not in out  # 4-space runs deleted (a run of n keeps n mod 4)
    assert not re.search("[\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]", out)  # other line breaks became \n


@SETTINGS
@given(MARKDOWNISH)
def test_normalize_lyrics_equals_diffusers_and_keeps_its_invariants(text):
    out = normalize_lyrics(text)
    assert out == enc._normalize_lyrics(text)
    assert out.startswith("[start]\n")
    body = out[len("[start]\n"):]
    for m in re.finditer(r"\[([^\]]+)\]", body):
        assert m.group(1) == m.group(1).lower()  # tags lower-cased
    assert " ^ " not in body and "] " not in body and " [" not in body  # breaks at tags and " ^ "


WORD = st.text(alphabet="abcXYZ019,.'!?éü中", min_size=1, max_size=6)
PLAIN_LINE = st.lists(WORD, min_size=1, max_size=5).map(" ".join)


@SETTINGS
@given(st.lists(PLAIN_LINE, min_size=1, max_size=6).map("\n".join))
def test_plain_text_passes_unchanged(text):
    """Lines of words (no markdown, tags, brackets or '^') are left exactly as they are."""
    assert clean_caption(text) == text
    assert normalize_lyrics(text) == "[start]\n" + text


# -- build_prompt on any text -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny):
    from mm3.tokenizer import MM3Tokenizer

    return MM3Tokenizer.from_gguf(tiny.file("mm3-lm"))


# Any text, lone surrogates (as JSON "\ud800" yields) and control characters included.
ANY_TEXT = st.one_of(st.text(max_size=40), st.text(st.characters(categories=["Cs", "Cc", "L", "Zs"]), max_size=20))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ANY_TEXT, ANY_TEXT)
def test_build_prompt_on_any_text(tokenizer, caption, lyrics):
    """Either a prompt (ids of the tokenizer's vocabulary) or PromptError: for empty input, for a
    lone surrogate (not Unicode text) and for nothing else here."""
    surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in caption + lyrics)
    try:
        p = build_prompt(tokenizer, caption, lyrics)
    except PromptError as e:
        assert not caption.strip() or not lyrics.strip() or (surrogate and "unpaired surrogate" in str(e))
        return
    assert not surrogate
    assert p.ids.shape == (2, p.num_tokens) and int(p.ids.min()) >= 0 and int(p.ids.max()) < len(tokenizer)


# -- audio_codes --------------------------------------------------------------------------------
SEM, AUD = 64, 1024  # the tiny model's semantic codes; the released depth decoder's acoustic vocabulary


@st.composite
def code_rows(draw):
    rows = draw(st.integers(2, 40))
    values = draw(st.lists(st.integers(0, AUD - 1), min_size=rows * 8, max_size=rows * 8))
    codes = torch.tensor(values).view(rows, 8)
    codes[:, 0] %= SEM
    return codes


@SETTINGS
@given(code_rows(), st.sampled_from([",", ", ", ",\n", " ,\t", ",\r\n"]), st.booleans())
def test_codes_round_trip(codes, sep, trailing):
    text = AudioCodes(codes, None, None).to_request_codes()
    assert torch.equal(parse_audio_codes(text, SEM, AUD), codes)
    assert count_code_frames(text) == codes.shape[0]
    spaced = sep.join(text.split(",")) + ("," if trailing else "")  # any spacing, a trailing comma
    assert torch.equal(parse_audio_codes(spaced, SEM, AUD), codes)


BAD_ITEMS = st.sampled_from(["", "x", "1.5", "--1", "1-", "+3", "0x10", "1 2", "٣", "1e3", "\u00a0", "NaN"])


@SETTINGS
@given(code_rows(), st.data())
def test_codes_rejections_name_the_problem(codes, data):
    items = AudioCodes(codes, None, None).to_request_codes().split(",")
    i = data.draw(st.integers(0, len(items) - 1))
    # a malformed item anywhere
    bad = data.draw(BAD_ITEMS)
    if bad == "" and i == len(items) - 1:
        bad = "x"  # an empty last item is a tolerated trailing comma
    with pytest.raises(AudioCodesError, match=r"^Invalid audio_codes"):
        parse_audio_codes(",".join(items[:i] + [bad] + items[i + 1:]), SEM, AUD)
    # a count that is not whole frames
    extra = data.draw(st.integers(1, 7))
    with pytest.raises(AudioCodesError, match=r"^audio_codes needs 8 codes per frame, at least 2 frames"):
        parse_audio_codes(",".join(items + ["0"] * extra), SEM, AUD)
    # a value out of range, named by frame and position
    f, p = divmod(i, 8)
    limit = SEM if p == 0 else AUD
    value = data.draw(st.one_of(st.integers(limit, 10**17), st.integers(-10**17, -1)))
    with pytest.raises(AudioCodesError, match=rf"^audio_codes frame {f} position {p}: .* {value} is out of range "
                                              rf"0\.\.{limit - 1}$"):
        parse_audio_codes(",".join(items[:i] + [str(value)] + items[i + 1:]), SEM, AUD)


@SETTINGS
@given(st.one_of(st.text(alphabet="0123456789,- \n", max_size=200), st.text(max_size=60)))
def test_codes_any_text_parses_or_is_refused(text):
    try:
        codes = parse_audio_codes(text, SEM, AUD)
    except AudioCodesError as e:
        assert str(e)
        return
    assert codes.dtype == torch.long and codes.shape[1] == 8 and codes.shape[0] >= 2
    assert int(codes[:, 0].max()) < SEM and int(codes.max()) < AUD and int(codes.min()) >= 0


# -- requests -----------------------------------------------------------------------------------
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) |
                           st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                      max_size=3), max_leaves=5)
FIELDS = [f for f in MM3Request.__dataclass_fields__]


@SETTINGS
@given(st.dictionaries(st.sampled_from(FIELDS + ["extra"]), JSON_VALUES, max_size=8),
       st.fixed_dictionaries({"caption": st.sampled_from(["pop", ""]), "lyrics": st.sampled_from(["la", " "])}))
def test_any_json_request_is_valid_or_refused_clearly(fields, text):
    """Any JSON object: a RequestError that names a field, or a request that validates."""
    body = json.dumps({**text, **fields})
    try:
        MM3Request.from_json(body).validate()
    except RequestError as e:
        msg = str(e)
        assert msg == "Malformed JSON" or any(name in msg for name in FIELDS), msg
