"""edit_a_line in the editor (a real ComfyUI driven in headless Chromium, as test_comfyui_browser.py):
the workflow opens from the template browser's files at its saved view with every node in sight;
after a first run the live player shows the song's lyric lines, a click on one sets MM3 Change a
Line's line, and the next run changes that line: the range MM3 Repaint renders follows it.

The tiny LM's heads do not follow the lyrics (random weights), so Change a Line times the lines with
all the heads of its last layer, and the line clicked is the one those heads time on the tiny song; the
workflow is otherwise run as shipped but short (3 s, 2 steps)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.comfyui import needs_comfy
from tests.nodes import test_comfyui_browser as editor_tests
from tests.nodes.test_comfyui_browser import _entry, _overlaps

browser, comfy, editor = editor_tests.browser, editor_tests.comfy, editor_tests.editor  # its fixtures, shared
pytestmark = pytest.mark.slow
LYRICS = "[verse]\nhello there my friend\nsing along tonight\n[chorus]\nla la la"
SET = """([type, name, value]) => { const n = window.app.graph._nodes.find((n) => n.type === type);
    const w = n.widgets.find((w) => w.name === name); w.value = value; return w.value; }"""
GET = """([type, name]) => window.app.graph._nodes.find((n) => n.type === type).widgets
    .find((w) => w.name === name).value"""


@needs_comfy
def test_clicking_a_lyric_line_sets_the_line_the_edit_changes(editor, comfy):
    editor.load_template("edit_a_line")
    assert not editor.hidden_nodes(), editor.hidden_nodes()
    assert not _overlaps(editor.nodes()), _overlaps(editor.nodes())
    assert editor.page.evaluate(GET, ["MM3ChangeLine", "line"]) == 3  # as shipped
    for type_, name, value in [("MM3PromptAssemble", "lyrics", LYRICS), ("MM3ChangeLine", "heads", "1:*"),
                               ("MM3ARPlan", "duration", 3.0), ("MM3FlowSampler", "steps", 2),
                               ("MM3Repaint", "steps", 2), ("MM3ChangeLine", "line", 1),
                               ("MM3ChangeLine", "words", "a first new line")]:
        editor.page.evaluate(SET, [type_, name, value])
    _entry(comfy, editor.queue(), timeout=600)
    # the song's lyric lines reach the player (Change a Line ran before its first window)
    rows = """() => { const n = window.app.graph._nodes.find((n) => n.type === "MM3VocoderDecode");
        return (n.mm3Player?.lineEls ?? []).map((r) => r.textContent); }"""
    editor.page.wait_for_function(f"({rows})().includes('hello there my friend')", timeout=30000)
    editor.page.evaluate(SET, ["MM3ChangeLine", "line", 3])  # elsewhere, as a user may have left it
    row = editor.page.evaluate_handle("""() => window.app.graph._nodes.find((n) => n.type === "MM3VocoderDecode")
        .mm3Player.lineEls.find((r) => r.textContent === "hello there my friend")""").as_element()
    row.scroll_into_view_if_needed()
    row.click()  # the mouse, on the line as drawn
    assert editor.page.evaluate(GET, ["MM3ChangeLine", "line"]) == 1
    editor.page.evaluate(SET, ["MM3ChangeLine", "words", "a second new line"])
    entry = _entry(comfy, editor.queue(), timeout=600)
    ids = {n["type"]: str(n["id"]) for n in editor.nodes()}
    change = "".join(entry["outputs"][ids["MM3ChangeLine"]]["text"])
    assert "line 1 'hello there my friend'" in change and "now sings 'a second new line'" in change, change
    saved = entry["outputs"][ids["MM3SaveSong"]]["audio"][0]
    replay = json.loads(comfy.view({**saved, "filename": saved["filename"][:-4] + ".json"}))
    edit = replay["lyric_edit"]
    assert edit["line"] == 1 and edit["words"] == "a second new line"
    assert replay["lyrics"] == LYRICS.replace("hello there my friend", "a second new line")
    repaint = "".join(entry["outputs"][ids["MM3Repaint"]]["text"])
    assert repaint.startswith(f"repainted {edit['start']:g}-{edit['end']:g} s"), (repaint, edit)
    assert (replay["repaint_start"], replay["repaint_end"]) == (edit["start"], edit["end"])
    assert not editor.pack_messages(), editor.pack_messages()
    editor.saved_view_screenshot("edit_a_line.png")
