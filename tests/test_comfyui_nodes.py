"""The ComfyUI node layer.

Part 1 needs no ComfyUI: the node logic (`nodes/logic.py`) chained as the nodes chain it gives the
same audio as `mm3.pipeline.Pipeline.run` (itself checked against diffusers), and Save Song's files
read back right.

Part 2 starts a real ComfyUI (COMFYUI_PATH, interpreter COMFYUI_PYTHON) once for the module, with
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
import torch

from mm3.ar import PlanSettings
from mm3.codes import AudioCodes
from mm3.gguf.errors import ComponentError
from mm3.pipeline import Pipeline
from mm3.request import MM3Request
from tests.helpers.comfy_server import cached_nodes, executed_nodes
from tests.helpers.comfy_workflows import api_from_ui, schema_problems
from tests.helpers.comfyui import (API_DIR, CAPTION, COMFYUI_PATH, LOADER_ARCH, LYRICS, SET_KEYS, audio_entries,
                                   import_pack, needs_comfy, read_wav, run, tiny_workflow)

ROOT = Path(__file__).resolve().parents[1]


# -- part 1: node logic without ComfyUI ------------------------------------------------------------
@pytest.fixture(scope="module")
def pack():
    """The repository imported as a package, as ComfyUI imports it."""
    return import_pack


def _handles(pack, tiny):
    h = pack("nodes.handles")
    return {kind: h.ComponentHandle(kind, tiny.file(arch).name, str(tiny.file(arch)))
            for kind, arch in (("lm", "mm3-lm"), ("depth", "mm3-depth"), ("cond", "mm3-cond"), ("dit", "mm3-dit"),
                               ("vae", "mm3-vae"))}


def test_node_chain_matches_pipeline(pack, tiny):
    """Prompt -> plan -> condition -> sample -> decode -> stitch, as the nodes run it, equals the
    pipeline's tracks bit for bit (2 songs x 2 variations), and each replay request renders its track."""
    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    m = {k: h.model() for k, h in hs.items()}
    prompt = logic.assemble_prompt(hs["lm"], CAPTION, LYRICS)
    songs, _ = logic.plan_songs(m["lm"], m["depth"], hs["lm"], hs["depth"], prompt,
                             PlanSettings(duration=0.8, lm_seed=11, songs=2), device="cpu", dtype=torch.float32)
    ours = []
    for song in songs:
        cond = logic.encode_condition(m["cond"], hs["cond"], song, device="cpu", dtype=torch.float32)
        lat = logic.sample(m["dit"], hs["dit"], cond, seed=5, steps=3, dit_cfg=1.7, variations=2, device="cpu",
                           dtype=torch.float32)
        audio = logic.stitch_audio(logic.decode(m["vae"], hs["vae"], lat, device="cpu"))
        assert audio["waveform"].dtype == torch.float32 and audio["waveform"].shape[:2] == (2, 2)
        ours += [(audio["waveform"][j], audio[logic.AUDIO_REQUESTS_KEY][j]) for j in range(2)]
    request = MM3Request(caption=CAPTION, lyrics=LYRICS, duration=0.8, lm_seed=11, seed=5, steps=3,
                         lm_batch_size=2, synth_batch_size=2)
    tracks = Pipeline(str(tiny.gguf)).run(request)
    assert len(tracks) == len(ours) == 4
    for track, (wave_, req) in zip(tracks, ours):
        assert torch.equal(track.audio, wave_)
        want = track.request.to_dict()
        assert {k: req[k] for k in ("audio_codes", "lm_seed", "seed", "steps", "caption", "lyrics")} == \
               {k: want[k] for k in ("audio_codes", "lm_seed", "seed", "steps", "caption", "lyrics")}
    # A replay request renders its own track again.
    again = Pipeline(str(tiny.gguf)).run(MM3Request.from_dict(ours[3][1]))
    assert torch.equal(again[0].audio, ours[3][0])


