"""The kernels one AR frame launches on the GPU code path (`python -m mm3 kernels --frame`).

`count_frame` writes the bench's random GGUF files of a config (`mm3.bench.checkpoints.CONFIGS`;
`real` with fewer LM layers, scaled to the released 36), loads the LM and the depth decoder on the
GPU code path over CPU tensors (`mm3.backends.gpu.emulation`, Triton's interpreter) and runs one
AR frame step as the CUDA graph holds it: `FrameSampler.step` with the KV bucket set, bfloat16, the
CFG pair of rows, the fast numerics, after one warm-up step. `mm3.backends.gpu.frame_count` counts
its kernels. `on_device` counts an eager frame on a CUDA device the same way and beside it the
kernels torch's profiler sees in one eager frame and in one graph replay.

Run as `python -m mm3.bench.frame_kernels --config medium --quant Q4_K_M` (it sets TRITON_INTERPRET=1
before Triton is imported), or through `python -m mm3 kernels --frame`, which runs it so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RELEASED_LM_LAYERS = 36
REAL_LAYERS = 2  # LM layers `real` runs by default (each layer launches the same kernels)
PROMPT_POSITIONS = 64  # filled KV positions before the frame (its bucket: the first, 256)
LATE_POSITIONS = 9000  # filled KV positions at a 6-minute song's last frames (25 frames a second)
POSITION_FRAMES = 20  # frames timed at each position


def models_folder(config: str, quant: str, work: Path, lm_layers: int | None = None, seed: int = 0) -> Path:
    """The folder of the LM and depth GGUF files of `config` in `quant` (random weights written straight in
    the quant, kept under `work` and reused), the LM with `lm_layers` layers where given."""
    from ..formats.diffusers import DIFFUSERS_DEFAULTS
    from ..tools.tiny import RELEASED_LM_CONFIG, build_tokenizer
    from .checkpoints import COMPONENTS, CONFIGS
    from .random_models import write_random_models

    c = CONFIGS[config]
    tj, special_ids, code_offset = build_tokenizer(c["vocab"])
    vocab = RELEASED_LM_CONFIG["vocab_size"] if config == "real" else code_offset + c["codes"]
    lm_cfg = {**RELEASED_LM_CONFIG, **c["lm"], "vocab_size": vocab}
    if lm_layers:
        lm_cfg["num_hidden_layers"] = lm_layers
    cfgs = {comp: {**DIFFUSERS_DEFAULTS[comp], **c[comp]} for comp in COMPONENTS}
    folder = work / f"{config}-{quant}-lm{lm_cfg['num_hidden_layers']}-seed{seed}"
    write_random_models(folder, lm_cfg, cfgs, quant, tj, special_ids["<|audio_end|>"],
                        ("language_model", "rvq_depth_decoder"), seed)
    return folder


def _load(folder: Path):
    from ..backends.gpu.placement import relayout
    from ..files.opener import open_component
    from ..models import build_model
    from ..tokenizer import MM3Tokenizer

    models, codes = {}, None
    for path in sorted(folder.glob("*.gguf")):
        comp = open_component(path)
        if comp.kind in ("lm", "depth"):
            models[comp.kind] = build_model(comp, numerics="fast")
            relayout(models[comp.kind])  # the device layout, held on CPU tensors
            if comp.kind == "lm":
                codes = MM3Tokenizer.from_component(comp).codes
    return models["lm"], models["depth"], codes


def frame_sampler(lm, depth, codes, dtype, device, positions: int = PROMPT_POSITIONS):
    """A `FrameSampler` of one song with CFG on a KV cache holding `positions` filled positions
    (zeros: what a frame computes does not change what it launches), its bucket set as the graphed
    step's; the products chosen as before a capture. Returns (sampler, q_sem, q_dep)."""
    import torch

    from ..plan.ar import MIN_KV_BUCKET, FrameSampler, PlanSettings, kv_bucket
    from ..weights.layers import choose_products

    settings = PlanSettings(duration=1.0, lm_seed=0)
    cache = lm.new_cache(2, min(lm.max_positions, MIN_KV_BUCKET + positions), dtype, device)
    cache.length = positions
    cache.pos.fill_(positions)
    cache.host_counting = False
    cache.bucket = kv_bucket(positions + 1, cache.max_len)
    sampler = FrameSampler(lm, depth, codes, cache, settings, dtype, device, max_frames=1)
    g = torch.Generator().manual_seed(0)
    sampler.last = (torch.randn(cache.rows, lm.hidden_size, generator=g) * 0.1).to(device, dtype)
    choose_products([lm, depth], dtype, device)
    depth.ready(dtype, device)
    head = lm.head_ids[1] - lm.head_ids[0]
    q_sem = torch.empty(1, head).exponential_(generator=g).to(device)
    q_dep = torch.empty(1, depth.num_codebooks - 1, depth.audio_vocab).exponential_(generator=g).to(device)
    return sampler, q_sem, q_dep


