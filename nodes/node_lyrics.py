"""MM3 Lyric Timestamps: each lyric line's start in the song, as LRC text, from the LM's attention.

A node of its own rather than an output of AR Plan: it times codes from anywhere (AR Plan, Load
Audio Codes), costs nothing when left out, and a change of its heads or lead re-runs only it. It
replays the codes through the language model (up to the deepest layer it reads; the depth
decoder only embeds the codes), which is what its depth input is for.
"""

from __future__ import annotations

import logging

from comfy_api.latest import io

from mm3.constants import MAX_PROMPT_TOKENS
from mm3.plan.lyric_edit import DEFAULT_MARGIN, MAX_WORDS_CHARS
from mm3.song.request import MM3Request
from mm3.plan.lyrics_align import LEAD_SECONDS, MAX_LEAD, LyricHeads, LyricHeadsError, untimed_warning
from mm3.song.numerics import Numerics
from . import logic
from .comfy_models import compute_dtype, dit_compute_dtype, load, patcher
from .common import ADVANCED, AUDIO_CODES, CATEGORY, DEPTH, LM, interruptible, node_progress
from .handles import ar_memory, dtype_bytes
from .node_stages import LM_SEED_MAX, MAX_LINE
from .validation import verdict

log = logging.getLogger("mm3")


class MM3LyricTimestamps(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3LyricTimestamps", display_name="MM3 Lyric Timestamps", category=CATEGORY,
            description="Times each lyric line and section tag of the planned song from where the language model "
                        "was 'reading' in the lyrics as it wrote each moment, and writes them as LRC text "
                        "([mm:ss.xx] line) for karaoke players and lyric videos. Wire it into MM3 Save Song to "
                        "save song.lrc beside the song.",
            inputs=[
                LM.Input("lm"), DEPTH.Input("depth"),
                AUDIO_CODES.Input("codes", lazy=True,
                                  tooltip="The planned song whose lyrics are timed (MM3 AR Plan or MM3 Load Audio "
                                          "Codes)."),
                io.Float.Input("lead", default=LEAD_SECONDS, min=-MAX_LEAD, max=MAX_LEAD, step=0.05, round=0.01,
                               tooltip=f"Seconds added to every line's time. The model reads a line about "
                                       f"{LEAD_SECONDS:g} s before it is sung, so {LEAD_SECONDS:g} lines the words up "
                                       "with the voice; raise it if lines show early, lower it if late (-10 to 10)."),
                io.String.Input("heads", default="", optional=True, extra_dict=ADVANCED,
                                tooltip="Which listening heads of the language model follow the lyrics, as "
                                        "layer:head (e.g. 12:3,19:*). Empty: the ones found for the released "
                                        "model (12:27, 19:7, 24:29). A pruned or retrained model needs its own: "
                                        "python -m mm3 align --discover finds them."),
            ],
            outputs=[io.String.Output("lyrics_lrc", display_name="lyrics_lrc")],
        )

    @classmethod
    def validate_inputs(cls, heads=None) -> bool | str:
        return verdict(logic.heads_problem(heads))

    @classmethod
    def check_lazy_status(cls, lm, depth, codes=None, lead: float = LEAD_SECONDS, heads: str = "") -> list[str]:
        """The heads against the LM before the codes are asked for: a head this LM lacks is refused
        before the plan upstream runs (the codes input is lazy)."""
        _heads(lm, heads)
        return ["codes"] if codes is None else []

    @classmethod
    def execute(cls, lm, depth, codes, lead: float = LEAD_SECONDS, heads: str = "") -> io.NodeOutput:
        chosen = _heads(lm, heads)
        with interruptible():
            device = patcher(lm).load_device
            lm_model, depth_model = load([lm, depth])
            dtype = compute_dtype(device)
            text = logic.lyric_timestamps(lm_model, depth_model, depth, codes, chosen, lead, device=device,
                                          dtype=dtype, progress=node_progress(),
                                          numerics=Numerics(compute_dtype=dit_compute_dtype(dtype)))
        warning = untimed_warning(text, where="this node's heads input")
        ui = {"text": [text or f"(empty: {warning})"]}
        if text:
            ui["lyrics_lrc"] = [text]  # the live players of this prompt show the lines (web/mm3.js)
        else:
            log.warning("MM3 Lyric Timestamps: %s", warning)
        return io.NodeOutput(text, ui=ui)


def _heads(lm, heads: str, node: str = "MM3 Lyric Timestamps") -> LyricHeads:
    """The heads a node reads, checked against the LM (an error names the node's heads input)."""
    chosen = LyricHeads.parse(heads or "")
    try:
        chosen.resolve(lm.hparams, where="this node's heads input")
    except LyricHeadsError as e:
        raise LyricHeadsError(f"{node}: heads {str(chosen)!r}: {e}") from None
    return chosen


