"""The prompt tokenizer: Qwen2 byte-level BPE built from the LM GGUF's token list and merges.

As the reference (transformers `Qwen2Tokenizer`): NFC, the Qwen2 split regex (each digit alone),
GPT-2 byte-to-unicode mapping, BPE merges by rank. One deliberate difference: no added or special
token is ever matched inside user text (the reference would turn a literal "<|im_start|>" in the
lyrics into the control token); special ids, found by their strings in `tokenizer.ggml.tokens`,
enter only through the template (`mm3.plan.prompt`). Semantic code c is LM token `code_offset + c`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .constants import SEMANTIC_VOCAB_SIZE
from .filecache import FileCache
from .formats.gguf.errors import ComponentError

# Qwen2 pre-tokenizer split (transformers `PRETOKENIZE_REGEX`): each digit alone.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")

# Control tokens the template and the sampler use, by role (strings of the released tokenizer).
SPECIAL_TOKENS = {
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "caption_start": "<|caption_start|>",
    "caption_end": "<|caption_end|>",
    "lyrics_start": "<|lyrics_start|>",
    "lyrics_end": "<|lyrics_end|>",
    "audio_start": "<|audio_start|>",
    "audio_end": "<|audio_end|>",  # END of the song: the sampler's stop token
    "audio_cfg": "<|audio_cfg|>",  # filler of the unconditional prompt
}


@dataclass(frozen=True)
class SpecialIds:
    im_start: int
    im_end: int
    caption_start: int
    caption_end: int
    lyrics_start: int
    lyrics_end: int
    audio_start: int
    audio_end: int
    audio_cfg: int


@dataclass(frozen=True)
class CodeSpace:
    """Where audio codes live in the LM vocabulary, and how many there are of each kind."""

    code_offset: int  # LM id of semantic code 0
    num_semantic: int  # semantic codes c0 in [0, num_semantic)
    end_id: int  # LM id of <|audio_end|>
    lm_vocab_size: int


class MM3Tokenizer:
    """Byte-level BPE over plain text plus the special ids and the code space of one LM file.

    `tokens`: `tokenizer.ggml.tokens` (byte-level strings, index = id); `merges`: "a b" strings in
    rank order; `lm_vocab_size`: rows of the LM head (codes sit between the token list's end and it).
    """

    def __init__(self, tokens: list[str], merges: list[str], lm_vocab_size: int, *, source: str = "tokenizer"):
        from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
        from tokenizers.models import BPE

        self.source = source
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            if tok in vocab:
                raise ComponentError(f"{source}: token {tok!r} appears twice (ids {vocab[tok]} and {i})")
            vocab[tok] = i
        pairs = []
        for rank, m in enumerate(merges):
            parts = m.split(" ")
            if len(parts) != 2 or not all(parts):
                raise ComponentError(f"{source}: merge #{rank} {m!r} is not two tokens separated by one space")
            pairs.append((parts[0], parts[1]))
        self.vocab = vocab
        self.tokens = list(tokens)
        ids = {}
        for role, text in SPECIAL_TOKENS.items():
            if text not in vocab:
                raise ComponentError(f"{source}: the token list has no {text} (needed for the prompt template)")
            ids[role] = vocab[text]
        self.special = SpecialIds(**ids)

        self.code_offset = len(tokens)
        num_semantic = min(SEMANTIC_VOCAB_SIZE, int(lm_vocab_size) - self.code_offset)
        if num_semantic <= 0:
            raise ComponentError(f"{source}: LM vocab_size {lm_vocab_size} leaves no room for audio codes after "
                                 f"the {self.code_offset} text tokens")
        if self.special.audio_end >= lm_vocab_size:
            raise ComponentError(f"{source}: <|audio_end|> id {self.special.audio_end} is outside the LM vocab "
                                 f"({lm_vocab_size})")
        self.codes = CodeSpace(self.code_offset, num_semantic, self.special.audio_end, int(lm_vocab_size))

        bpe = BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None, continuing_subword_prefix="",
                  end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
        tk = Tokenizer(bpe)
        tk.normalizer = normalizers.NFC()
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tk.decoder = decoders.ByteLevel()
        self._tk = tk  # no added tokens: nothing in user text can become a control token

    @classmethod
    def from_component(cls, component) -> "MM3Tokenizer":
        """From an opened `mm3-lm` component; built once per file (path, size, mtime)."""
        f = component.file
        return _TOKENIZERS.get(component.path, lambda st: cls(f.strings("tokenizer.ggml.tokens"), _merges(f),
                                                              component.hparams["vocab_size"], source=component.path))

    @classmethod
    def from_gguf(cls, path) -> "MM3Tokenizer":
        from .files.opener import open_component

        comp = open_component(path, expect="lm", header_only=True)  # the tokenizer is metadata
        try:
            return cls.from_component(comp)
        finally:
            comp.close()

    def encode(self, text: str) -> list[int]:
        """Ids of plain text (control-token strings in it are encoded as ordinary text). Through
        `encode_batch`, the same ids as `encode`, which releases the GIL while it works: a long
        text tokenized on a worker thread leaves the caller's other threads running."""
        if not text:
            return []
        return self._tk.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and, per id, the characters (start, stop) of `text` it came from (a byte
        of a multi-byte character names that whole character)."""
        if not text:
            return [], []
        enc = self._tk.encode_batch([text], add_special_tokens=False)[0]
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self):
        return (f"MM3Tokenizer({len(self.tokens)} tokens, code offset {self.code_offset}, "
                f"{self.codes.num_semantic} semantic codes, from {self.source})")


def _merges(f) -> list[str]:
    # A vocabulary without merges (pure byte-level) may omit the key altogether.
    return f.strings("tokenizer.ggml.merges") if "tokenizer.ggml.merges" in f.metadata else []


_TOKENIZERS = FileCache(1)  # one LM at a time is the common case; keep memory bounded