def _parts(lm, depth, sampler) -> tuple[dict, list]:
    """The modules whose calls make a part of the frame, and the KV buffers."""
    modules = {layer: ("lm_layer", i) for i, layer in enumerate(lm.model.layers)}
    modules[lm] = "lm_step_fixed"
    modules[depth] = "depth_pass"
    modules[depth.projection] = "depth_pass"
    modules[lm.lm_head] = "sampling"
    for head in depth.audio_heads:
        modules[head] = "sampling"
    caches = [t for t in (sampler.cache.k, sampler.cache.v, sampler.cache.k_scales, sampler.cache.v_scales)
              if t is not None]
    if sampler.depth_cache is not None:
        caches += [sampler.depth_cache.k, sampler.depth_cache.v]
    return modules, caches


def count_frame(config: str = "medium", quant: str = "Q4_K_M", work: Path | None = None,
                lm_layers: int | None = None) -> dict:
    """The kernels of one AR frame of `config` in `quant` on the GPU code path, counted over CPU
    tensors (needs TRITON_INTERPRET=1 before Triton is imported): the `frame_count` summary with
    the config, quant, layers and seconds. `real` runs `lm_layers` (default REAL_LAYERS) LM layers and
    scales them to the released 36; other configs run all of theirs, or `lm_layers` unscaled."""
    import torch

    from ..backends.gpu import kernels, layout_kernels
    from ..backends.gpu.emulation import emulated
    from ..backends.gpu.frame_count import KernelCounter
    from ..cache_dir import writable
    from ..formats.gguf import quants

    start = time.perf_counter()
    if config == "real":
        lm_layers = lm_layers or REAL_LAYERS
    work = Path(work) if work else (writable("frame-kernels") or Path.cwd() / "frame-kernels")
    folder = models_folder(config, quant, work, lm_layers)
    built = time.perf_counter()
    dtype, device = torch.bfloat16, torch.device("cpu")
    shifts, works = quants.BROADCAST_SHIFTS_ON_CPU, (layout_kernels.works, layout_kernels.fused_works, kernels.works)
    quants.BROADCAST_SHIFTS_ON_CPU = True  # the accelerators' form of the unpacking
    # The kernels serve every weight they read, as on a GPU (their checks of a bfloat16 product are not
    # what is counted, and the interpreter's answers to them are not the device's).
    layout_kernels.works = kernels.works = lambda qtype, dtype, device: True
    layout_kernels.fused_works = lambda form, qtype, dtype, device, second=None: True
    try:
        with emulated(), torch.inference_mode():
            lm, depth, codes = _load(folder)
            sampler, q_sem, q_dep = frame_sampler(lm, depth, codes, dtype, device)
            modules, caches = _parts(lm, depth, sampler)
            pos = sampler.cache.pos.clone()
            with KernelCounter(modules, caches, fast_products=True) as counter:
                counter.recording = False
                sampler.step(q_sem, q_dep)  # the warm-up, as before a capture
                sampler.cache.pos.copy_(pos)
                counter.recording = True
                sampler.step(q_sem, q_dep)
    finally:
        quants.BROADCAST_SHIFTS_ON_CPU, (layout_kernels.works, layout_kernels.fused_works, kernels.works) = shifts, works
    layers = len(lm.model.layers)
    scaled = RELEASED_LM_LAYERS if config == "real" else layers
    out = {"config": config, "quant": quant, "dtype": "bfloat16", "rows": sampler.cache.rows,
           "bucket": sampler.cache.bucket, "path": "GPU code path emulated on the CPU (Triton interpreter)",
           **counter.summary(layers, scaled)}
    if scaled != layers:
        out["note"] = (f"{layers} LM layers run, their kernels scaled to the released {scaled} "
                       f"(the first as counted, every later one as the later ones counted)")
    out["seconds"] = {"files": round(built - start, 1), "count": round(time.perf_counter() - built, 1)}
    return out


