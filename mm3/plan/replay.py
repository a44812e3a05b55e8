"""Teacher forcing: known codes fed through the LM and the depth decoder, as a song's frames are fed
back while it is planned. `replay` (and `Replayer`, fed as the codes come) rebuilds the frame
hiddens of known codes (what the DiT is conditioned on) and, with lyric heads or a tap, reads the
LM's attention on the way; `feed_frames` puts known frames into a plan's KV cache (a song
continued).
"""

from __future__ import annotations

import torch

from .codes import AudioCodes
from ..backends.device import model_device
from .lyrics_align import LyricAttention, LyricHeads
from ..backends.cpu.matmul import CPU_SCRATCH, onednn_matmul
from ..models.depth import RVQDepthDecoder
from ..models.lm import AttentionTap, KVCache, Qwen3LM
from ..progress import Cancelled, Progress
from .prompt import Prompt


def check_pair(lm: Qwen3LM, depth: RVQDepthDecoder, prompt: Prompt):
    if lm.hidden_size != depth.hidden_size:
        raise ValueError(f"LM hidden_size {lm.hidden_size} does not match the depth decoder's {depth.hidden_size}")
    if prompt.codes.lm_vocab_size != lm.vocab_size:
        raise ValueError(f"the prompt was built for an LM vocabulary of {prompt.codes.lm_vocab_size}, "
                         f"this LM has {lm.vocab_size}")
    if lm.numerics != depth.numerics:
        raise ValueError(f"the LM was loaded for {lm.numerics!r} numerics and the depth decoder for "
                         f"{depth.numerics!r}; load both the same way")


