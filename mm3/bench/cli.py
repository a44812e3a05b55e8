"""`python -m mm3 bench`: this engine against the diffusers 0.42.1 reference, same random weights.

    python -m mm3 bench --config medium --quant F32 --json bench-medium.json

Builds a random-weight checkpoint of the chosen size in the diffusers layout (mm3.tools.tiny's weight
recipe), converts it to the five GGUF files (mm3.tools.convert, then mm3.tools.quantize for --quant), loads
the reference from the same tensors (dequantized where ours are quantized), and measures per stage:

  ar        ms per frame (LM step + 7 depth steps + sampling), steady state, prefill excluded
  dit       ms per step of one window (the CFG pair; ours one batch of 2, the reference two calls)
  vocoder   seconds per minute of audio (one window, both stereo sides)
  e2e       seconds per minute of audio for a whole song (ours: mm3.song.pipeline; reference: its AR,
            denoise and decode blocks driven with the same prompt ids); with --stream, ours alone with
            the windows handed on as they are decoded: seconds to the first audio and to the whole song

plus the peak memory of each run (process RSS, whose baseline holds both sides' weights; peak
VRAM per side on CUDA) and, on CUDA, a roofline: the device's copy bandwidth and product
throughput (measured), the bytes a frame or step reads, its floor and the share reached, and the
kernels of one AR frame (counted as `python -m mm3 kernels --frame` counts them, and the kernel
events torch's profiler records in an eager frame and in a graph replay). The JSON names the
machine, torch, dtype and date. Without diffusers the
reference side is skipped with a note. Configs (sizes in CONFIGS): tiny (the test model), medium
(small enough for a laptop CPU: LM hidden 1024 x 8 layers with the released vocabulary layout, depth hidden
1024, DiT 512 wide x 4, a small vocoder), real (released dimensions: on CUDA against the reference,
which needs a large GPU; on other devices, or with --direct, ours alone, stages ar and dit, from random
files written straight in the quant asked for, e.g.

    python -m mm3 bench --config real --device cpu --quant Q4_K_M --stages ar --frames 20 --repeat 1
).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from .. import switches
from ..formats.diffusers import DIFFUSERS_DEFAULTS
from ..tools.tiny import RELEASED_LM_CONFIG
from .checkpoints import COMPONENTS, CONFIGS, build_checkpoint, build_direct, direct_bytes, param_bytes
from .measure import machine


DIRECT_STAGES = {"ar", "dit"}


def _direct(name: str, device: torch.device, asked: bool = False) -> bool:
    """`real` off CUDA (or with --direct): ours only, from random files written straight in the
    quant asked for."""
    return name == "real" and (device.type != "cuda" or asked)


def _kernel_mode() -> str:
    from ..backends.gpu import kernels

    return kernels.mode()


def _check_room(name: str, ckpt_cfgs: dict, lm_cfg: dict, device: torch.device, work: Path, quant: str,
                stages: list[str], direct: bool = False):
    """`real` holds the released dimensions twice (ours and the reference) on CUDA, or ours alone as
    directly written files elsewhere: refuse where it cannot fit or run."""
    if name != "real":
        return
    if _direct(name, device, direct):
        if not set(stages) <= DIRECT_STAGES:
            raise SystemExit(f"config real on {device.type} runs the stages {', '.join(sorted(DIRECT_STAGES))} "
                             f"(ours only, random files written directly), not {', '.join(stages)}")
        need = direct_bytes(ckpt_cfgs, lm_cfg, quant)
        disk = shutil.disk_usage(work).free
        if disk < need:
            raise SystemExit(f"config real writes about {need / 2**30:.0f} GiB of {quant} files under {work}; "
                             f"{disk / 2**30:.0f} GiB free")
        return
    need = param_bytes(ckpt_cfgs, lm_cfg, 2) * 2 + 8 * 2**30  # bf16 both sides + caches and activations
    free, _ = torch.cuda.mem_get_info(device)
    if free < need:
        raise SystemExit(f"config real needs about {need / 2**30:.0f} GiB of free GPU memory, {device} has "
                         f"{free / 2**30:.0f} GiB")
    from ..backends.device import free_bytes

    ram, lm_ram = free_bytes(torch.device("cpu")), param_bytes({}, lm_cfg, 6)  # f32 draws + bf16 copy
    if ram is not None and ram < lm_ram:
        raise SystemExit(f"config real builds the LM's random weights in host memory: about {lm_ram / 2**30:.0f} "
                         f"GiB needed, {ram / 2**30:.0f} GiB available")
    disk, disk_need = shutil.disk_usage(work).free, param_bytes(ckpt_cfgs, lm_cfg, 2) * 2  # safetensors + GGUF
    if disk < disk_need:
        raise SystemExit(f"config real writes about {disk_need / 2**30:.0f} GiB under {work}; "
                         f"{disk / 2**30:.0f} GiB free")


@contextmanager
def _quiet_reference(active: bool):
    """The reference's deprecation and experimental-feature messages off for the run, then restored."""
    if not active:
        yield
        return
    import diffusers
    import transformers

    levels = diffusers.logging.get_verbosity(), transformers.logging.get_verbosity()
    diffusers.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        diffusers.logging.set_verbosity(levels[0])
        transformers.logging.set_verbosity(levels[1])