def test_split_synthesis_matches_pipeline_over_windows(pack, tiny):
    """Songs longer than one DiT window (200 frames): conditions computed per window up front, the
    sampler fed from them, windows decoded one by one and then stitched, equal the pipeline's
    synthesis (overlap carry, crops and all). Frame hiddens are random: no AR needed."""
    logic, handles, hs = pack("nodes.logic"), pack("nodes.handles"), _handles(pack, tiny)
    m = {k: h.model() for k, h in hs.items() if k in ("cond", "dit", "vae")}
    dp = hs["depth"].hparams
    frames = 210  # windows [0, 200) and [100, 210)
    hiddens = torch.randn(frames, int(dp["num_codebooks"]), int(dp["hidden_size"]),
                          generator=torch.Generator().manual_seed(3))
    codes = AudioCodes(torch.zeros(frames + 1, int(dp["num_codebooks"]), dtype=torch.long), hiddens, None, 1)
    request = MM3Request(caption="c", lyrics="l", seed=8, steps=2, synth_batch_size=1)
    song = handles.PlannedSong(codes, request, logic.check_parts({}, lm=hs["lm"], depth=hs["depth"]))
    cond = logic.encode_condition(m["cond"], hs["cond"], song, device="cpu", dtype=torch.float32)
    assert len(cond.conds) == 2
    lat = logic.sample(m["dit"], hs["dit"], cond, seed=8, steps=2, dit_cfg=1.7, variations=1, device="cpu",
                       dtype=torch.float32)
    ours = logic.stitch_audio(logic.decode(m["vae"], hs["vae"], lat, device="cpu"))["waveform"]
    want = Pipeline(str(tiny.gguf)).synthesize(request, codes)
    assert torch.equal(ours, want)


def test_load_codes_rejects_bad_files(pack, tiny):
    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    with pytest.raises(ValueError, match="holds no audio_codes"):
        logic.read_codes_request(json.dumps({"caption": "a", "lyrics": "b"}), "x.json", hs["lm"], hs["depth"])
    with pytest.raises(ValueError, match="x.json: .*out of range"):
        logic.read_codes_request(json.dumps({"caption": "a", "lyrics": "b", "audio_codes": ",".join(["99999"] * 16)}),
                                 "x.json", hs["lm"], hs["depth"])
    h = pack("nodes.handles")
    with pytest.raises(Exception, match="is mm3-dit, expected mm3-lm"):
        h.ComponentHandle("lm", "dit.gguf", str(tiny.file("mm3-dit")))


def test_loader_refuses_what_the_command_line_refuses(pack, tiny, tmp_path):
    """A DiT with one tensor of a GGML type the engine cannot dequantize (Q8_1) is refused when the
    loader node runs, naming the file and the tensor, as the command line refuses it before
    loading anything (it used to fail in the first DiT forward, after the whole AR stage)."""
    import gguf
    import numpy as np
    from tests.helpers.gguf_util import rewrite

    h = pack("nodes.handles")
    bad = rewrite(tiny.file("mm3-dit"), tmp_path / "bad-dit.gguf", drop={"proj_in.weight"},
                  tensors={"proj_in.weight": (gguf.GGMLQuantizationType.Q8_1, np.zeros((64, 80), np.uint8))})
    with pytest.raises(ComponentError,
                       match=r"bad-dit.gguf: tensor proj_in.weight is Q8_1, which this engine cannot dequantize"):
        h.handle_for("dit", "bad-dit.gguf", str(bad))


