"""Bench stages after the AR: DiT step, vocoder, and the whole song end to end.

The reference side loads the same weights (`Context`): the LM, depth decoder and DiT from our GGUF
files dequantized to float, so a quantized run compares the same weights; the condition encoder and
vocoder from the diffusers safetensors, which the GGUF files hold folded.
"""

from __future__ import annotations

import time

import torch

from ..synth.flow import WINDOW_FRAMES
from ..progress import Progress
from .context import Context
from .measure import PeakMemory, best_of, ratio, read_bytes, sync
from .reference import run_song

LATENT_WINDOW_FRAMES = 200  # a full DiT window (mm3.synth.flow.WINDOW_FRAMES): 689 latents at the released rates


def _window_inputs(ctx: Context):
    """One full window: condition from random frame hiddens, noise, t = 0.5."""
    cond_enc = ctx.ours("cond")
    g = torch.Generator().manual_seed(ctx.seed)
    width = cond_enc.num_layers * cond_enc.hidden_dim
    fh = torch.randn(1, LATENT_WINDOW_FRAMES, width, generator=g).to(ctx.device, ctx.dtype)
    with torch.no_grad():
        cond = cond_enc(fh).to(ctx.dtype)  # [1, L, D]
    dit = ctx.ours("dit")
    x = torch.randn(1, dit.in_channels, cond.shape[1], generator=g).to(ctx.device, ctx.dtype)
    t = torch.full((1,), 0.5, device=ctx.device, dtype=ctx.dtype)
    return x, t, cond


@torch.no_grad()
def measure_dit(ctx: Context) -> dict:
    """ms per DiT step of one full window (the CFG pair). "ours" is what mm3.synth.flow.sample_latents
    runs by default (weights kept dequantized within the budget, oneDNN products on the CPU, the
    forward in bfloat16 where `mm3.backends.cpu.bf16` picks it), timed in turns with the reference;
    "ours_mkl" the same with torch's default CPU GEMM (where the forward is in the bench's dtype);
    in passes of their own before those, "ours_per_step_dequant" in the bench's dtype with no
    weight copies and "ours_<dtype>" in the bench's dtype with its own copies, where the forward's
    dtype differs."""
    from ..backends.cpu.bf16 import dit_dtype
    from ..backends.device import dit_weight_budget
    from ..weights.copies import cache_dequantized, release_dequantized
    from ..backends.cpu.matmul import onednn_matmul, pays_for

    dit = ctx.ours("dit")
    x, t, cond = _window_inputs(ctx)
    px, pt, pc = torch.cat([x, x]), t.expand(2), torch.cat([cond, torch.zeros_like(cond)])
    zeros = torch.zeros_like(cond)
    compute = ctx.dtype if ctx.dtype_named else dit_dtype(ctx.device, ctx.dtype)
    same = str(ctx.dtype).removeprefix("torch.")
    cx, ct, cc = px.to(compute), pt.to(compute), pc.to(compute)

    def ours():  # as the sampler calls it: inputs in the compute dtype, velocity in the latents'
        with onednn_matmul(ctx.device, pays_for(dit)):
            return dit(cx, ct, cc).to(ctx.dtype)

    def ours_same():
        with onednn_matmul(ctx.device, pays_for(dit)):
            return dit(px, pt, pc)

    fns = {}
    out = {"window_latents": cond.shape[1], "compute_dtype": str(compute).removeprefix("torch.")}
    if ctx.have_reference:
        ref = ctx.reference("transformer")

        def ref_step():  # its pipeline's two batch-1 calls
            return torch.cat([ref(hidden_states=x, timestep=t, encoder_hidden_states=c, return_dict=False)[0]
                              for c in (cond, zeros)])

        fns["diffusers"] = ref_step
        v_ref = ref_step().float()
        compared = {"rel_diff_vs_diffusers": ours, "mkl_rel_diff_vs_diffusers": lambda: dit(px, pt, pc)}
        if compute != ctx.dtype:
            compared[f"{same}_rel_diff_vs_diffusers"] = ours_same
        for key, fn in compared.items():
            out[key] = float((fn().float() - v_ref).norm() / v_ref.norm())
        if compute != ctx.dtype:  # the reference's own forward in the compute dtype, for scale
            import copy

            low = copy.deepcopy(ref).to(compute)
            v_low = torch.cat([low(hidden_states=x.to(compute), timestep=t.to(compute),
                                   encoder_hidden_states=c.to(compute), return_dict=False)[0] for c in (cond, zeros)])
            out[f"diffusers_{out['compute_dtype']}_rel_diff"] = float((v_low.float() - v_ref).norm() / v_ref.norm())
            del low
    best = {} if ctx.light else best_of({"ours_per_step_dequant": lambda: dit(px, pt, pc)}, ctx.repeat, ctx.device)
    if ctx.light and ctx.device.type == "cuda":  # without weight copies: the kernels (or a dequantization per product)
        best.update(best_of({"ours_no_copies": ours}, ctx.repeat, ctx.device))
        out["no_copies_read_mib"] = round(read_bytes(dit) / 2**20, 1)
    if compute != ctx.dtype and not ctx.light:  # the bench's dtype, with weight copies of its own
        cache_dequantized(dit, ctx.dtype, dit_weight_budget(ctx.device))
        best.update(best_of({f"ours_{same}": ours_same}, ctx.repeat, ctx.device))
        release_dequantized(dit)
    kept = cache_dequantized(dit, compute, dit_weight_budget(ctx.device))
    if not ctx.light and compute == ctx.dtype:
        fns["ours_mkl"] = lambda: dit(px, pt, pc)
    fns["ours"] = ours
    with onednn_matmul(ctx.device, pays_for(dit)) as switched:
        out["onednn_matmul"] = switched
    with PeakMemory(ctx.device) as timed:
        best.update(best_of(fns, ctx.repeat, ctx.device))
    out["read_mib_per_step"] = round(read_bytes(dit) / 2**20, 1)
    mem = {"ours": timed.as_dict()} if ctx.light else {}  # ours alone: the timed runs' peak is its own
    for side in ("ours", "diffusers"):
        if side in fns and side not in mem:
            with PeakMemory(ctx.device) as pm:
                fns[side]()
            mem[side] = pm.as_dict()
    release_dequantized(dit)
    out.update({f"{k}_ms_per_step": round(1e3 * v, 2) for k, v in best.items()})
    out.setdefault("diffusers_ms_per_step", None)
    out.update({"kept_dequantized_mib": round(kept / 2**20, 1), "memory": mem,
                "ratio": ratio(out["diffusers_ms_per_step"], out["ours_ms_per_step"])})
    out.update(_dit_roofline(ctx, dit, cond.shape[1], out))
    return out


