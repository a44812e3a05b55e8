"""Low-VRAM loading of the pack's MM3Patcher through ComfyUI's own LoadedModel, without a GPU.

ComfyUI refuses --lowvram / --novram together with --cpu, and a machine without a GPU needs --cpu,
so the check drives the same calls `load_models_gpu` makes in those modes (`model_load` with a
byte budget: a fraction of the model for --lowvram, 0.1 for --novram; `model_unload` with bytes
to free, then in full) with the `meta` device standing in for the GPU: any op that mixed the CPU
weights ComfyUI left behind with device tensors would raise. ComfyUI's own ModelPatcher code moves
the weights. With the LM partly resident, one AR frame runs through `mm3.plan.ar.FrameSampler.step`,
the function the command line's pipeline runs for every frame (it is counted in both). Prints one
JSON line of findings.

Run with ComfyUI's interpreter: python tests/helpers/comfy_lowvram_check.py COMFYUI_PATH MODELS_DIR
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def check(comfy_path: str, models_dir: str) -> dict:
    sys.path.insert(0, comfy_path)
    sys.path.append(str(ROOT))
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
    from mm3.plan import ar
    from mm3.plan.ar import PlanSettings
    from mm3.formats.gguf.reader import read_architecture
    from mm3.song.pipeline import Pipeline
    from mm3.song.request import MM3Request

    steps = {"count": 0}
    real_step = ar.FrameSampler.step

    def counted(self, *args):
        steps["count"] += 1
        return real_step(self, *args)

    ar.FrameSampler.step = counted
    files = {read_architecture(p): p for p in sorted(Path(models_dir).glob("*.gguf"))}
    meta = torch.device("meta")
    out = {}
    for mode, fraction in (("lowvram", 3 / 4), ("novram", None)):
        h = handles.ComponentHandle("lm", files["mm3-lm"].name, str(files["mm3-lm"]))
        d = handles.ComponentHandle("depth", files["mm3-depth"].name, str(files["mm3-depth"]))
        lm, depth = h.model(), d.model()
        homes = {n: p.data_ptr() for n, p in lm.named_parameters()}
        p = cm.MM3Patcher(cm.MM3Module(lm, "lm", h.name), meta, cm.OFFLOAD, size=h.nbytes(), handle=h)
        loaded = mm.LoadedModel(p)
        budget = 0.1 if fraction is None else fraction * p.model_size()  # what load_models_gpu passes
        loaded.model_load(lowvram_model_memory=budget)
        on_meta = {n for n, t in lm.named_parameters() if t.device == meta}
        cache = lm.new_cache(2, 8, torch.float32, meta)
        hidden = lm(torch.randn(2, 3, lm.hidden_size, device=meta), cache)
        logits = lm.head(hidden[:, -1])
        partial = {"loaded_bytes": p.loaded_size(), "size": p.model_size(), "lowvram": p.model.model_lowvram,
                   "resident_tensors": len(on_meta), "tensors": len(homes), "device": str(p.current_loaded_device()),
                   "hidden": str(hidden.device), "logits": str(logits.device)}
        if "model.embed_tokens.weight" in on_meta:  # token lookups on the device: a whole AR frame runs there
            depth.to(meta)
            prompt_codes = type("Codes", (), {"code_offset": lm.head_ids[0], "num_semantic": 1,
                                              "end_id": lm.head_ids[1] - 1})
            sampler = ar.FrameSampler(lm, depth, prompt_codes, cache, PlanSettings(duration=1.0), torch.float32, meta)
            width = lm.head_ids[1] - lm.head_ids[0]
            before = steps["count"]
            codes, end, frame_hidden = sampler.step(torch.ones(1, width, device=meta),
                                                    torch.ones(1, depth.num_codebooks - 1, depth.audio_vocab,
                                                               device=meta))
            partial["frame_step"] = {"calls": steps["count"] - before, "codes": str(codes.device),
                                     "hidden": list(frame_hidden.shape)}
            depth.to("cpu")
        gone = loaded.model_unload(memory_to_free=1)  # ComfyUI asks for a little memory back
        partial["after_partial_unload"] = {"unloaded": gone, "loaded_bytes": p.loaded_size()}
        if not gone:
            loaded.model_unload()  # and then everything
        partial["restored"] = all(t.data_ptr() == homes[n] for n, t in lm.named_parameters())
        partial["final_device"] = str(p.current_loaded_device())
        out[mode] = partial
    # The command line's pipeline on the CPU: the same frame step, counted.
    before = steps["count"]
    Pipeline(models_dir).plan(MM3Request(caption="c", lyrics="[verse]\nla", duration=0.2, lm_seed=1))
    out["pipeline_frame_steps"] = steps["count"] - before
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="ComfyUI's low-VRAM loading of the MM3 models, on the meta device")
    parser.add_argument("comfy_path", metavar="COMFYUI_PATH", help="the ComfyUI checkout")
    parser.add_argument("models_dir", metavar="MODELS_DIR", help="folder of the tiny GGUF files")
    args = parser.parse_args(argv)
    print(json.dumps(check(args.comfy_path, args.models_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
