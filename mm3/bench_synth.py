"""Time the synthesis stage, ours against diffusers 0.42.1, on the same tiny random model.

    python -m mm3.bench_synth [--frames 200] [--steps 10] [--threads N] [--device cpu] [--tiny DIR]

Builds the tiny checkpoint (mm3.tiny) in a temporary folder unless --tiny points at one, then
reports DiT milliseconds per step (one CFG pair: ours one batch of 2, diffusers two batch-1 calls
as its pipeline makes them) and vocoder seconds per minute of audio for one full window. The
numbers say how much overhead the two implementations add around the same math; the tiny sizes
say nothing about the released model's speed.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch


def _race(fns: dict, repeat: int) -> dict:
    """Best wall time of each callable, run in turns so that load from other processes hits all alike."""
    for fn in fns.values():
        fn()  # warm-up (caches, allocator, lazy init)
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


@torch.no_grad()
def run(tiny_dir: Path, frames: int, steps: int, device: str, repeat: int) -> list[tuple[str, str, float, str]]:
    from .audio import decode_windows
    from .components import open_component
    from .flow import sample_latents
    from .models.cond import ConditionEncoder
    from .models.dit import FlowDiT
    from .models.vocoder import Vocoder
    from .tiny import build_tiny

    if not (tiny_dir / "diffusers").is_dir():
        build_tiny(tiny_dir)
    found = sorted(tiny_dir.glob("*.gguf")) + sorted(tiny_dir.glob("gguf/*.gguf"))
    files = {open_component(p).kind: p for p in found}
    cond = ConditionEncoder.load(open_component(files["cond"], "cond")).to(device)
    dit = FlowDiT.load(open_component(files["dit"], "dit")).to(device)
    voc = Vocoder.load(open_component(files["vae"], "vae"), with_encoder=False).to(device)
    width = cond.num_layers * cond.hidden_dim
    fh = torch.randn(1, frames, width, generator=torch.Generator().manual_seed(0))
    c = cond(fh.to(device))
    length = c.shape[1]
    x = torch.randn(1, dit.in_channels, length, device=device)
    t = torch.full((1,), 0.5, device=device)
    pair_x, pair_t, pair_c = torch.cat([x, x]), t.expand(2), torch.cat([c, torch.zeros_like(c)])
    seconds_audio = length * voc.hop / voc.sampling_rate
    fns = {"dit": lambda: dit(pair_x, pair_t, pair_c),
           "voc": lambda: voc.decode(x),
           "decode": lambda: decode_windows(voc, [x])}
    try:
        import warnings

        from diffusers import MiniMaxMusic3Transformer1DModel, MiniMaxMusic3Vocoder

        d = tiny_dir / "diffusers"
        rdit = MiniMaxMusic3Transformer1DModel.from_pretrained(d / "transformer", torch_dtype=torch.float32)
        rdit = rdit.to(device).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            rvoc = MiniMaxMusic3Vocoder.from_pretrained(d / "vocoder", torch_dtype=torch.float32).to(device).eval()

        def ref_step():  # the reference pipeline's two batch-1 calls
            rdit(hidden_states=x, timestep=t, encoder_hidden_states=c, return_dict=False)
            rdit(hidden_states=x, timestep=t, encoder_hidden_states=torch.zeros_like(c), return_dict=False)

        fns.update(ref_dit=ref_step, ref_voc=lambda: rvoc(x))
    except ImportError:
        pass
    best = _race(fns, repeat)
    whole = _race({"sampler": lambda: sample_latents(cond, dit, fh, steps=steps, seed=0, device=device)}, 1)
    per_min = 60 / seconds_audio
    rows = [("DiT step (CFG pair)", "ours", 1e3 * best["dit"], "ms/step"),
            ("DiT step (CFG pair)", "diffusers", 1e3 * best.get("ref_dit", float("nan")), "ms/step"),
            ("sampler, whole window", "ours", 1e3 * whole["sampler"] / steps, "ms/step"),
            ("vocoder forward", "ours", per_min * best["voc"], "s/min audio"),
            ("vocoder forward", "diffusers", per_min * best.get("ref_voc", float("nan")), "s/min audio"),
            ("decode + stitch", "ours", per_min * best["decode"], "s/min audio")]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=200, help="AR frames of the window (200 = a full window)")
    ap.add_argument("--steps", type=int, default=10, help="sampler steps for the whole-window figure")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=15, help="timed repeats; the best is reported")
    ap.add_argument("--tiny", type=Path, default=None, help="folder of a built tiny model (default: build one)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args.tiny or Path(tmp), args.frames, args.steps, args.device, args.repeat)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    print(f"tiny model, {args.frames} frames, float32, {args.device} ({dev}), {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    for what, who, value, unit in rows:
        print(f"  {what:24s} {who:10s} {value:10.2f} {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
