"""Whether the DiT, and the AR stage's many-row products, compute in bfloat16 on this CPU, where
float32 is the CPU's default dtype.

A DiT step is almost all large matrix products, and processors with native bfloat16 dot products
(AVX512-BF16, AMX) run them in bfloat16 much faster than in float32; elsewhere bfloat16 is emulated
and slower. The same holds for the LM's and depth decoder's products over many rows (the prompt's
prefill, the replay of a song's codes): those are matrix products too, not the few-row products
of a frame (`mm3.backends.cpu.choice` measures those). The choice follows what torch reports of the
processor, not a timing, because a timing flips between runs on a loaded machine and the same
seeds would then give different audio. The price is bfloat16's precision, the GPUs' default (only
the products; latents, Euler steps and the LM's activations stay float32). The reference numerics
and RNG mode stay float32; `MM3_CPU_BF16` or a dtype named by the user (`--dtype float32`)
decides instead. Figures: the README's Speed section.
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


def many_rows_bf16(device, dtype: torch.dtype, dit_compute: torch.dtype | None = None) -> bool:
    """Whether the LM's and depth decoder's products over many rows (a prefill, a replay) multiply
    in bfloat16: float32 inputs on a CPU where the DiT's forward computes in bfloat16
    (`dit_compute`, the caller's pin of it; None: `dit_dtype`'s rule)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    return (dit_dtype(device, dtype) if dit_compute is None else dit_compute) == torch.bfloat16