def run(args) -> dict:
    """The report for `args`; the CPU thread count and kernel mode it sets are restored afterwards."""
    threads = torch.get_num_threads()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        return _run(args)
    finally:
        torch.set_num_threads(threads)
        if getattr(args, "kernels", None):
            from ..backends.gpu import kernels

            kernels.configure()


def _run(args) -> dict:
    from ..backends.device import pick_device, pick_dtype

    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    from ..tools.quantize import MIXES

    c = CONFIGS[args.config]
    quant = args.quant or c["native"]
    if quant != c["native"] and quant not in MIXES:
        raise SystemExit(f"--quant must be {c['native']} (the {args.config} checkpoint's own type) or one of "
                         f"{', '.join(MIXES)}, got {quant!r}")
    if args.lora_rank < 0:
        raise SystemExit(f"--lora-rank must be 0 (none) or a rank, got {args.lora_rank}")
    if args.profile < 0:
        raise SystemExit(f"--profile takes a number of frames (0: none), got {args.profile}")
    stages = [s.strip() for s in args.stages.split(",")]
    unknown = sorted(set(stages) - {"ar", "dit", "vocoder", "e2e"})
    if unknown:
        raise SystemExit(f"unknown stage(s) {', '.join(unknown)}; choose from ar, dit, vocoder, e2e")
    if args.profile and "ar" not in stages:
        raise SystemExit(f"--profile profiles AR frames: add ar to --stages (got {args.stages})")
    lm_cfg = {**RELEASED_LM_CONFIG, **c["lm"]}
    if args.direct and args.config != "real":
        raise SystemExit(f"--direct writes the released sizes (config real), not config {args.config}")
    if args.work:  # a new folder is made, as the help says it is kept and reused
        Path(args.work).mkdir(parents=True, exist_ok=True)
    _check_room(args.config, {k: {**DIFFUSERS_DEFAULTS[k], **c[k]} for k in COMPONENTS}, lm_cfg, device,
                Path(args.work or tempfile.gettempdir()), quant, stages, args.direct)
    if args.kernels:  # before any model is placed: the form a weight takes on the device follows it
        from ..backends.gpu import kernels

        kernels.configure(args.kernels)
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="mm3-bench-"))
    t0 = time.perf_counter()
    if _direct(args.config, device, args.direct):
        need = {"ar": ("language_model", "rvq_depth_decoder"), "dit": ("condition_encoder", "transformer")}
        ckpt = build_direct(args.config, root / args.config, quant, args.seed,
                            [comp for s in stages for comp in need[s]])
    else:
        ckpt = build_checkpoint(args.config, root / args.config, quant, args.seed)
    report = {
        "config": args.config, "quant": quant, "dtype": str(dtype).removeprefix("torch."),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine(device),
        "sizes": {"language_model": {k: ckpt.lm_cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                                   "num_hidden_layers", "num_attention_heads",
                                                                   "num_key_value_heads", "head_dim")},
                  **{k: {kk: vv for kk, vv in v.items() if kk != "_class_name"} for k, v in ckpt.cfgs.items()}},
        "settings": {"frames": args.frames or c["frames"], "e2e_seconds": args.seconds or c["seconds"],
                     "steps": args.steps, "repeat": args.repeat, "seed": args.seed, "compile": args.compile,
                     "stream": args.stream, "lora_rank": args.lora_rank, "graphs": args.graphs, "profile": args.profile,
                     "kernels": _kernel_mode(),
                     "switches": {name: switches.value(name) for name in sorted(switches.SWITCHES)
                                  if switches.SWITCHES[name].choices is not None}},
        "build_seconds": round(time.perf_counter() - t0, 1), "notes": [],
    }
    have_reference = importlib.util.find_spec("diffusers") is not None and ckpt.diffusers is not None
    if ckpt.diffusers is None:
        report["notes"].append(f"config {args.config} on {device.type}: random {quant} files written directly; "
                               "ours alone in its default mode (no float checkpoint for the reference)")
    elif not have_reference:
        report["notes"].append("diffusers is not installed: the reference side is skipped")
    from . import ar, synth
    from .context import Context

    ctx = Context(ckpt, device, dtype, have_reference, args.repeat, args.seed)
    ctx.compile = args.compile
    ctx.graphs = {"on": True, "off": False}.get(args.graphs)
    ctx.dtype_named = args.dtype not in (None, "", "auto")
    ctx.lora_rank = args.lora_rank
    if args.lora_rank:
        report["notes"].append(f"stages ar and dit: ours with a random rank-{args.lora_rank} LoRA on every attention "
                               "and MLP layer of the LM and the DiT (side products); the reference and e2e without")
    if device.type == "cuda":  # the roofline's two ceilings, measured here
        from .measure import copy_bandwidth, matmul_tflops

        ctx.roofline = {"copy_gb_per_s": copy_bandwidth(device), "matmul_tflops": matmul_tflops(device, dtype)}
        report["roofline"] = dict(ctx.roofline)
    with _quiet_reference(have_reference):
        if "ar" in stages:
            report["ar"] = ar.measure(ctx, report["settings"]["frames"])
            if args.profile:
                from .profile import profile_frames

                report["ar"]["profile"] = profile_frames(ctx, args.profile)
            if device.type == "cuda":  # the kernels of a frame: counted, and as the profiler sees them
                report["ar"]["frame_kernels"] = _frame_kernels(ctx)
                report["ar"]["positions"] = _positions(ctx)  # a long song's last frames against its first
            if ctx.light:  # strict memory: the AR group leaves before the synthesis group loads
                ctx.release("lm", "depth")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if "dit" in stages:
            report["dit"] = synth.measure_dit(ctx)
        if "vocoder" in stages:
            report["vocoder"] = synth.measure_vocoder(ctx)
        if "e2e" in stages:
            report["e2e"] = synth.measure_e2e(ctx, report["settings"]["e2e_seconds"], args.steps, args.stream)
    report["notes"] += ctx.notes
    if not args.work:
        shutil.rmtree(root, ignore_errors=True)
    return report


