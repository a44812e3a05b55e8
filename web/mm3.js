// MiniMax Music 3 (GGUF) nodes in the editor, through the public extension API (scripts/app.js and
// scripts/api.js only):
// - a read-only text box for what a node reports (the prompt's cleaned texts and token count, the AR
//   plan per song, the codes file written or loaded); it is neither sent with the prompt (so it never
//   changes a node's cache key) nor saved in the workflow;
// - a live token count on MM3 Prompt while the caption and lyrics are typed, with the budget;
// - an audio player on Save Song (ComfyUI's own AUDIO_UI widget);
// - a live player on Vocoder Decode and Generate that plays each window as soon as it is decoded
//   (web/mm3_player.js), with the waveform so far and the lyrics of an LRC text, when one arrives; a
//   click on a lyric line sets the line (or section) of the workflow's Change a Line and Repaint nodes;
// - a seed's "control after generate" hidden while the seed is wired in;
// - AR Plan workflows saved before its expert knobs moved onto MM3 Sampling Options load right;
// - the "MM3 models" sidebar: which of the five components are present in the mm3 folders, each
//   published set's files, and a resumable download of a missing set.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { PlayerView, readWav } from "./mm3_player.js";

const TEXT_NODES = new Set(["MM3PromptAssemble", "MM3ARPlan", "MM3LoadAudioCodes", "MM3SaveAudioCodes", "MM3CaptionBuilder",
  "MM3Repaint", "MM3AudioCodesFromText", "MM3UnpackSongs", "MM3Generate",
  "MM3LyricTimestamps", "MM3ChangeLine"]);
const INFO = "mm3_info";
const COUNT_DELAY_MS = 400;
const KIND_TITLES = { lm: "Language model", depth: "Depth decoder", cond: "Condition encoder", dit: "DiT",
                      vae: "Vocoder" };

function infoWidget(node) {
  let widget = node.widgets?.find((w) => w.name === INFO);
  if (widget) return widget;
  const el = document.createElement("textarea");
  el.className = "comfy-multiline-input mm3-info";
  el.readOnly = true;
  el.style.opacity = "0.8";
  el.rows = 3;
  // Added after the node's own widgets: a widget that is not saved must come last, so the saved
  // widgets_values keep their positions.
  widget = node.addDOMWidget(INFO, "customtext", el, {
    getValue: () => el.value,
    setValue: (v) => { el.value = v ?? ""; },
    serialize: false, // not sent with the prompt
    read_only: true,
  });
  widget.serialize = false; // not saved in the workflow
  return widget;
}

function showText(node, lines, { warn = false } = {}) {
  const widget = infoWidget(node);
  widget.value = Array.isArray(lines) ? lines.join("\n") : String(lines ?? "");
  if (widget.element) widget.element.style.color = warn ? "var(--error-text, #f66)" : "";
  node.setDirtyCanvas?.(true, true);
}

// -- the live player on the nodes that decode audio ---------------------------------------------
const LIVE_NODES = new Set(["MM3VocoderDecode", "MM3Generate"]);
const PLAYER = "mm3_player";

function audioContext(sampleRate) {
  const Context = globalThis.AudioContext ?? globalThis.webkitAudioContext;
  try {
    return new Context({ sampleRate }); // the windows' own rate: no resampling
  } catch (e) {
    return new Context();
  }
}

// A lyric line or section clicked in a player ({ line: n } or { section: "chorus 2" }): the range of
// the workflow's edits follows it. MM3 Change a Line takes a line; MM3 Repaint, where its lyrics_lrc is
// wired in, a line or a section (the other set to none). Returns the nodes changed.
export function chooseLyric(choice) {
  const changed = [];
  const set = (node, name, value) => {
    const w = node.widgets?.find((x) => x.name === name);
    if (!w) return false;
    w.value = value;
    w.callback?.(value);
    return true;
  };
  for (const node of allNodes()) {
    const type = node.comfyClass ?? node.type;
    if (type === "MM3ChangeLine" && choice.line && set(node, "line", choice.line)) changed.push(node);
    if (type === "MM3Repaint") {
      const slot = node.inputs?.findIndex((i) => i.name === "lyrics_lrc") ?? -1;
      if (slot < 0 || node.inputs[slot].link == null) continue;
      if (set(node, "line", choice.line ?? 0)) {
        set(node, "section", choice.section ?? "");
        changed.push(node);
      }
    }
  }
  for (const node of changed) node.setDirtyCanvas?.(true, true);
  return changed;
}

