"""Songs packed for a collector that carries one IMAGE batch and one AUDIO per server.

ComfyUI-Distributed's Distributed Collector brings each worker's image batch (as 8-bit PNG) and
its AUDIO (float32, lossless) to the master, and hands on every participant's images as one batch
and their audio joined end to end along time, in the same participant order. Joined audio has
lost where one song ends; the AUDIO's replay requests are not carried at all. So each server joins
its own songs (`pack_songs`) and writes what the master needs to cut them apart again (each song's
length in samples, and the replay request of each of its variations) into a small "card" image;
`unpack_songs` reads the cards and cuts the joined audio into the songs, each with its requests.

A card is one image of `CARD_WIDTH` pixels a row and `CARD_ROWS` rows per song (every server of
a workflow plans as many songs, so every card has the same size, which the collector's batch
needs): each channel value holds one byte, written as (b + 0.5) / 255 so that both the PNG
conversion (which truncates 255 * value) and the master's own card (never converted) read back as b.
The bytes: MAGIC, a version byte, the payload's length (4 bytes, big-endian), then the payload:
zlib-compressed JSON. Without ComfyUI imports (the tests use it directly).
"""

from __future__ import annotations

import json
import zlib

import torch

from mm3.bounded import loads

from .logic import AUDIO_REQUESTS_KEY

MAGIC = b"MM3SONGS"
VERSION = 1
CARD_WIDTH = 256
CARD_ROWS = 256  # per song: 196,608 bytes, room for the compressed codes of a 360 s song
_HEADER = len(MAGIC) + 1 + 4
MAX_CARD_JSON = 64 * 2**20  # the requests a card holds, inflated (a 360 s song's codes are ~0.5 MB)


class SongCardError(ValueError):
    """A card or a joined AUDIO that does not fit the cards."""


