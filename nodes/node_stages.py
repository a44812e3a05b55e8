"""Stage nodes: prompt -> AR plan -> condition -> flow DiT -> vocoder -> stitch.

Each node loads only its own models through ComfyUI's memory manager (`comfy_models.load`),
reports progress on its own bar and stops at ComfyUI's interrupt. None is marked not idempotent:
ComfyUI's cache reuses an AR plan when only synthesis settings change.
"""

from __future__ import annotations

from comfy_api.latest import io

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
    MAX_SONGS,
    MAX_STEPS,
    MAX_VARIATIONS,
    SEED_MAX,
)
from mm3.song import stages
from mm3.synth.flow import AUTO_SHIFT, MAX_SHIFT
from mm3.song.numerics import Numerics
from mm3.plan.lyric_edit import DEFAULT_MARGIN
from mm3.plan.prompt import INSTRUMENTAL_LYRICS
from mm3.song.request import shaping_of
from mm3.song.settings import (
    DEFAULT_REPAINT_FADE, MAX_TAKES, PlanSettings, RepaintSettings, SynthSettings, Takes)
from . import logic
from .comfy_models import compute_dtype, dit_compute_dtype, load, patcher, spare_bytes
from .common import (
    AUDIO_CODES,
    AUDIO_WINDOWS,
    CATEGORY,
    COND,
    CONDITION,
    DEPTH,
    DIT,
    LATENTS,
    LM,
    PROMPT,
    VAE,
    interruptible,
    node_progress,
    show_warnings,
    window_preview,
)
from .handles import ar_memory, dit_memory, dtype_bytes, vocoder_memory
from .node_options import SAMPLING_OPTIONS, SamplingOptions
from .validation import out_of_range, prompt_texts, repaint_range, verdict

# Seeds of song i / variation j are seed + i / seed + j and must stay in the request's 0..SEED_MAX.
LM_SEED_MAX = SEED_MAX - (MAX_SONGS - 1)
DIT_SEED_MAX = SEED_MAX - (MAX_VARIATIONS - 1)
MAX_LINE = 9999  # the lyric line a node may name (the lyrics themselves say how many they have)


def _device_dtype(handle):
    device = patcher(handle).load_device
    return device, compute_dtype(device)


class MM3PromptAssemble(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3PromptAssemble", display_name="MM3 Prompt", category=CATEGORY,
            description="Cleans the caption, normalises the lyrics and tokenizes both with the language model's "
                        f"tokenizer (at most {MAX_PROMPT_TOKENS} tokens). Shows the cleaned texts and the token count.",
            inputs=[
                LM.Input("lm"),
                io.String.Input("caption", multiline=True, default="",
                                placeholder="Caption: what the song sounds like (genre, mood, tempo and key, "
                                            "instruments, vocals), or wire in MM3 Caption Builder",
                                tooltip="What the song sounds like: genre, mood, tempo and key, instruments, the "
                                        "voice. The long structured layout (MM3 Caption Builder writes one) follows "
                                        f"best. With the lyrics at most {MAX_PROMPT_TOKENS} tokens (counted below)."),
                io.String.Input("lyrics", multiline=True, default="",
                                placeholder="Lyrics: [verse], [chorus], [bridge] ... each on its own line, then the "
                                            "sung lines; empty for an instrumental",
                                tooltip="The words sung, in sections such as [intro], [verse], [chorus], [outro] (the "
                                        "song follows their order); ' ^ ' breaks a line. Empty: an instrumental "
                                        f"(the model is sent {INSTRUMENTAL_LYRICS})."),
            ],
            outputs=[PROMPT.Output("prompt", display_name="prompt")],
        )

    @classmethod
    def validate_inputs(cls, lyrics=None) -> bool | str:
        """The lyrics alone (ComfyUI shows a verdict on every input named here); the caption is
        checked first thing when the node runs (`logic.assemble_prompt`)."""
        return verdict(prompt_texts(lyrics=lyrics))

    @classmethod
    def execute(cls, lm, caption: str, lyrics: str) -> io.NodeOutput:
        bundle = logic.assemble_prompt(lm, caption, lyrics)
        return io.NodeOutput(bundle, ui={"text": [logic.prompt_summary(bundle, MAX_PROMPT_TOKENS)]})


