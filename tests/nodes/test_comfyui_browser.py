"""The editor as a newcomer meets it: a real ComfyUI (COMFYUI_PATH) with only the tiny model files in
models/mm3, driven in headless Chromium through Playwright (the system's Chromium: MM3_CHROMIUM, or
`chromium` on the PATH; Playwright never downloads a browser here).

Each shipped workflow is opened from the template browser's files and run without editing a widget;
it opens at its saved view with every node in sight in a 1600 x 1000 window, its nodes do not
overlap and are wide enough for their widgets. Changing only the DiT seed re-runs
the synthesis while AR Plan comes from ComfyUI's cache. Typing lyrics updates MM3 Prompt's token
count before anything runs. The pack's script loads without a console error or warning, and every
template has its card, a square picture that says what the workflow makes. With MM3_SCREENSHOTS=DIR
the test also writes 1600 x 1000 screenshots there (each workflow at its saved view after its run,
the models sidebar, the pack's cards in the template browser: docs/images). COMFYUI_ARGS adds
arguments to ComfyUI's command line, e.g. `--front-end-root DIR` for another editor than the one
its requirements pin (the `comfyui_frontend_package/static` folder of a newer package).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers.comfy_server import ComfyServer
from tests.helpers.comfyui import API_DIR, COMFYUI_PATH, OWN_WORKFLOWS, needs_comfy

ROOT = Path(__file__).resolve().parents[2]
PACK = "ComfyUI-MM3-GGUF"
WORKFLOWS = OWN_WORKFLOWS  # those for ComfyUI-Distributed need its nodes (tests/nodes/test_comfyui_distributed.py)
# edit_a_line times the lyrics with the released LM's heads, which the tiny LM lacks: it is opened and
# run with heads of the tiny LM in tests/nodes/test_comfyui_browser_lyric_edit.py
WORKFLOWS = [w for w in WORKFLOWS if w != "edit_a_line"]
TEMPLATES = sorted(p.stem for p in API_DIR.glob("*.json"))
PACK_WARNINGS = ("[ComfyUI Notice]", "[ComfyUI Deprecated]", "[DEPRECATED]", "Unhandled message", "mm3", "MM3")
pytestmark = pytest.mark.slow


def _chromium() -> str | None:
    return os.environ.get("MM3_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    path = _chromium()
    if path is None:
        pytest.skip("no Chromium found (install Debian's chromium package or set MM3_CHROMIUM)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


class Editor:
    """One editor page, with every console message and failed request it produced."""

    def __init__(self, browser, comfy):
        self.comfy = comfy
        self.page = browser.new_page(viewport={"width": 1600, "height": 1000})
        self.console: list[str] = []
        self.failed: list[str] = []
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
        self.page.on("response", lambda r: r.status >= 400 and self.failed.append(f"{r.status} {r.url}"))
        self.open()

    def open(self):
        self.page.goto(self.comfy.url, wait_until="networkidle")
        self.page.wait_for_function("() => window.app && window.app.graph && window.app.extensionManager")

    def load_template(self, name: str):
        """The workflow as the template browser opens it: the pack's file from its template route."""
        wf = self.page.evaluate(f"""async () => (await fetch("/api/workflow_templates/{PACK}/{name}.json")).json()""")
        # Under its name, as the template browser opens it (the tab says which workflow it is).
        self.page.evaluate("async ([wf, name]) => { await window.app.loadGraphData(wf, true, true, name); }",
                           [wf, name])
        self.page.wait_for_timeout(500)
        self.close_dialogs()

    def close_dialogs(self):
        """Close what the frontend opens by itself (its template browser, on a new workflow tab)."""
        close = self.page.locator(".p-dialog.global-dialog button:not(.pointer-events-none)")
        for _ in range(3):  # its close button (the hidden one beside it is its back button)
            if not close.count():
                break
            close.first.click()
            self.page.wait_for_timeout(400)
        overlay = self.page.locator("[data-slot='dialog-overlay']")  # newer editors' dialogs: Escape closes
        for _ in range(3):
            if not overlay.count():
                return
            self.page.keyboard.press("Escape")
            self.page.wait_for_timeout(400)

    def queue(self) -> str:
        """Queue the open workflow as the Run button does; returns the prompt id."""
        before = set(self.comfy.get("/history"))
        self.page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            queue = self.comfy.get("/queue")
            ids = [q[1] for q in queue["queue_running"] + queue["queue_pending"]]
            new = [i for i in ids if i not in before] + [i for i in self.comfy.get("/history") if i not in before]
            if new:
                return new[0]
            time.sleep(0.2)
        raise AssertionError("the editor queued nothing:\n" + "\n".join(self.console[-20:]))

    def nodes(self) -> list[dict]:
        return self.page.evaluate("""() => window.app.graph._nodes.map((n) => ({
            id: n.id, type: n.type, pos: [...n.pos], size: [...n.size], need: [...n.computeSize()],
            widgets: (n.widgets || []).map((w) => [w.name, w.value]) }))""")

    def view(self) -> dict:
        return self.page.evaluate("() => ({ scale: window.app.canvas.ds.scale, offset: [...window.app.canvas.ds.offset] })")

    def hidden_nodes(self) -> list[str]:
        """Nodes not wholly in sight at the current view: a corner of the node (its title bar
        included) off the window, or under something that is neither the canvas nor a node's own
        widget (the editor's side bar, top bar, menus, minimap)."""
        return self.page.evaluate("""() => { const c = window.app.canvas, s = c.ds.scale, [ox, oy] = c.ds.offset;
            const r = c.canvas.getBoundingClientRect(), title = 30;
            const seen = (x, y) => { if (x < 0 || y < 0 || x > innerWidth || y > innerHeight) return false;
                const e = document.elementFromPoint(x, y);
                return e === c.canvas || !!e?.closest?.(".dom-widget") || ["TEXTAREA", "AUDIO"].includes(e?.tagName); };
            if (seen(10, innerHeight / 2)) return ["the side bar is not found over the canvas: check this test"];
            return window.app.graph._nodes.flatMap((n) => {
                const x0 = r.left + (n.pos[0] + ox) * s + 3, y0 = r.top + (n.pos[1] - title + oy) * s + 3;
                const x1 = r.left + (n.pos[0] + n.size[0] + ox) * s - 3, y1 = r.top + (n.pos[1] + n.size[1] + oy) * s - 3;
                const out = [[x0, y0], [x1, y0], [x0, y1], [x1, y1]].filter(([x, y]) => !seen(x, y));
                return out.length ? [`${n.type} #${n.id} at ${out.map((p) => p.map(Math.round).join(",")).join(" ")}`] : [];
            }); }""")

    def saved_view_screenshot(self, name: str):
        """With MM3_SCREENSHOTS set to a folder: the window as it is (the workflow's saved view)."""
        if os.environ.get("MM3_SCREENSHOTS"):
            self.page.mouse.move(1592, 600)  # on the bare canvas: no hover highlight or tooltip
            self.page.wait_for_timeout(300)
            self.window_screenshot(name)

    def window_screenshot(self, name: str):
        """With MM3_SCREENSHOTS set to a folder: the 1600 x 1000 window into it, a PNG of at most 256
        colours (far fewer bytes; the editor's flat colours survive)."""
        folder = os.environ.get("MM3_SCREENSHOTS")
        if folder:
            from PIL import Image

            Path(folder).mkdir(parents=True, exist_ok=True)
            path = Path(folder) / name
            # The minimap and the canvas's debug figures hidden for the picture, then put back.
            hide = {"Comfy.Minimap.Visible": False, "Comfy.Graph.CanvasInfo": False}
            was = self.page.evaluate("""async (hide) => { const s = window.app.extensionManager.setting, was = {};
                for (const [k, v] of Object.entries(hide)) { try { was[k] = s.get(k); await s.set(k, v); }
                    catch (e) { /* a setting this editor lacks */ } }
                window.app.canvas.setDirty(true, true); return was; }""", hide)
            self.page.wait_for_timeout(400)
            self.page.screenshot(path=str(path))
            self.page.evaluate("""async (was) => { const s = window.app.extensionManager.setting;
                for (const [k, v] of Object.entries(was)) await s.set(k, v); }""", was)
            with Image.open(path) as img:
                small = img.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
            small.save(path, optimize=True)

    def pack_messages(self) -> list[str]:
        return [m for m in self.console if m.startswith(("warning", "error", "pageerror"))
                and any(k in m for k in PACK_WARNINGS)]


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI for the editor tests, its torch on one CPU thread: the browser needs the other core
    (two busy-waiting torch threads against a rendering browser slow a run down many times)."""
    if not COMFYUI_PATH:
        pytest.skip("COMFYUI_PATH is not set (a ComfyUI checkout to run)")
    server = ComfyServer(COMFYUI_PATH, os.environ.get("COMFYUI_PYTHON"), env={"OMP_NUM_THREADS": "1"},
                         extra_args=tuple(shlex.split(os.environ.get("COMFYUI_ARGS", "")))).start()
    yield server
    server.stop()


@pytest.fixture()
def editor(browser, comfy):
    e = Editor(browser, comfy)
    yield e
    e.page.close()


def _overlaps(nodes: list[dict]) -> list[str]:
    title = 30  # the title bar sits above a node's position
    out = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            ax0, ay0, ax1, ay1 = a["pos"][0], a["pos"][1] - title, a["pos"][0] + a["size"][0], a["pos"][1] + a["size"][1]
            bx0, by0, bx1, by1 = b["pos"][0], b["pos"][1] - title, b["pos"][0] + b["size"][0], b["pos"][1] + b["size"][1]
            if ax0 < bx1 and bx0 < ax1 and ay0 < by1 and by0 < ay1:
                out.append(f"{a['type']} #{a['id']} overlaps {b['type']} #{b['id']}")
    return out


def _entry(comfy, prompt_id: str, timeout: float = 900) -> dict:
    entry = comfy.wait(prompt_id, timeout=timeout)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[:3000]
    return entry


def _cached(entry: dict) -> set[str]:
    return {n for kind, data in entry["status"]["messages"] if kind == "execution_cached" for n in data["nodes"]}


@needs_comfy
def test_each_workflow_runs_as_shipped_with_only_the_tiny_files(editor, comfy):
    """Open every template, run it untouched (rerender_from_codes after text_to_song saved a song
    and the page was reloaded, as its note says), check layout, console and thumbnails. Each opens
    at its saved view with every node, the Note too, in sight in the 1600 x 1000 window, before and
    after its run; a seed wired in shows no "control after generate"."""
    order = ["text_to_song"] + [w for w in WORKFLOWS if w != "text_to_song"]
    for name in order:
        if name == "rerender_from_codes":
            editor.open()  # the codes file list is read when the page loads
        editor.load_template(name)
        saved = json.loads((ROOT / "workflows" / f"{name}.json").read_text())["extra"]["ds"]
        view = editor.view()
        assert view["scale"] == pytest.approx(saved["scale"]) and view["offset"] == pytest.approx(saved["offset"]), (
            name, view, saved)
        assert not editor.hidden_nodes(), (name, editor.hidden_nodes())
        nodes = editor.nodes()
        assert not _overlaps(nodes), (name, _overlaps(nodes))
        narrow = [(n["type"], n["size"][0], n["need"][0]) for n in nodes if n["size"][0] + 1 < n["need"][0]]
        assert not narrow, (name, narrow)  # widgets (a file name in a combo) are not cut
        loaders = [w for n in nodes if n["type"].startswith("MM3Load") and "Codes" not in n["type"]
                   for w in n["widgets"] if w[0].endswith(("model_name", "_model"))]
        assert loaders and all(v == "auto" for _, v in loaders), (name, loaders)
        wired = editor.page.evaluate("""() => window.app.graph._nodes.flatMap((n) => (n.widgets || [])
            .filter((w) => w.linkedWidgets && n.isInputConnected(n.inputs?.findIndex((i) => i.widget?.name === w.name)))
            .map((w) => [n.type, w.name, !!w.linkedWidgets[0].hidden]))""")
        assert all(hidden for _, _, hidden in wired), (name, wired)
        if name == "rerender_from_codes":  # the file's seed is wired into the sampler
            assert wired, name
        _entry(comfy, editor.queue())
        editor.page.wait_for_timeout(500)  # the nodes' texts and the audio player
        nodes = editor.nodes()
        assert not _overlaps(nodes) and not editor.hidden_nodes(), (name, _overlaps(nodes), editor.hidden_nodes())
        editor.saved_view_screenshot(f"{name}.png")
    assert not editor.pack_messages(), editor.pack_messages()
    thumbs = [f for f in editor.failed if "workflow_templates" in f or "/extensions/" in f]
    assert not thumbs, thumbs
    for name in TEMPLATES:  # the template browser's cards, as it asks for them
        thumb = comfy.get(f"/api/workflow_templates/{PACK}/{name}.jpg")
        assert thumb[:3] == b"\xff\xd8\xff", name  # a JPEG


@needs_comfy
def test_template_browser_shows_a_card_for_each_workflow(editor, comfy):
    """The template browser's page of the pack: a card for each workflow, its picture loaded and
    square (drawn whole: the browser fits it into a square)."""
    editor.close_dialogs()
    editor.page.evaluate("""async () => { await window.app.extensionManager.command.execute("Comfy.BrowseTemplates"); }""")
    editor.page.get_by_text(PACK, exact=True).first.click()
    shown = {}
    for name in TEMPLATES:  # a card's title is the workflow's name, its picture's alt text too
        editor.page.get_by_text(name, exact=True).first.scroll_into_view_if_needed()  # drawn once in sight
        picture = f"""() => {{ const i = [...document.querySelectorAll("img")].find((i) => i.alt === "{name}");
            return i && i.complete && i.naturalWidth ? [i.naturalWidth, i.naturalHeight] : null; }}"""
        editor.page.wait_for_function(picture, timeout=20000)
        shown[name] = editor.page.evaluate(picture)
    assert all(w == h for w, h in shown.values()), shown
    editor.page.evaluate("() => document.querySelectorAll('*').forEach((e) => { if (e.scrollTop) e.scrollTop = 0; })")
    editor.page.mouse.move(800, 20)  # no card under the pointer (it would zoom)
    editor.page.wait_for_timeout(500)
    editor.window_screenshot("template_cards.png")


@needs_comfy
def test_changing_only_the_dit_seed_reuses_the_ar_plan(editor, comfy):
    editor.load_template("text_to_song")
    first = _entry(comfy, editor.queue())
    ar = next(n["id"] for n in editor.nodes() if n["type"] == "MM3ARPlan")
    editor.page.evaluate("""() => { const s = window.app.graph._nodes.find((n) => n.type === "MM3FlowSampler");
        const w = s.widgets.find((w) => w.name === "seed"); w.value = w.value + 1; }""")
    second = _entry(comfy, editor.queue())
    assert str(ar) in _cached(second), (_cached(first), _cached(second))
    sampler = next(n["id"] for n in editor.nodes() if n["type"] == "MM3FlowSampler")
    assert str(sampler) not in _cached(second)


@needs_comfy
def test_typing_lyrics_updates_the_token_count(editor, comfy):
    editor.load_template("text_to_song")
    read = """() => { const n = window.app.graph._nodes.find((n) => n.type === "MM3PromptAssemble");
        return n.widgets.find((w) => w.name === "mm3_info")?.value ?? ""; }"""
    editor.page.wait_for_function(f"({read})().includes('prompt tokens')", timeout=20000)
    before = editor.page.evaluate(read)
    box = editor.page.locator('textarea[placeholder^="Lyrics:"]').first
    box.click()
    box.press("Control+End")
    box.type("\nand a new line of lyrics that adds some tokens")
    editor.page.wait_for_function(f"({read})() !== {json.dumps(before)}", timeout=20000)
    after = editor.page.evaluate(read)
    assert int(after.split(" / ")[0]) > int(before.split(" / ")[0]), (before, after)
    assert not editor.pack_messages(), editor.pack_messages()


@needs_comfy
def test_model_sidebar_lists_the_components(editor, comfy):
    editor.load_template("text_to_song")  # beside the sidebar in the screenshot; closes the template browser
    # The tab's button: its class in the 0.8.0 editor, its label in newer ones.
    editor.page.locator(".mm3-models-tab-button, button.side-bar-button:has-text('MM3 models')").first.click()
    editor.page.wait_for_selector("text=MiniMax Music 3 models", timeout=20000)
    text = editor.page.inner_text("body")
    for title in ("Language model", "Depth decoder", "Condition encoder", "DiT", "Vocoder", "q8", "light", "native"):
        assert title in text, title
    assert "about 28.6 GB; to download: about" in text and " GB free in " in text, text  # before the click
    assert " KiB)" in text and "(F32, 0.0 MiB)" not in text, text  # the tiny files' sizes
    # Nothing runs past the sidebar's right edge (long folder paths and file names wrap).
    wide = editor.page.evaluate("""() => { const h = [...document.querySelectorAll("h3")]
            .find((e) => e.textContent === "MiniMax Music 3 models"), root = h.parentElement;
        const edge = root.getBoundingClientRect().right + 1;
        return [...root.querySelectorAll("*")].filter((e) => e.getBoundingClientRect().right > edge)
            .map((e) => e.textContent.slice(0, 60)); }""")
    assert not wide, wide
    editor.window_screenshot("models_sidebar.png")
    assert not editor.pack_messages(), editor.pack_messages()


@needs_comfy
def test_generate_plays_each_window_on_its_node(editor, comfy):
    """MM3 Generate opened from its template (a short song): the player on the node receives each
    window, schedules them back to back on its audio clock, knows when the song is complete, draws
    the time, and shows an LRC text's lines with the current one lit; the tiny model's song is said
    to be noise and played at a tenth of the volume; the layout holds with the player and nothing of
    the pack reaches the console."""
    editor.load_template("generate_in_one_node")
    editor.page.evaluate("""() => { const n = window.app.graph._nodes.find((n) => n.type === "MM3Generate");
        for (const [k, v] of [["duration", 9], ["steps", 2]]) n.widgets.find((w) => w.name === k).value = v; }""")
    _entry(comfy, editor.queue())
    player = """() => { const v = window.app.graph._nodes.find((n) => n.type === "MM3Generate").mm3Player;
        const p = v?.player; return p && { tracks: [...v.tracks.keys()], complete: p.complete,
        pieces: p.pieces.map((q) => [q.start, q.duration]), text: v.time.textContent,
        canvas: [v.canvas.width, v.canvas.clientHeight] }; }"""
    editor.page.wait_for_function(f"({player})()?.complete === true", timeout=60000)
    state = editor.page.evaluate(player)
    assert state["tracks"] == ["0.0"] and len(state["pieces"]) == 2, state
    (s0, d0), (s1, d1) = state["pieces"]
    assert s0 == 0 and s1 == pytest.approx(s0 + d0, abs=1e-9) and 8.5 < s1 + d1 < 9.5, state
    assert "/ 0:08" in state["text"] and state["canvas"][0] > 100, state  # 8.998 s
    lit = editor.page.evaluate("""() => { const v = window.app.graph._nodes.find((n) => n.type === "MM3Generate").mm3Player;
        v.setLrc("[00:00.00]first line\\n[00:04.00]second line"); v.player.seek(5); v.draw();
        return v.lineEls.map((e) => [e.textContent, e.style.fontWeight]); }""")
    assert lit == [["first line", ""], ["second line", "700"]], lit
    noise = editor.page.evaluate("""() => { const v = window.app.graph._nodes.find((n) => n.type === "MM3Generate").mm3Player;
        return [v.noise, v.note.offsetHeight > 0, v.note.textContent, v.gain.gain.value]; }""")
    assert noise[:2] == [True, True] and noise[2].startswith("Noise:") and noise[3] == pytest.approx(0.1), noise
    nodes = editor.nodes()
    assert not _overlaps(nodes) and not editor.hidden_nodes(), (_overlaps(nodes), editor.hidden_nodes())
    assert not editor.pack_messages(), editor.pack_messages()
