"""Songs packed for ComfyUI-Distributed's collector and unpacked on the master (nodes/song_cards.py),
without ComfyUI: the collector's transport is replayed as it is written (each worker's card through
an 8-bit PNG, the master's card as it is; the audio joined along time, master first)."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from mm3.constants import MAX_AUDIO_FRAMES
from tests.helpers.comfyui import import_pack


@pytest.fixture(scope="module")
def cards():
    return import_pack("nodes.song_cards")


def _song(cards, samples: int, seed: int, variations: int = 2, codes: str = "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16"):
    g = torch.Generator().manual_seed(seed)
    requests = [{"caption": "c", "lyrics": "l", "lm_seed": seed, "seed": 100 + j, "audio_codes": codes}
                for j in range(variations)]
    return {"waveform": torch.randn(variations, 2, samples, generator=g), "sample_rate": 44100,
            cards.AUDIO_REQUESTS_KEY: requests}


def _through_png(card: torch.Tensor) -> torch.Tensor:
    """A worker's card as the master receives it: 255 * value truncated to uint8, a PNG, / 255."""
    buf = io.BytesIO()
    Image.fromarray((255 * card[0].numpy()).astype(np.uint8)).save(buf, format="PNG", compress_level=0)
    return torch.from_numpy(np.array(Image.open(io.BytesIO(buf.getvalue()))).astype(np.float32) / 255.0)[None]


def test_collected_songs_come_apart_exactly(cards):
    """Master (two songs of its own, different lengths) and two workers: every song comes back
    sample for sample with its variations' requests, in the collector's order."""
    servers = [[_song(cards, 1000, 1), _song(cards, 777, 2)], [_song(cards, 901, 3), _song(cards, 1200, 4)],
               [_song(cards, 64, 5), _song(cards, 5, 6)]]
    packed = [cards.pack_songs(songs) for songs in servers]
    for (joined, card), songs in zip(packed, servers):
        assert card.shape == (1, 2 * cards.CARD_ROWS, cards.CARD_WIDTH, 3) and card.dtype == torch.float32
        assert joined["waveform"].shape == (2, 2, sum(s["waveform"].shape[-1] for s in songs))
    collected_cards = torch.cat([packed[0][1]] + [_through_png(c) for _, c in packed[1:]])
    collected = {"waveform": torch.cat([j["waveform"] for j, _ in packed], dim=-1), "sample_rate": 44100}
    got = cards.unpack_songs(collected_cards, collected)
    want = [s for songs in servers for s in songs]
    assert len(got) == 6
    for g, w in zip(got, want):
        assert torch.equal(g["waveform"], w["waveform"])
        assert g[cards.AUDIO_REQUESTS_KEY] == w[cards.AUDIO_REQUESTS_KEY]


def test_a_longest_song_fits_its_card(cards):
    """The codes of a song at the frame cap (random codes: the least compressible) and three
    variations' requests fit one card."""
    rnd = random.Random(0)
    codes = ",".join(str(rnd.randrange(16384) if i % 8 == 0 else rnd.randrange(1024))
                     for i in range(8 * (MAX_AUDIO_FRAMES + 1)))
    song = _song(cards, 10, 7, variations=3, codes=codes)
    for r in song[cards.AUDIO_REQUESTS_KEY]:
        r["caption"], r["lyrics"] = "x" * 12000, "y " * 3000
    joined, card = cards.pack_songs([song])
    (back,) = cards.unpack_songs(_through_png(card), joined)
    assert back[cards.AUDIO_REQUESTS_KEY] == song[cards.AUDIO_REQUESTS_KEY]


def test_audio_without_requests_and_what_does_not_fit(cards):
    """Audio from other nodes (no requests) packs too; a server whose audio did not arrive, an image
    that is not a card and songs of other variation counts are refused, saying what is wrong."""
    plain = {"waveform": torch.ones(1, 2, 50), "sample_rate": 44100}
    joined, card = cards.pack_songs([plain])
    (back,) = cards.unpack_songs(card, joined)
    assert torch.equal(back["waveform"], plain["waveform"]) and cards.AUDIO_REQUESTS_KEY not in back
    two = torch.cat([card, card])
    with pytest.raises(cards.SongCardError, match="holds 50 samples, its 2 cards say 100"):
        cards.unpack_songs(two, joined)
    with pytest.raises(cards.SongCardError, match="not an MM3 song card"):
        cards.unpack_songs(torch.zeros(1, cards.CARD_ROWS, cards.CARD_WIDTH, 3), joined)
    with pytest.raises(cards.SongCardError, match="not an MM3 song card"):
        cards.unpack_songs(torch.zeros(1, 64, 64, 3), joined)
    with pytest.raises(cards.SongCardError, match="song 2: AUDIO \\[2, 2, 9\\]"):
        cards.pack_songs([plain, {"waveform": torch.ones(2, 2, 9), "sample_rate": 44100}])


@pytest.mark.parametrize("payload, message", [
    (b" " * (80 * 2**20), "they inflate past 67108864 bytes"),  # 80 MiB of spaces in a 78 kB card
    (b"[" * 100000 + b"]" * 100000, "a song card nests 100000 levels deep"),
], ids=["zip-bomb", "deep"])
def test_a_hostile_card_is_refused_with_bounded_work(cards, payload, message):
    import zlib

    body = zlib.compress(payload, 9)
    head = cards.MAGIC + bytes([cards.VERSION]) + len(body).to_bytes(4, "big")
    raw = np.zeros(cards.CARD_ROWS * cards.CARD_WIDTH * 3, np.uint8)
    raw[:len(head) + len(body)] = np.frombuffer(head + body, np.uint8)
    card = torch.from_numpy(raw.astype(np.float32) / 255).reshape(cards.CARD_ROWS, cards.CARD_WIDTH, 3)
    with pytest.raises(cards.SongCardError, match=message):
        cards.read_card(card)