class MM3ARPlan(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3ARPlan", display_name="MM3 AR Plan", category=CATEGORY,
            description="Samples the song's audio codes frame by frame (25 per second) with the language model and "
                        "the depth decoder. The model may end the song before the duration.",
            inputs=[
                LM.Input("lm"), DEPTH.Input("depth"), PROMPT.Input("prompt"),
                io.Float.Input("duration", default=DEFAULT_DURATION, min=1.0 / FRAME_RATE, max=MAX_DURATION, step=1.0,
                               round=0.01, tooltip="Longest the song may be, in seconds (up to "
                                                   f"{MAX_DURATION:g}); the model may end it sooner by itself. "
                                                   "Planning time grows with it."),
                io.Int.Input("lm_seed", default=0, min=0, max=LM_SEED_MAX, control_after_generate=True,
                             tooltip="Picks the song: the same seed and settings give the same melody, words and "
                                     "arrangement, another seed another song. Song i of a batch uses lm_seed + i."),
                io.Float.Input("lm_cfg", default=DEFAULT_LM_CFG, min=0.0, max=MAX_CFG, step=0.05,
                               tooltip="How closely the song follows the caption and lyrics (guidance of the plan). "
                                       f"{DEFAULT_LM_CFG:g} is the model's own; 1-3 is safe, higher can sound forced, "
                                       "1 follows them loosest."),
                io.Int.Input("songs", default=1, min=1, max=MAX_SONGS,
                             tooltip=f"Different songs planned at once (1-{MAX_SONGS}), one list item each from "
                                     "lm_seed + i; memory and time grow with it."),
                # Beyond the reference; the defaults are the reference's draw.
                io.Int.Input("takes", default=1, min=1, max=MAX_TAKES, optional=True,
                             tooltip=f"Tries per song (1-{MAX_TAKES}, seeds lm_seed + n); the tries that ended by "
                                     "themselves are kept first. Each try costs a plan's time; 2-4 is typical."),
                io.Boolean.Input("require_ending", default=False, optional=True,
                                 tooltip="Keep only tries that ended by themselves before the duration; plan more "
                                         "rounds if none did (ending_rounds on MM3 Sampling Options)."),
                io.Float.Input("min_duration", default=0.0, min=0.0, max=MAX_DURATION, step=1.0, round=0.01,
                               optional=True, tooltip="Seconds before which the song may not end (0 = any time); "
                                                      "keep it well below the duration."),
                SAMPLING_OPTIONS.Input("options", optional=True,
                                       tooltip="Expert knobs from MM3 Sampling Options (top-k, temperature, "
                                               "repetition penalty, ending rounds); unwired: the model's own."),
                AUDIO_CODES.Input("prior_codes", optional=True,
                                  tooltip="Continue this song: its codes, then new frames up to the duration."),
            ],
            outputs=[AUDIO_CODES.Output("codes", display_name="codes", is_output_list=True)],
        )

    @classmethod
    def execute(cls, lm, depth, prompt, duration: float, lm_seed: int, lm_cfg: float, songs: int, takes: int = 1,
                require_ending: bool = False, min_duration: float = 0.0, options: SamplingOptions | None = None,
                prior_codes=None) -> io.NodeOutput:
        o = options or SamplingOptions()
        lm_seed = logic.linked_seed(lm_seed, LM_SEED_MAX, "lm_seed")
        frames = min(int(duration * FRAME_RATE), MAX_AUDIO_FRAMES)
        settings = PlanSettings(duration=duration, lm_seed=lm_seed, lm_cfg=lm_cfg, top_k=o.lm_top_k, songs=songs,
                                shaping=shaping_of(o, min_duration))
        rounds = Takes(takes=takes, require_ending=require_ending, rounds=o.ending_rounds)
        logic.check_plan(settings, prior_codes)  # ComfyUI checked each input's range alone
        with interruptible():
            device, dtype = _device_dtype(lm)
            batch = min(MAX_SONGS, songs * takes)
            need = ar_memory(lm.hparams, prompt.prompt.num_tokens, frames, batch, lm_cfg, device, dtype_bytes(dtype))
            lm_model, depth_model = load([lm, depth], memory_required=need)
            planned, candidates = logic.plan_songs(lm_model, depth_model, lm, depth, prompt, settings, device=device,
                                                   dtype=dtype, progress=node_progress(),
                                                   weight_budget=spare_bytes([lm, depth], need), takes=rounds,
                                                   prior=prior_codes,
                                                   numerics=Numerics(compute_dtype=dit_compute_dtype(dtype)))
        lines = [s.summary(FRAME_RATE) for s in planned] + [c.describe(FRAME_RATE) for c in candidates]
        return io.NodeOutput(planned, ui={"text": ["\n".join(lines)]})


