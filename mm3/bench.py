"""`python -m mm3 bench`: this engine against the diffusers 0.42.1 reference, same random weights.

    python -m mm3 bench --config medium --quant F32 --json bench-medium.json

Builds a random-weight checkpoint of the chosen size in the diffusers layout (mm3.tools.tiny's weight
recipe), converts it to the five GGUF files (mm3.tools.convert, then mm3.tools.quantize for --quant), loads
the reference from the same tensors (dequantized where ours are quantized), and measures per stage:

  ar        ms per frame (LM step + 7 depth steps + sampling), steady state, prefill excluded
  dit       ms per step of one window (the CFG pair; ours one batch of 2, the reference two calls)
  vocoder   seconds per minute of audio (one window, both stereo sides)
  e2e       seconds per minute of audio for a whole song (ours: mm3.pipeline; reference: its AR,
            denoise and decode blocks driven with the same prompt ids)

plus the peak memory of each run (process RSS, whose baseline holds both sides' weights; peak
VRAM per side on CUDA). The JSON names the machine, torch, dtype and date. Without diffusers the
reference side is skipped with a note. Configs (sizes in CONFIGS): tiny (the test model), medium
(fits a 2-core CPU: LM hidden 1024 x 8 layers with the released vocabulary layout, depth hidden
1024, DiT 512 wide x 4, a small vocoder), real (released dimensions; needs a large GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .tools.convert import DIFFUSERS_DEFAULTS, convert, expected_tensors
from .tools.tiny import RELEASED_LM_CONFIG, TINY, TINY_LM, build_tokenizer, build_weights

MIB = 1 << 20
# Bench configs: LM (Qwen3 config keys), the four diffusers components, the vocabulary layout of
# mm3.tools.tiny ("small": 256 bytes + specials; "real": the released ids) and the semantic codebook size.
CONFIGS = {
    "tiny": dict(lm=TINY_LM, **TINY, vocab="small", codes=64, native="F32", frames=48, seconds=4.0),
    "medium": dict(
        lm=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=128),  # released GQA ratio 4:1 and head_dim 128
        rvq_depth_decoder=dict(hidden_size=1024, num_layers=4, num_attention_heads=4, intermediate_size=1536),
        condition_encoder=dict(condition_hidden_dim=1024, out_dim=512),
        transformer=dict(condition_dim=512, num_layers=4, num_attention_heads=8, ff_inner_dim=2048),
        vocoder=dict(decoder_input_dim=256, decoder_hidden_dim=384),
        vocab="real", codes=16384, native="F32", frames=48, seconds=8.0),
    "real": dict(lm={}, rvq_depth_decoder={}, condition_encoder={}, transformer={}, vocoder={}, vocab="real",
                 codes=16384, native="BF16", frames=100, seconds=30.0),
}
COMPONENTS = ("rvq_depth_decoder", "condition_encoder", "transformer", "vocoder")
QUANTIZED = {"lm": "language_model", "depth": "rvq_depth_decoder", "dit": "transformer"}  # what --quant changes
CAPTION = "a bright synth pop song with warm female vocals and a punchy drum groove"
LYRICS = "[verse]\nneon lights are calling\nwe are dancing through the night\n[chorus]\nsing it loud"


@dataclass
class Checkpoint:
    """A built bench checkpoint: the diffusers layout, the GGUF folder for one quant, and sizes."""

    name: str
    root: Path
    diffusers: Path
    models: Path
    quant: str
    native: str  # the weight type the checkpoint was written in (F32, or BF16 for real)
    lm_cfg: dict
    cfgs: dict  # component -> full diffusers config
    special_ids: dict
    code_offset: int


def _save(folder: Path, cfg: dict, tensors: dict, filename: str, dtype: torch.dtype):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, folder / filename, metadata={"format": "pt"})


def build_checkpoint(name: str, root: Path, quant: str, seed: int = 0) -> Checkpoint:
    """Write (or reuse) the checkpoint of config `name` under `root`; returns where things are."""
    c = CONFIGS[name]
    tj, special_ids, code_offset = build_tokenizer(c["vocab"])
    vocab = RELEASED_LM_CONFIG["vocab_size"] if name == "real" else code_offset + c["codes"]
    lm_cfg = {**RELEASED_LM_CONFIG, **c["lm"], "vocab_size": vocab}
    cfgs = {comp: {**DIFFUSERS_DEFAULTS[comp], **c[comp]} for comp in COMPONENTS}
    if name != "real":
        lm_cfg["torch_dtype"] = "float32"
    diff = root / "diffusers"
    marker = root / "bench_checkpoint.json"
    stamp = {"config": name, "seed": seed, "lm": lm_cfg, "components": cfgs}
    if not (marker.is_file() and json.loads(marker.read_text()) == stamp):
        shutil.rmtree(root, ignore_errors=True)
        wdtype = torch.bfloat16 if c["native"] == "BF16" else torch.float32
        gen = torch.Generator().manual_seed(seed)
        (diff / "tokenizer").mkdir(parents=True)
        (diff / "tokenizer" / "tokenizer.json").write_text(json.dumps(tj))
        w = build_weights("language_model", lm_cfg, gen)
        head = w["lm_head.weight"]  # code rows of std 0.5 and a zero END row, as mm3.tools.tiny: songs rarely stop
        head[code_offset:] = 0.5 * torch.randn(head[code_offset:].shape, generator=gen)
        head[special_ids["<|audio_end|>"]] = 0.0
        _save(diff / "language_model", lm_cfg, w, "model.safetensors", wdtype)
        del w, head
        for comp in COMPONENTS:
            w = build_weights(comp, cfgs[comp], gen)
            if comp == "vocoder":  # keep tanh out of saturation, as mm3.tools.tiny does
                w["conv_out.weight_g"] *= 0.02
            keep = wdtype if comp in QUANTIZED.values() else torch.float32
            _save(diff / comp, cfgs[comp], w, "diffusion_pytorch_model.safetensors", keep)
            del w
        convert(diff, root / "gguf")
        marker.write_text(json.dumps(stamp))
    models = root / f"models-{quant}"
    if not models.is_dir():
        _quantized_folder(root / "gguf", models, quant, c["native"])
    return Checkpoint(name, root, diff, models, quant, c["native"], lm_cfg, cfgs, special_ids, code_offset)


def _quantized_folder(native: Path, out: Path, quant: str, native_type: str):
    """A models folder with the LM, depth and DiT files in `quant` and the others as converted."""
    from .tools.quantize import quantize_file

    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for src in sorted(native.glob("*.gguf")):
        if quant != native_type and any(f"-{sub}-" in src.name for sub in QUANTIZED.values()):
            quantize_file(src, tmp / src.name.replace(f"-{native_type}.gguf", f"-{quant}.gguf"), quant)
            continue
        try:
            os.link(src, tmp / src.name)
        except OSError:
            shutil.copy2(src, tmp / src.name)
    tmp.rename(out)


def param_bytes(cfgs: dict, lm_cfg: dict, bytes_per: float) -> int:
    """Bytes of every weight of the five components at `bytes_per` bytes per value."""
    shapes = list(expected_tensors("language_model", lm_cfg).values())
    shapes += [s for comp, cfg in cfgs.items() for s in expected_tensors(comp, cfg).values()]
    return int(sum(math.prod(s) for s in shapes) * bytes_per)


# --------------------------------------------------------------------------------------------
# Machine, memory, timing.


def machine(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "device": str(device),
            "os": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)}
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:
        info["diffusers"] = None
    return info


class PeakMemory:
    """Peak process RSS (Linux: VmHWM, reset through /proc/self/clear_refs) and, on CUDA, peak
    allocated VRAM, over a `with` block, with the RSS at its start (the bench holds both sides'
    models in one process: the difference is what the run itself added). MiB; None where the
    platform cannot say."""

    def __init__(self, device: torch.device):
        self.device, self.rss_mib, self.vram_mib, self.start_mib = device, None, None, None

    @staticmethod
    def _status(key: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def __enter__(self):
        rss = self._status("VmRSS")
        self.start_mib = None if rss is None else round(rss / MIB, 1)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        hwm = self._status("VmHWM")
        self.rss_mib = None if hwm is None else round(hwm / MIB, 1)
        if self.device.type == "cuda":
            self.vram_mib = round(torch.cuda.max_memory_allocated(self.device) / MIB, 1)
        return False

    def as_dict(self) -> dict:
        d = {"peak_rss_mib": self.rss_mib, "rss_before_mib": self.start_mib}
        if self.vram_mib is not None:
            d["peak_vram_mib"] = self.vram_mib
        return d


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ratio(reference: float | None, ours: float | None) -> float | None:
    """How many times faster ours is (reference time / our time)."""
    if not reference or not ours:
        return None
    return round(reference / ours, 2)


# --------------------------------------------------------------------------------------------
# The run.


def _check_room(name: str, ckpt_cfgs: dict, lm_cfg: dict, device: torch.device, work: Path):
    """`real` holds the released dimensions twice (ours and the reference): refuse where it cannot fit."""
    if name != "real":
        return
    need = param_bytes(ckpt_cfgs, lm_cfg, 2) * 2 + 8 * 2**30  # bf16 both sides + caches and activations
    if device.type != "cuda":
        raise SystemExit(f"config real needs a CUDA device with about {need / 2**30:.0f} GiB free (released "
                         f"dimensions for ours and the reference); this run is on {device}")
    free, _ = torch.cuda.mem_get_info(device)
    if free < need:
        raise SystemExit(f"config real needs about {need / 2**30:.0f} GiB of free GPU memory, {device} has "
                         f"{free / 2**30:.0f} GiB")
    from .device import free_bytes

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
    """The report for `args`; the CPU thread count it sets is restored afterwards."""
    threads = torch.get_num_threads()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> dict:
    from .device import pick_device, pick_dtype

    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    from .tools.quantize import MIXES

    c = CONFIGS[args.config]
    quant = args.quant or c["native"]
    if quant != c["native"] and quant not in MIXES:
        raise SystemExit(f"--quant must be {c['native']} (the {args.config} checkpoint's own type) or one of "
                         f"{', '.join(MIXES)}, got {quant!r}")
    stages = [s.strip() for s in args.stages.split(",")]
    unknown = sorted(set(stages) - {"ar", "dit", "vocoder", "e2e"})
    if unknown:
        raise SystemExit(f"unknown stage(s) {', '.join(unknown)}; choose from ar, dit, vocoder, e2e")
    lm_cfg = {**RELEASED_LM_CONFIG, **c["lm"]}
    _check_room(args.config, {k: {**DIFFUSERS_DEFAULTS[k], **c[k]} for k in COMPONENTS}, lm_cfg, device,
                Path(args.work or tempfile.gettempdir()))
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="mm3-bench-"))
    t0 = time.perf_counter()
    ckpt = build_checkpoint(args.config, root / args.config, quant, args.seed)
    report = {
        "config": args.config, "quant": quant, "dtype": str(dtype).removeprefix("torch."),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine(device),
        "sizes": {"language_model": {k: ckpt.lm_cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                                   "num_hidden_layers", "num_attention_heads",
                                                                   "num_key_value_heads", "head_dim")},
                  **{k: {kk: vv for kk, vv in v.items() if kk != "_class_name"} for k, v in ckpt.cfgs.items()}},
        "settings": {"frames": args.frames or c["frames"], "e2e_seconds": args.seconds or c["seconds"],
                     "steps": args.steps, "repeat": args.repeat, "seed": args.seed, "compile": args.compile},
        "build_seconds": round(time.perf_counter() - t0, 1), "notes": [],
    }
    have_reference = importlib.util.find_spec("diffusers") is not None
    if not have_reference:
        report["notes"].append("diffusers is not installed: the reference side is skipped")
    from . import bench_ar, bench_synth

    ctx = bench_synth.Context(ckpt, device, dtype, have_reference, args.repeat, args.seed)
    ctx.compile = args.compile
    with _quiet_reference(have_reference):
        if "ar" in stages:
            report["ar"] = bench_ar.measure(ctx, report["settings"]["frames"])
        if "dit" in stages:
            report["dit"] = bench_synth.measure_dit(ctx)
        if "vocoder" in stages:
            report["vocoder"] = bench_synth.measure_vocoder(ctx)
        if "e2e" in stages:
            report["e2e"] = bench_synth.measure_e2e(ctx, report["settings"]["e2e_seconds"], args.steps)
    report["notes"] += ctx.notes
    if not args.work:
        shutil.rmtree(root, ignore_errors=True)
    return report


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
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement, interleaved; best kept")
    p.add_argument("--seed", type=int, default=0, help="weights and sampling seed")
    p.add_argument("--compile", action="store_true", help="run our AR frame step through torch.compile (CUDA "
                   "graphs on CUDA); compilation happens in the warm-up run")
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
    p = argparse.ArgumentParser(prog="python -m mm3.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return _cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
