"""The MM3 models, one per file, built from a component's hyper-parameters through an `ops` namespace.

`build_model` is the one builder of the command line, the benchmark and the ComfyUI nodes: it
refuses what the engine cannot run before building anything (`check_loadable`), and turns what the
model classes raise about the file into a `ComponentError` naming it.
"""

from __future__ import annotations

import torch

from ..components import DESCRIPTIONS, Component, check_loadable
from ..formats.gguf.errors import ComponentError, GGUFFormatError


def _loader(kind: str):
    if kind == "lm":
        from .lm import Qwen3LM as cls
    elif kind == "depth":
        from .depth import RVQDepthDecoder as cls
    elif kind == "cond":
        from .cond import ConditionEncoder as cls
    elif kind == "dit":
        from .dit import FlowDiT as cls
    else:
        from .vocoder import Vocoder as cls
    return cls.load


def build_model(component: Component, *, numerics: str = "fast", with_encoder: bool | None = False) -> torch.nn.Module:
    """The engine model of an opened component, on the CPU with its weights still compressed (views
    of the file's mapping), in eval mode. `numerics` ("fast" or "reference", `mm3.models.lm`)
    applies to the LM and the depth decoder; `with_encoder` also builds the vocoder's encoder (audio
    -> latents; generation only decodes): True requires it, None when the file carries one.

    Every failure caused by the file is a `ComponentError` naming it: unsupported tensor types and
    implausible sizes are refused before anything is built, and what the model classes raise about
    inconsistent hyper-parameters (heads that do not divide the width, ...) is re-raised as one."""
    check_loadable(component)
    load = _loader(component.kind)
    try:
        if component.kind in ("lm", "depth"):
            model = load(component, numerics=numerics)
        elif component.kind == "vae":
            model = load(component, with_encoder=with_encoder)
        else:
            model = load(component)
    except (ComponentError, GGUFFormatError, torch.OutOfMemoryError):
        raise
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, OverflowError, RuntimeError) as e:
        raise ComponentError(f"{component.path}: cannot build the {DESCRIPTIONS[component.kind]} from this file "
                             f"({type(e).__name__}: {e})") from e
    return model.eval()