export function playerOf(node, makeContext = audioContext) {
  if (node.mm3Player) return node.mm3Player;
  const view = new PlayerView(makeContext);
  view.onChoose = chooseLyric;
  const widget = node.addDOMWidget(PLAYER, "mm3player", view.root, {
    getValue: () => "", setValue: () => {}, serialize: false,
    getMinHeight: () => view.height(), getMaxHeight: () => view.height(),
  });
  widget.serialize = false; // not saved in the workflow
  widget.computeSize = (width) => [width, view.height()];
  node.mm3Player = view;
  view.queue = Promise.resolve();
  return view;
}

// The node a message names by its execution id: "7" on the root graph, "12:5" node 5 inside the
// subgraph of node 12 (each part a node of the graph the part before it opens).
export function graphNode(id) {
  let graph = app.rootGraph ?? app.graph, node = null;
  for (const part of String(id ?? "").split(":")) {
    if (!graph) return null;
    node = graph.getNodeById?.(Number(part)) ?? graph.getNodeById?.(part) ?? null;
    if (!node) return null;
    graph = node.subgraph;
  }
  return node;
}

// Every node of the workflow, those inside subgraphs too (each subgraph once).
export function allNodes(graph = app.rootGraph ?? app.graph, seen = new Set()) {
  const out = [];
  if (!graph || seen.has(graph)) return out;
  seen.add(graph);
  for (const node of graph.nodes ?? []) {
    out.push(node);
    if (node.subgraph) out.push(...allNodes(node.subgraph, seen));
  }
  return out;
}

// The node grown to the player's height (room for the lyric lines, the line that says it is noise).
function fitHeight(node) {
  const need = node.computeSize?.()[1];
  if (need > node.size?.[1]) node.setSize?.([node.size[0], need]);
  node.setDirtyCanvas?.(true, true);
}

// A "mm3.window" message: its WAV fetched and decoded in arrival order, then handed to the node's player.
export function onWindow(message) {
  const node = graphNode(message?.node);
  if (!node || !LIVE_NODES.has(node.comfyClass ?? node.type)) return null;
  const view = playerOf(node);
  view.queue = view.queue.then(async () => {
    const query = new URLSearchParams(message.file).toString();
    const r = await api.fetchApi(`/view?${query}`);
    if (!r.ok) throw new Error(`${message.file.filename}: ${r.status}`);
    view.add(message, readWav(await r.arrayBuffer()));
    if (lastLrc.promptId === message.prompt_id && view.lrc !== lastLrc.text) view.setLrc(lastLrc.text);
    fitHeight(node);
  }).catch((e) => console.warn(`MM3 live player: ${e}`));
  return view.queue;
}

// LRC text a node of the same prompt shows (ui "lyrics_lrc"): every live player of the prompt takes it,
// those whose first window comes later too (MM3 Lyric Timestamps may run before the decoding).
let lastLrc = { promptId: null, text: "" };
export function onExecuted(detail) {
  const lrc = detail?.output?.lyrics_lrc;
  if (!lrc) return;
  const text = Array.isArray(lrc) ? lrc.join("\n") : String(lrc);
  lastLrc = { promptId: detail.prompt_id, text };
  for (const node of allNodes()) {
    const view = node.mm3Player;
    if (view && (view.promptId === detail.prompt_id || view.promptId === null)) {
      view.setLrc(text);
      fitHeight(node);
    }
  }
}

// -- the live token count on MM3 Prompt --------------------------------------------------------
function lmModelOf(node) {
  const slot = node.inputs?.findIndex((i) => i.name === "lm");
  const source = slot >= 0 ? node.getInputNode?.(slot) : null;
  const widget = source?.widgets?.find((w) => w.name === "model_name" || w.name === "lm_model");
  return widget?.value ?? "auto";
}

function scheduleCount(node) {
  clearTimeout(node.mm3CountTimer);
  node.mm3CountTimer = setTimeout(() => countTokens(node), COUNT_DELAY_MS);
}

async function countTokens(node) {
  const value = (name) => node.widgets?.find((w) => w.name === name)?.value ?? "";
  const body = { lm_model: lmModelOf(node), caption: value("caption"), lyrics: value("lyrics") };
  const asked = JSON.stringify(body);
  node.mm3CountAsked = asked;
  let text, warn = false;
  try {
    const r = await api.fetchApi("/mm3/tokens", { method: "POST", body: asked });
    const got = await r.json();
    if (node.mm3CountAsked !== asked) return; // a newer count is on its way
    if (!r.ok) {
      warn = r.status === 400; // a refused text (a control character, ...) or no LM to count with
      text = r.status === 400 && got.error ? got.error : `token count unavailable: ${got.error ?? r.status}`;
    } else {
      warn = got.over;
      text = `${got.tokens} / ${got.limit} prompt tokens` +
        (got.over ? ` (over the budget by ${got.tokens - got.limit}: shorten the caption or lyrics)` : "");
    }
  } catch (e) {
    text = `token count unavailable: ${e}`;
  }
  showText(node, text, { warn });
}