class MM3ConditionEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3ConditionEncode", display_name="MM3 Condition Encode", category=CATEGORY,
            description="Turns the AR frame hiddens into the DiT condition, one 200-frame window at a time.",
            inputs=[COND.Input("cond"), AUDIO_CODES.Input("codes")],
            outputs=[CONDITION.Output("condition", display_name="condition")],
        )

    @classmethod
    def execute(cls, cond, codes) -> io.NodeOutput:
        with interruptible():
            device, dtype = _device_dtype(cond)
            (model,) = load([cond])
            out = stages.encode(model, cond.file(), codes, device=device, dtype=dtype, progress=node_progress())
        show_warnings(out.warnings)
        return io.NodeOutput(out)


class MM3FlowSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3FlowSampler", display_name="MM3 Flow DiT Sampler", category=CATEGORY,
            description="Denoises the audio latents window by window (Euler steps with guidance). Variation j "
                        "draws its noise from seed + j.",
            inputs=[
                DIT.Input("dit"), CONDITION.Input("condition"),
                *_sampling_inputs(0, "Picks the rendering of the planned song: another seed plays the same melody "
                                     "and words with other sound detail. Variation j uses seed + j (the same on any "
                                     "device)."),
            ],
            outputs=[LATENTS.Output("latents", display_name="latents")],
        )

    @classmethod
    def execute(cls, dit, condition, seed: int, steps: int, dit_cfg: float, variations: int,
                shift: float = AUTO_SHIFT) -> io.NodeOutput:
        synth = SynthSettings(logic.linked_seed(seed, DIT_SEED_MAX, "seed"), steps, dit_cfg, variations, shift)
        with interruptible():
            model, run = _loaded_dit(dit, condition)
            out = stages.sample(model, dit.file(), condition, synth, **run)
        show_warnings(out.warnings)
        return io.NodeOutput(out)


def _sampling_inputs(seed_default: int, seed_tooltip: str) -> list:
    """seed, steps, dit_cfg, variations and shift: the DiT settings of the Flow Sampler and Repaint."""
    return [
        io.Int.Input("seed", default=seed_default, min=0, max=DIT_SEED_MAX, control_after_generate=True,
                     tooltip=seed_tooltip),
        io.Int.Input("steps", default=DEFAULT_STEPS, min=2, max=MAX_STEPS,
                     tooltip="Denoising steps: more gives cleaner detail and takes longer (time grows with the "
                             f"steps). {DEFAULT_STEPS} is the model's own; 20-50 is safe, below 10 sounds thin."),
        io.Float.Input("dit_cfg", default=DEFAULT_DIT_CFG, min=0.0, max=MAX_CFG, step=0.05,
                       tooltip="How strongly the sound follows the plan and caption (guidance of the DiT; 1 = "
                               f"conditional only). {DEFAULT_DIT_CFG:g} is the model's own; 1-3 is safe, higher "
                               "can sound harsh."),
        io.Int.Input("variations", default=1, min=1, max=MAX_VARIATIONS,
                     tooltip=f"Renderings of the same plan (1-{MAX_VARIATIONS}): the same song played again with "
                             "other sound detail, one audio item each (seed + j)."),
        io.Float.Input("shift", default=AUTO_SHIFT, min=0.0, max=MAX_SHIFT, step=0.05, optional=True,
                       tooltip="Where the denoising spends its steps (flow schedule shift): 0 = automatic (29 / "
                               "(steps - 1) below 30 steps, where few steps sound thin), 1 = off (the reference's "
                               f"schedule); up to {MAX_SHIFT:g}. Leave at 0 unless comparing with the reference."),
    ]


