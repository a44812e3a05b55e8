"""The editor side, without ComfyUI: web/mm3.js run under node.js against stand-ins for the
editor's app and api modules (node text, token count, old-workflow upgrade, wired seeds, the models
sidebar), and the shipped editor workflows' layout at their saved view."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

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
const deprecated = []; // what the newest editor warns about when it is read
const textWidget = (name, value) => { const element = new El();
  return { name, value, element, get inputEl() { deprecated.push("widget.inputEl"); return element; } }; };
class Node { constructor() { this.inputs = [{ name: "lm" }];
    this.widgets = [textWidget("caption", "x"), textWidget("lyrics", "y")]; }
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
node.widgets[0].element.listeners.input[0]();
await settle(); await settle();
const over = node.widgets.at(-1).value;
node.widgets[0].value = "bad\\u001b";
node.widgets[0].element.listeners.input[0]();
await settle(); await settle();
const refused = [node.widgets.at(-1).value, node.widgets.at(-1).element.style.color];
node.onExecuted({ text: ["a", "b"] });
const info = node.widgets.at(-1);
console.log(JSON.stringify({ name: ext.name, audioUI: save.input.required.audioUI, first, over, refused,
  tab: app.extensionManager.tabs.map((t) => t.id), calls: api.calls.map((c) => [c[0], c[1]?.lm_model]),
  widgets: node.widgets.map((w) => w.name), info: [info.value, info.serialize, info.options.serialize,
  info.element.readOnly], deprecated }));
"""