def test_loaded_codes_check_the_files_that_made_them(pack, tiny, tmp_path):
    """A song read from a replay file records each file's fingerprint; a later node whose file
    differs warns (logged, on the node), or refuses with model_check "refuse"."""
    import shutil

    logic, hs, handles = pack("nodes.logic"), _handles(pack, tiny), pack("nodes.handles")
    m = {k: hs[k].model() for k in ("lm", "depth", "cond")}
    prompt = logic.assemble_prompt(hs["lm"], CAPTION, LYRICS)
    (song,), _ = logic.plan_songs(m["lm"], m["depth"], hs["lm"], hs["depth"], prompt,
                               PlanSettings(duration=0.4, lm_seed=3), device="cpu", dtype=torch.float32)
    req = song.request
    assert req.model_fingerprints == {"lm_model": hs["lm"].fingerprint, "depth_model": hs["depth"].fingerprint}
    req = logic.with_model(req, "cond_model", hs["cond"])
    other = tmp_path / "other-cond.gguf"
    shutil.copy(tiny.file("mm3-cond"), other)
    with open(other, "r+b") as f:  # same tensors and header, other first weight bytes
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x3f")
    other_h = handles.ComponentHandle("cond", other.name, str(other))
    assert logic.codes_file_problems(req, hs["lm"], hs["depth"]) == []
    _, prompt2, codes = logic.read_codes_request(req.to_json(), "f.json", hs["lm"], hs["depth"])
    for check, same in (("warn", hs["cond"]), ("warn", other_h), ("refuse", other_h)):
        loaded = logic.replay_codes(m["lm"], m["depth"], hs["lm"], hs["depth"], req, prompt2, codes,
                                    device="cpu", dtype=torch.float32, model_check=check)
        if check == "refuse":
            with pytest.raises(ValueError, match="cond_model: other-cond.gguf .* is not the file that made this song"):
                logic.encode_condition(other_h.model(), other_h, loaded, device="cpu", dtype=torch.float32)
            continue
        out = logic.encode_condition(same.model(), same, loaded, device="cpu", dtype=torch.float32)
        assert bool(out.warnings) == (same is other_h)
        assert out.request.cond_model == same.name and out.request.model_fingerprints["cond_model"] == same.fingerprint
    # A file rendered with the reference RNG cannot be reproduced by the nodes: said, not hidden.
    from dataclasses import replace

    assert "reference RNG" in logic.codes_file_problems(replace(req, rng="reference"), hs["lm"], hs["depth"])[0]


def test_write_track_reads_back(pack, tmp_path):
    logic = pack("nodes.logic")
    wave_ = torch.linspace(-0.5, 0.5, 2 * 4410).reshape(2, -1)
    req = MM3Request(caption="c", lyrics="l", audio_codes="1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8")
    paths = logic.write_track(tmp_path / "a.wav", wave_, 44100, "wav16", mp3_bitrate=128, peak_clip=10,
                              request=req.to_dict())
    with wave.open(str(paths[0])) as w:
        assert (w.getnchannels(), w.getframerate(), w.getsampwidth(), w.getnframes()) == (2, 44100, 2, 4410)
    assert json.loads(paths[1].read_text())["output_format"] == "wav16"
    mono = logic.write_track(tmp_path / "m.wav", wave_[:1], 44100, "wav24", mp3_bitrate=128, peak_clip=10, request=None)
    assert len(mono) == 1 and wave.open(str(mono[0])).getnchannels() == 2


def test_prompt_over_the_budget_is_refused_with_the_count(pack, tiny):
    logic, hs = pack("nodes.logic"), _handles(pack, tiny)
    with pytest.raises(ValueError, match=r"Prompt exceeds the 5000 token budget: the assembled prompt has \d+ tokens "
                                         r"\(caption \d+ chars, lyrics \d+ chars\): shorten the caption or lyrics$"):
        logic.assemble_prompt(hs["lm"], CAPTION, "[verse]\n" + "la " * 3000)


JS_APP = """export const app = { extensions: [], registerExtension(e) { this.extensions.push(e); },
  extensionManager: { tabs: [], registerSidebarTab(t) { this.tabs.push(t); } } };"""
JS_API = """export const api = { calls: [], async fetchApi(path, opts) {
  this.calls.push([path, opts?.body ? JSON.parse(opts.body) : null]);
  const body = JSON.parse(opts.body); const n = body.caption.length + body.lyrics.length;
  if (body.caption.includes("\\u001b")) return { ok: false, status: 400,
    json: async () => ({ error: "caption contains the control character U+001B at position 3" }) };
  return { ok: true, json: async () => ({ tokens: n, limit: 10, over: n > 10, lm_model: body.lm_model }) }; } };"""
