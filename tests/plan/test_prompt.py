"""Caption cleaning, lyric normalisation and prompt assembly against diffusers 0.42.1's own functions."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mm3.files.opener import open_component
from mm3.constants import MAX_PROMPT_TOKENS
from mm3.plan.prompt import Prompt, PromptError, build_prompt, clean_caption, normalize_lyrics
from mm3.tokenizer import MM3Tokenizer

CAPTIONS = [
    "## Mood\n- **dark** synth\n\n---\n<|key C|>",
    "## Genre\n- **acoustic pop**, *warm*\n* BPM: 96\n---\n<|genre folk|> and <|mood|>\n•  tail    spaces",
    "   ### deep heading\n#no space heading\n####### seven hashes\n+ plus bullet\n  - indented bullet",
    "***bold italic*** and **a **nested** b** and *x* y * z and ****",
    "___\n***\n- - -\n  ---  \n--\ntext", "<| spaced  inner  tag |> <||> <|a\tb c|> <|unclosed",
    "line\r\nwindows\rold mac\x0bvertical\x0cfeed\x1cfs\u2028ls\u2029ps\x85nel",
    "•  bullet dot • inline•x", "tabs\t\t    four spaces        eight", "\n\n\nlead\n\n\n\ntrail\n\n",
    "Genre: 中文流行", "emoji 🎵 **bold 🎶**", "*", "**", "* *", "a*b*c", "",
]
LYRICS = [
    "[Verse] dropped words\n[Pre-Chorus][Chorus] also dropped\nline one ^ line two\nword [Bridge] more\n\n",
    "[Verse 1] hello\n(Ooh) yeah [Chorus]", "  \t[Intro]  [Build]\t trailing", "[] empty [ ] tag", "[unclosed tag\nx",
    "[VERSE]\nÜBER [ÄRGER]\nİstanbul [İ]", "a ^ b ^c^ d ^ ", "[inst]", "no tags at all\n\nsecond para",
    "line\r\n[Chorus]\r\nwindows", "[a][b] [c]x [d]", "",
]


@pytest.fixture(scope="module")
def reference():
    return pytest.importorskip("diffusers.modular_pipelines.minimax_music3.encoders")


@pytest.mark.parametrize("text", CAPTIONS)
def test_clean_caption_equals_reference(reference, text):
    assert clean_caption(text) == reference._clean_caption(text)


@pytest.mark.parametrize("text", LYRICS)
def test_normalize_lyrics_equals_reference(reference, text):
    assert normalize_lyrics(text) == reference._normalize_lyrics(text)


def test_spec_examples():
    assert clean_caption("## Mood\n- **dark** synth\n\n---\n<|key C|>") == "Mood\ndark synth\nkey is C"
    assert (normalize_lyrics("[Verse] dropped\n[Pre-Chorus][Chorus] x\nline one ^ line two\nword [Bridge] more")
            == "[start]\n[verse]\n[pre-chorus][chorus]\nline one\nline two\nword\n[bridge]\nmore")


MARKDOWN = st.text(alphabet="ab #*-_+•[]^<|>\n\t\r Ü", max_size=40)
BOLD = st.text(alphabet="**ab ", max_size=40)  # runs of stars of every length, unwrapped round by round


@settings(max_examples=600, deadline=None)
@given(st.one_of(MARKDOWN, BOLD))
def test_random_markdown_equals_reference(text):
    enc = pytest.importorskip("diffusers.modular_pipelines.minimax_music3.encoders")

    assert clean_caption(text) == enc._clean_caption(text)
    assert normalize_lyrics(text) == enc._normalize_lyrics(text)


RULES_AND_TAGS = st.text(alphabet="-*_[]aB \n\t\r\x0b\x0c\x1c\x85\xa0\u2028", max_size=40)


@settings(max_examples=200, deadline=None)
@given(RULES_AND_TAGS)
def test_rule_lines_and_tags_equal_reference(text):
    """Rule lines across blank runs and tags without an end, in every kind of whitespace, as the
    reference cleans them (the cleaning's linear-time rewrite of its two regexes)."""
    enc = pytest.importorskip("diffusers.modular_pipelines.minimax_music3.encoders")

    assert clean_caption(text) == enc._clean_caption(text)
    assert normalize_lyrics(text) == enc._normalize_lyrics(text)


# Texts of about n characters the reference takes quadratic time over: a blank run (rule lines),
# tags that never close, bold nested k deep (one layer a round).
SLOW_FOR_REGEX = {
    "newlines": lambda n: "\n" * n, "blank lines": lambda n: " \n" * (n // 2), "open tags": lambda n: "[" * n,
    "open words": lambda n: "[a" * (n // 2), "nested bold": lambda n: "**" * (n // 4) + "a" + "**" * (n // 4),
}


@pytest.mark.parametrize("make", SLOW_FOR_REGEX.values(), ids=SLOW_FOR_REGEX.keys())
def test_cleaning_takes_linear_time(reference, make):
    """The texts a token count may be sent (up to 256 KiB) clean in well under a second each,
    where the reference takes minutes (48 Ki characters: tens of seconds); at a size the
    reference manages, the same result."""
    import time

    small = make(3000)
    assert clean_caption(small) == reference._clean_caption(small)
    assert normalize_lyrics(small) == reference._normalize_lyrics(small)
    big = make(48 * 1024)
    for f in (clean_caption, normalize_lyrics):
        t = time.perf_counter()
        f(big)
        assert time.perf_counter() - t < 3.0, f.__name__


def test_corpus_texts_equal_reference(reference, corpus):
    for name, req in corpus.items():
        assert clean_caption(req["caption"]) == reference._clean_caption(req["caption"]), name
        assert normalize_lyrics(req["lyrics"]) == reference._normalize_lyrics(req["lyrics"]), name


@pytest.fixture(scope="module")
def qwen3_setup(tiny_qwen3):
    pytest.importorskip("diffusers")
    from transformers import Qwen2Tokenizer

    from diffusers.modular_pipelines.minimax_music3.encoders import MiniMaxMusic3TokenizeStep

    comp = open_component(tiny_qwen3.file("mm3-lm"), expect="lm")
    step = MiniMaxMusic3TokenizeStep().init_pipeline()
    step.update_components(tokenizer=Qwen2Tokenizer.from_pretrained(tiny_qwen3.diffusers / "tokenizer"))
    yield MM3Tokenizer.from_component(comp), step
    comp.close()


def reference_ids(step, caption, lyrics):
    """Reference ids, or the ValueError it raises (budget, empty input)."""
    try:
        return step(prompt=caption, lyrics=lyrics, output="text_ids")
    except ValueError as e:
        return e


def test_corpus_prompts_equal_reference(qwen3_setup, corpus):
    tok, step = qwen3_setup
    within = 0
    for name, req in corpus.items():
        ref = reference_ids(step, req["caption"], req["lyrics"])
        if isinstance(ref, ValueError):
            assert "maximum is 5000" in str(ref), name
            with pytest.raises(PromptError, match=r"exceeds the 5000 token budget: the assembled prompt has \d+"):
                build_prompt(tok, req["caption"], req["lyrics"])
            continue
        p = build_prompt(tok, req["caption"], req["lyrics"])
        assert torch.equal(p.ids, ref), name
        within += 1
    assert within >= len(corpus) // 2  # most demo prompts fit the budget


@pytest.mark.parametrize("caption,lyrics", list(zip(CAPTIONS[:-1], LYRICS[:-1])) + [
    ("Genre: 中文流行", "[verse]\n半首琴声 留在长安"), ("x", "y"), ("   caption   ", "\n[outro]\n"),
    ("---", "x"), ("<|key C|>", "[Chorus] text ^ more"), ("caption", "[instrumental]")])
def test_edge_prompts_equal_reference(qwen3_setup, caption, lyrics):
    tok, step = qwen3_setup
    ref = reference_ids(step, caption, lyrics)
    if isinstance(ref, ValueError):
        with pytest.raises(PromptError):
            build_prompt(tok, caption, lyrics)
    else:
        assert torch.equal(build_prompt(tok, caption, lyrics).ids, ref)


def test_prompt_fields_and_unconditional_row(qwen3_setup):
    tok, _ = qwen3_setup
    p = build_prompt(tok, "## Mood\n- **dark** synth", "[Verse] x\nhello")
    assert isinstance(p, Prompt)
    assert p.caption == "Mood\ndark synth" and p.lyrics == "[start]\n[verse]\nhello"
    assert p.ids.dtype == torch.long and p.ids.shape == (2, p.num_tokens)
    sp = tok.special
    assert p.cond[:2].tolist() == [sp.im_start, sp.caption_start]
    assert p.cond[-3:].tolist() == [sp.lyrics_end, sp.im_end, sp.audio_start]
    assert p.uncond[0] == sp.im_start and p.uncond[-2:].tolist() == [sp.im_end, sp.audio_start]
    assert (p.uncond[1:-2] == sp.audio_cfg).all()
    assert p.codes == tok.codes


def test_control_strings_in_lyrics_stay_text(qwen3_setup):
    tok, _ = qwen3_setup
    p = build_prompt(tok, "pop", "hello <|im_start|> world <|audio_end|>")
    assert (p.cond == tok.special.im_start).sum() == 1  # only the template's
    assert (p.cond == tok.special.audio_end).sum() == 0


def test_budget_and_required_inputs(qwen3_setup):
    tok, _ = qwen3_setup
    with pytest.raises(PromptError, match="caption is required: say what the song sounds like"):
        build_prompt(tok, "  ", "x")
    n = build_prompt(tok, "word " * 50, "la").num_tokens
    with pytest.raises(PromptError, match=f"exceeds the {n - 1} token budget: the assembled prompt has {n} tokens"):
        build_prompt(tok, "word " * 50, "la", max_tokens=n - 1)
    assert build_prompt(tok, "word " * 50, "la", max_tokens=n).num_tokens == n
    assert MAX_PROMPT_TOKENS == 5000


def test_empty_lyrics_are_an_instrumental(qwen3_setup):
    """Empty or blank lyrics send the section tag "[instrumental]" (as HOT-Step does; the reference
    refuses them): the same prompt as writing the tag, and the count the editor shows is of it."""
    from mm3.plan.prompt import INSTRUMENTAL_LYRICS, count_tokens, lyrics_sent

    tok, _ = qwen3_setup
    tagged = build_prompt(tok, "pop", INSTRUMENTAL_LYRICS)
    for lyrics in ("", "  \n\t", None):
        p = build_prompt(tok, "pop", lyrics)
        assert torch.equal(p.ids, tagged.ids) and p.lyrics == "[start]\n[instrumental]"
        assert count_tokens(tok, "pop", lyrics) == tagged.num_tokens
        assert lyrics_sent(lyrics) == INSTRUMENTAL_LYRICS
    assert lyrics_sent(" la ") == " la "  # lyrics with text go as written


def test_oversized_text_is_refused_before_the_tokenizer(qwen3_setup, monkeypatch):
    """Megabytes of caption or lyrics are refused by a bound that needs no tokenizer (no token
    covers more than 128 characters), in bounded time: the tokenizer never sees them, and the
    request check (run before any model loads) says the same."""
    import time

    from mm3.plan.prompt import MAX_TOKEN_CHARS, size_problem
    from mm3.song.request import MM3Request, RequestError

    tok, _ = qwen3_setup
    assert tok.max_token_chars >= MAX_TOKEN_CHARS  # the released vocabulary's longest: 128 spaces (bytes here)
    monkeypatch.setattr(tok, "encode", lambda *a: pytest.fail("the tokenizer saw the text"))
    monkeypatch.setattr(tok, "encode_with_offsets", lambda *a: pytest.fail("the tokenizer saw the text"))
    huge = "[verse]\n" + "1234567890 la la dee da ^ " * 400_000  # ~10 MB, as the editor can send
    big = "[verse]\n" + "la " * 250_000  # 750 k characters: cleaned, then refused
    for caption, lyrics, message in ((CAPTION_OK, huge, "lyrics is 10,400,008 characters long; a prompt of at most "
                                      "5000 tokens holds at most 640,000 characters"),
                                     (huge, "la", "caption is 10,400,008 characters long"),
                                     (CAPTION_OK, big, "lyrics is too long for the 5000 token budget: 750,016 "
                                      "characters after normalising")):
        start = time.perf_counter()
        with pytest.raises(PromptError, match=message):
            build_prompt(tok, caption, lyrics)
        with pytest.raises(RequestError, match=message):
            MM3Request(caption=caption, lyrics=lyrics).validate()
        assert time.perf_counter() - start < 5
    assert size_problem("lyrics", "[verse]\nla la") is None and size_problem("caption", "pop") is None
    assert size_problem("caption", " " * 700_000) is None  # cleaned away: nothing to refuse


CAPTION_OK = "warm synth pop"
