"""Whether the DiT, and the AR stage's many-row products, compute in bfloat16 on this CPU, where
float32 is the CPU's default dtype.

A DiT step is almost all large matrix products, and so are the LM's and depth decoder's products
over many rows (the prompt's prefill, the replay of a song's codes; a frame's few-row products are
`mm3.backends.cpu.choice`'s). Where the processor has no bfloat16 dot products, bfloat16 is
emulated and always slower: float32 serves, by rule. Where it has them (AVX512-BF16, AMX), whether
bfloat16 pays depends on the processor: with AMX it runs the DiT several times faster; with
AVX512-BF16 alone (many cloud processors, AMD Zen 4) torch's bfloat16 products can be slower than
its float32 ones. So there the choice comes from timing the products the model runs (its own
weight shapes, in both dtypes, alternating), once per machine: it is kept in the CPU record of the
cache folder, and later runs with the same seeds give the same audio. The price of bfloat16 is its
precision, the GPUs' default (only the products; latents, Euler steps and the LM's activations stay
float32). The reference numerics and RNG mode stay float32; `MM3_CPU_BF16` or a dtype named by the
user (`--dtype float32`) decides instead.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.nn.functional as F

from ... import switches
from ...weights.layers import Linear
from . import choice

NATIVE_FLAGS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's, where this torch has them
TIMED_ROWS = 512  # the rows a timed product multiplies: a DiT window's and a prompt's order (hundreds)
ROUNDS = 3  # each dtype's products timed this many times, alternating; the fastest round counts
PAYS = 0.9  # bfloat16 serves where its products take at most this share of float32's time

_MEMO: dict[str, torch.dtype] = {}  # this process's measurements by key (a record that cannot be written)


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


def ruled(device, dtype: torch.dtype) -> torch.dtype | None:
    """The compute dtype of large products for inputs of `dtype` on `device` where a rule gives it:
    `dtype` off the CPU, for a dtype other than float32 and where bfloat16 is emulated; the one
    `MM3_CPU_BF16` names; None where a timing of the model's products decides (`measured`)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return dtype
    named = switches.value("MM3_CPU_BF16")
    if named in ("on", "off"):
        return torch.bfloat16 if named == "on" else dtype
    return None if native() else dtype


def dit_dtype(device, dtype: torch.dtype, model: torch.nn.Module | None = None) -> torch.dtype:
    """The dtype the DiT's forward computes in, for latents of `dtype` on `device`: the rule's
    (`ruled`), else the faster of float32 and bfloat16 over `model`'s products (`measured`; without
    a model, float32)."""
    rule = ruled(device, dtype)
    if rule is not None:
        return rule
    return measured(model) if model is not None else dtype


def many_rows_bf16(device, dtype: torch.dtype, dit_compute: torch.dtype | None = None,
                   model: torch.nn.Module | None = None) -> bool:
    """Whether the LM's and depth decoder's products over many rows (a prefill, a replay) multiply
    in bfloat16: float32 inputs on a CPU where the DiT's forward computes in bfloat16 (`dit_compute`,
    the caller's pin of it), else where the rule or a timing of `model`'s products says so."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    if dit_compute is not None:
        return dit_compute == torch.bfloat16
    return dit_dtype(device, dtype, model) == torch.bfloat16


def products(model: torch.nn.Module) -> Counter:
    """The [out, in] shapes of `model`'s linear products, with how many of each it runs."""
    return Counter((m.out_features, m.in_features) for m in model.modules() if isinstance(m, Linear))


def measured(model: torch.nn.Module) -> torch.dtype:
    """bfloat16 where it multiplies `model`'s products faster than float32 on this machine (by
    `PAYS`), else float32: timed once per processor, thread count, torch and set of shapes, and
    kept in the CPU record (a record that cannot be read or written is timed again)."""
    shapes = products(model)
    if not shapes:
        return torch.float32
    key = (f"bf16; cpu={choice.processor()}; cores={choice.usable_cores()}; torch={torch.__version__}; "
           f"threads={torch.get_num_threads()}; products=" + ",".join(f"{n}x{k}*{c}" for (n, k), c in sorted(shapes.items())))
    if key in _MEMO:
        return _MEMO[key]
    known = choice.cached_entry(key)
    if isinstance(known, dict) and known.get("dtype") in ("float32", "bfloat16"):
        chosen = known["dtype"]
    else:
        ms = time_products(shapes)
        chosen = "bfloat16" if ms["bfloat16"] <= PAYS * ms["float32"] else "float32"
        choice.store_entry(key, {"dtype": chosen, "ms": {k: round(v, 3) for k, v in ms.items()}})
    _MEMO[key] = getattr(torch, chosen)
    return _MEMO[key]


def time_products(shapes: Counter, rows: int = TIMED_ROWS) -> dict[str, float]:
    """Milliseconds of one pass over `shapes` ({(out, in): count}) at `rows` input rows in float32
    and in bfloat16, each dtype's fastest of `ROUNDS` rounds, the dtypes alternating."""
    g = torch.Generator().manual_seed(0)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        pairs = [(torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype), c)
                 for (n, k), c in shapes.items()]
        runs[str(dtype).removeprefix("torch.")] = pairs
    best = {name: float("inf") for name in runs}
    with torch.inference_mode():
        for name, pairs in runs.items():  # once each before timing: oneDNN's first call builds its kernels
            for x, w, _ in pairs:
                F.linear(x, w)
        for _ in range(ROUNDS):
            for name, pairs in runs.items():
                total = 0.0
                for x, w, count in pairs:
                    start = time.perf_counter()
                    F.linear(x, w)
                    total += (time.perf_counter() - start) * count
                best[name] = min(best[name], total * 1e3)
    return best