function watchPrompt(node) {
  for (const name of ["caption", "lyrics"]) {
    const widget = node.widgets?.find((w) => w.name === name);
    if (!widget) continue;
    const callback = widget.callback;
    widget.callback = function () {
      scheduleCount(node);
      return callback?.apply(this, arguments);
    };
    widget.element?.addEventListener?.("input", () => scheduleCount(node));
  }
  const changed = node.onConnectionsChange;
  node.onConnectionsChange = function () {
    scheduleCount(node);
    return changed?.apply(this, arguments);
  };
  scheduleCount(node);
}

// -- a seed's "control after generate" only while the seed is typed in, not wired in ------------
function hasSeedControl(nodeData) {
  const inputs = { ...nodeData.input?.required, ...nodeData.input?.optional };
  return Object.values(inputs).some((spec) => spec?.[1]?.control_after_generate);
}

function syncSeedControls(node) {
  let changed = false;
  for (const w of node.widgets ?? []) {
    const control = w.linkedWidgets?.find((c) => c.name === "control_after_generate");
    if (!control) continue;
    const slot = node.inputs?.findIndex((i) => i.widget?.name === w.name) ?? -1;
    const wired = slot >= 0 && !!node.isInputConnected?.(slot);
    if (!!control.hidden !== wired) {
      control.hidden = wired;
      changed = true;
    }
  }
  if (changed) node.setDirtyCanvas?.(true, true);
}

// -- AR Plan saved before its expert knobs moved onto MM3 Sampling Options ------------------------
// The old AR Plan's widget values in order (a seed's control value right after it) and, for each
// moved knob, its default; the new AR Plan keeps the others, in this order.
const OLD_PLAN_WIDGETS = ["duration", "lm_seed", "control_after_generate", "lm_cfg", "lm_top_k", "songs", "takes",
  "require_ending", "ending_rounds", "min_duration", "lm_temperature", "lm_top_p", "lm_penalty",
  "lm_penalty_strength", "lm_penalty_window", "lm_dry_min_match"];
const OPTION_DEFAULTS = { lm_top_k: 50, lm_temperature: 1.0, lm_top_p: 1.0, lm_penalty: "none",
  lm_penalty_strength: 1.1, lm_penalty_window: 320, lm_dry_min_match: 15, ending_rounds: 1 };
const OPTIONS_TYPE = "MM3_SAMPLING_OPTIONS";

function dropInput(graph, node, index) {
  // A moved knob's socket: its link goes, later inputs' links move up one slot.
  const gone = node.inputs[index].link;
  node.inputs.splice(index, 1);
  graph.links = (graph.links ?? []).filter((l) => !(Array.isArray(l) && l[0] === gone));
  for (const n of graph.nodes) {
    for (const o of n.outputs ?? []) if (o.links) o.links = o.links.filter((id) => id !== gone);
  }
  for (const l of graph.links) if (Array.isArray(l) && l[3] === node.id && l[4] > index) l[4] -= 1;
}

export function upgradeWorkflow(graph) {
  if (!Array.isArray(graph?.nodes)) return graph;
  for (const node of [...graph.nodes]) {
    const old = node.widgets_values;
    if (node.type !== "MM3ARPlan" || !Array.isArray(old) || old.length !== OLD_PLAN_WIDGETS.length) continue;
    const value = Object.fromEntries(OLD_PLAN_WIDGETS.map((name, i) => [name, old[i]]));
    node.widgets_values = ["duration", "lm_seed", "control_after_generate", "lm_cfg", "songs", "takes",
      "require_ending", "min_duration"].map((name) => value[name]);
    node.inputs ??= [];
    for (let i = node.inputs.length - 1; i >= 0; i--) {
      if (node.inputs[i].name in OPTION_DEFAULTS) dropInput(graph, node, i);
    }
    const knobs = Object.keys(OPTION_DEFAULTS);
    if (knobs.every((k) => value[k] === OPTION_DEFAULTS[k])) continue; // the same song without the node
    const id = (graph.last_node_id = Math.max(graph.last_node_id ?? 0, ...graph.nodes.map((n) => +n.id || 0)) + 1);
    const link = (graph.last_link_id = (graph.last_link_id ?? 0) + 1);
    graph.nodes.push({ id, type: "MM3SamplingOptions", pos: [node.pos[0], node.pos[1] + (node.size?.[1] ?? 300) + 60],
      size: [node.size?.[0] ?? 400, 320], flags: {}, order: node.order ?? 0, mode: 0, inputs: [],
      outputs: [{ name: "options", type: OPTIONS_TYPE, links: [link], slot_index: 0 }],
      properties: { "Node name for S&R": "MM3SamplingOptions" }, widgets_values: knobs.map((k) => value[k]) });
    node.inputs.push({ name: "options", type: OPTIONS_TYPE, link });
    (graph.links ??= []).push([link, id, 0, node.id, node.inputs.length - 1, OPTIONS_TYPE]);
  }
  return graph;
}

