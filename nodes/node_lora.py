"""MM3 Load LoRA: an adapter from ComfyUI's models/loras on the language model or the DiT.

Takes an MM3 LM or DiT and gives the same type back with the adapter added (chain several); the
input handle is left as it was (`lora_handles.AdaptedHandle`). It checks that the file fits the
model and reports how far the adapters move each group's weights (`mm3.lora.health`), warning
above the healthy range.
"""

from __future__ import annotations

import logging

from comfy_api.latest import io

from mm3.lora.adapter import read_adapter
from mm3.lora.attach import Applied
from mm3.lora.health import WARN_ABOVE, group_changes, warnings_of
from mm3.lora.keys import GROUPS, NAMES
from mm3.lora.use import LoraUse

from .comfy_models import lora_files, lora_folders, lora_path
from .common import CATEGORY, DIT, LM
from .handles import file_fingerprint
from .lora_handles import AdaptedHandle, adapters_of, base_of
from .validation import verdict

log = logging.getLogger("mm3")
MAX_STRENGTH = 2.0
GROUP_TOOLTIPS = {
    "attn_qk": "How much of the LoRA reaches the attention's query/key layers, which shape the song's structure "
               "(where sections go, how lines are placed). 1 = as trained; 0 keeps the timbre the LoRA gives "
               "without changing the structure (a common fix for songs that fall apart); 0-1 is safe.",
    "attn_vo": "How much of the LoRA reaches the attention's value/output layers, which carry much of its sound "
               "(voice colour, instruments). 1 = as trained; 0-1.5 is safe.",
    "mlp": "How much of the LoRA reaches the MLP layers, which carry timbre and detail (and most of the damage an "
           "overtrained LoRA does). 1 = as trained; lower it to 0.5 if the sound turns harsh; 0-1.5 is safe.",
}


# The one choice the LoRA list offers while models/loras holds no LoRA of this model: the editor
# shows it instead of an empty list (which queues as a missing input), and queueing it says where
# LoRAs go.
NO_LORA = "(no MiniMax Music 3 LoRA in models/loras)"


def lora_name_problem(name) -> str | None:
    """Why `name` is not a LoRA this node can load, or None (a linked name is not judged here)."""
    if not isinstance(name, str):
        return None
    found = lora_files()
    if name in found:
        return None
    folders = ", ".join(lora_folders())
    if not found:
        return (f"no MiniMax Music 3 LoRA was found in models/loras ({folders}): put a LoRA trained for MiniMax "
                "Music 3 there (a PEFT / diffusers, ComfyUI, kohya or SimpleTuner .safetensors file), then refresh "
                "the editor (R) and pick it")
    return f"lora_name {name!r} is not a MiniMax Music 3 LoRA in models/loras ({folders}); found: {', '.join(found)}"


class MM3LoadLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        model = io.MatchType.Template("model", [LM, DIT])
        return io.Schema(
            node_id="MM3LoadLoRA", display_name="MM3 Load LoRA", category=CATEGORY,
            description="Adds a LoRA (a style adapter trained for MiniMax Music 3, from models/loras) to the language "
                        "model or the DiT; chain several. The model wired in stays as it was for other nodes. Shows "
                        f"how far the LoRAs move each group of weights and warns above {100 * WARN_ABOVE:.0f} % "
                        "(healthy LoRAs move them 1-5 %).",
            inputs=[
                io.MatchType.Input("model", template=model,
                                   tooltip="The language model (changes the song's plan: melody, words, structure) "
                                           "or the DiT (changes the sound) from its loader or another MM3 Load LoRA."),
                io.Combo.Input("lora_name", options=lora_files() or [NO_LORA],
                               tooltip="The LoRA file from models/loras (only LoRAs of MiniMax Music 3 are listed: "
                                       "PEFT / diffusers, ComfyUI, kohya or SimpleTuner files). A language-model "
                                       "LoRA goes after the LM loader, a DiT LoRA after the DiT loader."),
                io.Float.Input("strength", default=1.0, min=-MAX_STRENGTH, max=MAX_STRENGTH, step=0.05,
                               tooltip="How strongly the LoRA's style is applied: 1 = as trained, 0 = off, 0.5-1 "
                                       "is typical; above 1.2 or below 0 often sounds broken."),
                *(io.Float.Input(g, default=1.0, min=0.0, max=MAX_STRENGTH, step=0.05, tooltip=GROUP_TOOLTIPS[g])
                  for g in GROUPS),
            ],
            outputs=[io.MatchType.Output(template=model, display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, lora_name=None) -> bool | str:
        return verdict(lora_name_problem(lora_name))

    @classmethod
    def execute(cls, model, lora_name: str, strength: float, attn_qk: float = 1.0, attn_vo: float = 1.0,
                mlp: float = 1.0) -> io.NodeOutput:
        adapter = read_adapter(lora_path(lora_name))
        adapter.check_usable()  # NaN or infinite factors or alpha make every output NaN
        kind, base = model.kind, base_of(model)
        if kind not in adapter.kinds:
            held = " and ".join(NAMES[k] for k in adapter.kinds)
            raise ValueError(f"MM3 Load LoRA: {lora_name} changes the {held}; wire it after the {held} loader, not "
                             f"after the {NAMES.get(kind, kind)}")
        groups = tuple((g, float(v)) for g, v in zip(GROUPS, (attn_qk, attn_vo, mlp)))
        use = LoraUse(lora_name, adapter.fingerprint, kind, float(strength), groups)
        applied = adapters_of(model) + (Applied(adapter, use),)
        component = base.component()
        changes = group_changes(applied, component)  # refuses a LoRA made for another model size (layer_terms)
        what = lora_name if len(applied) == 1 else f"the {len(applied)} LoRAs together"
        warnings = warnings_of(changes, what)
        for w in warnings:
            log.warning("MM3: %s", w)
        lines = [f"{NAMES[kind]} with {', '.join(a.use.describe() for a in applied)}",
                 "weights changed (||s B A|| / ||W||):"] + [c.line() for c in changes]
        lines += [f"warning: {w}" for w in warnings]
        return io.NodeOutput(AdaptedHandle(base, applied), ui={"text": ["\n".join(lines)]})

    @classmethod
    def fingerprint_inputs(cls, lora_name: str, **values):
        try:
            stamp = file_fingerprint(lora_path(lora_name))
        except OSError:
            stamp = (lora_name,)  # execution reports the missing file
        return stamp, tuple(sorted((k, v) for k, v in values.items() if isinstance(v, (int, float))))


NODES = [MM3LoadLoRA]