def frame_feedback(lm: Qwen3LM, depth: RVQDepthDecoder, frame_codes: torch.Tensor, off: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """[rows, num_codebooks] codes -> LM input [rows, 1, H]: (LM embedding of the semantic id + the
    acoustic embeddings) * num_codebooks ** -0.5, in the reference's operation order."""
    emb = lm.embed(frame_codes[:, :1] + off, dtype)  # [rows, 1, H]
    shift = torch.arange(depth.num_codebooks - 1, device=frame_codes.device)[None] * depth.audio_vocab
    extra = depth.audio_embeddings.lookup(frame_codes[:, 1:] + shift, dtype).sum(dim=1, keepdim=True)
    return (emb + extra.to(emb.dtype)) * depth.num_codebooks ** -0.5


def checked_codes(codes: torch.Tensor, cs, depth: RVQDepthDecoder, what: str = "codes") -> torch.Tensor:
    """codes as CPU int64 [F + 1, ncb] (F >= 1) within the code ranges, else ValueError."""
    ncb = depth.num_codebooks
    codes = codes.cpu().long()
    if codes.ndim != 2 or codes.shape[1] != ncb or codes.shape[0] < 2:
        raise ValueError(f"{what} must be [frames + 1, {ncb}] with at least 2 rows, got {list(codes.shape)}")
    limits = torch.tensor([cs.num_semantic] + [depth.audio_vocab] * (ncb - 1))
    if ((codes < 0) | (codes >= limits)).any():
        raise ValueError(f"{what} out of range (c0 < {cs.num_semantic}, c1.. < {depth.audio_vocab})")
    return codes


def feed_frames(lm: Qwen3LM, depth: RVQDepthDecoder, codes: torch.Tensor, off: int, dtype: torch.dtype,
                 cache: KVCache, chunk: int = 512) -> torch.Tensor:
    """Teacher-force known frames into every CFG row of `cache`; returns the state after the last
    one [rows, H] (what predicts the next frame)."""
    last = None
    for a in range(0, codes.shape[0], chunk):
        fed = frame_feedback(lm, depth, codes[a:a + chunk], off, dtype).transpose(0, 1)  # [1, m, H]
        last = lm(fed.expand(cache.rows, -1, -1).contiguous(), cache)[:, -1]
    return last


REPLAY_CHUNK = 100  # frames per teacher-forced pass; divides the flow windows' hop, so every window's frames
#                    are replayed, with the same shapes, as soon as they are planned (`Replayer`)


class Replayer:
    """The teacher-forced replay of one song fed as its codes come (`feed`): frames are replayed
    in passes of `REPLAY_CHUNK` frames at fixed boundaries (0, 100, 200, ...; the last pass takes
    the rest once the song is final), so the hiddens are the same bits whether the codes were fed
    at once (`replay`) or chunk by chunk while the song is planned. `hiddens` [replayed, ncb, H]."""

    def __init__(self, lm: Qwen3LM, depth: RVQDepthDecoder, prompt: Prompt, capacity: int, *,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 progress: Progress | None = None, total: int | None = None,
                 lyric_heads: LyricHeads | None = None, tap: AttentionTap | None = None, hiddens: bool = True):
        check_pair(lm, depth, prompt)
        self.device = model_device(lm) if device is None else torch.device(device)
        n_prompt = prompt.num_tokens
        if n_prompt + capacity > lm.max_positions:
            raise ValueError(f"{capacity} frames after a {n_prompt}-token prompt exceed the LM context {lm.max_positions}")
        self.lm, self.depth, self.prompt, self.dtype = lm, depth, prompt, dtype
        self.progress, self.total = progress or Progress(), total or capacity
        self.cache = None
        self.capacity = capacity
        self.out = torch.empty(capacity, depth.num_codebooks, lm.hidden_size, dtype=dtype, device=self.device) \
            if hiddens else None
        self.replayed = 0  # frames whose hiddens are in `out`
        self.lyrics = None if lyric_heads is None else LyricAttention(prompt, lyric_heads.resolve(lm.cfg), capacity)
        self.taps = [t for t in (self.lyrics, tap) if t is not None]
        # hiddens False: no depth passes and no LM layer past the deepest tapped one
        self.last_layer = None if hiddens or not self.taps else max(layer for t in self.taps for layer in t.heads)

    @property
    def hiddens(self) -> torch.Tensor | None:
        return None if self.out is None else self.out[:self.replayed]

    def lyric_attention(self) -> torch.Tensor | None:
        """[replayed frames, lyric tokens] (`mm3.plan.lyrics_align.LyricAttention`), None without lyric heads."""
        return None if self.lyrics is None else self.lyrics.attention(self.replayed)

    def feed(self, codes: torch.Tensor, final: bool = False) -> int:
        """Replay the whole passes that `codes` [F + 1, ncb] (the song so far) now allow, and with
        `final` the rest; returns the frames replayed so far. Cancel check before every pass."""
        n = codes.shape[0] - 1
        if n > self.capacity:
            raise ValueError(f"{n} frames fed to a replay sized for {self.capacity}")
        end = n if final else n - n % REPLAY_CHUNK
        if end <= self.replayed:
            return self.replayed
        cs, ncb, lm, depth, dtype = self.prompt.codes, self.depth.num_codebooks, self.lm, self.depth, self.dtype
        first = self.replayed  # only the frames this call replays (and the next one) go to the device
        codes_d = codes[first:end + 1].to(self.device)
        try:
            with onednn_matmul(self.device):  # chunks of frames: GEMMs, where oneDNN beats MKL (mm3.backends.cpu.matmul)
                if self.cache is None:
                    self.cache = lm.new_cache(1, self.prompt.num_tokens + self.capacity, dtype, self.device)
                    lm(lm.embed(self.prompt.ids[:1].to(self.device), dtype), self.cache, stop_after=self.last_layer)
                for a in range(self.replayed, end, REPLAY_CHUNK):
                    if self.progress.should_stop():
                        raise Cancelled(f"replay cancelled at frame {a} of {self.total}")
                    b = min(a + REPLAY_CHUNK, end)
                    fed = frame_feedback(lm, depth, codes_d[a - first:b - first], cs.code_offset, dtype)  # [m, 1, H]
                    with lm.tapped(*self.taps):  # read-only: no number changes
                        hid = lm(fed.transpose(0, 1), self.cache, stop_after=self.last_layer)[0]  # [m, H]
                    if self.out is not None:  # the hidden after frame k predicted frame k + 1
                        nxt = codes_d[a + 1 - first:b + 1 - first]
                        seq = [depth.projection(hid)[:, None],
                               depth.projection(lm.embed(nxt[:, 0] + cs.code_offset, dtype))[:, None]]
                        seq += [depth.projection(depth.code_embedding(nxt[:, j], j, dtype))[:, None]
                                for j in range(1, ncb - 1)]
                        states = depth(torch.cat(seq, dim=1))  # [m, ncb, H]
                        self.out[a:b, 0] = hid
                        self.out[a:b, 1:] = states[:, 1:]
                    self.replayed = b
                    self.progress.on_progress("replay", b, self.total, {"frames": self.total})
        finally:
            CPU_SCRATCH.clear()
        return self.replayed


@torch.inference_mode()
def replay(lm: Qwen3LM, depth: RVQDepthDecoder, prompt: Prompt, codes: torch.Tensor, *,
           device: torch.device | None = None, dtype: torch.dtype = torch.float32,
           progress: Progress | None = None, lm_seed: int | None = None, ended: bool = False,
           lyric_heads: LyricHeads | None = None, tap: AttentionTap | None = None,
           hiddens: bool = True) -> AudioCodes:
    """Frame hiddens of known codes [F + 1, ncb] by teacher forcing: prefill the conditional prompt,
    one LM pass over the fed-back frames 0 .. F - 1 (the hidden after frame k - 1 predicted frame k),
    then for each frame k >= 1 one causal depth pass over [LM hidden, c0, c1 .. c6] whose positions
    1 .. 7 are the depth states; in passes of `REPLAY_CHUNK` frames (`Replayer`), cancel check
    between them.

    `lyric_heads`: also each frame's attention onto the lyrics at those heads, kept as the result's
    `lyric_attention` (`mm3.plan.lyrics_align`); `tap`: another read-only attention tap over the frames.
    Neither changes a number. `hiddens` False: the attention only (no depth passes, no layer past
    the deepest tapped one; the result has no frame hiddens)."""
    codes = checked_codes(codes, prompt.codes, depth)
    replayer = Replayer(lm, depth, prompt, codes.shape[0] - 1, device=device, dtype=dtype, progress=progress,
                        lyric_heads=lyric_heads, tap=tap, hiddens=hiddens)
    replayer.feed(codes, final=True)
    return AudioCodes(codes, replayer.hiddens, prompt, lm_seed, ended, lyric_attention=replayer.lyric_attention())
