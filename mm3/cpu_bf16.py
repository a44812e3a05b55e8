"""Whether the DiT computes in bfloat16 on this CPU, where float32 is the CPU's default dtype.

A DiT step is almost all large matrix products (the medium bench config: ~45 GFLOP a step, 55 %
of its time in products at near the float32 peak of the two cores we measured). Processors with
native bfloat16 dot products (AVX512-BF16, AMX) run oneDNN's bfloat16 products 2.5-2.7x faster
than float32 ones, and the whole step then runs 1.7x faster (medium config: 234 against 404 ms a
step; `python -m mm3 bench --config medium --stages dit`). Elsewhere bfloat16 products are
emulated and slower. So this is timed once per process on a product of the DiT's kind; bfloat16
is used where it is at least `MIN_SPEEDUP` faster.

The price is bfloat16's precision, the same as the default on GPUs: after 30 steps the latents
of a window differ from a float32 run by ~1 % relative (the latents themselves and the Euler
steps stay float32; only the DiT's forward is bfloat16). The reference RNG mode, which reproduces
the reference bit for bit, stays float32. `MM3_CPU_BF16` = "on" or "off" decides instead of the
timing; a dtype named by the user (`--dtype float32`) also decides.
"""

from __future__ import annotations

import math
import os
import time
import warnings

import torch
import torch.nn.functional as F

MIN_SPEEDUP = 1.5  # product speed ratio bf16 : f32 below which the precision is not worth spending
CHOICES = ("auto", "on", "off")
PROBE_SHAPE = (256, 1024, 1024)  # rows, in, out: one DiT-sized product (~0.5 GFLOP)
_SPEEDUP: list[float] = []  # cached probe result


def speedup() -> float:
    """How many times faster a bfloat16 product of PROBE_SHAPE runs than a float32 one here (best
    of 3 each, alternately; the first of each untimed). 0.0 where bfloat16 products fail or are
    wrong (relative error above 1 %)."""
    if not _SPEEDUP:
        _SPEEDUP.append(_measure())
    return _SPEEDUP[0]


def _measure() -> float:
    from .matmul import onednn_matmul

    rows, k, n = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / math.sqrt(k)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    try:
        want = F.linear(x, w)
        got = F.linear(xb, wb).float()
        if not bool(torch.isfinite(got).all()) or ((got - want).norm() / want.norm()).item() > 1e-2:
            return 0.0
    except RuntimeError:
        return 0.0
    with onednn_matmul("cpu"):  # the float32 side as fast as the DiT runs it
        forms = {"f32": lambda: F.linear(x, w), "bf16": lambda: F.linear(xb, wb)}
        best = dict.fromkeys(forms, math.inf)
        for _ in range(4):
            for name, run in forms.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    return best["f32"] / best["bf16"]


def dit_dtype(device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the DiT's forward computes in, for latents of `dtype` on `device`: bfloat16 on a
    CPU where float32 is asked and bfloat16 products pay (`MM3_CPU_BF16`, `speedup`), else `dtype`."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return dtype
    named = os.environ.get("MM3_CPU_BF16", "auto").strip().lower() or "auto"
    if named not in CHOICES:
        warnings.warn(f"MM3_CPU_BF16={named!r} is not one of {', '.join(CHOICES)}; timing instead", stacklevel=2)
    if named in ("on", "off"):
        return torch.bfloat16 if named == "on" else dtype
    return torch.bfloat16 if speedup() >= MIN_SPEEDUP else dtype
