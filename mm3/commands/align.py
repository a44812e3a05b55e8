"""`python -m mm3 align`: the lyric timestamps (LRC) of a replay file, or a ranking of the LM's heads.

align --request song.json --models DIR [--out song.lrc]: replays the file's codes through the LM
(no depth decoder, no layer past the deepest one read), reads the frames' attention onto the
lyrics at the file's `lrc_heads` (or --lrc-heads; default the released LM's) and writes the LRC,
by default beside the file. align --discover --request a.json b.json ...: every head of every
layer read over those songs and ranked by how sharp, moving and monotonic its frame-to-lyric
attention is, worst song first (`mm3.plan.lyrics_align.rank_heads`); the best heads are printed as
an --lrc-heads value.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..plan.codes import count_code_frames
from ..constants import FRAME_RATE
from .jobs import Console, _check_targets, _match_models, _pipeline, _request_from_args, add_lrc_flags
from ..plan.lyrics_align import HeadStats, head_scores, rank_heads, song_lrc
from ..synth.output import FileBatch
from ..song.request import RequestError

SUGGESTED = 3  # heads named in the --lrc-heads line --discover prints


def _requests(args) -> list:
    """(request, the namespace it was read with) for each --request: the file with the flags over
    it; it must hold its audio_codes, caption and lyrics."""
    out = []
    for path in args.request:
        one = argparse.Namespace(**{**vars(args), "request": path, "lrc": True})
        req = _request_from_args(one, need_text=False)
        if not req.audio_codes:
            raise RequestError(f"{path}: no audio_codes to align (make them with `plan` or `generate`)")
        out.append((req.validate(), one))
    return out


def _lm_pipeline(args):
    """The pipeline (its note on the DiT's dtype left out: align runs no DiT)."""
    return _pipeline(argparse.Namespace(**{**vars(args), "quiet": True}))


def cmd_align(args) -> int:
    if args.discover:
        return _discover(args)
    if len(args.request) > 1:
        raise RequestError("align writes the LRC of one --request at a time (several are for --discover)")
    (req, one), = _requests(args)
    out = Path(args.out) if args.out else Path(args.request[0]).with_suffix(".lrc")
    _check_targets([out], args.overwrite)
    pipe = _lm_pipeline(args)
    req = _match_models(pipe, req, one, kinds=("lm", "depth"))
    heads = req.lyric_heads()
    pipe.preflight(req, kinds=("lm", "depth"), lyric_heads=heads)
    start = time.perf_counter()
    try:
        with Console(args.quiet) as console:
            song = pipe.replay(req, console.progress(), lyric_heads=heads, hiddens=False)
    finally:
        pipe.store.release_all()
    text = song_lrc(song.codes, lead=req.lrc_lead)
    timed = text.count("\n")
    with FileBatch(args.overwrite) as batch:
        batch.add(out, text.encode("utf-8"))
        batch.commit()
    if not args.quiet:
        print(f"wrote {out}: {timed} lines timed over {song.frames / FRAME_RATE:.2f} s (heads {heads}, "
              f"{time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0


def _discover(args) -> int:
    if args.out:
        raise RequestError("--discover prints its ranking; --out names the LRC of a plain align")
    if args.top < 1:
        raise RequestError(f"--top must be at least 1, got {args.top}")
    pipe = _lm_pipeline(args)
    checked = []
    for req, one in _requests(args):
        req = _match_models(pipe, req, one, kinds=("lm", "depth"))
        pipe.preflight(req, kinds=("lm", "depth"))
        checked.append((req, one.request))
    names = {req.lm_model for req, _ in checked}
    if len(names) > 1:
        raise RequestError(f"--discover ranks the heads of one LM; these requests name {', '.join(sorted(names))}: "
                           "pass --lm-model")
    hp = pipe.model_file("lm", checked[0][0]).hparams
    layers, heads = int(hp["num_hidden_layers"]), int(hp["num_attention_heads"])
    runs = []
    start = time.perf_counter()
    try:
        with Console(args.quiet) as console:
            for req, path in checked:
                stats = HeadStats(pipe.prompt(req), layers, heads, count_code_frames(req.audio_codes) - 1)
                pipe.replay(req, console.progress(), tap=stats, hiddens=False)
                runs.append(head_scores(stats))
    finally:
        pipe.store.release_all()
    ranked = rank_heads(runs)
    lines = [f"{layers * heads} heads ({layers} layers x {heads}) over {len(runs)} song(s), each at its worst song; "
             "score = sharpness x travel x monotonic",
             f"{'rank':>4}  {'head':>7}  {'score':>6}  {'sharpness':>9}  {'travel':>6}  {'monotonic':>9}"]
    for i, s in enumerate(ranked[:args.top]):
        lines.append(f"{i + 1:>4}  {f'{s.layer}:{s.head}':>7}  {s.score:6.3f}  {s.sharpness:9.3f}  {s.travel:6.3f}  "
                     f"{s.monotonic:9.3f}")
    best = sorted(ranked[:SUGGESTED], key=lambda s: (s.layer, s.head))
    lines.append("--lrc-heads " + ",".join(f"{s.layer}:{s.head}" for s in best))
    print("\n".join(lines))
    if not args.quiet:
        print(f"ranked in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def add_cli(sub):
    p = sub.add_parser("align", help="lyric timestamps (LRC) of a replay JSON, or --discover the LM heads that give them")
    p.add_argument("--models", required=True, help="folder holding the LM and depth decoder GGUF files")
    p.add_argument("--request", required=True, nargs="+",
                   help="the replay JSON of a song (its audio_codes, caption and lyrics); several with --discover")
    p.add_argument("--out", help="the LRC file to write (default: the request's name with .lrc)")
    p.add_argument("--discover", action="store_true",
                   help="rank every head of the LM by how sharply and steadily its attention follows the lyrics over "
                        "the songs given, and print the best as an --lrc-heads value")
    p.add_argument("--top", type=int, default=10, help="heads --discover lists (default 10)")
    add_lrc_flags(p, None)
    for kind in ("lm", "depth"):
        p.add_argument(f"--{kind}-model", dest=f"{kind}_model", help=f"{kind} file name in --models")
    p.add_argument("--strict", action="store_true",
                   help="refuse a request whose LM or depth file is missing or differs from the one that made it")
    p.add_argument("--overwrite", action="store_true", help="replace an existing LRC file")
    p.add_argument("--device", default=None, help="cuda, cuda:1, xpu, mps or cpu (default: the best available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: per device)")
    p.add_argument("--keep-loaded", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_align)
