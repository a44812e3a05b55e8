"""The ComfyUI node layer in a real ComfyUI (the node logic alone: tests/nodes/test_node_logic.py; the
editor side: tests/nodes/test_editor.py).

It starts a real ComfyUI (COMFYUI_PATH, interpreter COMFYUI_PYTHON) once for the module, with
this pack linked into its custom_nodes and tiny GGUFs in models/mm3, and drives it over HTTP and
WebSocket: node definitions, the shipped workflows, caching, interrupt, and the memory policy.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import wave
from pathlib import Path

import pytest

from mm3.song.pipeline import Pipeline
from mm3.song.request import MM3Request
from tests.helpers.comfy_server import cached_nodes, executed_nodes
from tests.helpers.comfy_workflows import api_from_ui, schema_problems
from tests.helpers.comfyui import (
    API_DIR, CAPTION, COMFYUI_PATH, LOADER_ARCH, LYRICS, OWN_WORKFLOWS, SET_KEYS, audio_entries, needs_comfy,
    other_packs, read_wav, run, tiny_workflow)

ROOT = Path(__file__).resolve().parents[2]


LOADER_INPUTS = ["model_name", "keep_loaded"]
NODE_INPUTS = {  # node id -> its inputs in order
    "MM3LoadLanguageModel": LOADER_INPUTS, "MM3LoadDepthDecoder": LOADER_INPUTS,
    "MM3LoadConditionEncoder": LOADER_INPUTS, "MM3LoadDiT": LOADER_INPUTS, "MM3LoadVocoder": LOADER_INPUTS,
    "MM3LoadModelSet": ["lm_model", "depth_model", "cond_model", "dit_model", "vae_model", "keep_loaded"],
    "MM3PromptAssemble": ["lm", "caption", "lyrics"],
    "MM3ARPlan": ["lm", "depth", "prompt", "duration", "lm_seed", "lm_cfg", "songs"],
    "MM3SamplingOptions": ["lm_top_k", "lm_temperature", "lm_top_p", "lm_penalty", "lm_penalty_strength",
                           "lm_penalty_window", "lm_dry_min_match", "ending_rounds"],
    "MM3ConditionEncode": ["cond", "codes"],
    "MM3FlowSampler": ["dit", "condition", "seed", "steps", "dit_cfg", "variations"],
    "MM3VocoderDecode": ["vae", "latents"], "MM3Stitch": ["windows"],
    "MM3Repaint": ["dit", "condition", "source", "start", "end", "fade", "seed", "steps", "dit_cfg", "variations"],
    "MM3VocoderEncode": ["vae", "audio", "condition"],
    "MM3SaveAudioCodes": ["codes", "filename_prefix"],
    "MM3LoadAudioCodes": ["lm", "depth", "codes_file", "model_check"],
    "MM3SaveSong": ["audio", "filename_prefix", "format", "mp3_bitrate", "peak_clip"],
    "MM3LyricTimestamps": ["lm", "depth", "codes", "lead"],
    "MM3ChangeLine": ["lm", "depth", "codes", "line", "words", "lm_seed"],
}
NODE_IDS = set(NODE_INPUTS)
def read_mp3_header(data: bytes) -> tuple[int, int, str]:
    """(rate, kbps, channel mode) of the first MPEG-1 Layer III frame (after an ID3v2 tag if any)."""
    i = 10 + int.from_bytes(bytes(b & 0x7F for b in data[6:10]), "big") if data[:3] == b"ID3" else 0
    while not (data[i] == 0xFF and data[i + 1] & 0xFE == 0xFA):  # sync, MPEG-1, Layer III
        i += 1
    h = int.from_bytes(data[i:i + 4], "big")
    kbps = [0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320][(h >> 12) & 0xF]
    rate = [44100, 48000, 32000][(h >> 10) & 0x3]
    return rate, kbps, ["stereo", "joint stereo", "dual channel", "mono"][(h >> 6) & 0x3].replace("joint ", "")


def read_flac(data: bytes) -> tuple[int, int, int]:
    """(channels, rate, frames) from a FLAC stream's STREAMINFO block."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # first metadata block is STREAMINFO
    info = int.from_bytes(data[8 + 10:8 + 18], "big")  # rate 20 bits, channels-1 3, bps-1 5, samples 36
    return ((info >> 41) & 0x7) + 1, info >> 44, info & ((1 << 36) - 1)


