"""Loader nodes: one per component (a typed socket each) and one for the whole set of five.

A loader only checks the file's architecture and returns a handle (cheap); the model is built
and moved when a stage node needs it. The lists show only files of the right component.
"""

from __future__ import annotations

from comfy_api.latest import io

from mm3.components import ARCH_OF, COMPONENTS, DESCRIPTIONS, KINDS
from mm3.files.registry import AUTO

from .comfy_models import chosen_file, files_of, full_path
from .common import ADVANCED, CATEGORY, COMPONENT_TYPES
from .handles import file_fingerprint, handle_for

TITLES = {k: s.title for k, s in COMPONENTS.items()}
NODE_IDS = {k: s.node_id for k, s in COMPONENTS.items()}
SET_FIELDS = {k: s.request_field for k, s in COMPONENTS.items()}  # the request JSON's names for the five files


def _file_input(kind: str, id: str) -> io.Combo.Input:
    return io.Combo.Input(id, options=[AUTO] + files_of(kind), default=AUTO,
                          tooltip=f"Which file plays this part of the model ({DESCRIPTIONS[kind]}): a larger, more "
                                  "precise file sounds closest to the released model, a smaller one fits a smaller "
                                  f"GPU; auto is right for most. A GGUF in models/mm3 whose general.architecture is "
                                  f"{ARCH_OF[kind]}, or a MiniMax Music 3 file of ComfyUI's own (text_encoders, "
                                  "diffusion_models, vae; recognised by its tensors) or of HOT-Step (files it cannot "
                                  "use are not listed); auto: a full-size model before a tiny one, the most precise "
                                  "that fits the device's memory (the file used is recorded in the replay JSON)")


def _keep_input() -> io.Boolean.Input:
    return io.Boolean.Input(
        "keep_loaded", default=False, extra_dict=ADVANCED,
        tooltip="Keep this model resident while the other stage group runs: faster re-runs, more memory. By default "
                "the AR models (LM, depth) and the synthesis models (condition encoder, DiT, vocoder) are never "
                "resident together; leave it off unless the GPU holds both.")


def _fingerprint(*pairs: tuple[str, str]):
    """What decides a loader's output: each chosen file's path, size and mtime (so "auto" runs again
    when the folder gains or loses a file)."""
    out = []
    for kind, name in pairs:
        try:
            out.append(file_fingerprint(full_path(chosen_file(kind, name))))
        except (FileNotFoundError, OSError, ValueError):
            out.append(name)  # execution reports the missing file
    return tuple(out)


def _handle(kind: str, name: str, keep_loaded: bool):
    chosen = chosen_file(kind, name)
    return handle_for(kind, chosen, full_path(chosen), keep_loaded)


def _component_loader(kind: str) -> type[io.ComfyNode]:
    title = TITLES[kind]

    def define_schema(cls):
        return io.Schema(
            node_id=NODE_IDS[kind], display_name=f"MM3 Load {title} (GGUF)", category=CATEGORY,
            description=f"Picks the {DESCRIPTIONS[kind]} file. Loading is lazy: the model is built and moved to the "
                        "device by the node that uses it.",
            inputs=[_file_input(kind, "model_name"), _keep_input()],
            outputs=[COMPONENT_TYPES[kind].Output(kind, display_name=kind)],
        )

    def execute(cls, model_name: str = AUTO, keep_loaded: bool = False) -> io.NodeOutput:
        return io.NodeOutput(_handle(kind, model_name, keep_loaded))

    def fingerprint_inputs(cls, model_name: str = AUTO, keep_loaded: bool = False):
        return _fingerprint((kind, model_name)), keep_loaded

    return type(NODE_IDS[kind], (io.ComfyNode,), {
        "__module__": __name__, "__doc__": f"Load the {DESCRIPTIONS[kind]} GGUF.",
        "define_schema": classmethod(define_schema), "execute": classmethod(execute),
        "fingerprint_inputs": classmethod(fingerprint_inputs)})


COMPONENT_LOADERS = [_component_loader(kind) for kind in KINDS]


class MM3LoadModelSet(io.ComfyNode):
    """All five components in one node."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3LoadModelSet", display_name="MM3 Load Model Set (GGUF)", category=CATEGORY,
            description="Picks the five component files (language model, depth decoder, condition encoder, DiT, "
                        "vocoder). Loading is lazy: each model is built and moved by the node that uses it.",
            inputs=[_file_input(kind, SET_FIELDS[kind]) for kind in KINDS] + [_keep_input()],
            outputs=[COMPONENT_TYPES[kind].Output(kind, display_name=kind) for kind in KINDS],
        )

    @classmethod
    def execute(cls, keep_loaded: bool = False, **names: str) -> io.NodeOutput:
        return io.NodeOutput(*(_handle(k, names.get(SET_FIELDS[k], AUTO), keep_loaded) for k in KINDS))

    @classmethod
    def fingerprint_inputs(cls, keep_loaded: bool = False, **names: str):
        return _fingerprint(*((k, names.get(SET_FIELDS[k], AUTO)) for k in KINDS)), keep_loaded


NODES = COMPONENT_LOADERS + [MM3LoadModelSet]
