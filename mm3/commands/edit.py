"""`python -m mm3 repaint`: seconds of a song rendered anew, chosen by --start/--end or by a lyric
line or section (--line, --section, --margin), optionally singing new words (--words) or planning
the range again (--replan-lm-seed); the job itself is `generate`'s (`mm3.commands.jobs`).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from ..constants import FRAME_RATE
from ..plan.codes import count_code_frames
from ..plan.lyric_edit import (
    DEFAULT_MARGIN, LyricEditError, check_words, choose_range, has_lyrics, replace_line)
from ..plan.sampling import resolve_seed
from ..song.request import MM3Request, RequestError
from .jobs import Console, _common, _format_for, _match_models, _pipeline, _song_request, cmd_generate


def cmd_repaint(args) -> int:
    """The song of --request with seconds [--start, --end) rendered anew (new noise, optionally new
    codes), or the seconds of --line N / --section NAME from its lyric timestamps; with --words that
    line sings new words: the codes before the range replayed under the new lyrics, the range planned
    again, the codes after it kept (`mm3.plan.lyric_edit`)."""
    req = _song_request(args)
    start, end = _repaint_flags(args, req)
    words = getattr(args, "words", None)
    if words is not None:
        new_lyrics, old_words = replace_line(req.lyrics, args.line, words)  # refused before any model loads
    out = Path(args.out)
    check = replace(req, repaint_start=0.0 if start is None else start, repaint_end=1.0 if end is None else end)
    replace(check, output_format=_format_for(out, req, args.format)).validate()
    if start is not None and args.replan_lm_seed is None and words is None:
        return cmd_generate(args, _repainted(req, args, start, end))
    pipe = _pipeline(args)
    req = _match_models(pipe, req, args)
    try:
        with Console(args.quiet) as console:
            edit = {}
            if start is None:
                timed = req
                if getattr(args, "lrc_heads", None) is not None or getattr(args, "lrc_lead", None) is not None:
                    timed = replace(req, lyric_times=[])  # timed again with the heads and lead named
                chosen = choose_range(pipe.lyric_times(timed, console.progress()), _seconds(req),
                                      line=args.line, section=args.section, margin=args.margin)
                start, end, edit = chosen.start, chosen.end, chosen.record()
                if not args.quiet:
                    print(f"repainting {chosen.describe()}", file=sys.stderr)
            req = _repainted(req, args, start, end)
            seed = args.replan_lm_seed
            if words is not None:
                seed = resolve_seed(-1) if seed is None else seed
                edited = replace(req, lyrics=new_lyrics, lyric_times=[])
                try:
                    pipe.prompt(edited)
                except RequestError as e:
                    raise LyricEditError(f"line {args.line} with the new words: {e}") from None
                codes = pipe.replan_range(edited, start, end, seed, console.progress())
                req = replace(edited, source_codes=req.audio_codes, source_lyrics=req.lyrics, audio_codes=codes,
                              lyric_edit=edit | {"words": check_words(words), "replaced": old_words, "lm_seed": seed})
            elif seed is not None:
                codes = pipe.replan_range(req, start, end, seed, console.progress())
                req = replace(req, source_codes=req.audio_codes, audio_codes=codes, lyric_times=[],
                              lyric_edit=edit | {"lm_seed": seed} if edit else {})
            else:
                req = replace(req, lyric_edit=edit)
    except BaseException:
        pipe.store.release_all()
        raise
    return cmd_generate(args, req, pipe)


def _repaint_flags(args, req: MM3Request) -> tuple[float | None, float | None]:
    """(--start, --end), or (None, None) where --line or --section chooses the range; the flags'
    combinations refused here, before any model is loaded."""
    line, section = getattr(args, "line", None), getattr(args, "section", None)
    words = getattr(args, "words", None)
    if line is not None and section is not None:
        raise RequestError("choose the range by --line or by --section, not both")
    if words is not None:
        if line is None:
            raise RequestError("--words replaces the words of one line: name it with --line N")
        check_words(words)
    if line is not None or section is not None:
        if args.start is not None or args.end is not None:
            raise RequestError(f"{'--line' if line is not None else '--section'} chooses the range: leave out "
                               "--start and --end")
        if not has_lyrics(req.lyrics):
            raise LyricEditError("this song has no lyrics (an instrumental): choose the range with --start and --end")
        return None, None
    if args.margin != DEFAULT_MARGIN:
        raise RequestError("--margin widens the range of --line or --section")
    if args.start is None or args.end is None:
        raise RequestError("repaint needs --start and --end (seconds), or --line N or --section NAME (from the "
                           "lyric timestamps)")
    return args.start, args.end


def _repainted(req: MM3Request, args, start: float, end: float) -> MM3Request:
    return replace(req, repaint_start=start, repaint_end=end,
                   repaint_seed=-1 if args.repaint_seed is None else args.repaint_seed,
                   **({} if args.fade is None else {"repaint_fade": args.fade}))


def _seconds(req: MM3Request) -> float:
    return (count_code_frames(req.audio_codes) - 1) / FRAME_RATE


def add_cli(sub):
    p = sub.add_parser("repaint", help="render seconds --start..--end of the song of --request anew")
    p.add_argument("--start", type=float, help="first second to repaint")
    p.add_argument("--end", type=float, help="second where the repaint ends")
    p.add_argument("--line", type=int,
                   help="repaint sung line N of the lyrics (from 1; section tags not counted), its seconds taken from "
                        "the lyric timestamps (the request's lyric_times, else computed at its lrc_heads)")
    p.add_argument("--section", help='repaint a section by its tag: "chorus 2" is the second [chorus] ("chorus": the '
                                     "first), up to the next section tag")
    p.add_argument("--words", help="with --line: the new words that line sings; the range is planned again (from "
                                   "--replan-lm-seed, else a fresh seed), the codes after it kept")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help=f"seconds the range of --line/--section reaches into the neighbouring lines, at most half-way "
                        f"(default {DEFAULT_MARGIN:g})")
    p.add_argument("--fade", type=float, help="seconds of crossfade inside each edge (default 0.25)")
    p.add_argument("--repaint-seed", dest="repaint_seed", type=int, help="noise seed of the repainted part (-1 = random)")
    p.add_argument("--replan-lm-seed", dest="replan_lm_seed", type=int,
                   help="also sample new codes for the range from this AR seed (default: keep the codes)")
    _common(p, text=False, synth=True, out_help="output file (.mp3 or .wav)")
    p.set_defaults(func=cmd_repaint)
