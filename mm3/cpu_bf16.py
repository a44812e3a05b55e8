"""Whether the DiT computes in bfloat16 on this CPU, where float32 is the CPU's default dtype.

A DiT step is almost all large matrix products (the medium bench config: ~45 GFLOP a step, 55 %
of its time in products at near the float32 peak of the two cores we measured). Processors with
native bfloat16 dot products (AVX512-BF16, AMX) run oneDNN's bfloat16 products 1.8-2.7x faster
than float32 ones (measured on an AVX512-BF16 EPYC, on products of the DiT's shapes), and a whole
DiT step 1.7-2.0x (medium config: ~205 against ~350-400 ms a step;
`python -m mm3 bench --config medium --stages dit`). Elsewhere bfloat16 products are emulated and
slower.

So the choice follows what torch reports of the processor, not a timing: a timing at startup
flips between runs on a loaded machine (a competing process moved one such probe between 0.5x
and 4.4x), and the same seeds would then give different audio from one run to the next.

The price is bfloat16's precision, the same as the default on GPUs: one DiT step differs from
the float32 reference by ~1.3 % relative, as much as the reference's own bfloat16 forward, and
after 30 steps a window's latents by ~1 % (the latents and the Euler steps stay float32; only
the DiT's forward is bfloat16). The reference RNG mode, which reproduces the reference bit for
bit, stays float32. `MM3_CPU_BF16` = "on" or "off" decides instead; a dtype named by the user
(`--dtype float32`) also decides.
"""

from __future__ import annotations

import os
import warnings

import torch

CHOICES = ("auto", "on", "off")
NATIVE_FLAGS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's, where this torch has them


def native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX, as torch reports it)
    and oneDNN, which uses those instructions, is in this torch."""
    cpu = getattr(torch, "cpu", None)
    flags = [getattr(cpu, name, None) for name in NATIVE_FLAGS]
    try:
        has = any(bool(flag()) for flag in flags if callable(flag))
    except RuntimeError:
        has = False
    return has and torch.backends.mkldnn.is_available()


def dit_dtype(device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the DiT's forward computes in, for latents of `dtype` on `device`: bfloat16 on a
    CPU with native bfloat16 products where float32 is asked (`MM3_CPU_BF16`, `native`), else `dtype`."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return dtype
    named = os.environ.get("MM3_CPU_BF16", "auto").strip().lower() or "auto"
    if named not in CHOICES:
        warnings.warn(f"MM3_CPU_BF16={named!r} is not one of {', '.join(CHOICES)}; deciding by the processor",
                      stacklevel=2)
    if named in ("on", "off"):
        return torch.bfloat16 if named == "on" else dtype
    return torch.bfloat16 if native() else dtype