// -- the model inventory sidebar ----------------------------------------------------------------
export function gib(bytes) {
  if (bytes >= 2 ** 30) return `${(bytes / 2 ** 30).toFixed(1)} GiB`;
  if (bytes >= 2 ** 20) return `${(bytes / 2 ** 20).toFixed(1)} MiB`;
  return `${Math.max(1, Math.round(bytes / 2 ** 10))} KiB`;
}

function gb(bytes) { // the published sizes are decimal GB
  return `${(bytes / 1e9).toFixed(1)} GB`;
}

function cell(tag, text, style = "") {
  const el = document.createElement(tag);
  el.textContent = text;
  if (style) el.style.cssText = style;
  return el;
}

function toast(severity, summary, detail) {
  const t = app.extensionManager?.toast;
  t?.add?.({ severity, summary, detail, life: 6000 });
}

const STATE_TEXT = { present: "present", partial: "partly downloaded", missing: "missing", unusable: "unusable" };

export function renderInventory(root, inv) {
  root.replaceChildren();
  // Long folder paths and file names wrap at any character rather than run past the sidebar's edge.
  root.style.cssText = "padding: 8px; font-size: 13px; overflow-y: auto; height: 100%; box-sizing: border-box; " +
    "overflow-wrap: anywhere;";
  root.append(cell("h3", "MiniMax Music 3 models", "margin: 4px 0 8px;"));
  const folders = cell("div", inv.folders.length > 1 ? "Folders:" : "Folder:", "opacity: 0.7; margin-bottom: 8px;");
  for (const f of inv.folders) folders.append(cell("div", f, "font-family: monospace; font-size: 12px;"));
  root.append(folders);
  const table = document.createElement("table");
  table.style.cssText = "width: 100%; border-collapse: collapse;";
  for (const [kind, files] of Object.entries(inv.components)) {
    const row = table.insertRow();
    row.append(cell("td", KIND_TITLES[kind] ?? kind, "font-weight: 600; padding: 2px 4px; vertical-align: top;"));
    const list = cell("td", files.length ? "" : "none: download a set below", files.length ? "" : "color: #f66;");
    for (const f of files) {
      list.append(cell("div", `${f.name} (${f.file_type}, ${gib(f.size)})`));
    }
    row.append(list);
  }
  root.append(table);
  const said = new Map(); // each problem once: later mentions point back to it
  for (const f of inv.unusable) {
    root.append(cell("div", `unusable: ${f.name}: ${f.problem}`, "color: #f66;"));
    said.set(f.name, "see above");
  }
  const dl = inv.download ?? { state: "idle" };
  root.append(cell("h4", "Published sets", "margin: 12px 0 4px;"));
  for (const [set, files] of Object.entries(inv.sets)) {
    const box = document.createElement("div");
    box.style.cssText = "margin: 6px 0; padding: 4px; border: 1px solid var(--border-color, #444);";
    const complete = files.every((f) => f.state === "present");
    box.append(cell("div", `${set}${complete ? ": complete" : ""}`, "font-weight: 600;"));
    for (const f of files) {
      let extra = "";
      if (f.state === "partial") extra = ` (${gib(f.size)} so far)`;
      else if (f.problem && said.has(f.name)) extra = ` (${said.get(f.name)})`;
      else if (f.problem) {
        const problem = f.problem.startsWith(`${f.name}: `) ? f.problem.slice(f.name.length + 2) : f.problem;
        extra = ` (${problem})`;
        said.set(f.name, `see the ${set} set`);
      }
      box.append(cell("div", `${f.name}: ${STATE_TEXT[f.state] ?? f.state}${extra}`,
                      f.state === "present" ? "opacity: 0.7;" : ""));
    }
    const size = inv.set_sizes?.[set];
    if (size && !complete) {
      const short = inv.free != null && size.to_fetch > inv.free;
      const free = inv.free != null ? `, ${gb(inv.free)} free in ${inv.folders[0] ?? "the models folder"}` : "";
      box.append(cell("div", `about ${gb(size.total)}; to download: about ${gb(size.to_fetch)}${free}` +
                      (short ? ": not enough space" : ""), short ? "color: #f66;" : "opacity: 0.8;"));
    } else if (size) {
      box.append(cell("div", `about ${gb(size.total)}`, "opacity: 0.7;"));
    }
    if (!complete && dl.state !== "running") {
      const button = cell("button", `Download the ${set} set`, "margin-top: 4px;");
      button.className = "comfy-btn";
      button.onclick = () => startDownload(root, set);
      box.append(button);
    }
    root.append(box);
  }
  if (dl.state === "running") {
    const pct = dl.total ? ` ${((100 * dl.done) / dl.total).toFixed(1)}%` : "";
    root.append(cell("div", `Downloading the ${dl.set} set: ${dl.file ?? "listing files"}${pct}`, "margin-top: 8px;"));
    const stop = cell("button", "Stop (resumes next time)");
    stop.className = "comfy-btn";
    stop.onclick = () => api.fetchApi("/mm3/download/cancel", { method: "POST" });
    root.append(stop);
  } else if (dl.state === "failed" || dl.state === "cancelled") {
    root.append(cell("div", `Last download ${dl.state}: ${dl.error ?? ""}`, "color: #f66; margin-top: 8px;"));
  }
}

