"""MM3 Lyric Timestamps: each lyric line's start in the song, as LRC text, from the LM's attention.

A node of its own rather than an output of AR Plan: it times codes from anywhere (AR Plan, Load
Audio Codes), costs nothing when left out, and a change of its heads or lead re-runs only it. It
replays the codes through the language model (up to the deepest layer it reads; the depth
decoder only embeds the codes), which is what its depth input is for.
"""

from __future__ import annotations

from comfy_api.latest import io

from mm3.plan.lyrics_align import LEAD_SECONDS, MAX_LEAD, LyricHeads
from mm3.song.numerics import Numerics
from . import logic
from .comfy_models import compute_dtype, dit_compute_dtype, load, patcher
from .common import ADVANCED, AUDIO_CODES, CATEGORY, DEPTH, LM, interruptible, node_progress
from .validation import verdict


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
                AUDIO_CODES.Input("codes", tooltip="The planned song whose lyrics are timed (MM3 AR Plan or MM3 "
                                                   "Load Audio Codes)."),
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
    def execute(cls, lm, depth, codes, lead: float = LEAD_SECONDS, heads: str = "") -> io.NodeOutput:
        chosen = LyricHeads.parse(heads or "")
        chosen.resolve(lm.hparams)  # a head this LM lacks: refused before anything loads
        with interruptible():
            device = patcher(lm).load_device
            lm_model, depth_model = load([lm, depth])
            dtype = compute_dtype(device)
            text = logic.lyric_timestamps(lm_model, depth_model, depth, codes, chosen, lead, device=device,
                                          dtype=dtype, progress=node_progress(),
                                          numerics=Numerics(compute_dtype=dit_compute_dtype(dtype)))
        ui = {"text": [text or "(no lyric line was reached)"]}
        if text:
            ui["lyrics_lrc"] = [text]  # the live players of this prompt show the lines (web/mm3.js)
        return io.NodeOutput(text, ui=ui)


NODES = [MM3LyricTimestamps]