def on_device(lm, depth, codes, dtype, device) -> dict:
    """On a device (CUDA: the bench's check of the count): the kernels of one eager frame counted
    (`frame_count`, as `count_frame` counts the emulated path), and the kernel events torch's
    profiler records on the device in one eager frame and, on CUDA, in one replay of the frame's
    CUDA graph (None where the capture failed, with why)."""
    import torch

    from ..backends.gpu.frame_count import KernelCounter
    from .measure import sync

    device = torch.device(device)
    with torch.inference_mode():
        sampler, q_sem, q_dep = frame_sampler(lm, depth, codes, dtype, device)
        modules, caches = _parts(lm, depth, sampler)
        pos, last = sampler.cache.pos.clone(), sampler.last.clone()

        def rewind():
            sampler.cache.pos.copy_(pos)
            sampler.last = last.clone()

        sampler.step(q_sem, q_dep)  # warm-up: kernels compiled, tables made
        sync(device)
        rewind()
        with KernelCounter(modules, caches) as counter:
            sampler.step(q_sem, q_dep)
        sync(device)
        out = {"counted": counter.total(), "counted_by_kind": counter.by_kind(), "host_syncs": len(counter.syncs)}
        rewind()
        out["profiled_eager"] = _profiled(lambda: sampler.step(q_sem, q_dep), device)
        out["profiled_graph"] = None
        if device.type == "cuda":
            try:
                from ..backends.gpu.frame_graphs import CudaCapture

                rewind()
                capture = CudaCapture(device)
                with capture.warm():
                    sampler.step(q_sem, q_dep)
                rewind()
                replay = capture(sampler, q_sem, q_dep)
                out["profiled_graph"] = _profiled(lambda: replay(q_sem, q_dep), device)
            except Exception as e:  # a driver that refuses the capture
                out["graph_error"] = f"{type(e).__name__}: {e}"
    return out


def position_cost(lm, depth, codes, dtype, device, positions=(PROMPT_POSITIONS, LATE_POSITIONS),
                  frames: int = POSITION_FRAMES) -> dict:
    """What a frame costs as the song grows: ms per frame over `frames` frame steps after each count
    of filled KV positions (clamped to what the LM holds), run as a plan runs them (replayed from
    CUDA graphs where `frame_graphs.wanted`, else eager), and the last count's over the first."""
    import torch

    from ..backends.gpu import frame_graphs
    from .measure import sync

    device = torch.device(device)
    at = {}
    for wanted in positions:
        filled = max(0, min(int(wanted), lm.max_positions - frames - 2))
        with torch.inference_mode():
            sampler, q_sem, q_dep = frame_sampler(lm, depth, codes, dtype, device, filled)
            step = frame_graphs.GraphedStep(sampler, device) if frame_graphs.wanted(device, False) else sampler.step
            step(q_sem, q_dep)  # warm-up: kernels compiled, the graph captured and checked
            sync(device)
            start = time.perf_counter()
            for _ in range(frames):
                step(q_sem, q_dep)
            sync(device)
            at[str(filled)] = round((time.perf_counter() - start) * 1000 / frames, 3)
            del sampler, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first, last = at[min(at, key=int)], at[max(at, key=int)]
    return {"ms_per_frame_at": at, "frames": frames, "late_over_first": round(last / first, 3) if first else None}


def _profiled(run, device) -> dict:
    """Kernel events (and, apart, memory copies and sets) torch's profiler records on the device over
    `run()`; none on the CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from .measure import sync

    cuda = device.type == "cuda"
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        sync(device)
    kernels = copies = 0
    for e in prof.events():
        if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU:
            continue
        if e.name.startswith(("Memcpy", "Memset")):
            copies += 1
        else:
            kernels += 1
    return {"kernels": kernels, "memory_operations": copies}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mm3.bench.frame_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=("tiny", "medium", "real"), default="medium")
    p.add_argument("--quant", default="Q4_K_M")
    p.add_argument("--layers", type=int, default=0, help="LM layers run (real: default 2, scaled to 36)")
    p.add_argument("--work", default=None, help="folder of the random model files (kept and reused)")
    p.add_argument("--json", metavar="OUT", default=None,
                   help="also write the count as JSON to OUT ('-': only the JSON)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise SystemExit("the frame count needs TRITON_INTERPRET=1 before Triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    report = count_frame(args.config, args.quant, Path(args.work) if args.work else None, args.layers or None)
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return 0
    from ..tools.kernels import frame_lines

    print("\n".join(frame_lines(report)))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
