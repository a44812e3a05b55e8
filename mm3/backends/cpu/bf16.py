"""How the DiT's, and the AR stage's many-row, products compute on this CPU: in float32 by torch's
default library, in float32 through oneDNN, or in bfloat16.

A DiT step is almost all large matrix products, and so are the LM's and depth decoder's products
over many rows (the prompt's prefill, the replay of a song's codes; a frame's few-row products are
`mm3.backends.cpu.choice`'s rule). Where the processor has no bfloat16 dot products, bfloat16 is
emulated and always slower: float32 serves, by rule. Where it has them (AVX512-BF16, AMX), whether
bfloat16 pays depends on the processor: with AMX it runs the DiT several times faster; with
AVX512-BF16 alone (many cloud processors, AMD Zen 4) torch's bfloat16 products can be slower than
its float32 ones, and oneDNN's float32 products (`matmul.onednn_matmul`) faster or slower than
the default library's: no rule over the processor's flags tells them apart. So the form comes from timing the products the model runs (its own weight shapes, each
candidate in turn, alternating), once per machine: it is kept in the cache folder's record
(`mm3.cache_dir.remember`, section `SECTION`), and later runs with the same seeds give the same
audio. The price of bfloat16 is its
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
from . import matmul, timings

NATIVE_FLAGS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's, where this torch has them
TIMED_ROWS = 512  # the rows a timed product multiplies: a DiT window's and a prompt's order (hundreds)
ROUNDS = 3  # each form's products timed this many times, alternating; the fastest round counts
BUDGET_SECONDS = 10.0  # rounds after the first stop once the timing has taken this long
PAYS = 0.9  # a form other than plain float32 serves where it takes at most this share of float32's time
FORMS = ("float32", "onednn", "bfloat16")  # the default library's float32, oneDNN's float32, bfloat16 tensors
SECTION = "cpu-compute-dtype"  # the record's section of these measurements

_MEMO: dict[str, dict] = {}  # this process's measurements by key (a record that cannot be written)


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


def forget() -> None:
    """Drop this process's measurements (the next one reads the record again)."""
    _MEMO.clear()


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
    (`ruled`), else bfloat16 where it is the fastest form of `model`'s products (`measured`;
    without a model, float32)."""
    rule = ruled(device, dtype)
    if rule is not None:
        return rule
    return torch.bfloat16 if model is not None and measured(model) == "bfloat16" else dtype


def onednn_pays(device, compute: torch.dtype, model: torch.nn.Module) -> bool:
    """Whether `model`'s float32 products on `device` (computing in `compute`) go to oneDNN: on the
    CPU, where oneDNN's float32 is exact to float32 there (`matmul.onednn_matmul`'s probe) and the
    fastest form of the model's products (`measured`: the same timing as the compute dtype's where
    no rule fixed that, else float32 against oneDNN's alone)."""
    if torch.device(device).type != "cpu" or compute != torch.float32 or not matmul.accurate():
        return False
    among = None if ruled(device, torch.float32) is None else ("float32", "onednn")
    return measured(model, among) == "onednn"


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
    """The [out, in] shapes of `model`'s linear products that its blocks repeat (the bulk of its
    work; a one-off such as a vocabulary head is left out), with how many of each it runs; every
    shape where none repeats."""
    shapes = Counter((m.out_features, m.in_features) for m in model.modules() if isinstance(m, Linear))
    repeated = Counter({shape: count for shape, count in shapes.items() if count > 1})
    return repeated or shapes


def candidates(with_bf16: bool | None = None) -> tuple[str, ...]:
    """The forms to time here: oneDNN's float32 where its probe finds it exact, bfloat16 where the
    processor multiplies it natively (`with_bf16`, None: `native()`)."""
    bf16 = native() if with_bf16 is None else with_bf16
    return tuple(f for f in FORMS if f == "float32" or (f == "onednn" and matmul.accurate()) or
                 (f == "bfloat16" and bf16))


def measured(model: torch.nn.Module, among: tuple[str, ...] | None = None) -> str:
    """The fastest form (`FORMS`) of `model`'s products on this machine among `among` (None:
    `candidates()`), plain float32 unless another is faster by `PAYS`: timed once per processor,
    thread count, torch, candidates and set of shapes, and kept in the record (a record that
    cannot be read or written is timed again by the next process)."""
    among = candidates() if among is None else tuple(f for f in among if f in candidates(True))
    shapes = products(model)
    if not shapes or among == ("float32",):
        return "float32"
    key = timings.key("large products", f"forms={','.join(among)}; products="
                      + ",".join(f"{n}x{k}*{c}" for (n, k), c in sorted(shapes.items())))

    def timed() -> dict:
        ms = time_products(shapes, among)
        fastest = min(ms, key=ms.get)
        return {"form": fastest if ms[fastest] <= PAYS * ms["float32"] else "float32",
                "ms": {k: round(v, 3) for k, v in ms.items()}}

    return timings.kept(SECTION, key, _MEMO, lambda known: known.get("form") in among, timed)["form"]


def time_products(shapes: Counter, among: tuple[str, ...] = FORMS, rows: int = TIMED_ROWS) -> dict[str, float]:
    """Milliseconds of one pass over `shapes` ({(out, in): count}) at `rows` input rows in each form
    of `among`, each form's fastest of `ROUNDS` rounds, the forms alternating."""
    g = torch.Generator().manual_seed(0)
    floats = [(torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), c) for (n, k), c in shapes.items()]
    runs = {form: floats if form != "bfloat16" else
            [(x.to(torch.bfloat16), w.to(torch.bfloat16), c) for x, w, c in floats] for form in among}
    best = {form: float("inf") for form in runs}

    def one_pass(form: str) -> float:
        total = 0.0
        with matmul.onednn_matmul("cpu", form == "onednn"):
            for x, w, count in runs[form]:
                start = time.perf_counter()
                F.linear(x, w)
                total += (time.perf_counter() - start) * count
        return total * 1e3

    start = time.perf_counter()
    with torch.inference_mode():
        for form in runs:  # once each before timing: oneDNN's first call builds its kernels
            one_pass(form)
        for _ in range(ROUNDS):
            for form in runs:
                best[form] = min(best[form], one_pass(form))
            if time.perf_counter() - start > BUDGET_SECONDS:
                break
    return best