@needs_comfy
def test_object_info_lists_every_node(comfy):
    info = comfy.get("/object_info")
    assert NODE_IDS <= set(info)
    for node, inputs in NODE_INPUTS.items():
        assert info[node]["input_order"]["required"] == inputs, node
    categories = {info[n]["category"] for n in NODE_IDS}
    assert categories == {"MiniMax Music 3 (GGUF)"}
    plan = info["MM3ARPlan"]["input"]["required"]
    assert [plan[k][0] for k in ("lm", "depth", "prompt")] == ["MM3_LM", "MM3_DEPTH", "MM3_PROMPT"]
    assert plan["lm_seed"][1]["control_after_generate"]
    assert info["MM3ARPlan"]["input_order"]["optional"] == ["takes", "require_ending", "min_duration", "options",
                                                            "prior_codes"]
    assert info["MM3ARPlan"]["input"]["optional"]["options"][0] == info["MM3SamplingOptions"]["output"][0]
    assert info["MM3ARPlan"]["output"] == ["AUDIO_CODES"] and info["MM3ARPlan"]["output_is_list"] == [True]
    assert info["MM3FlowSampler"]["input"]["required"]["seed"][1]["control_after_generate"]
    assert info["MM3SaveSong"]["output_node"] and info["MM3LoadAudioCodes"]["output"] == [
        "AUDIO_CODES", "INT", "INT", "FLOAT"]
    assert info["MM3Stitch"]["output"] == ["AUDIO"]
    assert info["MM3LoadModelSet"]["output"] == ["MM3_LM", "MM3_DEPTH", "MM3_COND", "MM3_DIT", "MM3_VAE"]
    # Each loader lists only the files of its component (classified by general.architecture).
    for node, arch in LOADER_ARCH.items():  # "auto" first: the most precise file that fits the device
        assert info[node]["input"]["required"]["model_name"][1]["options"] == ["auto", comfy.files[arch]]
    for key, arch in SET_KEYS.items():
        assert info["MM3LoadModelSet"]["input"]["required"][key][1]["options"] == ["auto", comfy.files[arch]]
    assert f"/extensions/{'ComfyUI-MM3-GGUF'}/mm3.js" in comfy.get("/extensions")


WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


@needs_comfy
def test_every_widget_says_what_it_changes(comfy):
    """Every widget of every MM3 node has a tooltip (hover text) of a sentence at least, and the
    caption and lyrics boxes say what goes in them while empty."""
    info = comfy.get("/object_info")
    bare = []
    for node, spec in info.items():
        if not node.startswith("MM3"):
            continue
        for cat in ("required", "optional"):
            for name, (typ, *rest) in spec["input"].get(cat, {}).items():
                opts = rest[0] if rest else {}
                widget = (isinstance(typ, list) or typ in WIDGET_TYPES) and not opts.get("forceInput")
                if widget and len(opts.get("tooltip") or "") < 20:
                    bare.append(f"{node}.{name}")
    assert not bare, bare
    assert NODE_IDS <= set(info)
    prompt = info["MM3PromptAssemble"]["input"]["required"]
    assert prompt["caption"][1]["placeholder"].startswith("Caption:"), prompt["caption"]
    assert prompt["lyrics"][1]["placeholder"].startswith("Lyrics:"), prompt["lyrics"]


