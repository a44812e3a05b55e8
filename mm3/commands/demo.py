"""`python -m mm3 demo`: the main job end to end without a download, on the tiny random model.

Writes the tiny model into the folder when its five components are not all there
(`mm3.tools.tiny.build_tiny`), generates a short song from it with `generate`, and prints where
the song is. Random weights sound like noise: this shows that every stage runs, not the music.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import InputError

CAPTION = "Global Metadata\nBasic Attributes: bpm is 120. Synth-pop, bright and driving."
LYRICS = "[verse]\nneon lights on the water\n[chorus]\nwe run, we run"


def has_model(folder: Path) -> bool:
    """Whether `folder` holds a file of each of the five components (read by architecture, whatever
    the files are named)."""
    from ..components import KINDS
    from ..files.registry import Registry

    registry = Registry.scan(folder)
    return all(registry.buckets[kind] for kind in KINDS)


def run(args) -> int:
    from .main import build_parser
    from ..tools.tiny import build_tiny

    folder = Path(args.dir)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--dir {folder} is not a folder")
    if not has_model(folder):
        folder.mkdir(parents=True, exist_ok=True)
        build_tiny(folder)
        print(f"wrote the tiny random-weight model to {folder}", file=sys.stderr)
    out = folder / "song.mp3"
    generate = build_parser().parse_args(
        ["generate", "--models", str(folder), "--caption", CAPTION, "--lyrics", LYRICS,
         "--duration", str(args.duration), "--steps", str(args.steps), "--seed", "1", "--lm-seed", "1",
         "--out", str(out), "--overwrite", *(["--quiet"] if args.quiet else []),
         *(["--device", args.device] if args.device else [])])
    generate.func(generate)
    print(f"the song: {out} (and its replay request {out.with_suffix('.json')}); the tiny model's weights are "
          "random, so it sounds like noise; `python -m mm3 download --set q8 --dir models/mm3` gets the real ones")
    return 0


def add_cli(sub):
    p = sub.add_parser("demo", help="generate a song on the tiny random model (written if absent), no download",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="out/demo", help="folder of the tiny model and the song (default out/demo)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--steps", type=int, default=4, help="DiT steps (default 4)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, xpu, mps or cpu (default: the best available)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
