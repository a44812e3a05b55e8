"""Bench stages after the AR: DiT step, vocoder, and the whole song end to end (`mm3.bench`).

`Context` holds one bench checkpoint loaded both ways: this engine's models from the GGUF folder
(as the pipeline loads them) and the diffusers 0.42.1 reference from the same tensors (the LM,
depth decoder and DiT from our GGUF files dequantized to float, so a quantized run compares the
same weights; the condition encoder and vocoder from the diffusers safetensors, which the GGUF
files hold folded). `python -m mm3.bench_synth` is `python -m mm3 bench --stages dit,vocoder`.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch

from .bench import PeakMemory, ratio, sync
from .components import open_component

LATENT_WINDOW_FRAMES = 200  # a full DiT window (mm3.flow.WINDOW_FRAMES): 689 latents at the released rates


class Context:
    def __init__(self, ckpt, device: torch.device, dtype: torch.dtype, have_reference: bool, repeat: int, seed: int):
        self.ckpt, self.device, self.dtype = ckpt, device, dtype
        self.have_reference, self.repeat, self.seed = have_reference, max(1, repeat), seed
        self.notes: list[str] = []
        self.compile = False  # torch.compile our AR frame step
        self._ours: dict = {}
        self._ref: dict = {}

    # -- this engine -------------------------------------------------------------------------------
    def file(self, kind: str):
        for p in sorted(self.ckpt.models.glob("*.gguf")):
            c = open_component(p)
            if c.kind == kind:
                return c
            c.close()
        raise FileNotFoundError(f"no {kind} file in {self.ckpt.models}")

    def ours(self, kind: str, numerics: str = "fast"):
        key = kind if numerics == "fast" else f"{kind}:{numerics}"
        if key not in self._ours:
            from .models import build_model

            self._ours[key] = build_model(self.file(kind), numerics=numerics).to(self.device)
        return self._ours[key]

    def prompt(self):
        from .prompt import build_prompt
        from .tokenizer import MM3Tokenizer

        if "prompt" not in self._ours:
            from .bench import CAPTION, LYRICS

            self._ours["prompt"] = build_prompt(MM3Tokenizer.from_component(self.file("lm")), CAPTION, LYRICS)
        return self._ours["prompt"]

    # -- the reference -----------------------------------------------------------------------------
    def _gguf_floats(self, kind: str) -> dict:
        comp = self.file(kind)
        try:
            return {name: t.dequantize(torch.float32).clone() for name, t in comp.tensors.items()}  # F32: a view
        finally:
            comp.close()

    def reference(self, name: str):
        """language_model, rvq_depth_decoder, condition_encoder, transformer, vocoder, scheduler."""
        if name in self._ref:
            return self._ref[name]
        import warnings

        import diffusers
        from safetensors.torch import load_file

        c = self.ckpt
        if name == "language_model":
            from transformers import Qwen3Config, Qwen3ForCausalLM

            model = Qwen3ForCausalLM(Qwen3Config(**c.lm_cfg))
            model.load_state_dict(self._gguf_floats("lm"), strict=False)  # GGUF has no lm_head when tied
        elif name == "scheduler":
            from .tools.tiny import SCHEDULER_CONFIG

            self._ref[name] = diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
            return self._ref[name]
        else:
            cls = {"rvq_depth_decoder": diffusers.MiniMaxMusic3RVQDepthDecoder,
                   "condition_encoder": diffusers.MiniMaxMusic3ConditionEncoder,
                   "transformer": diffusers.MiniMaxMusic3Transformer1DModel,
                   "vocoder": diffusers.MiniMaxMusic3Vocoder}[name]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's weight_norm deprecation
                model = cls(**c.cfgs[name])
            if name in ("rvq_depth_decoder", "transformer"):
                state = self._gguf_floats({"rvq_depth_decoder": "depth", "transformer": "dit"}[name])
            else:
                state = load_file(c.diffusers / name / "diffusion_pytorch_model.safetensors")
            model.load_state_dict(state)
        self._ref[name] = model.to(device=self.device, dtype=self.dtype).eval()
        return self._ref[name]

    @contextmanager
    def reference_constants(self):
        """The reference's token-id constants set to this checkpoint's (mm3.tools.tiny's small vocabulary
        moves them; for the released layout they are unchanged)."""
        from .reference import reference_token_constants

        ids = self.ckpt.special_ids
        values = {"_AUDIO_CFG_TOKEN_ID": ids["<|audio_cfg|>"], "_AUDIO_END_TOKEN_ID": ids["<|audio_end|>"],
                  "_AUDIO_CODE_OFFSET": self.ckpt.code_offset}
        with reference_token_constants(values) as enc:
            yield enc

    def release(self, *names: str):
        for n in names:
            for key in [k for k in self._ours if k == n or k.startswith(n + ":")]:
                self._ours.pop(key)
            self._ref.pop(n, None)


def best_of(fns: dict, repeat: int, device: torch.device) -> dict:
    """Best wall time of each callable, run in turns (load from other processes hits all alike)."""
    for fn in fns.values():
        fn()  # warm-up
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


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
    """ms per DiT step of one full window (the CFG pair). "ours" is what mm3.flow.sample_latents
    runs by default (weights kept dequantized within the budget, oneDNN products on the CPU);
    "ours_mkl" the same with torch's default CPU GEMM; "ours_per_step_dequant" neither."""
    from .device import dit_weight_budget
    from .gguf.ops import cache_dequantized, release_dequantized
    from .matmul import onednn_matmul, pays_for

    dit = ctx.ours("dit")
    x, t, cond = _window_inputs(ctx)
    px, pt, pc = torch.cat([x, x]), t.expand(2), torch.cat([cond, torch.zeros_like(cond)])
    zeros = torch.zeros_like(cond)

    def ours():
        with onednn_matmul(ctx.device, pays_for(dit)):
            return dit(px, pt, pc)

    fns = {"ours_per_step_dequant": lambda: dit(px, pt, pc)}
    out = {"window_latents": cond.shape[1]}
    if ctx.have_reference:
        ref = ctx.reference("transformer")

        def ref_step():  # its pipeline's two batch-1 calls
            return torch.cat([ref(hidden_states=x, timestep=t, encoder_hidden_states=c, return_dict=False)[0]
                              for c in (cond, zeros)])

        fns["diffusers"] = ref_step
        v_ref = ref_step().float()
        for key, fn in (("rel_diff_vs_diffusers", ours), ("mkl_rel_diff_vs_diffusers", fns["ours_per_step_dequant"])):
            out[key] = float((fn().float() - v_ref).norm() / v_ref.norm())
    kept = cache_dequantized(dit, ctx.dtype, dit_weight_budget(ctx.device))
    fns["ours_mkl"] = lambda: dit(px, pt, pc)
    fns["ours"] = ours
    with onednn_matmul(ctx.device, pays_for(dit)) as switched:
        out["onednn_matmul"] = switched
    best = best_of(fns, ctx.repeat, ctx.device)
    mem = {}
    for side in ("ours", "diffusers"):
        if side in fns:
            with PeakMemory(ctx.device) as pm:
                fns[side]()
            mem[side] = pm.as_dict()
    release_dequantized(dit)
    out.update({f"{k}_ms_per_step": round(1e3 * v, 2) for k, v in best.items()})
    out.setdefault("diffusers_ms_per_step", None)
    out.update({"kept_dequantized_mib": round(kept / 2**20, 1), "memory": mem,
                "ratio": ratio(out["diffusers_ms_per_step"], out["ours_ms_per_step"])})
    return out


