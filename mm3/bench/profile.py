"""Where our AR frame goes: a few eager frames under torch's profiler (`bench --profile N`).

The frames run one after another on scratch state (`ScratchFrames`, the prompt prefilled
before the profile starts), eagerly: on CUDA without graphs, so every kernel is seen with its own
time on the device. Reported per frame: the wall time under the profiler, the operations (or, on
CUDA, kernels) that took the most time, and the sum of all of them. On the CPU the profiler's own
cost inflates each small operation several times, and the native integer products (a C library,
not torch operations) do not appear: wall time less the operations' sum is theirs and Python's.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..models.depth import RVQDepthDecoder
from ..models.lm import Qwen3LM
from ..plan.ar import FrameSampler, PlanSettings, rows_per_song
from ..plan.prompt import Prompt
from ..plan.shaping import Shaping
from ..song.numerics import Numerics
from ..song.stages import set_ar_numerics
from .measure import sync

TOP = 20  # entries kept


class ScratchFrames:
    """Whole AR frames of the prompt's first song on scratch state: a KV cache of their own (rewound
    to the prompt before every run), their own sampler and draws."""

    def __init__(self, lm: Qwen3LM, depth: RVQDepthDecoder, prompt: Prompt, settings: PlanSettings,
                 dtype: torch.dtype, device: torch.device, frames: int):
        rows = rows_per_song(lm.numerics, settings.lm_cfg, device)
        frames = max(1, min(frames, lm.max_positions - prompt.num_tokens - 1))
        self.cache = lm.new_cache(rows, prompt.num_tokens + frames + 1, dtype, device)
        self.after_prompt = lm(lm.embed(prompt.ids[:rows].to(device), dtype), self.cache)[:, -1]
        self.start = self.cache.length
        one = replace(settings, songs=1, shaping=Shaping())
        self.sampler = FrameSampler(lm, depth, prompt.codes, self.cache, one, dtype, device, frames)
        self.generator = torch.Generator().manual_seed(0)
        self.sizes = ((1, lm.head_ids[1] - lm.head_ids[0]), (1, depth.num_codebooks - 1, depth.audio_vocab))
        self.device = device

    def run(self, n: int) -> list[float]:
        """n frames from the prompt on; each one's seconds."""
        seconds = []
        for _ in range(n):
            if not seconds or self.cache.length + 1 > self.cache.max_len:
                self.cache.length = self.start
                self.cache.pos.fill_(self.start)
                self.sampler.last = self.after_prompt
            q_sem, q_dep = (torch.empty(size).exponential_(generator=self.generator).to(self.device)
                            for size in self.sizes)
            start = time.perf_counter()
            self.sampler.step(q_sem, q_dep)
            seconds.append(time.perf_counter() - start)
        return seconds


def profile_frames(ctx, frames: int, top: int = TOP) -> dict:
    """The profile of `frames` frames of ours (after 3 unprofiled ones): per frame, the wall ms,
    the summed ms of every operation (CPU) or kernel (CUDA), and the `top` entries by that time."""
    from torch.profiler import ProfilerActivity, profile

    if frames < 1:
        raise ValueError(f"--profile takes a number of frames >= 1, got {frames}")
    lm, depth = ctx.ours("lm"), ctx.ours("depth")
    set_ar_numerics(lm, depth, Numerics("fast"), device=ctx.device, dtype=ctx.dtype)
    settings = PlanSettings(duration=1.0, lm_seed=ctx.seed)
    scratch = ScratchFrames(lm, depth, ctx.prompt(), settings, ctx.dtype, ctx.device, frames=frames + 3)
    scratch.run(3)
    cuda = ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(ctx.device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        scratch.run(frames)
        sync(ctx.device)
        wall = time.perf_counter() - start
    return summarize(prof.key_averages(), frames, wall, "device" if cuda else "cpu", top)


def summarize(events, frames: int, wall_s: float, side: str, top: int = TOP) -> dict:
    """`events` (a profiler's key averages) per frame on `side` ("cpu": self CPU time of the
    operations; "device": self device time of the kernels, not of the operations that launched
    them, which carry the same time again), the `top` first by that time."""
    from torch.autograd import DeviceType

    if side != "cpu":
        events = [e for e in events if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU]

    def us(e) -> float:
        if side == "cpu":
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    timed = [(us(e), e) for e in events]
    timed = sorted(((t, e) for t, e in timed if t > 0), key=lambda te: -te[0])
    return {
        "frames": frames,
        "side": side,
        "wall_ms_per_frame": round(1e3 * wall_s / frames, 3),
        "busy_ms_per_frame": round(sum(t for t, _ in timed) / 1e3 / frames, 3),
        "top": [{"name": e.key, "calls_per_frame": round(e.count / frames, 2),
                 "ms_per_frame": round(t / 1e3 / frames, 4)} for t, e in timed[:top]],
    }


def lines(p: dict, shown: int = 10) -> list[str]:
    """The profile in a few lines of the bench's summary."""
    what = "kernels on the device" if p["side"] == "device" else "torch operations on the CPU (profiler-inflated)"
    out = [f"           profile of {p['frames']} eager frames: {p['wall_ms_per_frame']:.2f} ms a frame, "
           f"{what} {p['busy_ms_per_frame']:.2f} ms; the most:"]
    out += [f"             {e['ms_per_frame']:8.3f} ms  {e['calls_per_frame']:7.1f} x  {e['name'][:70]}"
            for e in p["top"][:shown]]
    return out