JS_HARNESS = """globalThis.requestAnimationFrame = (f) => f();
globalThis.setTimeout = (f) => { f(); return 0; }; globalThis.clearTimeout = () => {};
const settle = () => new Promise((r) => setImmediate(r));
const { app } = await import("./scripts/app.js");
const { api } = await import("./scripts/api.js");
await import("./extensions/pack/mm3.js");
const ext = app.extensions[0];
ext.setup();
class El { constructor() { this.style = {}; this.listeners = {}; }
  addEventListener(k, f) { (this.listeners[k] ??= []).push(f); } }
globalThis.document = { createElement: () => new El() };
const loader = { widgets: [{ name: "model_name", value: "lm-q8.gguf" }] };
class Node { constructor() { this.inputs = [{ name: "lm" }];
    this.widgets = [{ name: "caption", value: "x", inputEl: new El() }, { name: "lyrics", value: "y" }]; }
  getInputNode(slot) { return slot === 0 ? loader : null; }
  addDOMWidget(name, type, element, options) {
    const w = { name, type, element, options, get value() { return options.getValue(); },
                set value(v) { options.setValue(v); } };
    this.widgets.push(w); return w; } }
const save = { name: "MM3SaveSong", input: { required: { audio: ["AUDIO", {}] } } };
await ext.beforeRegisterNodeDef(class {}, save);
await ext.beforeRegisterNodeDef(Node, { name: "MM3PromptAssemble", input: { required: {} } });
const node = new Node();
node.onNodeCreated();
await settle(); await settle();
const first = node.widgets.at(-1).value;
node.widgets[0].value = "a much longer caption";
node.widgets[0].inputEl.listeners.input[0]();
await settle(); await settle();
const over = node.widgets.at(-1).value;
node.widgets[0].value = "bad\\u001b";
node.widgets[0].inputEl.listeners.input[0]();
await settle(); await settle();
const refused = [node.widgets.at(-1).value, node.widgets.at(-1).element.style.color];
node.onExecuted({ text: ["a", "b"] });
const info = node.widgets.at(-1);
console.log(JSON.stringify({ name: ext.name, audioUI: save.input.required.audioUI, first, over, refused,
  tab: app.extensionManager.tabs.map((t) => t.id), calls: api.calls.map((c) => [c[0], c[1]?.lm_model]),
  widgets: node.widgets.map((w) => w.name), info: [info.value, info.serialize, info.options.serialize,
  info.element.readOnly] }));
"""


