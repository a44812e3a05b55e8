"""What the tests against a real ComfyUI share: the skip without one, the shipped API workflows
pointed at the tiny models, running a prompt to its end, and reading the audio files it wrote."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
API_DIR = ROOT / "workflows" / "api"
CAPTION = "Warm lo-fi hip hop, dusty drums, mellow Rhodes, vinyl crackle, 80 BPM"
LYRICS = "[verse]\nRain on the window, coffee in my hand\n[chorus]\nSlow it down ^ slow it down"
SET_KEYS = {"lm_model": "mm3-lm", "depth_model": "mm3-depth", "cond_model": "mm3-cond", "dit_model": "mm3-dit",
            "vae_model": "mm3-vae"}
LOADER_ARCH = {"MM3LoadLanguageModel": "mm3-lm", "MM3LoadDepthDecoder": "mm3-depth",
               "MM3LoadConditionEncoder": "mm3-cond", "MM3LoadDiT": "mm3-dit", "MM3LoadVocoder": "mm3-vae"}


OTHER_PACKS = {"Distributed": "ComfyUI-Distributed"}  # class-name prefix -> the node pack it comes from


def other_packs(name: str) -> set[str]:
    """The node packs besides this one and ComfyUI's own that the shipped workflow `name` needs."""
    wf = json.loads((API_DIR / f"{name}.json").read_text())
    return {pack for node in wf.values() for prefix, pack in OTHER_PACKS.items()
            if node["class_type"].startswith(prefix)}


# The shipped workflows that need nothing but this pack and ComfyUI (the others: tests/nodes/test_comfyui_distributed.py).
OWN_WORKFLOWS = sorted(p.stem for p in API_DIR.glob("*.json") if not other_packs(p.stem))


def import_pack(sub: str):
    """A module of the repository imported as a package, as ComfyUI imports it (the node layer
    imports the engine as `mm3`, the very modules the tests use)."""
    name = "mm3_pack_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.{sub}")


def needs_comfy(test):
    """Marks a test `comfyui` and skips it, saying why, without a ComfyUI checkout (COMFYUI_PATH)."""
    skip = pytest.mark.skipif(not COMFYUI_PATH, reason="COMFYUI_PATH is not set (a ComfyUI checkout to run)")
    return pytest.mark.comfyui(skip(test))


def tiny_workflow(server, name: str, *, duration=1.2, steps=3, fmt=None, named=False, **node_inputs) -> dict:
    """A shipped API workflow (its loaders on auto, so the tiny models) with a short duration and few
    steps; `named`: the loaders name the tiny files instead; `node_inputs` as {node_id: {input: value}}."""
    wf = json.loads((API_DIR / f"{name}.json").read_text())
    for node in wf.values():
        inputs, cls = node["inputs"], node["class_type"]
        if cls == "MM3LoadModelSet" and named:
            inputs.update({k: server.files[a] for k, a in SET_KEYS.items()})
        elif cls in LOADER_ARCH and named:
            inputs["model_name"] = server.files[LOADER_ARCH[cls]]
        if "duration" in inputs:  # a continuation goes on for as long again
            inputs["duration"] = 2 * duration if "prior_codes" in inputs else duration
        if "min_duration" in inputs:
            inputs["min_duration"] = min(inputs["min_duration"], duration / 2)
        if cls in ("MM3FlowSampler", "MM3Repaint") and not isinstance(inputs["steps"], list):
            inputs["steps"] = steps
        if cls == "MM3Repaint":  # the middle of the short song (where the range is not wired in)
            inputs.update({k: v for k, v in (("start", duration / 3), ("end", 2 * duration / 3))
                           if not isinstance(inputs[k], list)}, fade=0.04)
        if cls == "MM3SaveSong" and fmt:
            inputs["format"] = fmt
    for nid, values in node_inputs.items():
        wf[nid]["inputs"].update(values)
    return wf


def run(server, workflow, timeout=120) -> tuple[dict, list[dict]]:
    """Queue `workflow`, follow its WebSocket events to the end; (history entry, events)."""
    ws = server.ws()
    try:
        pid = server.queue(workflow)
        events = ws.events(pid, timeout=timeout)
    finally:
        ws.close()
    entry = server.wait(pid, timeout=30)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[:4000]
    return entry, events


def audio_entries(entry, node_id):
    return entry["outputs"][node_id]["audio"]


def read_wav(data: bytes) -> tuple[int, int, int, int]:
    """(channels, rate, bits, frames) of a RIFF WAV (PCM or IEEE float) from its header."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    _, channels, rate, _, block, bits = struct.unpack("<HHIIHH", data[20:36])
    size = struct.unpack("<I", data[40:44])[0]
    return channels, rate, bits, size // block