@needs_comfy
def test_sampling_options_and_old_prompts_that_set_them_on_ar_plan(comfy):
    """MM3 Sampling Options changes the song; at its defaults it gives the song AR Plan gives without
    it; an old API prompt that sets the knobs on AR Plan itself gives the song the options node does."""
    info = comfy.get("/object_info")["MM3SamplingOptions"]["input"]["required"]
    defaults = {k: spec[1]["default"] for k, spec in info.items()}
    knobs = {"lm_top_k": 3, "lm_temperature": 1.6, "lm_penalty": "dry", "lm_penalty_strength": 1.15}

    def song(wf) -> list[bytes]:
        entry, _ = run(comfy, wf)
        return [comfy.view(f) for f in audio_entries(entry, "8")]

    def with_options(values: dict) -> dict:
        wf = tiny_workflow(comfy, "text_to_song", fmt="wav32", **{"3": {"lm_seed": 77}})
        wf["20"] = {"class_type": "MM3SamplingOptions", "inputs": {**defaults, **values}}
        wf["3"]["inputs"]["options"] = ["20", 0]
        return wf

    plain = song(tiny_workflow(comfy, "text_to_song", fmt="wav32", **{"3": {"lm_seed": 77}}))
    assert song(with_options({})) == plain
    tuned = song(with_options(knobs))
    assert tuned != plain
    old = tiny_workflow(comfy, "text_to_song", fmt="wav32", **{"3": {"lm_seed": 77, **defaults, **knobs}})
    assert song(old) == tuned


@needs_comfy
def test_ui_workflows_convert_to_the_api_ones(comfy):
    """The editor-format workflows (listed in the template browser) queue exactly the API files."""
    info = comfy.get("/object_info")
    names = sorted(p.stem for p in API_DIR.glob("*.json"))
    assert sorted(comfy.get("/workflow_templates")["ComfyUI-MM3-GGUF"]) == names
    # The workflows for ComfyUI-Distributed convert where its nodes are known (tests/nodes/test_comfyui_distributed.py).
    assert {n: other_packs(n) for n in names if n not in OWN_WORKFLOWS} == {
        "songs_across_workers": {"ComfyUI-Distributed"}, "variations_across_workers": {"ComfyUI-Distributed"}}
    for name in OWN_WORKFLOWS:
        ui = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
        assert schema_problems(ui) == [], name
        api = json.loads((API_DIR / f"{name}.json").read_text())
        assert api_from_ui(ui, info) == {k: {"class_type": v["class_type"], "inputs": v["inputs"]}
                                         for k, v in api.items()}, name


@needs_comfy
def test_text_to_song_equals_the_command_line(comfy):
    """text_to_song with 2 songs x 2 variations (a list of plans) gives the pipeline's four tracks,
    float WAV bit for bit; each file gets its replay request beside it."""
    from mm3.synth.output import render

    wf = tiny_workflow(comfy, "text_to_song", fmt="wav32", **{"2": {"caption": CAPTION, "lyrics": LYRICS},
                                                              "3": {"lm_seed": 21, "songs": 2},
                                                              "5": {"seed": 9, "variations": 2}})
    entry, events = run(comfy, wf)
    files = audio_entries(entry, "8")
    assert len(files) == 4
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=1.2, lm_seed=21, seed=9, steps=3, lm_batch_size=2,
                         synth_batch_size=2, output_format="wav32")
    tracks = Pipeline(str(comfy.base / "models" / "mm3")).run(request)
    for f, track in zip(files, tracks):
        data = comfy.view(f)
        assert read_wav(data)[:3] == (2, 44100, 32)
        assert data == render(track.audio, "wav32")
        replay = json.loads(comfy.view({**f, "filename": f["filename"][:-4] + ".json"}))
        assert replay["audio_codes"] == track.request.audio_codes and replay["seed"] == track.request.seed
        for key, arch in SET_KEYS.items():  # the loaders said auto; the file used is what is recorded
            assert replay[key] == comfy.files[arch] and replay["model_fingerprints"][key], key
    progress = [e["data"] for e in events if e["type"] == "progress"]
    ar = [p for p in progress if p["node"] == "3"]
    assert len(ar) >= int(1.2 * 25) and ar[-1]["value"] == ar[-1]["max"]  # per frame, then the replay
    assert [p["max"] for p in progress if p["node"] == "5"][-1] == 2 * 3  # per DiT step: 2 variations x 3 steps