def run_web_harness(tmp_path, script: str, api_js: str = JS_API) -> dict:
    """Run `script` (node.js) beside web/mm3.js (and the modules it imports) and stand-ins for the
    editor's app and api modules (`api_js`: another api stand-in); the JSON it prints. Skipped
    without node.js."""
    import shutil

    node = shutil.which("node")
    if node is None:
        pytest.skip("node.js is not installed")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "extensions" / "pack").mkdir(parents=True)
    (tmp_path / "scripts" / "app.js").write_text(JS_APP)
    (tmp_path / "scripts" / "api.js").write_text(api_js)
    for script_file in (ROOT / "web").glob("*.js"):
        shutil.copy(script_file, tmp_path / "extensions" / "pack" / script_file.name)
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / "harness.js").write_text(script)
    out = subprocess.run([node, "harness.js"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_web_extension_shows_node_text(tmp_path):
    """web/mm3.js against stand-ins for the editor's app and api modules (needs node.js): the info
    text is the node's last widget and is neither sent with the prompt nor saved; typing recounts the
    prompt's tokens with the LM the upstream loader names; the sidebar tab is registered. The text
    boxes are reached through `widget.element`, never the deprecated `widget.inputEl`."""
    got = run_web_harness(tmp_path, JS_HARNESS)
    assert got["deprecated"] == []
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
// Connectivity through node.isInputConnected(slot): reading an input's `link` is deprecated.
const deprecated = [];
class Node { constructor() { const control = { name: "control_after_generate", value: "fixed" };
  this.widgets = [{ name: "seed", value: 1, linkedWidgets: [control] }, control];
  this.wired = [5]; const node = this;
  this.inputs = [{ name: "seed", widget: { name: "seed" }, get link() { deprecated.push("input.link");
    return node.wired[0]; } }]; }
  isInputConnected(slot) { return this.wired[slot] != null; } }
await ext.beforeRegisterNodeDef(Node, { name: "MM3FlowSampler",
  input: { required: { seed: ["INT", { control_after_generate: true }] } } });
const node = new Node();
node.onConfigure();
const wired = node.widgets[1].hidden;
node.wired[0] = null;
node.onConnectionsChange();
console.log(JSON.stringify({ plain, tuned, wired, unwired: node.widgets[1].hidden, deprecated }));
"""


def test_web_extension_upgrades_old_plans_and_hides_wired_seed_controls(tmp_path):
    """web/mm3.js (needs node.js): an editor workflow saved with the old AR Plan (16 widget values)
    loads with the new AR Plan's values; knobs off their defaults come back on an MM3 Sampling
    Options node wired into `options`; at the defaults no node is added. A seed's "control after
    generate" is hidden while the seed is wired in, and shown again once it is not (read through
    `node.isInputConnected`, not the deprecated `input.link`)."""
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
    assert got["deprecated"] == []


def test_shipped_workflows_fit_the_window_at_their_saved_view():
    """Each editor workflow, opened at its saved view in a 1600 x 1000 window, shows every node (its
    Note too) whole inside the part of the window the editor's bars leave free, at a scale where
    the editor still draws text, without overlaps; more than five columns wrap onto a second row."""
    from tests.helpers.comfy_workflows import BOTTOM, LEFT, MAX_COLUMNS, RIGHT, TOP, WINDOW, boxes_on_screen

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
        if len(ui["nodes"]) - 1 > MAX_COLUMNS:  # a chain of more nodes wraps: Save Song ends it on row 2
            first = min(n["pos"][1] + n["size"][1] for n in ui["nodes"] if n["type"].startswith("MM3Load"))
            assert all(n["pos"][1] > first for n in ui["nodes"] if n["type"] == "MM3SaveSong"), path.name


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
console.log(JSON.stringify({ text: root.text(), style: root.style.cssText,
  folders: root.children[1].children.map((c) => c.textContent) }));
"""


def test_web_sidebar_says_sizes_free_space_and_each_problem_once(tmp_path):
    """The MM3 models sidebar (web/mm3.js, needs node.js): each set's published size and what is
    left to download against the free space, a problem said once (later mentions point to it),
    small files in KiB. Each folder on a line of its own; long paths and file names wrap at any
    character instead of running past the sidebar's edge."""
    got = run_web_harness(tmp_path, JS_SIDEBAR)
    text = got["text"]
    assert "overflow-wrap: anywhere" in got["style"] and got["folders"] == ["/models/mm3"]
    assert text.count("truncated") == 1, text
    assert "MiniMax-Music3-vocoder-F32.gguf: unusable (see above)" in text
    assert "tiny-lm.gguf (F32, 3 KiB)" in text and "(4 KiB so far)" in text
    assert "about 28.6 GB; to download: about 28.6 GB, 10.0 GB free in /models/mm3: not enough space" in text
    assert "about 8.8 GB; to download: about 4.2 GB, 10.0 GB free in /models/mm3" in text
    assert "Download the light set" in text


# -- the live player (web/mm3_player.js) ------------------------------------------------------------
JS_PLAYER_API = """import { readFileSync } from "node:fs";
export const api = { listeners: {}, fetched: [], addEventListener(type, f) { (this.listeners[type] ??= []).push(f); },
  async fetchApi(path) { this.fetched.push(path); const q = new URLSearchParams(path.split("?")[1]);
    const bytes = readFileSync(`files/${q.get("filename")}`);
    return { ok: true, arrayBuffer: async () => bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length) }; } };"""
# The page the player scripts run in under node.js: a bare DOM and the editor's app and api.
JS_PAGE = """import { readFileSync } from "node:fs";
class El { constructor(tag) { this.tag = tag; this.style = {}; this.children = []; this.textContent = ""; }
  append(...c) { this.children.push(...c); } replaceChildren(...c) { this.children = c; } }
globalThis.document = { createElement: (tag) => new El(tag) };
globalThis.requestAnimationFrame = () => 0;
const { app } = await import("./scripts/app.js");
const { api } = await import("./scripts/api.js");
"""
JS_PLAYER_HARNESS = JS_PAGE + """const P = await import("./extensions/pack/mm3_player.js");
await import("./extensions/pack/mm3.js");
class Ctx { constructor(rate) { this.currentTime = 0; this.sampleRate = rate; this.started = []; this.destination = {}; }
  createBuffer(n, length, sampleRate) { const chans = Array.from({ length: n }, () => new Float32Array(length));
    return { length, sampleRate, duration: length / sampleRate, chans, copyToChannel(d, c) { chans[c].set(d); } }; }
  createBufferSource() { const ctx = this; return { connect(to) { this.to = to; }, stop() { this.stopped = true; },
    start(when, offset) { ctx.started.push({ at: ctx.currentTime, when, offset, n: this.buffer.length,
                                             to: this.to }); } }; }
  createGain() { return (this.gainNode = { gain: { value: 1 }, connect(to) { this.to = to; } }); }
  resume() {} }
const round = (x) => Math.round(x * 1e9) / 1e9;
const starts = (ctx) => ctx.started.splice(0).map((s) => [round(s.when), round(s.offset), s.n]);
const out = {};

// The schedule: 0.1 s pieces back to back, a pause, a seek, the render falling behind, the end.
const ctx = new Ctx(1000);
const p = new P.LivePlayer(ctx);
const piece = (k, last = false) => ({ start: 100 * k, channels: [new Float32Array(100).fill(k / 10),
  new Float32Array(100).fill(-k / 10)], sampleRate: 1000, last });
ctx.currentTime = 1; p.add(piece(0)); p.play();
out.first = starts(ctx);
p.add(piece(1));
out.second = starts(ctx);
ctx.currentTime = 1.2; out.at = round(p.now()); p.pause(); p.seek(0.05);
ctx.currentTime = 2; p.play();
out.resumed = starts(ctx);
ctx.currentTime = 2.5; p.tick(); out.waiting = [p.waiting, round(p.now())];
ctx.currentTime = 3; p.add(piece(2, true));
out.caught_up = starts(ctx);
ctx.currentTime = 3.2; p.tick(); out.ended = [p.playing, round(p.now()), p.complete, round(p.duration)];
p.play(); out.again = starts(ctx);

// LRC: several stamps on a line, [offset], tags and unstamped lines left out.
out.lines = P.parseLrc(["[ti:Song]", "[offset:+500]", "[00:03.50][00:01.00]la la", "[00:02]li", "no stamp",
  "[01:02.345]end", "[00:05:10]x"].join("\\n"));
out.at_times = [0, 0.6, 1.0, 3.1, 100].map((t) => P.lineAt(out.lines, t));

// The engine's messages (nodes/live.py) on a node of the graph: fetched in order, played back to back.
const messages = JSON.parse(readFileSync("messages.json", "utf8"));
const node = { comfyClass: "MM3Generate", widgets: [], addDOMWidget(name, type, element, options) {
  const w = { name, type, element, options }; this.widgets.push(w); return w; } };
app.graph = { getNodeById: (id) => (id === 7 ? node : null), nodes: [node] };
const made = [];
app.extensions[0].setup();
const { playerOf, onWindow, onExecuted } = await import("./extensions/pack/mm3.js");
const view = playerOf(node, (rate) => { const c = new Ctx(rate); made.push(c); return c; });
for (const m of messages) await onWindow(m);
const track = view.player;
const joined = (c) => track.pieces.flatMap((pc) => Array.from(pc.buffer.chans[c]));
out.view = { widget: node.widgets.map((w) => [w.name, w.options.serialize]), tracks: [...view.tracks.keys()],
  fetched: api.fetched.length, complete: track.complete, rate: made[0].sampleRate,
  starts: made[0].started.map((s) => round(s.when)), left: joined(0), right: joined(1) };
onExecuted({ prompt_id: messages[0].prompt_id, output: { lyrics_lrc: ["[00:00.00]one", "[00:00.20]two"] } });
track.pause();
view.lineEls[1].onclick();
out.seek = [round(track.now()), track.currentLine(), view.lineEls[1].style.fontWeight, view.lineEls[0].style.fontWeight];
out.listens = Object.keys(api.listeners).sort();
console.log(JSON.stringify(out));
"""


def test_live_player_schedules_windows_back_to_back_and_follows_lrc(tmp_path):
    """web/mm3_player.js under node.js with a stand-in AudioContext: each window starts where the
    previous one ends on the one clock; a pause and seek restart from the right place; when the
    render falls behind, the player waits and goes on from where it stopped; at the end it stops.
    LRC text parses (several stamps, offset, tags left out) and the line of a time is found. The
    messages nodes/live.py sends for a song (two variations) are fetched in order, decoded from its
    WAV files exactly, and played gaplessly; clicking a lyric line seeks there."""
    from tests.helpers.comfyui import import_pack

    live = import_pack("nodes.live")
    messages = []
    files = tmp_path / "files"
    preview = live.WindowPreview(lambda event, data: messages.append(data), files, "7", "prompt-1", duration=9.0)
    g = torch.Generator().manual_seed(0)
    pieces = [torch.rand(2, 2, n, generator=g) * 2 - 1 for n in (300, 200, 250)]
    for k, piece in enumerate(pieces):
        preview(k, None if k < 2 else 3, piece, 1000)
    (tmp_path / "messages.json").write_text(json.dumps(messages))
    got = run_web_harness(tmp_path, JS_PLAYER_HARNESS, JS_PLAYER_API)
    assert got["first"] == [[1.05, 0, 100]]
    assert got["second"] == [[1.15, 0, 100]]  # right after the first, on the same clock
    assert got["at"] == 0.15
    assert got["resumed"] == [[2.05, 0.05, 100], [2.1, 0, 100]]  # from 0.05 s on
    assert got["waiting"] == [True, 0.2]
    assert got["caught_up"] == [[3.05, 0, 100]]  # goes on from where it stopped
    assert got["ended"] == [False, 0.3, True, 0.3]
    assert got["again"] == [[3.25, 0, 100], [3.35, 0, 100], [3.45, 0, 100]]  # from the start
    assert got["lines"] == [{"time": 0.5, "text": "la la"}, {"time": 1.5, "text": "li"}, {"time": 3.0, "text": "la la"},
                            {"time": 4.6, "text": "x"}, {"time": 61.845, "text": "end"}]
    assert got["at_times"] == [-1, 0, 0, 2, 4]
    view = got["view"]
    assert view["widget"] == [["mm3_player", False]] and view["tracks"] == ["0.0", "0.1"]
    assert view["fetched"] == 6 and view["complete"] and view["rate"] == 1000
    assert view["starts"] == [0.05, 0.35, 0.55]  # variation 0's windows back to back
    whole = torch.cat(pieces, dim=-1)[0]
    assert torch.equal(torch.tensor(view["left"]), whole[0]) and torch.equal(torch.tensor(view["right"]), whole[1])
    assert got["seek"] == [0.2, 1, "700", ""]
    assert got["listens"] == ["executed", "mm3.window"]


JS_SUBGRAPH_HARNESS = JS_PAGE + """const { graphNode, onWindow, onExecuted, playerOf } = await import("./extensions/pack/mm3.js");
const contexts = [];
class Ctx { constructor(rate) { this.currentTime = 0; this.destination = { speakers: true }; this.sources = [];
    contexts.push(this); }
  createBuffer(n, length, sampleRate) { return { length, sampleRate, copyToChannel() {} }; }
  createBufferSource() { const s = { connect(to) { s.to = to; }, start() {}, stop() {} }; this.sources.push(s);
    return s; }
  createGain() { return (this.gainNode = { gain: { value: 1 }, connect(to) { this.to = to; } }); }
  resume() {} }
globalThis.AudioContext = Ctx;
const live = (name) => ({ comfyClass: "MM3Generate", name, widgets: [], size: [400, 100],
  computeSize() { return [400, playerOf(this).height()]; }, setSize(s) { this.size = s; },
  addDOMWidget(n, type, element, options) { const w = { name: n, element, options }; this.widgets.push(w); return w; } });
// Node 12 is a subgraph holding node 5; the root graph has a node 5 of its own.
const inner = live("inner"), outer = live("root 5");
const sub = { nodes: [inner], getNodeById: (id) => (id === 5 ? inner : null) };
const holder = { id: 12, subgraph: sub };
app.rootGraph = { nodes: [outer, holder], getNodeById: (id) => ({ 5: outer, 12: holder })[id] ?? null };
const out = { lookup: [graphNode("12:5")?.name, graphNode("5")?.name, graphNode(5)?.name, graphNode("12:9"),
                       graphNode("7:5")] };
const messages = JSON.parse(readFileSync("messages.json", "utf8"));
for (const m of messages) await onWindow(m);
const view = inner.mm3Player, ctx = contexts[0];
out.player = [!!view, outer.mm3Player === undefined, view.tracks.size];
out.noise = [view.noise, view.note.style.display, view.note.textContent, ctx.gainNode.gain.value,
             ctx.gainNode.to === ctx.destination, ctx.sources.every((s) => s.to === ctx.gainNode),
             inner.size[1] >= view.height()];
view.setVolume(0.5);
out.volume = ctx.gainNode.gain.value;
onExecuted({ prompt_id: messages[0].prompt_id, output: { lyrics_lrc: ["[00:00.00]one"] } });
out.lrc = view.lineEls.map((r) => r.textContent);
await onWindow({ ...messages[0], prompt_id: "prompt-2", noise: false });
out.music = [view.noise, view.note.style.display, ctx.gainNode.gain.value];
console.log(JSON.stringify(out));
"""


def test_live_player_finds_nodes_inside_subgraphs_and_plays_noise_quietly(tmp_path):
    """web/mm3.js (needs node.js): a window message for a node inside a subgraph (its execution id
    "12:5") reaches that node's player, not the root graph's node 5, and an LRC text reaches it too.
    The messages of a tiny (random-weight) vocoder say so: the player shows that the song is noise
    and plays it at a tenth of the volume slider's level, through one gain; a later prompt of a real
    model plays at the slider's level again."""
    from tests.helpers.comfyui import import_pack

    live = import_pack("nodes.live")
    messages = []
    preview = live.WindowPreview(lambda event, data: messages.append(data), tmp_path / "files", "12:5", "prompt-1",
                                 duration=1.0, noise=True)
    preview(0, 1, torch.zeros(1, 2, 100), 1000)
    (tmp_path / "messages.json").write_text(json.dumps(messages))
    got = run_web_harness(tmp_path, JS_SUBGRAPH_HARNESS, JS_PLAYER_API)
    assert got["lookup"] == ["inner", "root 5", "root 5", None, None]
    assert got["player"] == [True, True, 1]
    noise, shown, note, gain, to_speakers, through_gain, room = got["noise"]
    assert noise is True and shown == "" and note.startswith("Noise: this vocoder has random weights")
    assert gain == 0.1 and to_speakers and through_gain and room
    assert got["volume"] == 0.05 and got["lrc"] == ["one"]
    assert got["music"] == [False, "none", 0.5]


def test_every_template_has_a_card_that_says_what_it_makes():
    """Each editor workflow has its template-browser card (tests/helpers/template_cards.py): a title
    and a line in CARDS, and workflows/NAME.jpg, a square JPEG (the browser fits pictures into a
    square) as the script draws it; no card for a workflow that is gone."""
    from PIL import Image

    from tests.helpers.template_cards import CARDS, SIZE

    names = sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))
    assert sorted(CARDS) == names
    for name in names:
        title, line, _ = CARDS[name]
        assert title and line and len(title) <= 26, name  # two lines of large type at most
        with Image.open(ROOT / "workflows" / f"{name}.jpg") as img:
            assert img.format == "JPEG" and img.size == (SIZE, SIZE), (name, img.format, img.size)
