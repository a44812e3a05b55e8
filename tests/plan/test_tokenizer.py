"""The GGUF-built tokenizer against the HF Qwen2 tokenizer of the same vocabulary (the reference's)."""

import json
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mm3.files.opener import open_component
from mm3.formats.gguf.errors import ComponentError
from mm3.plan.prompt import normalize_lyrics
from mm3.constants import SEMANTIC_VOCAB_SIZE
from mm3.tokenizer import SPECIAL_TOKENS, MM3Tokenizer

ADVERSARIAL = [
    "Hello world", "  leading and   inner   spaces  ", "trailing newlines\n\n\n", "\n", " ", "a",
    "中文流行 半首琴声 留在长安", "日本語のテキスト、カタカナ", "한국어 노래 가사", "مرحبا بالعالم",
    "emoji 🎵🎶🔥 and 👩‍👩‍👧 family", "digits 1234567890 and 3.14159 and 1,000,000",
    "１２３ fullwidth ½ x² ⅷ",
    "it's I'M you're we've they'll he'd she'S 'sun 'tis", "don’t curly apostrophe’s",
    "CRLF line\r\nnext\r\n\r\nend", "tabs\tand\t\ttabs", "zero\u200bwidth\u200b space", "non\u00a0breaking\u00a0space",
    "e\u0301 combining (NFC -> é) and cafe\u0301", "Å vs A\u030a", "mixed\u3000ideographic space",
    "punctuation!!! ??? ... --- *** ### [] () {}", "path/like/thing.ext", "<|im_start|> literal",
    "<|caption_start|>x<|caption_end|>", "<|endoftext|>", "\x00\x01 control\x7f", "\u2028line sep\u2029para",
    "[verse]\nline one\n[chorus]\nla la la", "  \n  \t  \n", "ALL CAPS SHOUTING", "a" * 300,
]


def hf_tokenizer(diffusers_dir):
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer.from_pretrained(diffusers_dir / "tokenizer")


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3):
    comp = open_component(tiny_qwen3.file("mm3-lm"), expect="lm")
    tok = MM3Tokenizer.from_component(comp)
    yield tok, hf_tokenizer(tiny_qwen3.diffusers), comp
    comp.close()


@pytest.fixture(scope="module")
def small(tiny):
    comp = open_component(tiny.file("mm3-lm"), expect="lm")
    yield MM3Tokenizer.from_component(comp), hf_tokenizer(tiny.diffusers), comp
    comp.close()


def hf_ids(hf, text):
    return hf(text, add_special_tokens=False)["input_ids"]


def test_special_ids_looked_up_in_vocabulary(qwen3, small):
    for tok, hf, comp in (qwen3, small):
        for role, text in SPECIAL_TOKENS.items():
            assert getattr(tok.special, role) == hf.convert_tokens_to_ids(text), role
    tok = qwen3[0]
    assert (tok.special.im_start, tok.special.audio_cfg, tok.special.audio_end) == (151644, 151654, 151670)
    assert small[0].special.im_start == 257  # the small tiny puts the ten specials at 256..265


def test_code_space(qwen3, small):
    for tok, hf, comp in (qwen3, small):
        vocab = comp.hparams["vocab_size"]
        assert tok.code_offset == len(comp.file.strings("tokenizer.ggml.tokens"))
        assert tok.codes.num_semantic == min(SEMANTIC_VOCAB_SIZE, vocab - tok.code_offset)
        assert tok.codes.end_id == tok.special.audio_end
    assert qwen3[0].code_offset == 151675
    assert small[0].code_offset == 266


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_encode_equals_hf_qwen2(qwen3, small, text):
    for tok, hf, _ in (qwen3, small):
        if any(s in text for s in hf.all_special_tokens + list(SPECIAL_TOKENS.values())):
            continue  # HF matches control tokens in text; covered by test_no_control_token_from_text
        assert tok.encode(text) == hf_ids(hf, text)


def test_corpus_equals_hf_qwen2(qwen3, corpus):
    tok, hf, _ = qwen3
    for name, req in corpus.items():
        for text in (req["caption"], req["lyrics"], normalize_lyrics(req["lyrics"])):
            assert tok.encode(text) == hf_ids(hf, text), name


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="<|>"), max_size=60))
def test_random_text_equals_hf_qwen2(qwen3, text):
    tok, hf, _ = qwen3
    assert tok.encode(text) == hf_ids(hf, text)


@pytest.mark.parametrize("text", ["<|im_start|>", "lyrics <|im_end|><|audio_start|> more", "<|audio_end|>",
                                  "<|endoftext|>", "<think>x</think>"])
def test_no_control_token_from_text(qwen3, text):
    tok = qwen3[0]
    ids = tok.encode(text)
    assert not set(ids) & set(vars(tok.special).values())
    assert all(i < 151643 for i in ids)  # base BPE ids only (Qwen3 base vocabulary size)
    assert tok.decode(ids) == text
    assert len(ids) > 1


@pytest.mark.parametrize("text", [t for t in ADVERSARIAL if "\x00" not in t])
def test_decode_roundtrip(qwen3, text):
    tok = qwen3[0]
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_errors_name_the_problem():
    byte_tokens = [chr(0x100 + i) for i in range(10)]
    with pytest.raises(ComponentError, match=r"no <\|im_start\|>"):
        MM3Tokenizer(byte_tokens, [], 100, source="x.gguf")
    specials = list(SPECIAL_TOKENS.values())
    with pytest.raises(ComponentError, match="leaves no room"):
        MM3Tokenizer(byte_tokens + specials, [], len(byte_tokens) + len(specials), source="x.gguf")
    with pytest.raises(ComponentError, match="appears twice"):
        MM3Tokenizer(byte_tokens + specials + ["a", "a"], [], 100, source="x.gguf")
    with pytest.raises(ComponentError, match="merge #0"):
        MM3Tokenizer(byte_tokens + specials, ["abc"], 100, source="x.gguf")


def test_cached_per_file(tiny):
    a = open_component(tiny.file("mm3-lm"), expect="lm")
    b = open_component(tiny.file("mm3-lm"), expect="lm")
    try:
        assert MM3Tokenizer.from_component(a) is MM3Tokenizer.from_component(b)
    finally:
        a.close()
        b.close()


def test_small_vocab_constants_agree(tiny, small):
    consts = json.loads((tiny.diffusers / "test_constants.json").read_text())
    tok = small[0]
    assert consts == {"_AUDIO_CFG_TOKEN_ID": tok.special.audio_cfg, "_AUDIO_END_TOKEN_ID": tok.special.audio_end,
                      "_AUDIO_CODE_OFFSET": tok.code_offset}
