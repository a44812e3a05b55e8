"""MM3 Sampling Options: AR Plan's expert knobs on a node of their own, wired into AR Plan's one
optional `options` input. Unwired, AR Plan samples with the same defaults.

API prompts that set these knobs on AR Plan itself are still accepted: `upgrade_prompt` (run on
every queued prompt) moves them onto an options node so they keep their effect.
"""

from __future__ import annotations

import logging
from dataclasses import field, make_dataclass

from comfy_api.latest import io

from mm3.constants import MAX_AUDIO_FRAMES, SEMANTIC_VOCAB_SIZE
from mm3.song.request import MM3Request, shaping_of
from mm3.song.settings import MAX_ENDING_ROUNDS, MAX_TEMPERATURE, PENALTIES, Takes
from .common import CATEGORY

SAMPLING_OPTIONS = io.Custom("MM3_SAMPLING_OPTIONS")
NODE_ID = "MM3SamplingOptions"
PLAN_NODE = "MM3ARPlan"
log = logging.getLogger("mm3")


# The request fields these knobs set (also accepted on AR Plan in older prompts, see upgrade_prompt), with the
# request's defaults (the reference's draw); the strength is where a penalty starts once picked.
KEYS = ("lm_top_k", "lm_temperature", "lm_top_p", "lm_penalty", "lm_penalty_strength", "lm_penalty_window",
        "lm_dry_min_match", "ending_rounds")
DEFAULTS = {k: getattr(MM3Request, k) for k in KEYS} | {"lm_penalty_strength": 1.1}
# The expert settings of the AR sampling, named as the request names them (`mm3.song.request.shaping_of`).
SamplingOptions = make_dataclass("SamplingOptions", [(k, type(v), field(default=v)) for k, v in DEFAULTS.items()],
                                 frozen=True, namespace={"__module__": __name__})


class MM3SamplingOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = SamplingOptions()
        return io.Schema(
            node_id=NODE_ID, display_name="MM3 Sampling Options", category=CATEGORY,
            description="Expert settings of how AR Plan draws the song. Leave this node out for the model's own "
                        "defaults (the same song as with this node at its defaults).",
            inputs=[
                io.Int.Input("lm_top_k", default=d.lm_top_k, min=1, max=SEMANTIC_VOCAB_SIZE,
                             tooltip="How many candidate sounds the plan chooses from at each step. Fewer: safer and "
                                     "more repetitive; more: more varied, with more odd moments. "
                                     f"{d.lm_top_k} is the model's own; 20-200 is safe."),
                io.Float.Input("lm_temperature", default=d.lm_temperature, min=0.05, max=MAX_TEMPERATURE, step=0.05,
                               tooltip="How adventurous the plan is: below 1 plainer and more repetitive, above 1 "
                                       "wilder and less coherent. 1 is the model's own; 0.8-1.2 is safe."),
                io.Float.Input("lm_top_p", default=d.lm_top_p, min=0.01, max=1.0, step=0.01,
                               tooltip="Drops the least likely candidates (nucleus sampling): lower plays it safer. "
                                       "1 = off (the model's own); 0.9-1 is safe."),
                io.Combo.Input("lm_penalty", options=list(PENALTIES), default=d.lm_penalty,
                               tooltip="Keeps the song from repeating itself: none (the model's own); dry pushes "
                                       "out a riff or line stuck in a loop; frequency / presence discourage any "
                                       "repeated sound (choruses too)."),
                io.Float.Input("lm_penalty_strength", default=d.lm_penalty_strength, min=0.0, max=10.0, step=0.01,
                               tooltip="How hard the penalty pushes: dry 1.05-1.15, frequency / presence 0.1-1. "
                                       "Ignored when lm_penalty is none."),
                io.Int.Input("lm_penalty_window", default=d.lm_penalty_window, min=1, max=MAX_AUDIO_FRAMES,
                             tooltip="How far back the penalty looks for repeats, in frames (25 per second: "
                                     f"{d.lm_penalty_window} = {d.lm_penalty_window / 25:g} s, a few bars). "
                                     "100-750 is safe."),
                io.Int.Input("lm_dry_min_match", default=d.lm_dry_min_match, min=1, max=MAX_AUDIO_FRAMES,
                             tooltip="Shortest repeat dry counts as a loop, in frames (25 per second: "
                                     f"{d.lm_dry_min_match} = {d.lm_dry_min_match / 25:g} s). Shorter also "
                                     "penalises held notes and beats; 10-50 is safe."),
                io.Int.Input("ending_rounds", default=d.ending_rounds, min=1, max=MAX_ENDING_ROUNDS,
                             tooltip="With AR Plan's require_ending: how many rounds of takes (at the next seeds) "
                                     "to plan until one ends by itself. Each round costs as long as its takes; "
                                     "1-3 is typical."),
            ],
            outputs=[SAMPLING_OPTIONS.Output("options", display_name="options")],
        )

    @classmethod
    def execute(cls, **values) -> io.NodeOutput:
        """The options, refused here when their settings cannot be built (a penalty strength outside
        its penalty's range, a linked value out of range); min_duration joins them on AR Plan."""
        options = SamplingOptions(**{k: values[k] for k in KEYS if k in values})
        shaping_of(options)
        Takes(rounds=options.ending_rounds)
        return io.NodeOutput(options)


def upgrade_prompt(prompt: dict) -> dict:
    """An API prompt whose AR Plan nodes still set the moved knobs: each such node gets an options
    node with those values (the others at their defaults) wired into `options`. Returns the prompt,
    changed in place; prompts already in the new form pass unchanged."""
    if not isinstance(prompt, dict):
        return prompt
    for nid, node in list(prompt.items()):
        if not isinstance(node, dict) or node.get("class_type") != PLAN_NODE or not isinstance(node.get("inputs"),
                                                                                                 dict):
            continue
        inputs = node["inputs"]
        moved = {k: inputs.pop(k) for k in KEYS if k in inputs}
        if not moved or "options" in inputs:
            continue
        new_id = f"{nid}_options"
        while new_id in prompt:
            new_id += "_"
        prompt[new_id] = {"class_type": NODE_ID, "inputs": {k: moved.get(k, getattr(SamplingOptions(), k))
                                                            for k in KEYS},
                          "_meta": {"title": "MM3 Sampling Options"}}
        inputs["options"] = [new_id, 0]
        log.info("MM3: AR Plan %s: %s moved onto MM3 Sampling Options %s", nid, ", ".join(moved), new_id)
    return prompt


def on_prompt(json_data):
    """ComfyUI's on-prompt hook: `upgrade_prompt` on the queued prompt."""
    if isinstance(json_data, dict):
        upgrade_prompt(json_data.get("prompt"))
    return json_data


def add_prompt_upgrade() -> None:
    from server import PromptServer

    if PromptServer.instance is not None:
        PromptServer.instance.add_on_prompt_handler(on_prompt)


NODES = [MM3SamplingOptions]
