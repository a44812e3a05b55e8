"""UI-format <-> API-format ComfyUI workflows, from a server's /object_info.

The API files in `workflows/api/` are the source; `python tests/helpers/comfy_workflows.py --server URL`
writes the UI files the editor loads (`workflows/*.json`, listed in ComfyUI's template browser)
from them, and the tests convert each UI file back and compare. Widget values are positional: each
widget input of the node's schema in order, a seed's control_after_generate value right after it.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "workflows"
API_DIR = WORKFLOWS / "api"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
NOTE_TYPES = {"Note", "MarkdownNote"}  # editor-only nodes, not in the API format
PACK_ID = "comfyui-mm3-gguf"
NODE_PACKS = {"MM3": PACK_ID, "Distributed": "comfyui-distributed"}  # class-name prefix -> its pack's registry id
WIDTH, COLUMN, GAP, ROW_GAP = 400, 460, 50, 70  # node width, column pitch, gaps between nodes and rows
TITLE = 30  # the title bar, drawn above a node's position
MAX_COLUMNS = 5  # per row: a wider graph goes on two rows
# The editor window the saved view is made for, and what of it the editor's own bars cover: the
# graph is drawn inside (LEFT, TOP) - (WINDOW - RIGHT/BOTTOM) at the saved scale and offset.
WINDOW = (1600, 1000)
LEFT, TOP, RIGHT, BOTTOM = 80, 110, 20, 20
NOTE_SIZE = [WIDTH, 400]  # beside the first row
WIDE_NOTE_SIZE = [3 * COLUMN - (COLUMN - WIDTH), 150]  # above it
# MM3 Generate as the editor draws it: its widgets, two text boxes, the live player with lyric lines
# (web/mm3.js) and the node's text; short enough that its workflow's Note clears the queue panel.
GENERATE_HEIGHT = 930
PLAYER_ROOM = 84  # the live player a Vocoder Decode grows by once its windows come (web/mm3_player.js)
TALLEST = 700  # a column of stacked nodes taller than this is split in two side by side

NOTES = {
    "text_to_song": "Caption + lyrics -> a song. Put a set of the five GGUF files in models/mm3 (from the pack's "
                    "folder: python -m mm3 download --set q8 --dir ../../models/mm3). The light and native sets "
                    "work the same, and the MM3 models sidebar downloads them too. The loaders' auto picks the most "
                    "precise file of each component that fits the GPU. lm_seed picks the song (change it, or set it to "
                    "randomize, for another). The AR plan is the slow part and ComfyUI caches it: change only the DiT "
                    "seed, steps or cfg and queue again to re-render the same plan. Save Song writes the replay JSON "
                    "beside the audio.",
    "variations_from_one_plan": "One AR plan, three DiT variations (seed, seed + 1, seed + 2). Save Audio Codes keeps "
                                "the plan; Save Song writes one file per variation, Save Audio (FLAC) shows the same "
                                "AUDIO in ComfyUI's own saver.",
    "natural_ending_takes": "Four takes of a song planned together (lm_seed, lm_seed + 1, ...): the first that ends by "
                            "itself before the 120 s cap (and after min_duration) is kept; with require_ending a "
                            "second round is planned at the next seeds if none did. AR Plan's text says which takes "
                            "ended and when.",
    "continue_song": "Plans 30 s, then a second AR Plan continues that song to 60 s: its codes are kept and new frames "
                     "follow from lm_seed 43. Wire prior_codes from MM3 Load Audio Codes to extend a saved song.",
    "repaint_range": "Renders a 30 s song, then MM3 Repaint samples seconds 10-20 again with another seed and keeps "
                     "the rest (a short crossfade at the edges). Both are saved. To repaint your own recording, "
                     "feed MM3 Vocoder Encode's latents (a vocoder file with its encoder) as the source.",
    "edit_a_line": "Changes the words of one sung line and keeps the rest of the song. MM3 Change a Line times "
                   "the plan's lyric lines (the player on Vocoder Decode shows them after a run: click one to choose "
                   "it, or set line: 1 = the first sung line, section tags not counted), plans that line's seconds "
                   "again under the lyrics with its new words (lm_seed picks the take) and keeps the codes after "
                   "it; MM3 Repaint renders those seconds anew over the original's latents and keeps the audio "
                   "elsewhere. The replay JSON records the new lyrics, the edit and its seeds.",
    "songs_across_workers": "Needs ComfyUI-Distributed, its workers enabled, and this pack with a model set on every "
                            "server. Each server makes its own song: Distributed Seed gives the master lm_seed 42 and "
                            "worker i 42 + i (change it for other songs; keep it fixed). MM3 Pack Songs joins a "
                            "server's songs and writes their lengths and replay requests into a card image; the "
                            "Distributed Collector brings every worker's audio and card to the master, where MM3 "
                            "Unpack Songs cuts the songs apart for Save Song (each with its replay JSON). Keep songs "
                            "at 1 per server.",
    "variations_across_workers": "Needs ComfyUI-Distributed, its workers enabled, and this pack with a model set on "
                                 "every server. Plan once on the master (text_to_song, or AR Plan into Save Audio "
                                 "Codes), then paste that replay JSON's text into MM3 Audio Codes From Text: the text "
                                 "travels inside the workflow to every worker, and each server checks its own LM and "
                                 "depth files against the fingerprints it records. Distributed Seed gives the master "
                                 "seed 100 and worker i 100 + i: one variation each, collected and saved on the "
                                 "master with their replay JSONs.",
    "generate_in_one_node": "Caption + lyrics -> a song in one node: MM3 Generate plans, denoises and decodes. Where "
                            "the five models fit in memory together, each 8 s window is rendered as soon as its "
                            "frames are planned, and the player on the node plays the windows as they come, before "
                            "the song is done (click the waveform to jump). With these settings it is text_to_song's "
                            "song.",
    "rerender_from_codes": "Renders a saved replay JSON again: Save Song and Save Audio Codes write them (into "
                           "output/mm3; they are listed with [output]), or put one in input/. The list is empty until "
                           "a first song was saved: run text_to_song first. The codes are replayed, not sampled; the "
                           "seed, steps and cfg come from the file, so the same files give the same audio.",
}
CONTROL: dict[tuple[str, str], str] = {}  # (workflow, input) -> control_after_generate value; "fixed" otherwise


def fetch_object_info(server: str) -> dict:
    with urllib.request.urlopen(f"{server.rstrip('/')}/object_info", timeout=60) as r:
        return json.load(r)


def schema_inputs(info: dict) -> list[tuple[str, str, dict]]:
    """(name, type, options) of every input in order (required, then optional)."""
    out = []
    for cat in ("required", "optional"):
        for name in info.get("input_order", {}).get(cat, []):
            spec = info["input"][cat][name]
            typ = "COMBO" if isinstance(spec[0], list) else spec[0]
            out.append((name, typ, spec[1] if len(spec) > 1 else {}))
    return out


def is_widget(typ: str, opts: dict) -> bool:
    return typ in WIDGET_TYPES and not opts.get("forceInput")


def has_control(name: str, typ: str, opts: dict) -> bool:
    """Whether the editor gives this widget a "control after generate" value: when its schema says
    so, and for an INT named seed or noise_seed (ComfyUI-Distributed's Distributed Seed) unless it
    says not to."""
    return opts.get("control_after_generate", typ == "INT" and name in ("seed", "noise_seed"))


def _depths(api: dict) -> dict[str, int]:
    depth = {}

    def d(nid):
        if nid not in depth:
            srcs = [v[0] for v in api[nid]["inputs"].values() if isinstance(v, list)]
            depth[nid] = 1 + max((d(s) for s in srcs), default=-1)
        return depth[nid]

    for nid in api:
        d(nid)
    return depth


def node_height(class_type: str, widgets: int, sockets: int) -> int:
    """Room for the editor's own layout of a node: its slots and widget rows (MM3 Prompt: two text
    boxes; MM3 Audio Codes From Text: one; MM3 Generate and Vocoder Decode: their players too)."""
    tall = {"MM3PromptAssemble": 480, "MM3AudioCodesFromText": 320, "MM3Generate": GENERATE_HEIGHT}
    player = PLAYER_ROOM if class_type == "MM3VocoderDecode" else 0
    return tall.get(class_type, 60 + 28 * widgets + 24 * sockets + player)


def layout(columns: list[list[tuple[str, int]]]) -> tuple[dict[str, list[int]], tuple[list[int], list[int]]]:
    """Positions of the nodes (per depth column: (id, height)) and the Note's position and size: at
    most MAX_COLUMNS columns a row (as few rows as that allows), a tall column split in two; the Note
    in the first row's first free column, else above the first row (the window's bottom right, where
    the editor's minimap sits, stays free)."""
    split = []
    for column in columns:
        height = sum(TITLE + h + GAP for _, h in column)
        half = len(column) - len(column) // 2
        split += [column[:half], column[half:]] if height > TALLEST and len(column) > 1 else [column]
    columns = split
    rows_needed = -(-len(columns) // MAX_COLUMNS)
    per_row = -(-len(columns) // rows_needed)
    rows = [columns[i:i + per_row] for i in range(0, len(columns), per_row)]
    note_top = per_row >= MAX_COLUMNS
    pos, y0 = {}, (WIDE_NOTE_SIZE[1] + TITLE + GAP) if note_top else 0
    for row in rows:
        bottom = y0
        for c, column in enumerate(row):
            y = y0
            for nid, height in column:
                pos[nid] = [c * COLUMN, y + TITLE]
                y += TITLE + height + GAP
            bottom = max(bottom, y - GAP)
        y0 = bottom + ROW_GAP
    note = ([0, TITLE], list(WIDE_NOTE_SIZE)) if note_top else ([per_row * COLUMN, TITLE], list(NOTE_SIZE))
    return pos, note


def saved_view(boxes: list[tuple[float, float, float, float]]) -> dict:
    """The scale and offset at which the boxes (x0, y0, x1, y1, title bars included) fill the
    window's visible area, centred, at most 1:1."""
    x0, y0 = min(b[0] for b in boxes), min(b[1] for b in boxes)
    x1, y1 = max(b[2] for b in boxes), max(b[3] for b in boxes)
    w, h = WINDOW[0] - LEFT - RIGHT, WINDOW[1] - TOP - BOTTOM
    scale = min(1.0, w / (x1 - x0), h / (y1 - y0)) * 0.98
    scale = int(scale * 100) / 100
    dx, dy = (w - (x1 - x0) * scale) / 2, (h - (y1 - y0) * scale) / 2
    return {"scale": scale, "offset": [round((LEFT + dx) / scale - x0, 1), round((TOP + dy) / scale - y0, 1)]}


def boxes_on_screen(ui: dict) -> list[tuple[str, list[float]]]:
    """(node, [x0, y0, x1, y1]) of each node, its title bar included, in window pixels at the saved view."""
    ds = ui["extra"]["ds"]
    s, (ox, oy) = ds["scale"], ds["offset"]
    return [(f"{n['type']} #{n['id']}", [(n["pos"][0] + ox) * s, (n["pos"][1] - TITLE + oy) * s,
                                         (n["pos"][0] + n["size"][0] + ox) * s, (n["pos"][1] + n["size"][1] + oy) * s])
            for n in ui["nodes"]]


def ui_from_api(name: str, api: dict, object_info: dict) -> dict:
    depth = _depths(api)
    order = sorted(api, key=lambda n: (depth[n], int(n)))
    nodes = []
    out_links: dict[tuple[str, int], list[int]] = {}
    for nid in order:  # links first: every target's inputs
        for v in api[nid]["inputs"].values():
            if isinstance(v, list):
                out_links.setdefault((v[0], v[1]), [])
    link_id = 0
    pending = []
    columns: list[list[tuple[str, int]]] = [[] for _ in range(max(depth.values()) + 1)]
    for rank, nid in enumerate(order):
        node = api[nid]
        info = object_info[node["class_type"]]
        inputs, widgets = [], []
        for iname, typ, opts in schema_inputs(info):
            value = node["inputs"].get(iname)
            linked = isinstance(value, list)
            if is_widget(typ, opts):
                widgets.append(opts.get("default") if linked else value)
                if has_control(iname, typ, opts):
                    widgets.append(CONTROL.get((name, iname), "fixed"))
            if linked:
                link_id += 1
                entry = {"name": iname, "type": typ, "link": link_id}
                if is_widget(typ, opts):
                    entry["widget"] = {"name": iname}
                pending.append((link_id, int(value[0]), value[1], int(nid), len(inputs), typ))
                out_links[(value[0], value[1])].append(link_id)
                inputs.append(entry)
        outputs = [{"name": oname, "type": otype, "links": out_links.get((nid, i), []), "slot_index": i}
                   for i, (oname, otype) in enumerate(zip(info["output_name"], info["output"]))]
        for i, is_list in enumerate(info.get("output_is_list", [])):
            if is_list:
                outputs[i]["shape"] = 6  # the editor's list marker
        height = node_height(node["class_type"], len(widgets), max(len(inputs), len(outputs)))
        columns[depth[nid]].append((nid, height))
        cnr = next((pack for prefix, pack in NODE_PACKS.items() if node["class_type"].startswith(prefix)), "comfy-core")
        entry = {"id": int(nid), "type": node["class_type"], "pos": [0, 0], "size": [WIDTH, height],
                 "flags": {}, "order": rank, "mode": 0, "inputs": inputs, "outputs": outputs,
                 "properties": {"Node name for S&R": node["class_type"], "cnr_id": cnr},
                 "widgets_values": widgets}
        title = node.get("_meta", {}).get("title")
        if title and title != info.get("display_name"):
            entry["title"] = title
        nodes.append(entry)
    pos, (note_pos, note_size) = layout(columns)
    for entry in nodes:
        entry["pos"] = pos[str(entry["id"])]
    note_id = max(int(n) for n in api) + 1
    nodes.append({"id": note_id, "type": "Note", "pos": note_pos, "size": note_size, "flags": {},
                  "order": len(order), "mode": 0, "inputs": [], "outputs": [], "properties": {},
                  "widgets_values": [NOTES.get(name, "")]})
    links = [list(p) for p in pending]
    wf_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{PACK_ID}/workflows/{name}"))  # the editor wants a UUID
    ui = {"id": wf_id, "revision": 0, "last_node_id": note_id, "last_link_id": link_id,
          "nodes": nodes, "links": links, "groups": [], "config": {}, "extra": {}, "version": 0.4}
    ui["extra"]["ds"] = {"scale": 1.0, "offset": [0, 0]}
    ui["extra"]["ds"] = saved_view([b for _, b in boxes_on_screen(ui)])
    return ui


def schema_problems(ui: dict) -> list[str]:
    """What the editor's workflow schema (version 0.4: zComfyWorkflow of the ComfyUI frontend) would
    reject, checked field by field; empty when the file loads."""
    bad = []

    def need(ok, what):
        if not ok:
            bad.append(what)

    num = (int, float)
    try:
        uuid.UUID(str(ui.get("id")))
    except ValueError:
        bad.append(f"id {ui.get('id')!r} is not a UUID")
    need(isinstance(ui.get("version"), num), "version must be a number")
    need(isinstance(ui.get("last_node_id"), (int, str)) and isinstance(ui.get("last_link_id"), num),
         "last_node_id / last_link_id")
    need(isinstance(ui.get("config", {}), dict) and isinstance(ui.get("groups", []), list), "config / groups")
    ds = (ui.get("extra") or {}).get("ds")
    need(ds is None or (isinstance(ds.get("scale"), num) and len(ds.get("offset", [])) == 2), "extra.ds")
    ids = set()
    for n in ui["nodes"]:
        where = f"node {n.get('id')}"
        ids.add(n.get("id"))
        need(isinstance(n.get("id"), (int, str)) and isinstance(n.get("type"), str), f"{where}: id / type")
        for key in ("pos", "size"):
            need(isinstance(n.get(key), list) and len(n[key]) == 2 and all(isinstance(v, num) for v in n[key]),
                 f"{where}: {key}")
        need(isinstance(n.get("flags"), dict) and isinstance(n.get("properties"), dict), f"{where}: flags / properties")
        need(isinstance(n.get("order"), num) and isinstance(n.get("mode"), num), f"{where}: order / mode")
        need(isinstance(n.get("widgets_values", []), (list, dict)), f"{where}: widgets_values")
        for i in n.get("inputs", []):
            need(isinstance(i.get("name"), str) and isinstance(i.get("type"), (str, list, int))
                 and (i.get("link") is None or isinstance(i["link"], int)), f"{where}: input {i}")
        for o in n.get("outputs", []):
            need(isinstance(o.get("name"), str) and isinstance(o.get("type"), (str, list, int))
                 and all(isinstance(x, int) for x in (o.get("links") or [])), f"{where}: output {o}")
    by_id = {n.get("id"): n for n in ui["nodes"]}
    for lk in ui["links"]:
        ok = (isinstance(lk, list) and len(lk) == 6 and isinstance(lk[0], int) and lk[1] in ids and lk[3] in ids
              and isinstance(lk[2], int) and isinstance(lk[4], int))
        need(ok, f"link {lk}")
        if ok:  # both ends name the link (what the graph is rebuilt from)
            src, dst = by_id[lk[1]].get("outputs", []), by_id[lk[3]].get("inputs", [])
            need(lk[2] < len(src) and lk[0] in (src[lk[2]].get("links") or []), f"link {lk}: not on its output")
            need(lk[4] < len(dst) and dst[lk[4]].get("link") == lk[0], f"link {lk}: not on its input")
    return bad


def api_from_ui(ui: dict, object_info: dict) -> dict:
    """The API prompt the editor would queue for a UI workflow (widget values and links)."""
    link_src = {lk[0]: (str(lk[1]), lk[2]) for lk in ui["links"]}
    api = {}
    for node in ui["nodes"]:
        if node["type"] in NOTE_TYPES or node.get("mode", 0) in (2, 4):
            continue
        info = object_info[node["type"]]
        values = list(node.get("widgets_values") or [])
        linked = {i["name"]: i["link"] for i in node.get("inputs", []) if i.get("link") is not None}
        inputs, k = {}, 0
        for iname, typ, opts in schema_inputs(info):
            widget_value = None
            if is_widget(typ, opts):
                widget_value = values[k]
                k += 2 if has_control(iname, typ, opts) else 1
            if iname in linked:
                inputs[iname] = list(link_src[linked[iname]])
            elif is_widget(typ, opts):
                inputs[iname] = widget_value
        api[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return api


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="write workflows/*.json (UI format) from workflows/api/*.json")
    p.add_argument("--server", required=True, help="a running ComfyUI with this pack, e.g. http://127.0.0.1:8188")
    args = p.parse_args(argv)
    info = fetch_object_info(args.server)
    for path in sorted(API_DIR.glob("*.json")):
        api = json.loads(path.read_text())
        ui = ui_from_api(path.stem, api, info)
        (WORKFLOWS / path.name).write_text(json.dumps(ui, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {WORKFLOWS / path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