class MM3ChangeLine(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3ChangeLine", display_name="MM3 Change a Line", category=CATEGORY,
            description="Gives one sung line new words and keeps the rest of the song: the lyrics with that line "
                        "replaced become the prompt, the codes before the line are replayed under it, the line's "
                        "seconds (from the song's lyric timestamps, with a margin) are planned again and the codes "
                        "after it kept. Feed the codes to Condition Encode and MM3 Repaint (start and end from here, "
                        "the original song's latents as its source), which keeps the audio outside those seconds. "
                        "The players of the workflow show the song's lyric lines: click one to choose it.",
            inputs=[
                LM.Input("lm"), DEPTH.Input("depth"),
                AUDIO_CODES.Input("codes", tooltip="The song to change (MM3 AR Plan or MM3 Load Audio Codes)."),
                io.Int.Input("line", default=1, min=1, max=MAX_LINE,
                             tooltip="Which sung line (1 = the first; section tags are not counted). Click a lyric "
                                     "line in a player of this workflow to set it."),
                io.String.Input("words", default="", placeholder="the new words of that line",
                                tooltip=f"What the line sings instead: one line (no line breaks or [tags]), at most "
                                        f"{MAX_WORDS_CHARS} characters; the whole prompt stays within "
                                        f"{MAX_PROMPT_TOKENS} tokens."),
                io.Int.Input("lm_seed", default=0, min=0, max=LM_SEED_MAX,
                             tooltip="Picks the new take of the line's codes: another seed, another melody for "
                                     f"the new words. The range reaches {DEFAULT_MARGIN:g} s into the neighbouring "
                                     "lines (at most half-way), since the timestamps are approximate."),
                io.String.Input("heads", default="", optional=True, extra_dict=ADVANCED,
                                tooltip="The heads that time the lyrics, as on MM3 Lyric Timestamps (empty: the "
                                        "released model's). Not used with lyrics_lrc wired in."),
                io.Float.Input("lead", default=LEAD_SECONDS, min=-MAX_LEAD, max=MAX_LEAD, step=0.05, round=0.01,
                               optional=True, extra_dict=ADVANCED,
                               tooltip="Seconds added to every line's time, as on MM3 Lyric Timestamps."),
                io.String.Input("lyrics_lrc", optional=True, force_input=True,
                                tooltip="The song's lyric timestamps from MM3 Lyric Timestamps (of the same codes); "
                                        "unwired, this node times the lines itself (heads, lead)."),
            ],
            outputs=[AUDIO_CODES.Output("codes", display_name="codes"),
                     io.Float.Output("start", display_name="start"), io.Float.Output("end", display_name="end")],
        )

    @classmethod
    def validate_inputs(cls, heads=None) -> bool | str:
        return verdict(logic.heads_problem(heads))

    @classmethod
    def execute(cls, lm, depth, codes, line: int, words: str, lm_seed: int, heads: str = "",
                lead: float = LEAD_SECONDS, lyrics_lrc: str | None = None) -> io.NodeOutput:
        lm_seed = logic.linked_seed(lm_seed, LM_SEED_MAX, "lm_seed")
        chosen_heads = None if lyrics_lrc else _heads(lm, heads, "MM3 Change a Line")
        with interruptible():
            device = patcher(lm).load_device
            dtype = compute_dtype(device)
            numerics = Numerics(compute_dtype=dit_compute_dtype(dtype))
            cfg = codes.plan.lm_cfg if codes.plan is not None else (codes.origin or MM3Request()).lm_cfg
            tokens = codes.prompt.prompt.num_tokens + len(words)  # the new words: at most a token per character
            need = ar_memory(lm.hparams, tokens, codes.frames, 1, cfg, device, dtype_bytes(dtype))
            lm_model, depth_model = load([lm, depth], memory_required=need)
            if chosen_heads is not None:
                lyrics_lrc = logic.lyric_timestamps(lm_model, depth_model, depth, codes, chosen_heads, lead,
                                                    device=device, dtype=dtype, progress=node_progress(),
                                                    numerics=numerics)
            song, chosen = logic.change_words(lm_model, depth_model, lm, codes, lyrics_lrc, line, words, lm_seed,
                                              DEFAULT_MARGIN, device=device, dtype=dtype, progress=node_progress(),
                                              numerics=numerics)
        ui = {"text": [f"{chosen.describe()} now sings {words.strip()!r} (lm_seed {lm_seed})"]}
        if chosen_heads is not None:
            ui["lyrics_lrc"] = [lyrics_lrc]  # the song's lines in the players of this prompt (web/mm3.js)
        return io.NodeOutput(song, chosen.start, chosen.end, ui=ui)


NODES = [MM3LyricTimestamps, MM3ChangeLine]