def dit_flops(dit, latents: int, batch: int = 2) -> int:
    """Floating-point operations of one DiT forward of `batch` windows of `latents` (the CFG pair):
    every linear product over the tokens (the latents and the time token) and the attention's two
    products per block."""
    from ..weights.layers import Linear

    tokens = batch * (latents + 1)
    linear = sum(2 * tokens * m.in_features * m.out_features for m in dit.modules() if isinstance(m, Linear))
    hp = dit.hp
    inner = int(hp["num_attention_heads"]) * int(hp["attention_head_dim"])
    attention = int(hp["num_layers"]) * 2 * 2 * batch * (latents + 1) ** 2 * inner
    return linear + attention


def _dit_roofline(ctx: Context, dit, latents: int, out: dict) -> dict:
    """Compute and bandwidth floors of a step against what the device measured (CUDA)."""
    tflops, bandwidth = ctx.roofline.get("matmul_tflops"), ctx.roofline.get("copy_gb_per_s")
    flops = dit_flops(dit, latents)
    step = out["ours_ms_per_step"] * 1e-3
    roof = {"flops_per_step": flops, "ours_tflops": round(flops / step / 1e12, 2)}
    if tflops:
        roof["floor_ms_per_step"] = round(flops / (tflops * 1e12) * 1e3, 2)
        roof["compute_share"] = round(roof["ours_tflops"] / tflops, 3)
    if bandwidth:
        roof["bandwidth_share"] = round(out["read_mib_per_step"] * 2**20 / step / 1e9 / bandwidth, 3)
    return roof


@torch.no_grad()
def measure_vocoder(ctx: Context) -> dict:
    """Seconds per minute of audio decoding one full window (both sides)."""
    from ..models.cond import latent_length

    voc = ctx.ours("vae")
    g = torch.Generator().manual_seed(ctx.seed)
    length = latent_length(LATENT_WINDOW_FRAMES, ctx.ours("cond").hp)
    lat = torch.randn(1, voc.latent_channels, length, generator=g).to(ctx.device, ctx.dtype)
    seconds = length * voc.hop / voc.sampling_rate
    fns = {"ours": lambda: voc.decode(lat)}
    if ctx.have_reference:
        rvoc = ctx.reference("vocoder")
        fns["diffusers"] = lambda: rvoc(lat)
    best = best_of(fns, ctx.repeat, ctx.device)
    per_min = {k: round(v * 60 / seconds, 3) for k, v in best.items()}
    out = {"audio_seconds": round(seconds, 3), "ours_s_per_min": per_min["ours"],
           "diffusers_s_per_min": per_min.get("diffusers")}
    out["ratio"] = ratio(out["diffusers_s_per_min"], out["ours_s_per_min"])
    return out