async function refreshInventory(root) {
  try {
    const inv = await (await api.fetchApi("/mm3/inventory")).json();
    renderInventory(root, inv);
    const dl = inv.download ?? {};
    if (root.mm3LastState === "running" && dl.state !== "running") {
      if (dl.state === "done") toast("success", "MM3", `The ${dl.set} set is complete`);
      else toast("error", "MM3 download", dl.error ?? dl.state);
    }
    root.mm3LastState = dl.state;
    clearTimeout(root.mm3Timer);
    if (dl.state === "running") root.mm3Timer = setTimeout(() => refreshInventory(root), 1000);
  } catch (e) {
    root.replaceChildren(cell("div", `Cannot read the model inventory: ${e}`));
  }
}

async function startDownload(root, set) {
  const r = await api.fetchApi("/mm3/download", { method: "POST", body: JSON.stringify({ set }) });
  if (!r.ok) toast("error", "MM3 download", (await r.json()).error ?? r.status);
  root.mm3LastState = "running";
  refreshInventory(root);
}

app.registerExtension({
  name: "MM3.GGUF.Nodes",
  setup() {
    api.addEventListener?.("mm3.window", (e) => onWindow(e.detail));
    api.addEventListener?.("executed", (e) => onExecuted(e.detail));
    const tabs = app.extensionManager;
    const register = tabs?.registerSidebarTab?.bind(tabs) ?? tabs?.sidebarTab?.registerSidebarTab?.bind(tabs.sidebarTab);
    register?.({
      id: "mm3-models", icon: "pi pi-box", title: "MM3 models", tooltip: "MiniMax Music 3 model files",
      type: "custom",
      render: (el) => refreshInventory(el),
    });
  },
  beforeConfigureGraph(graph) {
    upgradeWorkflow(graph);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name === "MM3SaveSong") {
      nodeData.input.required.audioUI = ["AUDIO_UI", {}]; // the player core gives SaveAudio
    }
    if (LIVE_NODES.has(nodeData.name)) {
      const created = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const r = created?.apply(this, arguments);
        playerOf(this);
        return r;
      };
    }
    if (hasSeedControl(nodeData)) {
      for (const hook of ["onConnectionsChange", "onConfigure"]) {
        const own = nodeType.prototype[hook];
        nodeType.prototype[hook] = function () {
          const r = own?.apply(this, arguments);
          syncSeedControls(this);
          return r;
        };
      }
    }
    if (!TEXT_NODES.has(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      if (message?.text) showText(this, message.text);
    };
    if (nodeData.name === "MM3PromptAssemble") {
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const r = onNodeCreated?.apply(this, arguments);
        infoWidget(this);
        requestAnimationFrame(() => watchPrompt(this)); // once the widgets hold their loaded values
        return r;
      };
    }
  },
});