@needs_comfy
def test_variations_workflow_through_api_example(comfy, tmp_path):
    """workflows/api_example.py runs variations_from_one_plan: 3 stereo 44.1 kHz WAVs + their FLACs
    from ComfyUI's own Save Audio, and the plan's codes file."""
    wf = tiny_workflow(comfy, "variations_from_one_plan")
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(wf))
    out = subprocess.run([sys.executable, str(ROOT / "workflows" / "api_example.py"), "--server", comfy.url,
                          "--workflow", str(path), "--out", str(tmp_path / "out"), "--lm-seed", "3", "--seed", "40",
                          "--caption", "Dreamy synth-pop, female vocal, 100 BPM",  # none of the format's headings
                          "--timeout", "120"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr + comfy.log_tail()
    assert "warning: node 6 (MM3PromptAssemble): the caption has none of the headings" in out.stderr, out.stderr
    wavs = sorted((tmp_path / "out").glob("*.wav"))
    flacs = sorted((tmp_path / "out").glob("*.flac"))
    jsons = sorted((tmp_path / "out").glob("*.json"))
    codes = [p for p in jsons if p.stem.startswith("plan")]  # Save Audio Codes' file, fetched too
    songs = [p for p in jsons if p not in codes]
    assert len(wavs) == len(flacs) == 3 and len(songs) == 3 and len(codes) == 1
    assert json.loads(codes[0].read_text())["audio_codes"] == json.loads(songs[0].read_text())["audio_codes"]
    expected = int(1.2 * 25) * 44100 // 25  # frames x samples per frame (hop 512 per latent)
    for w, f in zip(wavs, flacs):
        channels, rate, bits, frames = read_wav(w.read_bytes())
        assert (channels, rate, bits) == (2, 44100, 16) and abs(frames - expected) < 0.02 * expected
        assert read_flac(f.read_bytes()) == (2, 44100, frames)
    assert [json.loads(p.read_text())["seed"] for p in songs] == [40, 41, 42]
    # A refused workflow is said in words: which node, which input, what is wrong.
    out = subprocess.run([sys.executable, str(ROOT / "workflows" / "api_example.py"), "--server", comfy.url,
                          "--workflow", str(path), "--duration", "0", "--timeout", "60"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "(MM3ARPlan): " in out.stderr and "duration" in out.stderr, out.stderr
    assert "{" not in out.stderr, out.stderr  # no raw JSON dump


@needs_comfy
def test_vocoder_encode_of_a_recording_feeds_repaint(comfy):
    """A recording through ComfyUI's Load Audio and MM3 Vocoder Encode is the kept part of a repaint
    (the vocoder file carries its encoder; the node builds it)."""
    import numpy as np

    t = np.arange(int(1.2 * 44100)) / 44100
    x = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)])
    with wave.open(str(comfy.base / "input" / "mm3_recording.wav"), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(44100)
        w.writeframes(np.round(x.T * 32767).astype("<i2").tobytes())
    wf = tiny_workflow(comfy, "repaint_range", fmt="wav16", **{"12": {"filename_prefix": "mm3/from_recording"}})
    wf["20"] = {"class_type": "LoadAudio", "inputs": {"audio": "mm3_recording.wav"}}
    wf["21"] = {"class_type": "MM3VocoderEncode",
                "inputs": {"vae": ["1", 4], "audio": ["20", 0], "condition": ["4", 0]}}
    wf["9"]["inputs"]["source"] = ["21", 0]
    entry, events = run(comfy, wf)
    assert "21" in executed_nodes(events)
    out = audio_entries(entry, "12")[0]
    data = (comfy.base / "output" / out["subfolder"] / out["filename"]).read_bytes()
    assert read_wav(data)[:3] == (2, 44100, 16)


@needs_comfy
def test_rerender_from_codes_reproduces_the_song(comfy):
    """Save Song's replay JSON, rendered by rerender_from_codes (seed, steps, cfg wired from the
    file), gives the same samples."""
    first, _ = run(comfy, tiny_workflow(comfy, "text_to_song", fmt="wav24", **{"3": {"lm_seed": 77},
                                                                              "8": {"filename_prefix": "mm3/rr_src"}}))
    src = audio_entries(first, "8")[0]
    codes_file = f"{src['subfolder']}/{src['filename'][:-4]}.json [output]"
    assert codes_file in comfy.get("/object_info/MM3LoadAudioCodes")["MM3LoadAudioCodes"]["input"]["required"][
        "codes_file"][1]["options"]
    again, _ = run(comfy, tiny_workflow(comfy, "rerender_from_codes", **{"2": {"codes_file": codes_file}}))
    out = audio_entries(again, "7")[0]
    a, b = comfy.view(src), comfy.view(out)
    assert read_wav(b)[:3] == (2, 44100, 24)
    assert a == b


@needs_comfy
def test_saved_codes_rerender_like_the_original_run(comfy):
    """A plan kept by Save Audio Codes (variations_from_one_plan), loaded by Load Audio Codes and
    rendered with the same DiT settings, gives the original run's first variation byte for byte;
    the codes file names the LM and depth files with their fingerprints and the RNG mode."""
    from mm3.formats.fingerprint import file_fingerprint

    first, _ = run(comfy, tiny_workflow(comfy, "variations_from_one_plan", **{
        "7": {"lm_seed": 606}, "8": {"filename_prefix": "mm3/keep_plan"}, "10": {"seed": 31},
        "13": {"filename_prefix": "mm3/keep_var", "format": "wav24"}}))
    codes = sorted((comfy.base / "output" / "mm3").glob("keep_plan_*.json"))[-1]
    saved = json.loads(codes.read_text())
    models = comfy.base / "models" / "mm3"
    assert saved["rng"] == "independent" and saved["lm_model"] == comfy.files["mm3-lm"]
    assert saved["model_fingerprints"] == {"lm_model": file_fingerprint(models / comfy.files["mm3-lm"]),
                                           "depth_model": file_fingerprint(models / comfy.files["mm3-depth"])}
    again, _ = run(comfy, tiny_workflow(comfy, "rerender_from_codes", **{
        "2": {"codes_file": f"mm3/{codes.name} [output]"}, "4": {"seed": 31, "steps": 3}, "7": {"format": "wav24"}}))
    original = audio_entries(first, "13")[0]
    assert comfy.view(audio_entries(again, "7")[0]) == comfy.view(original)
    replay = json.loads(comfy.view({**original, "filename": original["filename"][:-4] + ".json"}))
    assert set(replay["model_fingerprints"]) == set(SET_KEYS)


@needs_comfy
def test_rerender_with_another_file_warns_or_refuses(comfy):
    """Load Audio Codes' model_check: a DiT other than the one that made the song is a warning on
    the sampler (the run completes), or with "refuse" an error that names both files."""
    import shutil

    first, _ = run(comfy, tiny_workflow(comfy, "text_to_song", fmt="wav16", **{
        "3": {"lm_seed": 8080}, "8": {"filename_prefix": "mm3/mc_src"}}))
    src = audio_entries(first, "8")[0]
    codes_file = f"{src['subfolder']}/{src['filename'][:-4]}.json [output]"
    models = comfy.base / "models" / "mm3"
    other = models / "zz-other-transformer.gguf"
    shutil.copy(models / comfy.files["mm3-dit"], other)
    with open(other, "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x3f")
    try:
        wf = tiny_workflow(comfy, "rerender_from_codes", **{"2": {"codes_file": codes_file}})
        wf["1"]["inputs"]["dit_model"] = other.name
        entry, events = run(comfy, wf)
        texts = [e["data"].get("text", "") for e in events if e["type"] == "progress_text"]
        assert any("dit_model: zz-other-transformer.gguf" in t and "is not the file that made this song" in t
                   for t in texts), texts
        wf["2"]["inputs"]["model_check"] = "refuse"
        ws = comfy.ws()
        try:
            pid = comfy.queue(wf)
            events = ws.events(pid, timeout=120)
        finally:
            ws.close()
        error = [e for e in events if e["type"] == "execution_error"]
        assert error and error[0]["data"]["node_id"] == "4", events[-3:]
        assert "zz-other-transformer.gguf" in error[0]["data"]["exception_message"]
        assert "refused" in error[0]["data"]["exception_message"]
    finally:
        other.unlink()


@needs_comfy
def test_changing_the_dit_seed_reruns_only_synthesis(comfy):
    wf = tiny_workflow(comfy, "text_to_song", **{"3": {"lm_seed": 5150}})
    run(comfy, wf)
    wf2 = copy.deepcopy(wf)
    wf2["5"]["inputs"]["seed"] += 1
    entry, events = run(comfy, wf2)
    assert set(executed_nodes(events)) == {"5", "6", "7", "8"}
    assert {"1", "2", "3", "4"} <= set(cached_nodes(events))
    mp3 = comfy.view(audio_entries(entry, "8")[0])  # the workflow's own format: MP3, 192 kbps
    assert read_mp3_header(mp3) == (44100, 192, "stereo")


@needs_comfy
def test_interrupt_during_the_plan_then_run_again(comfy):
    wf = tiny_workflow(comfy, "text_to_song", duration=300.0, **{"3": {"lm_seed": 999}})
    ws = comfy.ws()
    try:
        pid = comfy.queue(wf)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the AR plan is under way
            msg = ws.recv(timeout=60)
            if isinstance(msg, dict) and msg["type"] == "progress" and msg["data"]["node"] == "3" \
                    and msg["data"]["value"] >= 5:
                break
        started = time.monotonic()
        comfy.post("/interrupt", {})
        events = ws.events(pid, timeout=60)
    finally:
        ws.close()
    assert events[-1]["type"] == "execution_interrupted" and events[-1]["data"]["node_id"] == "3"
    assert time.monotonic() - started < 10
    entry = comfy.wait(pid)
    assert "3" not in entry["outputs"]
    run(comfy, tiny_workflow(comfy, "text_to_song", **{"3": {"lm_seed": 1000}}))


@needs_comfy
def test_ar_group_leaves_before_synthesis(comfy):
    """Strict: after the sampler ran, neither the LM nor the depth decoder is resident; with
    keep_loaded on the loader both groups stay."""
    run(comfy, tiny_workflow(comfy, "text_to_song", **{"3": {"lm_seed": 4242}}))
    kinds = {m["kind"] for m in comfy.get("/mm3/resident")["resident"]}
    assert kinds == {"cond", "dit", "vae"}, kinds
    assert all(m["loaded_bytes"] == m["size_bytes"] > 0 for m in comfy.get("/mm3/resident")["resident"])
    run(comfy, tiny_workflow(comfy, "text_to_song", **{"1": {"keep_loaded": True}, "3": {"lm_seed": 4243}}))
    resident = comfy.get("/mm3/resident")["resident"]
    assert {m["kind"] for m in resident if m["keep_loaded"]} == {"lm", "depth", "cond", "dit", "vae"}
    assert not any(m["streaming"] for m in resident)
    assert all(m["pinned"] == 0 for m in resident)  # no pinned host memory is left behind


@needs_comfy
def test_low_vram_loading_in_comfyui_classes(comfy):
    """ComfyUI rejects --lowvram / --novram with --cpu, so on a machine without a GPU the test makes
    the calls those modes make (LoadedModel.model_load with a byte budget, partial then full
    unload) on the `meta` device: ComfyUI's own code leaves part of the LM on the CPU, every op
    runs on one device, an AR frame runs through the same frame step as the command line's, and the
    file-backed CPU tensors are back afterwards."""
    check = ROOT / "tests" / "helpers" / "comfy_lowvram_check.py"
    out = subprocess.run([os.environ.get("COMFYUI_PYTHON", sys.executable), str(check), COMFYUI_PATH,
                          str(comfy.base / "models" / "mm3")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    for mode in ("lowvram", "novram"):
        r = found[mode]
        assert r["lowvram"] and 0 <= r["loaded_bytes"] < r["size"], (mode, r)
        assert r["resident_tensors"] < r["tensors"], (mode, r)
        assert r["device"] == r["hidden"] == r["logits"] == "meta", (mode, r)
        assert r["restored"] and r["final_device"] == "cpu", (mode, r)
    assert found["novram"]["loaded_bytes"] < found["lowvram"]["loaded_bytes"]
    assert not found["lowvram"]["after_partial_unload"]["unloaded"]  # freed a layer, stayed usable
    assert found["lowvram"]["frame_step"]["calls"] == 1 and found["lowvram"]["frame_step"]["codes"] == "meta"
    assert found["pipeline_frame_steps"] > 0  # one decode path: the same function in both


@needs_comfy
def test_inventory_token_count_and_download_routes(tiny):
    """The routes behind the editor's model sidebar and token count: the inventory of models/mm3,
    a token count with the LM "auto" resolves to, and a published set fetched from a (local) hub
    into models/mm3 (the hub serves the tiny model's files: the inventory lists them under the
    published names, and, not being the published sizes, they complete no set)."""
    import urllib.error

    from mm3.formats.published import SETS, published_name
    from tests.helpers.comfy_server import ComfyServer
    from tests.helpers.fake_hub import FakeHub

    arch = {"language_model": "mm3-lm", "rvq_depth_decoder": "mm3-depth", "condition_encoder": "mm3-cond",
            "transformer": "mm3-dit", "vocoder": "mm3-vae"}
    hub = FakeHub({published_name(c, t): tiny.file(arch[c]).read_bytes() for c, t in SETS["light"].items()})
    server = ComfyServer(COMFYUI_PATH, os.environ.get("COMFYUI_PYTHON"), env={"HF_ENDPOINT": hub.endpoint})
    try:
        server.start()
        inv = server.get("/mm3/inventory")
        assert inv["missing_kinds"] == [] and "light" not in inv["complete_sets"]
        states = {f["kind"]: f["state"] for f in inv["sets"]["light"]}
        assert set(states.values()) == {"missing"}, states  # the tiny model's files have names of their own
        got = server.post("/mm3/tokens", {"lm_model": "auto", "caption": "dark synth", "lyrics": "[verse]\nla"})
        assert got["tokens"] > 5 and got["limit"] == 5000 and not got["over"] and got["lm_model"].endswith(".gguf")
        with pytest.raises(urllib.error.HTTPError) as e:
            server.post("/mm3/tokens", {"lm_model": "nope.gguf", "caption": "a", "lyrics": "b"})
        assert e.value.code == 400 and "nope.gguf" in e.value.read().decode()
        assert server.post("/mm3/download", {"set": "light"})["state"] == "running"
        deadline = time.monotonic() + 60
        while (status := server.get("/mm3/download"))["state"] == "running":
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["state"] == "done", status
        folder = server.base / "models" / "mm3"
        assert all((folder / n).read_bytes() == data for n, data in hub.files.items())
        inv = server.get("/mm3/inventory")
        assert "light" not in inv["complete_sets"], inv
        assert {f["state"] for f in inv["sets"]["light"]} == {"unusable"}, inv["sets"]["light"]
        assert all("the published file" in f["problem"] for f in inv["sets"]["light"]), inv["sets"]["light"]
    finally:
        server.stop()
        hub.close()




LOADER_FILES_SCRIPT = r"""
import importlib, importlib.util, json, logging, sys
import torch
sys.path.insert(0, sys.argv[2])
import comfy.cli_args
comfy.cli_args.args.cpu = not torch.cuda.is_available()  # model_management needs a device at import
import folder_paths
models = sys.argv[3]
folder_paths.models_dir = models
for key in ("text_encoders", "diffusion_models", "vae"):  # none of ComfyUI's own folders' files
    folder_paths.folder_names_and_paths[key] = ([models + "/" + key], {".gguf", ".safetensors"})
spec = importlib.util.spec_from_file_location("pack", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pack = importlib.util.module_from_spec(spec); sys.modules["pack"] = pack; spec.loader.exec_module(pack)
cm = importlib.import_module("pack.nodes.comfy_models")
loaders = importlib.import_module("pack.nodes.node_loaders")
cm.register_model_folder()
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("mm3").addHandler(Keep(logging.WARNING))
from mm3.files.inventory import scan
dit_loader = next(c for c in loaders.NODES if c.__name__ == "MM3LoadDiT")
options = dit_loader.define_schema().inputs[0].options
handles = [dit_loader.execute("auto").args[0].name, loaders.MM3LoadModelSet.execute().args[3].name]
print(json.dumps({"files": cm.files_of("dit"), "options": options, "handles": handles, "warnings": warnings,
                  "sidebar": [f.name for f in scan(models + "/mm3").components["dit"]],
                  "unusable": [f.name for f in scan(models + "/mm3").unusable]}))
"""


@needs_comfy
def test_loader_lists_and_auto_skip_an_unusable_file(tiny, tmp_path):
    """In ComfyUI's interpreter, with a truncated DiT under a published name beside the good one in
    models/mm3: the DiT loader's list offers the good file only (as the sidebar's inventory lists
    it; the bad one is among its unusable files), and "auto" loads the good one, warning once."""
    from tests.helpers.gguf_util import models_with_truncated_dit

    mm3_dir = tmp_path / "mm3"
    good, bad = models_with_truncated_dit(tiny, mm3_dir)
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    out = subprocess.run([python, "-c", LOADER_FILES_SCRIPT, str(ROOT), COMFYUI_PATH, str(tmp_path)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["files"] == got["sidebar"] == [good], got
    assert got["options"] == ["auto", good] and got["unusable"] == [bad.name], got
    assert got["handles"] == [good, good], got
    assert len(got["warnings"]) == 1 and bad.name in got["warnings"][0] and "truncated" in got["warnings"][0], got


SPARE_BYTES_SCRIPT = r"""
import importlib, importlib.util, json, sys, types
import torch
sys.path.insert(0, sys.argv[2])
import comfy.cli_args
comfy.cli_args.args.cpu = not torch.cuda.is_available()
import comfy.model_management as mm
spec = importlib.util.spec_from_file_location("pack", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pack = importlib.util.module_from_spec(spec); sys.modules["pack"] = pack; spec.loader.exec_module(pack)
cm = importlib.import_module("pack.nodes.comfy_models")
GiB = 1 << 30
mm.get_free_memory = lambda dev=None, torch_free_too=False: 1 * GiB  # what is free without evicting
cm.patcher = lambda handle: handle
gpu = torch.device("cuda", 0)
model = types.SimpleNamespace(model_lowvram=False)
counting = types.SimpleNamespace(load_device=gpu, model=model, get_free_memory=lambda device: 9 * GiB)
older = types.SimpleNamespace(load_device=gpu, model=model)  # ComfyUI 0.8.0's patcher: no get_free_memory
reserve = mm.minimum_inference_memory()
print(json.dumps({"counting": cm.spare_bytes([counting], GiB), "older": cm.spare_bytes([older]), "reserve": reserve}))
"""


@needs_comfy
def test_spare_bytes_counts_what_comfyui_would_free_for_the_model(tmp_path):
    """The memory the engine may fill with weight copies: where the model's patcher counts free
    memory itself (current ComfyUI: what idle models hold, which it evicts on demand, counts as
    free), that count; on ComfyUI 0.8.0, whose patcher lacks it, the global free memory."""
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    out = subprocess.run([python, "-c", SPARE_BYTES_SCRIPT, str(ROOT), COMFYUI_PATH], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 1 << 30
    assert got["counting"] == max(0, int(9 * gib - got["reserve"] - gib)), got
    assert got["older"] == max(0, int(gib - got["reserve"])), got
