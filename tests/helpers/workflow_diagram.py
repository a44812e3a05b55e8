"""A template-browser thumbnail drawn from an editor workflow file, for workflows the browser tests
cannot open (those for ComfyUI-Distributed need its nodes): each node a box with its title at the
workflow's saved view (the graph runs left to right, row after row), the Note's text in its box.

    python tests/helpers/workflow_diagram.py songs_across_workers variations_across_workers
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[2]
WINDOW = (1600, 1000)  # the editor window the saved view is made for
SIZE = (960, 540)  # the thumbnails' size (the browser test's screenshots)
TITLE = 30
BACKGROUND, NODE, HEADER, TEXT, NOTE = "#202020", "#353535", "#222222", "#dddddd", "#432"


def wrap(text: str, font, width: float) -> list[str]:
    """The text in lines no wider than `width` pixels."""
    lines, line = [], ""
    for word in text.split():
        trial = f"{line} {word}".strip()
        if line and font.getlength(trial) > width:
            lines.append(line)
            line = word
        else:
            line = trial
    return lines + [line] if line else lines


def draw(ui: dict, titles: dict[str, str]) -> Image.Image:
    """The editor window at the workflow's saved view, scaled into SIZE (centred); `titles`: node id -> title."""
    ds = ui["extra"]["ds"]
    k = min(SIZE[0] / WINDOW[0], SIZE[1] / WINDOW[1])
    s, (ox, oy) = ds["scale"] * k, ds["offset"]
    left = (SIZE[0] - WINDOW[0] * k) / 2

    def at(x, y):
        return left + (x + ox) * s, (y + oy) * s

    img = Image.new("RGB", SIZE, BACKGROUND)
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=max(8, round(13 * s)))
    for n in ui["nodes"]:
        x0, y0 = at(n["pos"][0], n["pos"][1] - TITLE)
        x1, y1 = at(n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
        note = n["type"] in ("Note", "MarkdownNote")
        d.rounded_rectangle([x0, y0, x1, y1], radius=5, fill=NOTE if note else NODE)
        d.rounded_rectangle([x0, y0, x1, y0 + TITLE * s], radius=5, fill=HEADER)
        d.text((x0 + 6, y0 + (TITLE * s - font.size) / 2), titles.get(str(n["id"]), n["type"]), fill=TEXT,
               font=font)
        if note:
            lines = wrap(n["widgets_values"][0], font, x1 - x0 - 12)
            room = int((y1 - y0 - TITLE * s - 8) // (font.size + 2))
            d.multiline_text((x0 + 6, y0 + TITLE * s + 4), "\n".join(lines[:room]), fill=TEXT, font=font, spacing=2)
    return img


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write workflows/NAME.jpg, a drawn thumbnail of workflows/NAME.json")
    p.add_argument("names", nargs="+", help="workflow names (workflows/NAME.json)")
    args = p.parse_args(argv)
    for name in args.names:
        ui = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
        api = json.loads((ROOT / "workflows" / "api" / f"{name}.json").read_text())
        titles = {nid: node.get("_meta", {}).get("title", node["class_type"]) for nid, node in api.items()}
        out = ROOT / "workflows" / f"{name}.jpg"
        draw(ui, titles).save(out, quality=70)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
