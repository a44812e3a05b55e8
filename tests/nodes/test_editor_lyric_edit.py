"""The editor's lyric-line click without ComfyUI (web/mm3.js and web/mm3_player.js under node.js):
each LRC line is numbered as the engine counts lines and sections, and a click on a player's line
sets the line of MM3 Change a Line and of an MM3 Repaint whose lyrics_lrc is wired in."""

from __future__ import annotations

from mm3.plan.lyric_edit import sections, sung_lines
from mm3.plan.prompt import LyricLine, normalize_lyrics
from tests.nodes.test_editor import JS_PAGE, JS_PLAYER_API, run_web_harness

LYRICS = "[Verse]\nhello there\nsing along\n[chorus]\nla la la\n[verse]\nsecond\n[chorus]\nagain"

HARNESS = JS_PAGE + """const P = await import("./extensions/pack/mm3_player.js");
const { playerOf, chooseLyric } = await import("./extensions/pack/mm3.js");
const out = {};
const lrc = ["[00:00.50][verse]", "[00:01.00]hello there", "[00:03.00]sing along", "[00:05.00][chorus]",
  "[00:05.20]la la la", "[00:08.00][verse]", "[00:08.40]second", "[00:11.00][chorus]", "[00:11.50]again"].join("\\n");
out.choices = P.lyricChoices(P.parseLrc(lrc));
const widget = (name, value) => ({ name, value, callback(v) { this.called = v; } });
const node = (type, widgets, inputs = []) => ({ type, comfyClass: type, widgets, inputs, setDirtyCanvas() {},
  addDOMWidget(name, t, element, options) { const w = { name, element, options }; this.widgets.push(w); return w; } });
const change = node("MM3ChangeLine", [widget("line", 3), widget("words", "x")]);
const wired = node("MM3Repaint", [widget("start", 10), widget("line", 0), widget("section", "")],
                   [{ name: "lyrics_lrc", link: 4 }]);
const unwired = node("MM3Repaint", [widget("start", 10), widget("line", 0), widget("section", "")],
                     [{ name: "lyrics_lrc", link: null }]);
const decode = node("MM3VocoderDecode", []);
app.graph = { nodes: [change, wired, unwired, decode], getNodeById: () => null };
const view = playerOf(decode, () => ({}));
view.setLrc(lrc);
view.lineEls[2].onclick();  // "sing along": sung line 2
out.line = [change.widgets[0].value, change.widgets[0].called, wired.widgets[1].value, wired.widgets[2].value,
            unwired.widgets[1].value];
view.lineEls[7].onclick();  // the second [chorus]
out.section = [change.widgets[0].value, wired.widgets[1].value, wired.widgets[2].value, unwired.widgets[2].value];
out.title = view.lineEls[2].title;
out.changed = chooseLyric({ line: 1 }).map((n) => n.type);
console.log(JSON.stringify(out));
"""


def _numbering(lyrics: str) -> list[dict]:
    """What the engine calls each line of `lyrics` past "[start]": { line: n } or { section: name }."""
    lines = [LyricLine(t.strip(), 0, 1, t.strip().startswith("[")) for t in normalize_lyrics(lyrics).split("\n")
             if t.strip()]
    sung = {i: n + 1 for n, i in enumerate(sung_lines(lines))}
    named = {i: label for label, i in sections(lines)}
    return [{"line": sung[i]} if i in sung else {"section": named[i]} for i in range(1, len(lines))]


def test_a_clicked_lyric_line_sets_the_line_of_the_edit_nodes(tmp_path):
    got = run_web_harness(tmp_path, HARNESS, JS_PLAYER_API)
    assert got["choices"] == _numbering(LYRICS)  # the player counts as the engine does
    assert got["line"] == [2, 2, 2, "", 0]  # Change a Line and the wired Repaint; not the unwired one
    assert got["section"] == [2, 0, "chorus 2", ""]  # a section: Repaint only (Change a Line takes lines)
    assert got["title"] == "0:03: click to jump here and to edit this line (MM3 Repaint, Change a Line)"
    assert got["changed"] == ["MM3ChangeLine", "MM3Repaint"]