def pack_songs(audios: list[dict]) -> tuple[dict, torch.Tensor]:
    """This server's songs (AUDIO dicts, one per song, each [V, C, T_i] with V variations) ->
    (one AUDIO [V, C, sum T_i] joined along time, keeping the requests of every item, and its card
    [1, CARD_ROWS * songs, CARD_WIDTH, 3])."""
    if not audios:
        raise SongCardError("no songs to pack")
    first = audios[0]["waveform"]
    rate = int(audios[0]["sample_rate"])
    songs, codes, requests = [], [], []
    for i, audio in enumerate(audios):
        wave = audio["waveform"]
        if wave.dim() != 3 or wave.shape[:2] != first.shape[:2] or int(audio["sample_rate"]) != rate:
            raise SongCardError(f"song {i + 1}: AUDIO {list(wave.shape)} at {int(audio['sample_rate'])} Hz; every "
                                f"song here must have {first.shape[0]} variations of {first.shape[1]} channels at "
                                f"{rate} Hz, as the first")
        reqs = audio.get(AUDIO_REQUESTS_KEY)
        songs.append({"samples": int(wave.shape[-1]), "requests": None if reqs is None else
                      [_shared_codes(r, codes) for r in reqs]})
        requests += list(reqs or [])
    payload = zlib.compress(json.dumps({"rate": rate, "songs": songs, "codes": codes},
                                       separators=(",", ":")).encode("utf-8"), 9)
    capacity = len(audios) * CARD_ROWS * CARD_WIDTH * 3 - _HEADER
    if len(payload) > capacity:
        raise SongCardError(f"the songs' replay requests take {len(payload)} bytes packed, a card holds {capacity}")
    data = MAGIC + bytes([VERSION]) + len(payload).to_bytes(4, "big") + payload
    raw = torch.zeros(len(audios) * CARD_ROWS * CARD_WIDTH * 3, dtype=torch.uint8)
    raw[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    card = ((raw.float() + 0.5) / 255).view(1, len(audios) * CARD_ROWS, CARD_WIDTH, 3)
    joined = {"waveform": torch.cat([a["waveform"] for a in audios], dim=-1), "sample_rate": rate}
    if all(a.get(AUDIO_REQUESTS_KEY) is not None for a in audios):
        joined[AUDIO_REQUESTS_KEY] = requests
    return joined, card


def _shared_codes(request: dict, codes: list[str]) -> dict:
    """The request with its audio_codes replaced by an index into `codes` (variations share theirs)."""
    text = request.get("audio_codes", "")
    if text not in codes:
        codes.append(text)
    return {**request, "audio_codes": codes.index(text)}


def read_card(card: torch.Tensor) -> dict:
    """One card [H, W, 3] (its PNG round trip or the tensor itself) -> its JSON."""
    if card.dim() != 3 or card.shape[1] != CARD_WIDTH or card.shape[2] != 3 or card.shape[0] % CARD_ROWS:
        raise SongCardError(f"an image of {list(card.shape)} is not an MM3 song card (wire MM3 Pack Songs' card into "
                            "the collector's images)")
    raw = torch.floor(card.float().reshape(-1) * 255 + 0.25).clamp(0, 255).to(torch.uint8)
    head = bytes(raw[:_HEADER].tolist())
    if head[:len(MAGIC)] != MAGIC:
        raise SongCardError("an image of the collected batch is not an MM3 song card (wire MM3 Pack Songs' card into "
                            "the collector's images)")
    if head[len(MAGIC)] != VERSION:
        raise SongCardError(f"song card version {head[len(MAGIC)]}, this pack reads version {VERSION}: update the "
                            "pack on every server")
    n = int.from_bytes(head[len(MAGIC) + 1:], "big")
    if n > raw.numel() - _HEADER:
        raise SongCardError(f"a song card says {n} bytes follow, it holds {raw.numel() - _HEADER}")
    try:
        inflate = zlib.decompressobj()
        text = inflate.decompress(bytes(raw[_HEADER:_HEADER + n].tolist()), MAX_CARD_JSON)
        if inflate.unconsumed_tail:  # a zip bomb, or no card of this pack: its requests are far smaller
            raise ValueError(f"they inflate past {MAX_CARD_JSON} bytes")
        return loads(text, "a song card")
    except (zlib.error, ValueError) as e:
        raise SongCardError(f"a song card's contents do not read back ({e})") from None


def unpack_songs(cards: torch.Tensor, audio: dict) -> list[dict]:
    """The collected cards [P, H, W, 3] and joined AUDIO [V, C, T] -> one AUDIO per song in the
    collector's order (each server's songs in its order), each with its variations' requests."""
    if cards.dim() != 4:
        raise SongCardError(f"expected an IMAGE batch [count, height, width, 3], got {list(cards.shape)}")
    wave, rate = audio["waveform"], int(audio["sample_rate"])
    songs = []
    for p in range(cards.shape[0]):
        info = read_card(cards[p])
        if int(info["rate"]) != rate:
            raise SongCardError(f"card {p + 1} is of audio at {info['rate']} Hz, the collected audio is at {rate} Hz")
        for song in info["songs"]:
            reqs = song["requests"]
            songs.append((int(song["samples"]), None if reqs is None else
                          [{**r, "audio_codes": info["codes"][r["audio_codes"]]} for r in reqs]))
    total = sum(n for n, _ in songs)
    if wave.dim() != 3 or wave.shape[-1] != total:
        raise SongCardError(f"the collected audio holds {wave.shape[-1] if wave.dim() else 0} samples, its "
                            f"{cards.shape[0]} cards say {total}: a server's audio or card did not arrive (see the "
                            "collector's log)")
    out, start = [], 0
    for n, reqs in songs:
        if reqs is not None and len(reqs) != wave.shape[0]:
            raise SongCardError(f"a card lists {len(reqs)} variations, the collected audio has {wave.shape[0]}")
        item = {"waveform": wave[..., start:start + n].clone(), "sample_rate": rate}
        if reqs is not None:
            item[AUDIO_REQUESTS_KEY] = reqs
        out.append(item)
        start += n
    return out
