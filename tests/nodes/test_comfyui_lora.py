"""MM3 Load LoRA in a real ComfyUI (COMFYUI_PATH): LoRA files from models/loras on the LM and the
DiT give the command line's audio with the same LoRAs, bit for bit; the plain DiT wired beside the
adapted one in the same graph still gives the plain audio; Save Song's replay JSON records the
LoRAs, which `render` reads back; a LoRA on the wrong model is refused by name."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from mm3.formats.gguf import GGUFFile
from mm3.synth.output import render
from mm3.song.pipeline import Pipeline
from mm3.song.request import MM3Request
from tests.helpers.comfyui import CAPTION, LYRICS, audio_entries, needs_comfy, run, tiny_workflow
from tests.helpers.lora_files import dit_modules, lm_modules, write_lora


def _shapes(path) -> dict:
    with GGUFFile(path, header_only=True) as g:
        return {name: torch.empty(shape, device="meta") for name, shape, _ in g.tensor_infos()}


def _loras(comfy) -> dict:
    """A kohya LoRA of the LM and a ComfyUI-named one of the DiT, written into models/loras once."""
    folder = comfy.base / "models" / "loras"
    if not (folder / "dit_style.safetensors").exists():
        folder.mkdir(parents=True, exist_ok=True)
        models = comfy.base / "models" / "mm3"
        lm = _shapes(models / comfy.files["mm3-lm"])
        dit = _shapes(models / comfy.files["mm3-dit"])
        write_lora(folder / "lm_style.safetensors", lm, lm_modules(lm), "kohya", "lm", seed=1)
        write_lora(folder / "dit_style.safetensors", dit, dit_modules(dit), "diffusers", "dit", seed=2)
        sdxl = "lora_unet_down_blocks_0_attentions_0_proj_in"  # another model's LoRA: not listed
        save_file({f"{sdxl}.lora_down.weight": torch.zeros(2, 8), f"{sdxl}.lora_up.weight": torch.zeros(8, 2)},
                  str(folder / "sdxl_style.safetensors"))
    return {"lm": "lm_style.safetensors", "dit": "dit_style.safetensors", "folder": folder}


def _graph(comfy, loras, *, plain_branch: bool):
    """text_to_song with the LM through one MM3 Load LoRA and the DiT through another (its q/k at 0.5);
    `plain_branch`: a second sampler, decoder and Save Song from the loader's own DiT."""
    wf = tiny_workflow(comfy, "text_to_song", fmt="wav32", **{"2": {"caption": CAPTION, "lyrics": LYRICS},
                                                              "3": {"lm_seed": 5}, "5": {"seed": 3}})
    wf["20"] = {"class_type": "MM3LoadLoRA", "inputs": {"model": ["1", 0], "lora_name": loras["lm"], "strength": 0.8,
                                                        "attn_qk": 1.0, "attn_vo": 1.0, "mlp": 1.0}}
    wf["21"] = {"class_type": "MM3LoadLoRA", "inputs": {"model": ["1", 3], "lora_name": loras["dit"], "strength": 1.0,
                                                        "attn_qk": 0.5, "attn_vo": 1.0, "mlp": 1.0}}
    wf["2"]["inputs"]["lm"] = wf["3"]["inputs"]["lm"] = ["20", 0]
    wf["5"]["inputs"]["dit"] = ["21", 0]
    if plain_branch:
        wf["30"] = {**wf["5"], "inputs": {**wf["5"]["inputs"], "dit": ["1", 3]}}
        wf["31"] = {**wf["6"], "inputs": {**wf["6"]["inputs"], "latents": ["30", 0]}}
        wf["32"] = {**wf["7"], "inputs": {"windows": ["31", 0]}}
        wf["33"] = {**wf["8"], "inputs": {**wf["8"]["inputs"], "audio": ["32", 0], "filename_prefix": "mm3/plain"}}
    return wf


def _request(loras, *, dit: bool = True) -> MM3Request:
    folder = loras["folder"]
    entries = [{"file": str(folder / loras["lm"]), "strength": 0.8}]
    if dit:
        entries.append({"file": str(folder / loras["dit"]), "groups": {"attn_qk": 0.5}})
    return MM3Request(caption=CAPTION, lyrics=LYRICS, duration=1.2, steps=3, lm_seed=5, seed=3,
                      output_format="wav32", loras=entries)


@needs_comfy
def test_lora_nodes_give_the_command_lines_audio_and_leave_the_plain_model_plain(comfy, tmp_path):
    loras = _loras(comfy)
    info = comfy.get("/object_info")["MM3LoadLoRA"]
    assert info["input_order"]["required"] == ["model", "lora_name", "strength", "attn_qk", "attn_vo", "mlp"]
    listed = set(info["input"]["required"]["lora_name"][1]["options"])
    assert {loras["lm"], loras["dit"]} <= listed and "sdxl_style.safetensors" not in listed

    entry, _ = run(comfy, _graph(comfy, loras, plain_branch=True))
    pipe = Pipeline(str(comfy.base / "models" / "mm3"))
    (adapted,) = pipe.run(_request(loras))
    (plain,) = pipe.run(_request(loras, dit=False))  # the LM's LoRA only: the plain DiT's audio
    assert not torch.equal(adapted.audio, plain.audio)
    for node, track in (("8", adapted), ("33", plain)):
        (f,) = audio_entries(entry, node)
        assert comfy.view(f) == render(track.audio, "wav32"), node
    (f,) = audio_entries(entry, "8")
    replay = json.loads(comfy.view({**f, "filename": f["filename"][:-4] + ".json"}))
    assert [(e["file"], e["component"], e["strength"], e["groups"]["attn_qk"]) for e in replay["loras"]] == [
        (loras["lm"], "lm", 0.8, 1.0), (loras["dit"], "dit", 1.0, 0.5)]
    assert [e["fingerprint"] for e in replay["loras"]] == [e["fingerprint"] for e in adapted.request.loras]
    text = "\n".join(entry["outputs"]["21"]["text"])
    assert "attn_qk" in text and "mlp" in text

    # The replay JSON renders the same audio on the command line (LoRAs found in the loras folder).
    path = tmp_path / "song.json"
    path.write_text(json.dumps(replay))
    pipe.lora_folders.append(str(loras["folder"]))
    request, warnings = pipe.match_models(MM3Request.from_json(path.read_text()), loras_recorded=True)
    assert warnings == []
    (again,) = pipe.run(request)
    assert torch.equal(again.audio, adapted.audio)


@needs_comfy
def test_a_lora_on_the_wrong_model_is_refused_by_name(comfy):
    loras = _loras(comfy)
    wf = _graph(comfy, loras, plain_branch=False)
    wf["21"]["inputs"]["lora_name"] = loras["lm"]
    pid = comfy.queue(wf)
    entry = comfy.wait(pid, timeout=120)
    assert entry["status"]["status_str"] == "error"
    message = json.dumps(entry["status"])
    assert "lm_style.safetensors changes the LM" in message and "not after the DiT" in message