def _loaded_dit(dit, condition):
    """The DiT loaded by ComfyUI's manager for the condition's longest window, and the keyword
    arguments of a sampling call (device, dtype, progress, the spare memory for weight copies)."""
    device, dtype = _device_dtype(dit)
    need = dit_memory(dit.hparams, max(c.shape[1] for c in condition.conds), dtype_bytes(dtype))
    (model,) = load([dit], memory_required=need)
    return model, dict(device=device, dtype=dtype, numerics=Numerics(compute_dtype=dit_compute_dtype(dtype)),
                       progress=node_progress(), weight_cache=spare_bytes([dit], need))


class MM3Repaint(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3Repaint", display_name="MM3 Repaint", category=CATEGORY,
            description="Samples a time range of a song anew and keeps the rest: the kept latents follow the "
                        "source at every step (flow-matching inpainting), with a crossfade at the edges.",
            inputs=[
                DIT.Input("dit"), CONDITION.Input("condition"),
                LATENTS.Input("source", tooltip="The song's latents (Flow DiT Sampler, or MM3 Vocoder Encode of a "
                                                 "recording) for the same codes."),
                io.Float.Input("start", default=10.0, min=0.0, max=MAX_DURATION, step=0.5, round=0.01,
                               tooltip="Second where the part sung and played anew begins (0 up to the song's length); "
                                       "must be before end."),
                io.Float.Input("end", default=20.0, min=0.0, max=MAX_DURATION, step=0.5, round=0.01,
                               tooltip="Second where the part played anew ends (after start, at most the song's "
                                       "length)."),
                io.Float.Input("fade", default=DEFAULT_REPAINT_FADE, min=0.0, max=10.0, step=0.05,
                               tooltip="Seconds of crossfade inside each edge of the range, so the new part blends in; "
                                       "0.1-1 is safe, at most half the range."),
                *_sampling_inputs(1, "Picks the new take of the repainted range: another seed, another rendering "
                                     "of those seconds. Variation j uses seed + j."),
                io.String.Input("lyrics_lrc", optional=True, force_input=True,
                                tooltip="The song's lyric timestamps (MM3 Lyric Timestamps of the source's codes), for "
                                        "choosing the range by line or section."),
                io.Int.Input("line", default=0, min=0, max=MAX_LINE, optional=True,
                             tooltip="Repaint this sung line (1 = the first; section tags are not counted) instead of "
                                     "start-end: its seconds come from lyrics_lrc, reaching "
                                     f"{DEFAULT_MARGIN:g} s into the neighbouring lines (at most half-way). 0 = use "
                                     "start and end. Click a lyric line in a player of this workflow to set it."),
                io.String.Input("section", default="", optional=True,
                                tooltip='Repaint a section instead of start-end: "chorus 2" is the second [chorus] '
                                        '("chorus": the first), up to the next section tag. Empty: not used.'),
            ],
            outputs=[LATENTS.Output("latents", display_name="latents")],
        )

    @classmethod
    def validate_inputs(cls, start=None, end=None) -> bool | str:
        return verdict(out_of_range(MM3Repaint, start=start, end=end), repaint_range(start, end))

    @classmethod
    def execute(cls, dit, condition, source, start: float, end: float, fade: float, seed: int, steps: int,
                dit_cfg: float, variations: int, shift: float = AUTO_SHIFT, lyrics_lrc: str | None = None,
                line: int = 0, section: str = "") -> io.NodeOutput:
        what, record = "", ()
        if line or (section or "").strip():
            chosen = logic.lyric_range(source.conditions.song, lyrics_lrc, line=line or None,
                                       section=None if line else section, margin=DEFAULT_MARGIN)
            start, end, what = chosen.start, chosen.end, f"{chosen.label} {chosen.text!r}: "
            record = tuple(chosen.record().items())
        if not start < end:
            raise ValueError(f"MM3 Repaint: start ({start:g} s) must be before end ({end:g} s)")
        seed = logic.linked_seed(seed, DIT_SEED_MAX, "seed")
        repaint, synth = RepaintSettings(start, end, fade, record), SynthSettings(seed, steps, dit_cfg, variations, shift)
        with interruptible():
            model, run = _loaded_dit(dit, condition)
            out = stages.repaint(model, dit.file(), condition, source, repaint, synth, **run)
        show_warnings(out.warnings)
        return io.NodeOutput(out, ui={"text": [f"repainted {what}{start:g}-{end:g} s with seed {seed}"]})


