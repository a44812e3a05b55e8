"""Bench stage "ar": milliseconds per AR frame, this engine against diffusers 0.42.1 (`mm3.bench`).

A frame is the LM-head sampling, the 7 depth steps with their sampling, and the LM step that feeds
the frame back. Each side runs the same prompt ids, seed and weights (`bench_synth.Context`); the
time per frame is taken between the first and the last frame of a run, so the prompt prefill is
left out. Ours runs with the fast engine (the default; weights kept dequantized within
`mm3.fast.budget.ar_weight_budget`) and the plain one; the codes of the fast engine are compared
with the reference's. `python -m mm3.bench_ar` is `python -m mm3 bench --stages ar`.
"""

from __future__ import annotations

import sys
import time

import torch

from .ar import PlanSettings, plan
from .bench import PeakMemory, ratio, sync
from .constants import FRAME_RATE
from .progress import Progress

WARMUP_FRAMES = 4


def _ours(ctx, frames: int, numerics: str = "fast", **kwargs):
    """(seconds per frame, codes) of one `plan` run with the models loaded for `numerics`."""
    stamps = []

    def tick(*_):
        sync(ctx.device)
        stamps.append(time.perf_counter())

    settings = PlanSettings(duration=frames / FRAME_RATE, lm_seed=ctx.seed)
    (song,) = plan(ctx.ours("lm", numerics), ctx.ours("depth", numerics), ctx.prompt(), settings, device=ctx.device,
                   dtype=ctx.dtype, progress=Progress(on_progress=tick), **kwargs)
    return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), song.codes


def _reference(ctx, frames: int):
    """(seconds per frame, codes) of one run of the reference's AR block."""
    from diffusers.modular_pipelines.minimax_music3.encoders import MiniMaxMusic3AutoregressiveStep

    from .sampling import make_generator

    stamps, codes = [], []
    with ctx.reference_constants() as enc:
        original = enc._generate_depth_codes

        def recording(*a):  # called once per sampled frame
            out = original(*a)
            codes.append(out[0][0].clone())
            sync(ctx.device)
            stamps.append(time.perf_counter())
            return out

        enc._generate_depth_codes = recording
        try:
            step = MiniMaxMusic3AutoregressiveStep().init_pipeline()
            step.update_components(language_model=ctx.reference("language_model"),
                                   rvq_depth_decoder=ctx.reference("rvq_depth_decoder"))
            with torch.no_grad():
                step(text_ids=ctx.prompt().ids.to(ctx.device), audio_duration=frames / FRAME_RATE,
                     generator=make_generator(ctx.seed), output="frame_hiddens")
        finally:
            enc._generate_depth_codes = original
    return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), torch.stack(codes).cpu()


def measure(ctx, frames: int) -> dict:
    """ms per frame for each side (best of ctx.repeat interleaved runs of `frames` frames)."""
    from .device import ar_weight_budget

    runs = {"ours": lambda n: _ours(ctx, n, compile=ctx.compile),
            "ours_reference_numerics": lambda n: _ours(ctx, n, "reference")}
    if ctx.ckpt.quant != ctx.ckpt.native:  # quantized: also without kept dequantized copies
        runs["ours_per_product_dequant"] = lambda n: _ours(ctx, n, weight_budget=0)
    if ctx.have_reference:
        runs["diffusers"] = lambda n: _reference(ctx, n)
    for fn in runs.values():
        fn(frames if ctx.compile else WARMUP_FRAMES)  # compiled: same shapes as the timed runs
    best, codes = {}, {}
    for _ in range(ctx.repeat):
        for k, fn in runs.items():
            dt, codes[k] = fn(frames)
            best[k] = min(best.get(k, dt), dt)
    memory = {}
    for k in ("ours", "diffusers"):
        if k in runs:
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
    return out


def frame_weight_bytes(lm, depth, head_rows: int) -> int:
    """Bytes of weights, as stored, that one frame reads: the LM layers, the head rows of the
    candidates, and per depth step (7) the depth layers, the projection and one audio head
    (the bandwidth floor of a frame is this over the memory bandwidth; SPEC section 12)."""
    from .gguf.ops import compressed_nbytes

    head = lm.model.embed_tokens if lm.tied else lm.lm_head
    row = compressed_nbytes(head) // (lm.vocab_size if lm.tied else head.out_features)  # a GGUF row is whole blocks
    steps = depth.num_codebooks - 1
    per_step = sum(compressed_nbytes(b) for b in depth.layers) + compressed_nbytes(depth.projection) + \
        compressed_nbytes(depth.audio_heads[0])
    return sum(compressed_nbytes(layer) for layer in lm.model.layers) + head_rows * row + steps * per_step


def main(argv=None) -> int:
    from .bench import main as bench_main

    return bench_main(["--stages", "ar", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
