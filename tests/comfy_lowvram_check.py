"""Low-VRAM loading of the pack's MM3Patcher through ComfyUI's own LoadedModel, without a GPU.

ComfyUI refuses --lowvram / --novram together with --cpu, and a machine without a GPU needs --cpu,
so the test drives the same calls `load_models_gpu` makes in those modes (`model_load` with a
byte budget: a fraction of the model for --lowvram, 0.1 for --novram; `model_unload` with bytes
to free, then in full) with the `meta` device standing in for the GPU: any op that mixed the
streamed CPU weights with device tensors would raise. Prints one JSON line of findings.

Run with ComfyUI's interpreter: python tests/comfy_lowvram_check.py COMFYUI_PATH MODELS_DIR
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(comfy_path: str, models_dir: str) -> dict:
    sys.path.insert(0, comfy_path)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.model_management as mm
    import torch

    spec = importlib.util.spec_from_file_location("mm3pack", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["mm3pack"] = pack
    spec.loader.exec_module(pack)
    cm = importlib.import_module("mm3pack.nodes.comfy_models")
    handles = importlib.import_module("mm3pack.nodes.handles")
    read_architecture = importlib.import_module("mm3pack.mm3.gguf.reader").read_architecture

    lm_file = next(p for p in sorted(Path(models_dir).glob("*.gguf")) if read_architecture(p) == "mm3-lm")
    meta = torch.device("meta")
    out = {}
    for mode, fraction in (("lowvram", 1 / 3), ("novram", None)):
        h = handles.ComponentHandle("lm", lm_file.name, str(lm_file))
        model = h.model()
        before = {n: b for n, b in model.named_buffers()}
        p = cm.MM3Patcher(cm.MM3Module(model, "lm", h.name), meta, cm.OFFLOAD, size=h.nbytes(),
                          placement=h.placement, handle=h)
        loaded = mm.LoadedModel(p)
        budget = 0.1 if fraction is None else fraction * p.model_size()  # what load_models_gpu passes
        loaded.model_load(lowvram_model_memory=budget)
        cache = model.new_cache(2, 8, torch.float32)
        hidden = model(model.embed(torch.tensor([[1, 2, 3], [1, 4, 3]], device=meta), torch.float32), cache)
        logits = model.logits_rows(hidden[:, -1], [(0, 4)])
        partial = {"loaded_bytes": p.loaded_size(), "size": p.model_size(), "lowvram": p.model.model_lowvram,
                   "device": str(p.current_loaded_device()), "hidden": str(hidden.device), "logits": str(logits.device)}
        gone = loaded.model_unload(memory_to_free=1)  # ComfyUI asks for a little memory back
        partial["after_partial_unload"] = {"unloaded": gone, "loaded_bytes": p.loaded_size()}
        if not gone:
            loaded.model_unload()  # and then everything
        partial["restored"] = all(b is before[n] for n, b in model.named_buffers())
        partial["final_device"] = str(p.current_loaded_device())
        out[mode] = partial
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
