"""The host loop around `FrameStep`: random draws, END detection one frame late, results.

Each frame the host draws the songs' Exponential(1) numbers on their CPU generators (the same
calls, in the same order, as the reference's `torch.multinomial`), launches the frame step, and
only then reads the END flags of the *previous* frame, which on an accelerator have long arrived
(a pinned copy and an event, no synchronisation of the current frame). The frame launched after a
song's END is speculative: its results are dropped and the song's generator is set back to where
it stood before the END frame, then advanced by the END frame's semantic draw only, which is all
the reference consumes for it. So codes, hiddens and generator states come out as if every song
had stopped at once (checked in tests/test_fastpath.py).
"""

from __future__ import annotations

import torch

from ..models.depth import RVQDepthDecoder
from ..models.lm import KVCache, Qwen3LM
from ..progress import Cancelled, Progress
from ..sampling import exponential_draws, exponential_tail
from .budget import ar_weight_budget
from .frame import FrameStep

MIN_KV_BUCKET = 256  # shortest attention length of a compiled step (lengths go up in powers of two)


def kv_bucket(n_keys: int, max_len: int) -> int:
    """Attention length of a compiled step for `n_keys` filled positions: a power of two >= it."""
    b = MIN_KV_BUCKET
    while b < n_keys:
        b *= 2
    return min(b, max_len)


class _Flags:
    """END flags of launched frames, copied to the host without waiting for them."""

    def __init__(self, device: torch.device):
        self.device, self.pending = device, {}

    def put(self, frame: int, end: torch.Tensor):
        if self.device.type == "cuda":
            host = torch.empty(end.shape, dtype=end.dtype, pin_memory=True)
            host.copy_(end, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending[frame] = (host, event)
        else:
            self.pending[frame] = (end.to("cpu"), None)

    def take(self, frame: int) -> list[bool]:
        host, event = self.pending.pop(frame)
        if event is not None:
            event.synchronize()
        return host.tolist()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@torch.no_grad()
def sample_frames(lm: Qwen3LM, depth: RVQDepthDecoder, codes_space, cache: KVCache, last: torch.Tensor,
                  generators: list[torch.Generator], *, max_frames: int, lm_cfg: float, top_k: int,
                  dtype: torch.dtype, progress: Progress, cache_budget: int | None = None,
                  compile: bool = False, static_shapes: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Sample up to `max_frames` emitted frames (plus frame 0) for every generator's song, from a
    prefilled `cache` (rows [cond_0, uncond_0, cond_1, ...], one free position per frame plus one)
    and the final-normed hiddens `last` [rows, H]. Returns per song (codes [n + 1, ncb] on the CPU,
    frame hiddens [n, ncb, H], ended_naturally). `cache_budget`: bytes of dequantized weight copies
    (None: `budget.ar_weight_budget`). `compile`: run the frame step through torch.compile (CUDA graphs
    on CUDA; not yet measured on a GPU). `static_shapes`: attend over power-of-two buckets of the KV
    cache with a mask, as the compiled step does (implied by `compile`; eager, for tests)."""
    cs, n_songs, device = codes_space, len(generators), last.device
    ranges = sorted([(cs.end_id, cs.end_id + 1), (cs.code_offset, cs.code_offset + cs.num_semantic)])
    columns = torch.cat([torch.arange(a, b) for a, b in ranges])  # CPU: indexes the CPU draws
    first = int(columns[0])
    ncb, av, n_total = depth.num_codebooks, depth.audio_vocab, lm.vocab_size
    step = FrameStep(lm, depth, code_offset=cs.code_offset, end_id=cs.end_id, candidates=ranges, songs=n_songs,
                     cache=cache, lm_cfg=lm_cfg, top_k=top_k, dtype=dtype)
    step.last.copy_(last)
    codes_buf = torch.zeros(max_frames + 1, n_songs, ncb, dtype=torch.long, device=device)
    hid_buf = torch.zeros(max_frames + 1, n_songs, ncb, lm.hidden_size, dtype=dtype, device=device)
    step.cache_weights(ar_weight_budget(device) if cache_budget is None else cache_budget)
    frame_fn = step.frame
    if compile:
        cuda = device.type == "cuda"
        if cuda:
            step.mark_static()
        frame_fn = torch.compile(step.frame, mode="reduce-overhead" if cuda else None, dynamic=False)

    active, ended = [True] * n_songs, [False] * n_songs
    emitted, last_frame = [0] * n_songs, [-1] * n_songs
    snaps: dict[int, list] = {}  # frame -> each song's generator state before that frame's draws
    flags = _Flags(device)
    ones_sem, ones_dep = torch.ones(1, columns.numel()), torch.ones(ncb - 1, av)

    def launch(f: int):
        snaps[f] = [g.get_state() if active[i] else None for i, g in enumerate(generators)]
        sem, dep = [], []
        for i, g in enumerate(generators):
            if not active[i]:  # an ended song draws nothing; its rows compute on placeholders
                sem.append(ones_sem)
                dep.append(ones_dep)
                continue
            sem.append(exponential_tail(n_total, first, g)[:, columns - first])
            dep.append(torch.cat([exponential_draws(av, g) for _ in range(ncb - 1)]))
        q_sem = _to_device(torch.cat(sem), device)  # [songs, C]
        q_dep = _to_device(torch.stack(dep), device)  # [songs, ncb - 1, av]
        if compile or static_shapes:
            step.kv_bucket = kv_bucket(step.pos_host + 1, cache.max_len)
        codes, end, hidden = frame_fn(q_sem, q_dep)
        step.pos_host += 1
        codes_buf[f].copy_(codes)
        hid_buf[f].copy_(hidden)
        flags.put(f, end)

    def process(f: int):
        end = flags.take(f)
        recorded = False
        for i, g in enumerate(generators):
            if not active[i] or snaps[f][i] is None:
                continue
            if end[i]:  # undo this frame's depth draws and any later frame's, keep the semantic draw
                g.set_state(snaps[f][i])
                exponential_tail(n_total, first, g)
                active[i], ended[i] = False, True
                continue
            last_frame[i], recorded = f, True
            if f > 0:
                emitted[i] += 1
                active[i] = emitted[i] < max_frames
        snaps.pop(f - 1, None)
        if recorded:
            progress.on_progress("ar", max(emitted), max_frames,
                                 {"frame": f, "songs": n_songs, "active": sum(active)})

    launched = done = 0
    try:
        while True:
            can_launch = launched <= max_frames and any(active)
            if not can_launch and done >= launched:
                break
            if progress.should_stop():
                raise Cancelled(f"AR cancelled before frame {done} of {max_frames}")
            if can_launch:
                launch(launched)
                launched += 1
                if done < launched - 1:  # the previous frame's flags: one frame late
                    process(done)
                    done += 1
            else:
                process(done)
                done += 1
    finally:
        step.release()
    codes_cpu = codes_buf[:max(launched, 1)].cpu()
    out = []
    for i in range(n_songs):
        n = last_frame[i] + 1  # frames 0 .. last recorded
        hiddens = hid_buf[1:n, i]
        whole = n_songs == 1 and n == hid_buf.shape[0]  # then a contiguous view of nearly all the buffer
        out.append((codes_cpu[:n, i].clone(), hiddens if whole else hiddens.clone(), ended[i]))
    return out
