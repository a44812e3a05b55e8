"""ComfyUI's own MiniMax Music 3 files in a real ComfyUI (COMFYUI_PATH): the loaders list them from
ComfyUI's standard folders (text_encoders and clip, diffusion_models and unet, vae) by their tensors,
and the shipped workflow pointed at them makes the audio our GGUFs of the same weights make."""

from __future__ import annotations

import os
import shutil

import pytest
from safetensors.torch import save_file

from tests.helpers import foreign_layouts as F
from tests.helpers.comfyui import COMFYUI_PATH, audio_entries, needs_comfy, run, tiny_workflow

LOADERS = {"MM3LoadLanguageModel": "lm", "MM3LoadDepthDecoder": "depth", "MM3LoadConditionEncoder": "cond",
           "MM3LoadDiT": "dit", "MM3LoadVocoder": "vae"}
SET_FIELDS = {"lm_model": "lm", "depth_model": "depth", "cond_model": "cond", "dit_model": "dit", "vae_model": "vae"}
TE = "minimax_music3_text_encoder_pruned_bf16.safetensors"


@pytest.fixture(scope="module")
def comfy_foreign(tiny_foreign):
    """A ComfyUI with ComfyUI's three files of the foreign-size tiny in its standard folders (the DiT
    in the legacy unet folder, a GGUF text encoder in clip), our GGUFs of the same weights in
    models/mm3/ours, and an unrelated safetensors file in text_encoders."""
    from tests.helpers.comfy_server import ComfyServer

    if not COMFYUI_PATH:
        pytest.skip("COMFYUI_PATH is not set (a ComfyUI checkout to run)")
    server = ComfyServer(COMFYUI_PATH, os.environ.get("COMFYUI_PYTHON"))
    models = server.base / "models"
    for sub in ("text_encoders", "unet", "vae", "clip", "mm3/ours"):
        (models / sub).mkdir(parents=True, exist_ok=True)
    root = tiny_foreign.diffusers
    F.comfy_text_encoder(root, models / "text_encoders" / TE, pruned=True, merged=True)
    F.comfy_dit(root, models / "unet" / "minimax_music3_dit_fp32.safetensors")
    F.comfy_dav(root, models / "vae" / "minimax_music3_dav.safetensors")
    F.comfy_gguf(models / "text_encoders" / TE, models / "clip" / "minimax_music3_text_encoder_pruned_Q8_0.gguf",
                 quant="Q8_0")
    import torch

    save_file({"encoder.block.0.layer.0.weight": torch.zeros(4, 4)}, models / "text_encoders" / "t5_other.safetensors")
    import gguf

    w = gguf.GGUFWriter(str(models / "unet" / "flux_other-Q4_0.gguf"), arch="flux")  # another model's GGUF
    w.add_tensor("img_in.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for kind in SET_FIELDS.values():
        p = tiny_foreign.file(f"mm3-{kind}")
        shutil.copy(p, models / "mm3" / "ours" / p.name)
    server.start()
    yield server
    server.stop()


def _options(server, node: str, field: str) -> list[str]:
    info = server.get(f"/object_info/{node}")[node]
    spec = info["input"]["required"][field]
    return spec[0] if isinstance(spec[0], list) else spec[1]["options"]


@needs_comfy
def test_loaders_list_comfyui_files_by_their_tensors(comfy_foreign):
    want = {"lm": {f"text_encoders/{TE}", "text_encoders/minimax_music3_text_encoder_pruned_Q8_0.gguf"},
            "depth": {f"text_encoders/{TE}", "text_encoders/minimax_music3_text_encoder_pruned_Q8_0.gguf"},
            "cond": {"diffusion_models/minimax_music3_dit_fp32.safetensors"},
            "dit": {"diffusion_models/minimax_music3_dit_fp32.safetensors"},
            "vae": {"vae/minimax_music3_dav.safetensors"}}
    for node, kind in LOADERS.items():
        options = _options(comfy_foreign, node, "model_name")
        foreign = {o for o in options if "/" in o and not o.startswith("ours/")}
        assert foreign == want[kind], (node, options)
        assert any(o.startswith("ours/") for o in options)
        assert not any("t5_other" in o for o in options)


@needs_comfy
def test_comfyui_files_make_the_audio_of_our_files(comfy_foreign):
    """The shipped text-to-song workflow, its loader pointed at ComfyUI's files, then at our GGUFs of
    the same weights: the same WAV bytes."""
    ours = {f: next(o for o in _options(comfy_foreign, "MM3LoadModelSet", f)
                    if o.startswith("ours/") and f"mm3-{k}" in _arch(comfy_foreign, o)) for f, k in SET_FIELDS.items()}
    theirs = {"lm_model": f"text_encoders/{TE}", "depth_model": f"text_encoders/{TE}",
              "cond_model": "diffusion_models/minimax_music3_dit_fp32.safetensors",
              "dit_model": "diffusion_models/minimax_music3_dit_fp32.safetensors",
              "vae_model": "vae/minimax_music3_dav.safetensors"}
    out = []
    for names in (theirs, ours):
        wf = tiny_workflow(comfy_foreign, "text_to_song", fmt="wav32", **{"1": names})
        entry, _ = run(comfy_foreign, wf, timeout=300)
        out.append(comfy_foreign.view(audio_entries(entry, "8")[0]))
    assert out[0] == out[1]


def _arch(server, name: str) -> str:
    from mm3.formats.gguf import read_architecture

    return read_architecture(server.base / "models" / "mm3" / name)


@needs_comfy
def test_models_sidebar_counts_comfyui_files(comfy_foreign):
    inv = comfy_foreign.get("/mm3/inventory")
    lm = {f["name"] for f in inv["components"]["lm"]}
    assert TE in lm and "minimax_music3_text_encoder_pruned_Q8_0.gguf" in lm
    assert "minimax_music3_dav.safetensors" in {f["name"] for f in inv["components"]["vae"]}
    assert not any("other" in f["name"] for f in inv["unusable"]), inv["unusable"]  # other models are not ours
