"""Oracle helpers for the synthesis tests: the diffusers 0.42.1 reference on a tiny checkpoint.

Loads the reference condition encoder, DiT, vocoder and scheduler from the diffusers folder that
`mm3.tools.tiny.build_tiny` writes, runs the reference's own denoise and decode blocks (unmodified) and
records what they compute with forward hooks and wrappers. Nothing in diffusers is patched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import diffusers  # noqa: F401  (the oracle; without it this module must not import, so its tests skip)

import torch


@dataclass
class Reference:
    condition_encoder: object
    transformer: object
    vocoder: object
    scheduler: object


def load_reference(diffusers_dir) -> Reference:
    """The four synthesis components, float32, eval mode (no pipeline: the LM is not needed)."""
    import warnings

    from diffusers import (FlowMatchEulerDiscreteScheduler, MiniMaxMusic3ConditionEncoder,
                           MiniMaxMusic3Transformer1DModel, MiniMaxMusic3Vocoder)

    d = Path(diffusers_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's weight_norm deprecation
        voc = MiniMaxMusic3Vocoder.from_pretrained(d / "vocoder", torch_dtype=torch.float32)
    return Reference(
        MiniMaxMusic3ConditionEncoder.from_pretrained(d / "condition_encoder", torch_dtype=torch.float32).eval(),
        MiniMaxMusic3Transformer1DModel.from_pretrained(d / "transformer", torch_dtype=torch.float32).eval(),
        voc.eval(),
        FlowMatchEulerDiscreteScheduler.from_pretrained(d / "scheduler"),
    )


@dataclass
class Recording:
    dit_calls: list = field(default_factory=list)  # (x, t, cond, v) in call order: window, step, [cond, uncond]
    cond_calls: list = field(default_factory=list)  # (frame window, condition out)
    voc_calls: list = field(default_factory=list)  # (latents, waveform)
    steps: list = field(default_factory=list)  # (guided velocity, t, latent in, latent out)
    sigmas: list = field(default_factory=list)  # scheduler.sigmas after each set_timesteps
    timesteps: list = field(default_factory=list)


class Recorder:
    """Context manager: hooks the reference models and the scheduler, collects a `Recording`."""

    def __init__(self, ref: Reference):
        self.ref, self.rec, self.handles = ref, Recording(), []

    def __enter__(self) -> Recording:
        r, rec = self.ref, self.rec
        self.handles = [
            r.transformer.register_forward_hook(
                lambda m, a, kw, out: rec.dit_calls.append(
                    (kw["hidden_states"].clone(), kw["timestep"].clone(), kw["encoder_hidden_states"].clone(),
                     out[0].clone())), with_kwargs=True),
            r.condition_encoder.register_forward_hook(lambda m, a, out: rec.cond_calls.append((a[0].clone(), out.clone()))),
            r.vocoder.register_forward_hook(lambda m, a, out: rec.voc_calls.append((a[0].clone(), out.clone()))),
        ]
        sched = r.scheduler
        self._step, self._set = sched.step, sched.set_timesteps

        def step(model_output, timestep, sample, *a, **k):
            s_in = sample.clone()
            res = self._step(model_output, timestep, sample, *a, **k)
            rec.steps.append((model_output.clone(), timestep.clone(), s_in, res[0].clone()))
            return res

        def set_timesteps(*a, **k):
            out = self._set(*a, **k)
            rec.sigmas.append(sched.sigmas.clone())
            rec.timesteps.append(sched.timesteps.clone())
            return out

        sched.step, sched.set_timesteps = step, set_timesteps
        return rec

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.ref.scheduler.step, self.ref.scheduler.set_timesteps = self._step, self._set


def reference_denoise(ref: Reference, frame_hiddens: torch.Tensor, steps: int, generator: torch.Generator,
                      guidance: float = 1.7):
    """Run diffusers' core denoise block: -> (chunk_starts, latent_chunks, Recording)."""
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.modular_pipelines.minimax_music3.modular_blocks_minimax_music3 import (
        MiniMaxMusic3CoreDenoiseStep)

    pipe = MiniMaxMusic3CoreDenoiseStep().init_pipeline()
    pipe.update_components(condition_encoder=ref.condition_encoder, transformer=ref.transformer,
                           scheduler=ref.scheduler, guider=ClassifierFreeGuidance(guidance_scale=guidance))
    pipe.set_progress_bar_config(disable=True)
    with Recorder(ref) as rec:
        out = pipe(frame_hiddens=frame_hiddens, generator=generator, num_inference_steps=steps,
                   output=["chunk_starts", "latent_chunks"])
    return out["chunk_starts"], out["latent_chunks"], rec


def reference_decode(ref: Reference, latent_chunks: list[torch.Tensor]) -> torch.Tensor:
    """diffusers' vocoder decode block (decode per window, crop, concatenate, clamp): [1, 2, T]."""
    from diffusers.modular_pipelines.minimax_music3.decoders import MiniMaxMusic3VocoderDecodeStep

    pipe = MiniMaxMusic3VocoderDecodeStep().init_pipeline()
    pipe.update_components(vocoder=ref.vocoder)
    return pipe(latent_chunks=latent_chunks, output_type="pt", output="audios")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)
