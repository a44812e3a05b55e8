"""MM3 Generate: caption and lyrics to a song in one node, heard while it is made.

Where the five models fit in memory together (`comfy_models.fit_together`), the song's windows are
rendered as soon as the AR has planned their frames (`mm3.song.overlap.plan_and_render`); otherwise the
stages run one after another, one model group loaded at a time. Either way each window plays on the
node as soon as it is decoded, and the AUDIO and codes are those of the separate stage nodes with
the same settings.
"""

from __future__ import annotations

import math

from comfy_api.latest import io

from mm3.song import stages
from mm3.constants import (
    DEFAULT_DIT_CFG,
    DEFAULT_DURATION,
    DEFAULT_LM_CFG,
    DEFAULT_STEPS,
    FRAME_RATE,
    MAX_AUDIO_FRAMES,
    MAX_CFG,
    MAX_DURATION,
    MAX_PROMPT_TOKENS,
    MAX_STEPS,
    MAX_VARIATIONS,
)
from mm3.synth.flow import AUTO_SHIFT, MAX_SHIFT, WINDOW_FRAMES
from mm3.song.numerics import Numerics
from mm3.plan.prompt import INSTRUMENTAL_LYRICS
from mm3.song.overlap import Models, plan_and_render
from mm3.song.request import shaping_of
from mm3.song.settings import PlanSettings, SynthSettings, Takes
from . import logic
from .comfy_models import (compute_dtype, dit_compute_dtype, fit_together, load, load_device, load_together, patcher,
                           spare_bytes)
from .common import (AUDIO_CODES, CATEGORY, COND, DEPTH, DIT, LM, VAE, interruptible, node_progress, show_warnings,
                     window_preview)
from .handles import ar_memory, dit_memory, dtype_bytes, vocoder_memory
from .node_options import SAMPLING_OPTIONS, SamplingOptions
from .node_stages import DIT_SEED_MAX, LM_SEED_MAX
from .validation import prompt_texts, verdict


class MM3Generate(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3Generate", display_name="MM3 Generate", category=CATEGORY,
            description="Caption and lyrics to a song in one node: the plan, the DiT and the vocoder together. Each "
                        "window plays on the node as soon as it is decoded; where the five models fit in memory "
                        "together the first one comes while the song is still being planned. The same song as the "
                        "separate stage nodes with the same settings.",
            inputs=[
                LM.Input("lm"), DEPTH.Input("depth"), COND.Input("cond"), DIT.Input("dit"), VAE.Input("vae"),
                io.String.Input("caption", multiline=True, default="",
                                placeholder="Caption: what the song sounds like (genre, mood, tempo and key, "
                                            "instruments, vocals), or wire in MM3 Caption Builder",
                                tooltip="What the song sounds like: genre, mood, tempo and key, instruments, the "
                                        "voice. With the lyrics at most "
                                        f"{MAX_PROMPT_TOKENS} tokens (MM3 Prompt counts them)."),
                io.String.Input("lyrics", multiline=True, default="",
                                placeholder="Lyrics: [verse], [chorus], [bridge] ... each on its own line, then the "
                                            "sung lines; empty for an instrumental",
                                tooltip="The words sung, in sections such as [intro], [verse], [chorus], [outro] (the "
                                        "song follows their order); ' ^ ' breaks a line. Empty: an instrumental "
                                        f"(the model is sent {INSTRUMENTAL_LYRICS})."),
                io.Float.Input("duration", default=DEFAULT_DURATION, min=1.0 / FRAME_RATE, max=MAX_DURATION, step=1.0,
                               round=0.01, tooltip=f"Longest the song may be, in seconds (up to {MAX_DURATION:g}); "
                                                   "the model may end it sooner by itself. Time grows with it."),
                io.Int.Input("lm_seed", default=0, min=0, max=LM_SEED_MAX, control_after_generate=True,
                             tooltip="Picks the song: the same seed and settings give the same melody, words and "
                                     "arrangement, another seed another song."),
                io.Int.Input("seed", default=0, min=0, max=DIT_SEED_MAX, control_after_generate=True,
                             tooltip="Picks the rendering of the song: another seed plays the same melody and words "
                                     "with other sound detail. Variation j uses seed + j."),
                io.Int.Input("steps", default=DEFAULT_STEPS, min=2, max=MAX_STEPS,
                             tooltip="Denoising steps: more gives cleaner detail and takes longer. "
                                     f"{DEFAULT_STEPS} is the model's own; 20-50 is safe, below 10 sounds thin."),
                io.Float.Input("lm_cfg", default=DEFAULT_LM_CFG, min=0.0, max=MAX_CFG, step=0.05,
                               tooltip="How closely the song follows the caption and lyrics. "
                                       f"{DEFAULT_LM_CFG:g} is the model's own; 1-3 is safe, higher can sound forced."),
                io.Float.Input("dit_cfg", default=DEFAULT_DIT_CFG, min=0.0, max=MAX_CFG, step=0.05,
                               tooltip="How strongly the sound follows the plan and caption. "
                                       f"{DEFAULT_DIT_CFG:g} is the model's own; 1-3 is safe, higher can sound harsh."),
                io.Int.Input("variations", default=1, min=1, max=MAX_VARIATIONS,
                             tooltip=f"Renderings of the same song (1-{MAX_VARIATIONS}), one audio item each "
                                     "(seed + j); the player plays the first, or the one you pick."),
                io.Float.Input("min_duration", default=0.0, min=0.0, max=MAX_DURATION, step=1.0, round=0.01,
                               optional=True, tooltip="Seconds before which the song may not end (0 = any time); "
                                                      "keep it well below the duration."),
                io.Float.Input("shift", default=AUTO_SHIFT, min=0.0, max=MAX_SHIFT, step=0.05, optional=True,
                               tooltip="Where the denoising spends its steps: 0 = automatic (right for most), 1 = "
                                       f"the reference's schedule; up to {MAX_SHIFT:g}."),
                SAMPLING_OPTIONS.Input("options", optional=True,
                                       tooltip="Expert knobs of the plan from MM3 Sampling Options (top-k, "
                                               "temperature, repetition penalty); unwired: the model's own."),
            ],
            outputs=[io.Audio.Output("audio", display_name="audio"),
                     AUDIO_CODES.Output("codes", display_name="codes")],
        )

    @classmethod
    def validate_inputs(cls, lyrics=None) -> bool | str:
        """The lyrics alone (ComfyUI shows a verdict on every input named here, and checks the
        ranges of the others itself); the caption and min_duration against the duration are
        checked when the node runs, before anything loads."""
        return verdict(prompt_texts(lyrics=lyrics))

    @classmethod
    def execute(cls, lm, depth, cond, dit, vae, caption: str, lyrics: str, duration: float, lm_seed: int, seed: int,
                steps: int, lm_cfg: float, dit_cfg: float, variations: int, min_duration: float = 0.0,
                shift: float = AUTO_SHIFT, options: SamplingOptions | None = None) -> io.NodeOutput:
        o = options or SamplingOptions()
        lm_seed = logic.linked_seed(lm_seed, LM_SEED_MAX, "lm_seed")
        seed = logic.linked_seed(seed, DIT_SEED_MAX, "seed")
        settings = PlanSettings(duration=duration, lm_seed=lm_seed, lm_cfg=lm_cfg, top_k=o.lm_top_k,
                                shaping=shaping_of(o, min_duration))
        synth = SynthSettings(seed, steps, dit_cfg, variations, shift)
        with interruptible():
            prompt = logic.assemble_prompt(lm, caption, lyrics)
            takes = Takes(rounds=o.ending_rounds)
            logic.check_plan(settings)
            audio = _render([lm, depth, cond, dit, vae], prompt, settings, takes, synth,
                            window_preview(duration, noise=vae.is_tiny))
        song = audio.windows.latents.conditions.song
        show_warnings(audio.windows.warnings)
        return io.NodeOutput(logic.audio_output(audio), song, ui={"text": [song.summary(FRAME_RATE)]})


