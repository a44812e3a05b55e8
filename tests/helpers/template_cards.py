"""The template browser's cards: workflows/NAME.jpg for each editor workflow, a square card that says
in large type what the workflow makes (its title and one line) over a waveform, readable at the size
the browser shows it (about 230 pixels). ComfyUI lists a pack's workflows under the pack's name with
the file name as the title and NAME.jpg as the picture; this is where a user sees what each one is for.

    python tests/helpers/template_cards.py            # every card
    python tests/helpers/template_cards.py text_to_song
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[2]
SIZE = 512  # square: the browser fits the picture into a square
MARGIN = 40
TOP = 96  # below the browser's "Node graph" badge in the top left corner

# name -> (title, what it makes, accent colour); the two last need ComfyUI-Distributed.
CARDS = {
    "text_to_song": ("Text to song", "A song from a caption and lyrics, one stage per node", "#4f9dff"),
    "generate_in_one_node": ("Song in one node", "The same song from MM3 Generate alone, heard while it is made",
                             "#46c28e"),
    "variations_from_one_plan": ("Three variations", "One plan rendered three times, each with its own seed",
                                 "#c77dff"),
    "rerender_from_codes": ("Render a song again", "From its replay file: the same song, or new seeds", "#ffb547"),
    "natural_ending_takes": ("A song that ends itself", "Four takes; keeps one that ends on its own", "#ff7a7a"),
    "continue_song": ("Continue a song", "A 30\u00a0s song carried on to 60\u00a0s", "#3fc7d6"),
    "repaint_range": ("Repaint a passage", "Seconds 10-20 made anew, the rest of the song kept", "#f47fc0"),
    "edit_a_line": ("Change a line", "New words for one sung line, the rest of the song kept", "#ffd166"),
    "songs_across_workers": ("Songs on every GPU", "One song per server (needs ComfyUI-Distributed)", "#9aa7b8"),
    "variations_across_workers": ("Variations on every GPU",
                                  "One plan, one variation per server (needs ComfyUI-Distributed)", "#9aa7b8"),
}


def font(size: int, bold: bool = True):
    """DejaVu Sans or Liberation Sans from the system's fonts (Pillow finds them by name), else Pillow's own."""
    for name in (("DejaVuSans-Bold.ttf", "LiberationSans-Bold.ttf") if bold else ("DejaVuSans.ttf",
                                                                                   "LiberationSans-Regular.ttf")):
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            continue
    return ImageFont.load_default(size=size)


def wrap(text: str, face, width: float) -> list[str]:
    """The text in lines no wider than `width` pixels (a no-break space keeps a number with its unit)."""
    lines, line = [], ""
    for word in text.split(" "):
        trial = f"{line} {word}".strip()
        if line and face.getlength(trial) > width:
            lines.append(line)
            line = word
        else:
            line = trial
    return lines + [line] if line else lines


def draw(title: str, line: str, accent: str) -> Image.Image:
    """One card: the title and the line in large type, a waveform in the accent colour beneath."""
    img = Image.new("RGB", (SIZE, SIZE), "#16181d")
    d = ImageDraw.Draw(img)
    width = SIZE - 2 * MARGIN
    big, small = font(50), font(30, bold=False)
    y = TOP
    for text in wrap(title, big, width):
        d.text((MARGIN, y), text, fill="#ffffff", font=big)
        y += 60
    y += 14
    for text in wrap(line, small, width):
        d.text((MARGIN, y), text, fill="#c9ced6", font=small)
        y += 38
    # A waveform: a row of bars whose heights follow two slow sines, the same on every card.
    base, bars = SIZE - 70, 44
    step = width / bars
    for i in range(bars):
        h = 8 + 34 * abs(math.sin(i * 0.37) * math.sin(i * 0.11 + 0.6))
        x = MARGIN + i * step
        d.rounded_rectangle([x, base - h, x + step * 0.6, base + h], radius=2, fill=accent)
    return img


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write workflows/NAME.jpg, the template browser's card of each workflow")
    p.add_argument("names", nargs="*", help="workflow names (default: every one)")
    args = p.parse_args(argv)
    for name in args.names or sorted(CARDS):
        if name not in CARDS:
            p.error(f"no card for {name!r}: add its title and line to CARDS ({', '.join(sorted(CARDS))})")
        out = ROOT / "workflows" / f"{name}.jpg"
        draw(*CARDS[name]).save(out, quality=85)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
