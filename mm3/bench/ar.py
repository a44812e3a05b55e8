"""Bench stage "ar": milliseconds per AR frame, this engine against diffusers 0.42.1.

A frame is the LM-head sampling, the 7 depth steps with their sampling, and the LM step that feeds
the frame back. Each side runs the same prompt ids, seed and weights (`Context`); the time per frame
is taken between the first and the last frame of a run, so the prompt prefill is left out. Ours runs
with the models loaded for the fast numerics (the default) and for the reference numerics; the
codes of the fast run are compared with the reference's. On the CPU the few-row product form the
plan takes (`mm3.backends.cpu.choice`: by rule, or as `MM3_CPU_PRODUCT` names) is reported, and the
AR's weight bandwidth beside the machine's (a copy of a 1 GiB tensor).
"""

from __future__ import annotations

import time

import torch

from ..backends.cpu import choice as cpu_choice
from ..plan.ar import PlanSettings, plan
from ..constants import FRAME_RATE
from ..song.numerics import Numerics
from ..progress import Progress
from ..song.stages import set_ar_numerics
from .measure import PeakMemory, host_copy_bandwidth, ratio, sync
from .reference import run_ar

WARMUP_FRAMES = 4


def _ours(ctx, frames: int, numerics: str = "fast", **kwargs):
    """(seconds per frame, codes) of one `plan` run with the models loaded for `numerics`."""
    stamps = []

    def tick(*_):
        sync(ctx.device)
        stamps.append(time.perf_counter())

    settings = PlanSettings(duration=frames / FRAME_RATE, lm_seed=ctx.seed)
    lm, depth = ctx.ours("lm", numerics), ctx.ours("depth", numerics)
    set_ar_numerics(lm, depth, Numerics(numerics), device=ctx.device, dtype=ctx.dtype)  # as the stages do
    (song,) = plan(lm, depth, ctx.prompt(), settings, device=ctx.device,
                   dtype=ctx.dtype, progress=Progress(on_progress=tick), **kwargs)
    return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), song.codes


def _reference(ctx, frames: int):
    """(seconds per frame, codes) of one run of the reference's AR block."""
    from ..plan.sampling import make_generator

    stamps, codes = [], []

    def on_frame(last_hidden, frame_codes, depth_hidden):
        codes.append(frame_codes[0].clone())
        sync(ctx.device)
        stamps.append(time.perf_counter())

    with ctx.reference_constants():
        run_ar(ctx.reference("language_model"), ctx.reference("rvq_depth_decoder"), ctx.prompt().ids.to(ctx.device),
               frames / FRAME_RATE, make_generator(ctx.seed), on_frame)
    return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), torch.stack(codes).cpu()


def cpu_products(ctx) -> dict | None:
    """The CPU product forms the plan gives the bench's models (`mm3.backends.cpu.choice.serve`), and
    the vector width the native kernel was built for where a form reads it; None off the CPU."""
    lm, depth = ctx.ours("lm"), ctx.ours("depth")
    choice = cpu_choice.serve({"lm": lm, "depth": depth}, ctx.device)
    if choice is None:
        return None
    from ..backends.cpu import native as cpu_native

    return {"chosen": choice.label, "forms": choice.forms, "source": choice.source,
            "native_vector_bits": cpu_native.vector_bits() if "native" in choice.forms.values() else None}


def measure(ctx, frames: int) -> dict:
    """ms per frame for each side (best of ctx.repeat interleaved runs of `frames` frames)."""
    from ..backends.device import ar_weight_budget

    products = cpu_products(ctx)
    runs = {"ours": lambda n: _ours(ctx, n, compile=ctx.compile, graphs=ctx.graphs)}
    if not ctx.light:
        runs["ours_reference_numerics"] = lambda n: _ours(ctx, n, "reference")
    if ctx.have_reference:
        runs["diffusers"] = lambda n: _reference(ctx, n)
    for fn in runs.values():
        fn(frames if ctx.compile else WARMUP_FRAMES)  # compiled: same shapes as the timed runs
    best, codes = {}, {}
    with PeakMemory(ctx.device) as timed:
        for _ in range(ctx.repeat):
            for k, fn in runs.items():
                dt, codes[k] = fn(frames)
                best[k] = min(best.get(k, dt), dt)
    memory = {}
    if ctx.light:  # ours alone: the timed runs' peak is its own (a frame can take seconds here)
        memory["ours"] = timed.as_dict()
    for k in ("ours", "diffusers"):
        if k in runs and k not in memory:
            with PeakMemory(ctx.device) as pm:
                runs[k](frames)
            memory[k] = pm.as_dict()
    out = {f"{k}_ms_per_frame": round(1e3 * v, 2) for k, v in best.items()}
    out.setdefault("diffusers_ms_per_frame", None)
    out["ratio"] = ratio(out["diffusers_ms_per_frame"], out["ours_ms_per_frame"])
    out["frames"] = frames
    out["prompt_tokens"] = int(ctx.prompt().num_tokens)
    out["ar_weight_budget_mib"] = round(ar_weight_budget(ctx.device) / 2**20, 1)
    if "diffusers" in codes:
        a, b = codes["ours"], codes["diffusers"]
        n = min(len(a), len(b))
        diff = (a[:n] != b[:n]).any(dim=1).nonzero()
        out["codes_equal"] = bool(len(a) == len(b) and len(diff) == 0)
        out["first_differing_frame"] = int(diff[0]) if len(diff) else None
    out["memory"] = memory
    stored = frame_weight_bytes(ctx.ours("lm"), ctx.ours("depth"), ctx.prompt().codes.num_semantic + 1)
    out["weights_per_frame_mib"] = round(stored / 2**20, 1)
    out["ours_weight_gb_per_s"] = round(stored / (out["ours_ms_per_frame"] * 1e-3) / 1e9, 2)
    if ctx.device.type == "cpu":
        copy = host_copy_bandwidth()
        out["machine_copy_gb_per_s"] = round(copy, 2)
        out["weight_bandwidth_share"] = round(out["ours_weight_gb_per_s"] / copy, 3)
    if products is not None:
        out["cpu_products"] = products
    bandwidth = ctx.roofline.get("copy_gb_per_s")
    if bandwidth:  # the roofline: a frame reads its weights once; how close to the copy bandwidth
        out["floor_ms_per_frame"] = round(stored / (bandwidth * 1e9) * 1e3, 2)
        out["bandwidth_share"] = round(out["ours_weight_gb_per_s"] / bandwidth, 3)
    return out


def frame_weight_bytes(lm, depth, head_rows: int) -> int:
    """Bytes of weights, as stored, that one frame reads: the LM layers, the head rows of the
    candidates, and per depth step (7) the depth layers, the projection and one audio head
    (the bandwidth floor of a frame is this over the memory bandwidth)."""
    from ..weights.copies import compressed_nbytes

    head = lm.model.embed_tokens if lm.tied else lm.lm_head
    row = compressed_nbytes(head) // (lm.vocab_size if lm.tied else head.out_features)  # a GGUF row is whole blocks
    steps = depth.num_codebooks - 1
    per_step = sum(compressed_nbytes(b) for b in depth.layers) + compressed_nbytes(depth.projection) + \
        compressed_nbytes(depth.audio_heads[0])
    return sum(compressed_nbytes(layer) for layer in lm.model.layers) + head_rows * row + steps * per_step