def _render(handles, prompt, settings: PlanSettings, takes: Takes, synth: SynthSettings, preview) -> stages.Audio:
    """The song, overlapped where the five models fit together, else stage by stage."""
    lm, depth, cond, dit, vae = handles
    device = patcher(lm).load_device
    dtype = compute_dtype(device)
    elem = dtype_bytes(dtype)
    numerics = Numerics(compute_dtype=dit_compute_dtype(dtype))
    frames = min(int(settings.duration * FRAME_RATE), MAX_AUDIO_FRAMES)
    hp = cond.hparams  # the latents of the longest window: its seconds at the latent rate
    latents = math.ceil(min(frames, WINDOW_FRAMES) / FRAME_RATE * hp["output_sampling_rate"] / hp["output_hop_length"])
    need_ar = ar_memory(lm.hparams, prompt.prompt.num_tokens, frames, 1, settings.lm_cfg, device, elem)
    need_dit = dit_memory(dit.hparams, latents, elem)
    need_vae = vocoder_memory({n: t.shape for n, t in vae.component().tensors.items()},
                              list(vae.hparams["upsampling_ratios"]), latents)
    run = dict(device=device, dtype=dtype, progress=node_progress())
    if fit_together(handles, need_ar + need_dit + need_vae):
        models = load_together(handles, need_ar + need_dit + need_vae)
        spare = spare_bytes(handles, need_ar + need_dit + need_vae)
        half = None if spare is None else spare // 2  # the AR's weight copies, then the DiT's
        rendered = plan_and_render(Models(*models, files={h.kind: h.file() for h in handles}), prompt, settings,
                                   synth, takes, numerics=numerics, weight_budget=half, weight_cache=half,
                                   vae_device=load_device("vae"), on_audio=preview and preview.of_song, **run)
        return rendered.audio[0]
    lm_model, depth_model = load([lm, depth], memory_required=need_ar)
    (song,), _ = logic.plan_songs(lm_model, depth_model, lm, depth, prompt, settings, takes=takes,
                                  weight_budget=spare_bytes([lm, depth], need_ar), numerics=numerics, **run)
    cond_model, dit_model, vae_model = load([cond, dit, vae], memory_required=need_dit + need_vae)
    conditions = stages.encode(cond_model, cond.file(), song, **run)
    stream = stages.WindowStream(vae_model, vae.file(), conditions, preview or (lambda *piece: None),
                                 device=load_device("vae"), progress=run["progress"])
    latent = stages.sample(dit_model, dit.file(), conditions, synth, numerics=numerics,
                           weight_cache=spare_bytes([cond, dit, vae], need_dit + need_vae), on_window=stream, **run)
    return stages.stitch_windows(stream.windows(latent))


NODES = [MM3Generate]