def measure_e2e(ctx: Context, seconds: float, steps: int, stream: bool = False) -> dict:
    """A whole song of `seconds`: ours through mm3.song.pipeline (plan, replay, DiT, vocoder), the
    reference through its AR, denoise and decode blocks on the same prompt ids and seeds. `stream`:
    ours with each window handed on as it is decoded (planning and synthesis overlapped where
    `Pipeline.can_overlap`), timing the first window's audio against the whole song; no reference
    run (it has no stream to compare with)."""
    from ..song.pipeline import Pipeline
    from ..song.request import MM3Request
    from .checkpoints import CAPTION, LYRICS

    pipe = Pipeline(ctx.ckpt.models, device=ctx.device, keep_loaded=True,
                    dtype=str(ctx.dtype).removeprefix("torch.") if ctx.dtype_named else None)
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=seconds, steps=steps, seed=ctx.seed,
                         lm_seed=ctx.seed, output_format="wav32")
    from ..weights.copies import compressed_nbytes

    weights = sum(compressed_nbytes(pipe.store.model(kind)) for kind in ("lm", "depth", "cond", "dit", "vae"))
    # (loading is not part of the timed run)
    marks = {}

    def heard(song, k, windows, samples, rate):
        marks.setdefault("first_audio", time.perf_counter())

    def planned(stage, done, total, info):
        if stage == "ar" and done >= WINDOW_FRAMES + 1:  # the frames the first window waits for
            marks.setdefault("ar_first_window", time.perf_counter())

    overlapped = stream and pipe.can_overlap(request.validate())
    with PeakMemory(ctx.device) as pm:
        t0 = time.perf_counter()
        tracks = pipe.run(request, Progress(on_progress=planned), on_audio=heard if stream else None)
        sync(ctx.device)
        ours = time.perf_counter() - t0
    audio_s = tracks[0].audio.shape[-1] / tracks[0].sample_rate
    out = {"audio_seconds": round(audio_s, 3), "steps": steps,
           "ours_s_per_min": round(ours * 60 / audio_s, 2),
           "ours_stages_s": {k: round(v, 2) for k, v in pipe.timings.stages.items()},
           "memory": {"ours": pm.as_dict()}, "diffusers_s_per_min": None,
           "weights_mib": {"ours": round(weights / 2**20, 1)}}
    if stream:
        out["stream"] = {"overlapped": overlapped, "whole_s": round(ours, 2),
                         "first_audio_s": round(marks["first_audio"] - t0, 2),
                         "ar_first_window_s": round(marks["ar_first_window"] - t0, 2)
                         if "ar_first_window" in marks else None}
    ids = pipe.prompt(request).ids
    pipe.store.release_all()
    del pipe
    if ctx.have_reference and not stream:
        with PeakMemory(ctx.device) as pm:
            t0 = time.perf_counter()
            ref_audio, stages = _reference_song(ctx, ids, seconds, steps)
            sync(ctx.device)
            ref = time.perf_counter() - t0
        ref_s = ref_audio.shape[-1] / ctx.ours("vae").sampling_rate
        ref_bytes = sum(t.numel() * t.element_size() for n in ("language_model", "rvq_depth_decoder",
                        "condition_encoder", "transformer", "vocoder") for t in ctx.reference(n).state_dict().values())
        out.update({"diffusers_s_per_min": round(ref * 60 / ref_s, 2), "diffusers_stages_s": stages})
        out["weights_mib"]["diffusers"] = round(ref_bytes / 2**20, 1)
        out["memory"]["diffusers"] = pm.as_dict()
    out["ratio"] = ratio(out["diffusers_s_per_min"], out["ours_s_per_min"])
    if ctx.device.type == "cpu":
        ctx.notes.append("e2e memory: our weights are memory-mapped GGUF files whose pages count in the RSS once "
                         "read, so ours' peak includes them; the reference's weights were resident before its run")
    return out


def _reference_song(ctx: Context, ids: torch.Tensor, seconds: float, steps: int):
    """The reference's three stages as its pipeline chains them: (audio [1, 2, T], seconds per stage)."""
    from ..plan.sampling import make_generator

    comps = {n: ctx.reference(n) for n in ("language_model", "rvq_depth_decoder", "condition_encoder",
                                           "transformer", "vocoder", "scheduler")}
    stages = {}

    def timed(name, run):
        t0 = time.perf_counter()
        out = run()
        sync(ctx.device)
        stages[name] = round(time.perf_counter() - t0, 2)
        return out

    with ctx.reference_constants():  # the AR reads them; the later stages do not mind
        audio = run_song(comps, ids.to(ctx.device), seconds, steps, make_generator(ctx.seed), timed)
    return audio, stages