class MM3VocoderDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3VocoderDecode", display_name="MM3 Vocoder Decode", category=CATEGORY,
            description="Decodes each window's latents to stereo audio (not yet cropped and joined: see Stitch). "
                        "The node's player plays each window as soon as it is decoded.",
            inputs=[VAE.Input("vae"), LATENTS.Input("latents")],
            outputs=[AUDIO_WINDOWS.Output("windows", display_name="windows")],
        )

    @classmethod
    def execute(cls, vae, latents) -> io.NodeOutput:
        with interruptible():
            device, _ = _device_dtype(vae)
            comp = vae.component()
            shapes = {n: t.shape for n, t in comp.tensors.items()}
            longest = max(x.shape[-1] for x in latents.latents)
            need = vocoder_memory(shapes, list(vae.hparams["upsampling_ratios"]), longest)
            (model,) = load([vae], memory_required=need)
            out = logic.decode_streamed(model, vae.file(), latents, window_preview(noise=vae.is_tiny), device=device,
                                        progress=node_progress())
        show_warnings(out.warnings)
        return io.NodeOutput(out)


class MM3VocoderEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3VocoderEncode", display_name="MM3 Vocoder Encode", category=CATEGORY,
            description="Encodes a recording (resampled to 44.1 kHz, stereo) with the vocoder's encoder into latents "
                        "laid out as the windows of the condition's song, so MM3 Repaint can keep parts of it.",
            inputs=[VAE.Input("vae"), io.Audio.Input("audio"), CONDITION.Input("condition")],
            outputs=[LATENTS.Output("latents", display_name="latents")],
        )

    @classmethod
    def execute(cls, vae, audio, condition) -> io.NodeOutput:
        with interruptible():
            device, _ = _device_dtype(vae)
            comp = vae.component()
            shapes = {n: t.shape for n, t in comp.tensors.items()}
            longest = max(c.shape[1] for c in condition.conds)
            need = vocoder_memory(shapes, list(vae.hparams["upsampling_ratios"]), longest)
            (model,) = load([vae], memory_required=need)
            out = logic.encode_recording(model, vae, audio, condition, device=device)
        return io.NodeOutput(out)


class MM3Stitch(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3Stitch", display_name="MM3 Stitch", category=CATEGORY,
            description="Crops the window overlaps and joins the windows: standard AUDIO (stereo, 44.1 kHz) for "
                        "Save Song or ComfyUI's audio nodes.",
            inputs=[AUDIO_WINDOWS.Input("windows")],
            outputs=[io.Audio.Output("audio", display_name="audio")],
        )

    @classmethod
    def execute(cls, windows) -> io.NodeOutput:
        return io.NodeOutput(logic.stitch_audio(windows))


NODES = [MM3PromptAssemble, MM3ARPlan, MM3ConditionEncode, MM3FlowSampler, MM3Repaint, MM3VocoderEncode,
         MM3VocoderDecode, MM3Stitch]