@torch.no_grad()
def measure_vocoder(ctx: Context) -> dict:
    """Seconds per minute of audio decoding one full window (both sides)."""
    from .models.cond import latent_length

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


def measure_e2e(ctx: Context, seconds: float, steps: int) -> dict:
    """A whole song of `seconds`: ours through mm3.pipeline (plan, replay, DiT, vocoder), the
    reference through its AR, denoise and decode blocks on the same prompt ids and seeds."""
    from .bench import CAPTION, LYRICS
    from .pipeline import Pipeline
    from .request import MM3Request

    pipe = Pipeline(ctx.ckpt.models, device=ctx.device, dtype=str(ctx.dtype).removeprefix("torch."),
                    keep_loaded=True)
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=seconds, steps=steps, seed=ctx.seed,
                         lm_seed=ctx.seed, output_format="wav32")
    from .gguf.ops import compressed_nbytes

    weights = sum(compressed_nbytes(pipe.store.model(kind)) for kind in ("lm", "depth", "cond", "dit", "vae"))
    # (loading is not part of the timed run)
    with PeakMemory(ctx.device) as pm:
        t0 = time.perf_counter()
        tracks = pipe.run(request)
        sync(ctx.device)
        ours = time.perf_counter() - t0
    audio_s = tracks[0].audio.shape[-1] / tracks[0].sample_rate
    out = {"audio_seconds": round(audio_s, 3), "steps": steps,
           "ours_s_per_min": round(ours * 60 / audio_s, 2),
           "ours_stages_s": {k: round(v, 2) for k, v in pipe.timings.stages.items()},
           "memory": {"ours": pm.as_dict()}, "diffusers_s_per_min": None,
           "weights_mib": {"ours": round(weights / 2**20, 1)}}
    ids = pipe.prompt(request).ids
    pipe.store.release_all()
    del pipe
    if ctx.have_reference:
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


@torch.no_grad()
def _reference_song(ctx: Context, ids: torch.Tensor, seconds: float, steps: int):
    """The reference's three stages as its pipeline chains them: (audio [1, 2, T], seconds per stage)."""
    from diffusers.modular_pipelines.minimax_music3.decoders import MiniMaxMusic3VocoderDecodeStep
    from diffusers.modular_pipelines.minimax_music3.encoders import MiniMaxMusic3AutoregressiveStep
    from diffusers.modular_pipelines.minimax_music3.modular_blocks_minimax_music3 import MiniMaxMusic3CoreDenoiseStep

    from .sampling import make_generator

    comps = {n: ctx.reference(n) for n in ("language_model", "rvq_depth_decoder", "condition_encoder",
                                           "transformer", "vocoder", "scheduler")}
    g = make_generator(ctx.seed)  # one generator through AR and noise, as the reference pipeline
    stages = {}

    def stage(key, block, **kwargs):
        sub = block.init_pipeline()
        sub.update_components(**{k: v for k, v in comps.items() if k in sub._component_specs})
        sub.set_progress_bar_config(disable=True)
        t0 = time.perf_counter()
        out = sub(**kwargs)
        sync(ctx.device)
        stages[key] = round(time.perf_counter() - t0, 2)
        return out

    with ctx.reference_constants():
        fh = stage("ar", MiniMaxMusic3AutoregressiveStep(), text_ids=ids.to(ctx.device), audio_duration=seconds,
                   generator=g, output="frame_hiddens")
    chunks = stage("dit", MiniMaxMusic3CoreDenoiseStep(), frame_hiddens=fh, num_inference_steps=steps, generator=g,
                   output="latent_chunks")
    audio = stage("vae", MiniMaxMusic3VocoderDecodeStep(), latent_chunks=chunks, output_type="pt", output="audios")
    return audio, stages


def main(argv=None) -> int:
    from .bench import main as bench_main

    return bench_main(["--stages", "dit,vocoder", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