def run_web_harness(tmp_path, script: str) -> dict:
    """Run `script` (node.js) beside web/mm3.js and stand-ins for the editor's app and api modules;
    the JSON it prints. Skipped without node.js."""
    import shutil

    node = shutil.which("node")
    if node is None:
        pytest.skip("node.js is not installed")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "extensions" / "pack").mkdir(parents=True)
    (tmp_path / "scripts" / "app.js").write_text(JS_APP)
    (tmp_path / "scripts" / "api.js").write_text(JS_API)
    shutil.copy(ROOT / "web" / "mm3.js", tmp_path / "extensions" / "pack" / "mm3.js")
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / "harness.js").write_text(script)
    out = subprocess.run([node, "harness.js"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_web_extension_shows_node_text(tmp_path):
    """web/mm3.js against stand-ins for the editor's app and api modules (needs node.js): the info
    text is the node's last widget and is neither sent with the prompt nor saved; typing recounts the
    prompt's tokens with the LM the upstream loader names; the sidebar tab is registered."""
    got = run_web_harness(tmp_path, JS_HARNESS)
    assert got["audioUI"] == ["AUDIO_UI", {}]  # Save Song gets ComfyUI's audio player
    assert got["widgets"] == ["caption", "lyrics", "mm3_info"]
    assert got["info"] == ["a\nb", False, False, True]
    assert got["first"] == "2 / 10 prompt tokens"
    assert got["over"].startswith("22 / 10 prompt tokens (over the budget by 12")
    assert got["over"].endswith("shorten the caption or lyrics)")
    # A text the count refuses shows the reason, in the warning colour.
    assert got["refused"] == ["caption contains the control character U+001B at position 3", "var(--error-text, #f66)"]
    assert got["calls"][-1] == ["/mm3/tokens", "lm-q8.gguf"] and got["tab"] == ["mm3-models"]


JS_UPGRADE = """globalThis.document = { createElement: () => ({ style: {} }) };
const { app } = await import("./scripts/app.js");
const { upgradeWorkflow } = await import("./extensions/pack/mm3.js");
const ext = app.extensions[0];
const old = (knobs) => ({ last_node_id: 4, last_link_id: 2, links: [[1, 1, 0, 3, 0, "MM3_LM"], [2, 2, 0, 3, 1, "X"]],
  nodes: [{ id: 1, type: "A", outputs: [{ links: [1] }] }, { id: 2, type: "B", outputs: [{ links: [2] }] },
    { id: 3, type: "MM3ARPlan", pos: [10, 20], size: [400, 300],
      inputs: [{ name: "lm", link: 1 }, { name: "lm_top_k", link: null, widget: { name: "lm_top_k" } },
               { name: "prior_codes", link: 2 }],
      widgets_values: [120, 42, "fixed", 1.5, knobs.top_k ?? 50, 1, 4, true, knobs.rounds ?? 1, 30, 1, 1, "none",
                       1.1, 320, 15] }] });
const plain = upgradeWorkflow(old({}));
const tuned = upgradeWorkflow(old({ top_k: 7, rounds: 2 }));
// A seed widget with its control, on a node whose seed input is wired, then unwired.
class Node { constructor() { const control = { name: "control_after_generate", value: "fixed" };
  this.widgets = [{ name: "seed", value: 1, linkedWidgets: [control] }, control];
  this.inputs = [{ name: "seed", widget: { name: "seed" }, link: 5 }]; } }
await ext.beforeRegisterNodeDef(Node, { name: "MM3FlowSampler",
  input: { required: { seed: ["INT", { control_after_generate: true }] } } });
const node = new Node();
node.onConfigure();
const wired = node.widgets[1].hidden;
node.inputs[0].link = null;
node.onConnectionsChange();
console.log(JSON.stringify({ plain, tuned, wired, unwired: node.widgets[1].hidden }));
"""


def test_web_extension_upgrades_old_plans_and_hides_wired_seed_controls(tmp_path):
    """web/mm3.js (needs node.js): an editor workflow saved with the old AR Plan (16 widget values)
    loads with the new AR Plan's values; knobs off their defaults come back on an MM3 Sampling
    Options node wired into `options`; at the defaults no node is added. A seed's "control after
    generate" is hidden while the seed is wired in, and shown again once it is not."""
    got = run_web_harness(tmp_path, JS_UPGRADE)
    plan = [n for n in got["plain"]["nodes"] if n["type"] == "MM3ARPlan"][0]
    assert plan["widgets_values"] == [120, 42, "fixed", 1.5, 1, 4, True, 30]
    assert [i["name"] for i in plan["inputs"]] == ["lm", "prior_codes"]
    assert got["plain"]["links"] == [[1, 1, 0, 3, 0, "MM3_LM"], [2, 2, 0, 3, 1, "X"]]  # prior_codes moved up
    assert len(got["plain"]["nodes"]) == 3
    options = [n for n in got["tuned"]["nodes"] if n["type"] == "MM3SamplingOptions"]
    assert len(options) == 1 and options[0]["id"] == 5
    assert options[0]["widgets_values"] == [7, 1, 1, "none", 1.1, 320, 15, 2]
    plan = [n for n in got["tuned"]["nodes"] if n["type"] == "MM3ARPlan"][0]
    assert plan["inputs"][-1] == {"name": "options", "type": "MM3_SAMPLING_OPTIONS", "link": 3}
    assert got["tuned"]["links"][-1] == [3, 5, 0, 3, 2, "MM3_SAMPLING_OPTIONS"]
    assert options[0]["outputs"][0]["links"] == [3] and got["tuned"]["last_link_id"] == 3
    assert got["wired"] is True and got["unwired"] is False


def test_shipped_workflows_fit_the_window_at_their_saved_view():
    """Each editor workflow, opened at its saved view in a 1600 x 1000 window, shows every node (its
    Note too) whole inside the part of the window the editor's bars leave free, at a scale where
    the editor still draws text, without overlaps; more than five columns wrap onto a second row."""
    from tests.helpers.comfy_workflows import BOTTOM, LEFT, RIGHT, TOP, WINDOW, boxes_on_screen

    for path in sorted((ROOT / "workflows").glob("*.json")):
        ui = json.loads(path.read_text())
        assert ui["extra"]["ds"]["scale"] >= 0.6, path.name
        boxes = boxes_on_screen(ui)
        assert any(name.startswith("Note ") for name, _ in boxes), path.name
        outside = [(name, [round(v) for v in b]) for name, b in boxes
                   if b[0] < LEFT or b[1] < TOP or b[2] > WINDOW[0] - RIGHT or b[3] > WINDOW[1] - BOTTOM]
        assert not outside, (path.name, outside)
        for i, (a, p) in enumerate(boxes):
            for b, q in boxes[i + 1:]:
                assert not (p[0] < q[2] and q[0] < p[2] and p[1] < q[3] and q[1] < p[3]), (path.name, a, b)
        first = min(n["pos"][1] + n["size"][1] for n in ui["nodes"] if n["type"].startswith("MM3Load"))
        assert all(n["pos"][1] > first for n in ui["nodes"] if n["type"] == "MM3SaveSong"), path.name  # row 2


JS_SIDEBAR = """class El { constructor(tag) { this.tag = tag; this.style = {}; this.children = []; this.textContent = ""; }
  append(...c) { this.children.push(...c); } replaceChildren(...c) { this.children = c; }
  insertRow() { const r = new El("tr"); this.children.push(r); return r; }
  text() { return [this.textContent, ...this.children.map((c) => c.text())].filter(Boolean).join("\\n"); } }
globalThis.document = { createElement: (tag) => new El(tag) };
const { renderInventory } = await import("./extensions/pack/mm3.js");
const bad = "MiniMax-Music3-vocoder-F32.gguf";
const file = (name, state, problem = "") => ({ name, state, size: 4000, problem });
const inv = { folders: ["/models/mm3"], free: 10e9,
  components: { lm: [{ name: "tiny-lm.gguf", file_type: "F32", size: 3 * 1024 }], depth: [] },
  unusable: [{ name: bad, problem: "truncated: tensor t needs bytes 0..9999" }],
  sets: { native: [file(bad, "unusable", `${bad}: truncated: tensor t needs bytes 0..9999, expected mm3-vae`)],
          light: [file(bad, "unusable", `${bad}: truncated: tensor t needs bytes 0..9999, expected mm3-vae`),
                  file("MiniMax-Music3-transformer-Q4_K_M.gguf", "partial")] },
  set_sizes: { native: { total: 28.6e9, to_fetch: 28.6e9 }, light: { total: 8.8e9, to_fetch: 4.2e9 } } };
const root = new El("div");
renderInventory(root, inv);
console.log(JSON.stringify(root.text()));
"""


def test_web_sidebar_says_sizes_free_space_and_each_problem_once(tmp_path):
    """The MM3 models sidebar (web/mm3.js, needs node.js): each set's published size and what is
    left to download against the free space, a problem said once (later mentions point to it),
    small files in KiB."""
    text = run_web_harness(tmp_path, JS_SIDEBAR)
    assert text.count("truncated") == 1, text
    assert "MiniMax-Music3-vocoder-F32.gguf: unusable (see above)" in text
    assert "tiny-lm.gguf (F32, 3 KiB)" in text and "(4 KiB so far)" in text
    assert "about 28.6 GB; to download: about 28.6 GB, 10.0 GB free in /models/mm3: not enough space" in text
    assert "about 8.8 GB; to download: about 4.2 GB, 10.0 GB free in /models/mm3" in text
    assert "Download the light set" in text


# -- part 2: a real ComfyUI ---------------------------------------------------------------------
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
    for name in names:
        ui = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
        assert schema_problems(ui) == [], name
        api = json.loads((API_DIR / f"{name}.json").read_text())
        assert api_from_ui(ui, info) == {k: {"class_type": v["class_type"], "inputs": v["inputs"]}
                                         for k, v in api.items()}, name


@needs_comfy
def test_text_to_song_equals_the_command_line(comfy):
    """text_to_song with 2 songs x 2 variations (a list of plans) gives the pipeline's four tracks,
    float WAV bit for bit; each file gets its replay request beside it."""
    from mm3.output import render
    from mm3.pipeline import Pipeline
    from mm3.request import MM3Request

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
    from mm3.fingerprint import file_fingerprint

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
from mm3.inventory import scan
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