def _frame_kernels(ctx) -> dict:
    """`frame_kernels.on_device` for our models, or what stopped it."""
    from .frame_kernels import on_device

    try:
        return on_device(ctx.ours("lm"), ctx.ours("depth"), ctx.prompt().codes, ctx.dtype, ctx.device)
    except Exception as e:  # a count that fails costs its figure, never the bench
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        torch.cuda.empty_cache()


def _positions(ctx) -> dict:
    """`frame_kernels.position_cost` for our models, or what stopped it."""
    from .frame_kernels import position_cost

    try:
        return position_cost(ctx.ours("lm"), ctx.ours("depth"), ctx.prompt().codes, ctx.dtype, ctx.device)
    except Exception as e:  # a figure that fails costs itself, never the bench
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        torch.cuda.empty_cache()


def summary(report: dict) -> str:
    m = report["machine"]
    lines = [f"MM3 bench, config {report['config']}, weights {report['quant']}, compute {report['dtype']}, "
             f"{m['device']} ({m.get('gpu', {}).get('name', m['cpu'])}), {m['threads']} threads, torch {m['torch']}, "
             f"{report['date']}"]
    rows = [("ar", "ms/frame", "ms_per_frame"), ("dit", "ms/step", "ms_per_step"),
            ("vocoder", "s/min audio", "s_per_min"), ("e2e", "s/min audio", "s_per_min")]
    for stage, unit, key in rows:
        r = report.get(stage)
        if not r:
            continue
        ours, ref = r.get(f"ours_{key}"), r.get(f"diffusers_{key}")
        fmt = (lambda v: "n/a" if v is None else f"{v:.2f}")
        lines.append(f"  {stage:8s} ours {fmt(ours):>9s}  diffusers {fmt(ref):>9s} {unit:12s} "
                     f"ratio {fmt(r.get('ratio'))}x")
        if stage == "e2e" and r.get("stream"):
            t = r["stream"]
            ar = t["ar_first_window_s"]
            lines.append(f"           streamed ({'planning and synthesis overlapped' if t['overlapped'] else 'by stages'}): "
                         f"first audio after {t['first_audio_s']:.2f} s, the whole song after {t['whole_s']:.2f} s"
                         + ("" if ar is None else f"; the AR had planned the first window's frames after {ar:.2f} s"))
        if stage == "ar" and r.get("cpu_products"):
            cp = r["cpu_products"]
            lines.append(f"           CPU products: {cp['chosen']} ({cp['source']})")
        if stage == "ar" and r.get("profile"):
            from .profile import lines as profile_lines

            lines += profile_lines(r["profile"])
        if stage == "ar" and r.get("frame_kernels"):
            k = r["frame_kernels"]
            if "error" in k:
                lines.append(f"           kernels a frame: not counted ({k['error']})")
            else:
                graph = k.get("profiled_graph") or {}
                lines.append(f"           kernels a frame: {k['counted']} counted (eager), profiled "
                             f"{k['profiled_eager']['kernels']} eager, {graph.get('kernels', 'n/a')} in a graph replay")
        if stage == "ar" and r.get("positions"):
            pc = r["positions"]
            if "error" in pc:
                lines.append(f"           late frames: not timed ({pc['error']})")
            else:
                costs = ", ".join(f"{ms:.2f} ms after {n} positions" for n, ms in pc["ms_per_frame_at"].items())
                lines.append(f"           a frame as the song grows: {costs} ({pc['late_over_first']}x)")
        if stage == "ar" and r.get("machine_copy_gb_per_s"):
            lines.append(f"           weights read at {r['ours_weight_gb_per_s']:.2f} GB/s, "
                         f"{100 * r['weight_bandwidth_share']:.1f} % of a 1 GiB copy's {r['machine_copy_gb_per_s']:.1f} GB/s")
        if stage == "dit" and r.get("compute_dtype", report["dtype"]) != report["dtype"]:
            same = r.get(f"ours_{report['dtype']}_ms_per_step")
            lines.append(f"           ours computes the DiT in {r['compute_dtype']} (mm3.backends.cpu.bf16)"
                         + ("" if same is None else f"; in {report['dtype']} {fmt(same)} ms/step"))
    roof = report.get("roofline")
    if roof:
        lines.append(f"  roofline: copy {roof['copy_gb_per_s']} GB/s, {report['dtype']} products "
                     f"{roof['matmul_tflops']} TFLOP/s")
        a, d = report.get("ar") or {}, report.get("dit") or {}
        if "bandwidth_share" in a:
            lines.append(f"  ar  reads {a['weights_per_frame_mib']} MiB a frame: floor {a['floor_ms_per_frame']} ms, "
                         f"{100 * a['bandwidth_share']:.0f} % of the copy bandwidth")
        if "compute_share" in d:
            lines.append(f"  dit {d['flops_per_step'] / 1e12:.2f} TFLOP a step: floor {d['floor_ms_per_step']} ms, "
                         f"{100 * d['compute_share']:.0f} % of the product throughput; reads {d['read_mib_per_step']} MiB")
    lines += [f"  note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--config", choices=list(CONFIGS), default="tiny", help="model size (default tiny)")
    p.add_argument("--quant", default=None, help="LM, depth and DiT weight type: the checkpoint's own (F32; BF16 "
                   "for real) or a mix of mm3.tools.quantize (Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q5_0, Q4_0)")
    p.add_argument("--stages", default="ar,dit,vocoder,e2e", help="comma-separated subset of ar,dit,vocoder,e2e")
    p.add_argument("--json", metavar="OUT", default=None, help="write the report as JSON to OUT ('-' = stdout)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: the best available)")
    p.add_argument("--dtype", default=None, help="compute dtype for both sides (default: the device's)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--frames", type=int, default=0, help="AR frames per timed run (0 = the config's)")
    p.add_argument("--seconds", type=float, default=0, help="song length of the e2e run (0 = the config's)")
    p.add_argument("--steps", type=int, default=30, help="DiT steps of the e2e run (default 30)")
    p.add_argument("--stream", action="store_true", help="e2e: ours with each window handed on as it is decoded "
                   "(planning and synthesis overlapped), timing the first audio against the whole song; no reference")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement, interleaved; best kept")
    p.add_argument("--seed", type=int, default=0, help="weights and sampling seed")
    p.add_argument("--compile", action="store_true", help="run our AR frame step through torch.compile "
                   "(on CUDA then captured by our CUDA graphs, unless --graphs off); compilation happens in the "
                   "warm-up run")
    p.add_argument("--profile", type=int, default=0, metavar="FRAMES",
                   help="also profile this many of our AR frames, eagerly (on CUDA without graphs, every kernel "
                   "timed on the device): the operations or kernels that take the most time, per frame")
    p.add_argument("--lora-rank", dest="lora_rank", type=int, default=0,
                   help="give our LM and DiT a random LoRA of this rank on every attention and MLP layer (0: none), "
                        "to measure what an adapter costs")
    p.add_argument("--direct", action="store_true", help="config real from random files written straight in the "
                   "quant, ours alone (the default off CUDA): no float checkpoint, no reference")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto", help="our AR frame step from CUDA "
                   "graphs (auto: the engine's default, on with CUDA)")
    p.add_argument("--kernels", choices=("auto", "off", "triton", "layout"), default=None,
                   help="the quantized kernels (MM3_KERNELS; default: as the environment says)")
    p.add_argument("--work", default=None, help="folder for the built checkpoints (kept and reused; default: "
                   "a temporary folder, removed afterwards)")


def _cli(args) -> int:
    report = run(args)
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(summary(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {args.json}", file=sys.stderr)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark this engine against the diffusers reference",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_cli)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mm3 bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return _cli(p.parse_args(argv))
