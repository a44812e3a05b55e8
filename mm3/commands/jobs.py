"""`python -m mm3 generate | plan | render`: the main job from the command line.

generate: caption + lyrics (or a request JSON) -> audio files, each with its replay request
(`song.mp3` + `song.json`). plan: the AR stage only -> replay requests with codes and seeds.
render: synthesis from a request's `audio_codes` (no AR sampling), any synthesis settings.
Ctrl+C stops within one frame or step and writes nothing; existing files are never overwritten
unless --overwrite is given.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..bounded import BoundError, read_bytes
from ..constants import FORMAT_EXTENSIONS, MAX_REQUEST_BYTES, MAX_TEXT_BYTES, RNG_MODES
from ..synth.output import FileBatch, OutputError, atomic_write, render
from ..progress import STAGES, Progress
from ..plan.prompt import CAPTION_REQUIRED, INSTRUMENTAL_LYRICS
from ..lora.use import parse_flag
from ..song.request import MODEL_FIELDS, MM3Request, RequestError, check_output_format
from ..plan.lyric_edit import record_times
from ..plan.lyrics_align import LEAD_SECONDS, LyricHeads, check_lead, song_lrc, untimed_warning
from ..song.stages import replay_requests
from ..plan.shaping import DEFAULT_DRY_MIN_MATCH, DEFAULT_PENALTY_WINDOW, PENALTIES

EXTENSIONS = FORMAT_EXTENSIONS


# -- request assembly ---------------------------------------------------------------------------
def _read_input(path: str, limit: int, flag: str) -> bytes:
    """The bytes of the file a flag names, refused unread past `limit` (a device or a pipe is
    never read whole)."""
    try:
        return read_bytes(path, limit, flag)
    except BoundError as e:
        raise RequestError(str(e)) from None
    except OSError as e:
        raise RequestError(f"cannot read {flag} {path}: {e.strerror or e}") from None


def _request_from_args(args, *, need_text: bool) -> MM3Request:
    """The request of a command: `--request`'s file (if any) with the flags' fields over it, and
    `args.recorded_models`: the *_model fields whose names a replay request (one with audio_codes)
    recorded, as opposed to names given by a flag or by a request for a new song (an unknown name
    there is an error, as in the reference server); `args.recorded_loras`: likewise its LoRAs
    (--lora replaces them)."""
    args.recorded_models, args.recorded_loras = (), False
    if args.request:
        text = _read_input(args.request, MAX_REQUEST_BYTES, "--request")
        try:
            req = MM3Request.from_json(text)
        except RequestError as e:
            raise RequestError(f"{e} (in --request {args.request})") from None
    else:
        req = MM3Request()
    overrides = {}
    for field in ("caption", "lyrics", "duration", "steps", "seed", "lm_seed", "lm_cfg", "lm_top_k",
                  "lm_batch_size", "synth_batch_size", "dit_cfg", "peak_clip", "mp3_bitrate",
                  "lm_model", "depth_model", "cond_model", "dit_model", "vae_model", "lm_temperature", "lm_top_p",
                  "lm_penalty", "lm_penalty_strength", "lm_penalty_window", "lm_dry_min_match", "min_duration",
                  "takes", "require_ending", "ending_rounds", "dit_shift"):
        v = getattr(args, field, None)
        if v is not None:
            overrides[field] = v
    for field in ("caption", "lyrics"):
        path = getattr(args, f"{field}_file", None)
        if path:
            flag = f"--{field}-file"
            data = _read_input(path, MAX_TEXT_BYTES, flag)
            try:
                overrides[field] = data.decode("utf-8")
            except UnicodeDecodeError as e:
                line = data.count(b"\n", 0, e.start) + 1
                raise RequestError(f"{flag} {path} is not valid UTF-8 text: byte 0x{data[e.start]:02x} at offset "
                                   f"{e.start} (line {line}); save it as UTF-8") from None
    if getattr(args, "lora", None):
        try:
            overrides["loras"] = [parse_flag(text) for text in args.lora]
        except ValueError as e:
            raise RequestError(str(e)) from None
    if args.request and req.audio_codes:
        args.recorded_models = tuple(f for f in MODEL_FIELDS.values() if f not in overrides and getattr(req, f))
        args.recorded_loras = "loras" not in overrides and bool(req.loras)
    if getattr(args, "rng", None) is not None:
        overrides["rng"] = args.rng
    overrides |= _lrc_overrides(args)
    req = replace(req, **overrides)
    if not req.audio_codes and req.lyric_times:  # the timestamps of codes this request no longer holds
        req = replace(req, lyric_times=[])
    if not need_text and req.audio_codes and not req.caption.strip():
        raise RequestError(CAPTION_REQUIRED)
    return req


def _lrc_overrides(args) -> dict:
    """--lrc-heads (canonical; "" for the default heads) and --lrc-lead, which need --lrc."""
    heads, lead = getattr(args, "lrc_heads", None), getattr(args, "lrc_lead", None)
    by_lyrics = getattr(args, "line", None) is not None or getattr(args, "section", None) is not None
    if (heads is not None or lead is not None) and not getattr(args, "lrc", False) and not by_lyrics:
        raise RequestError(f"{'--lrc-heads' if heads is not None else '--lrc-lead'} needs --lrc (write the lyric "
                           "timestamps), or --line / --section of repaint (which read them)")
    out = {}
    if heads is not None:
        parsed = LyricHeads.parse(heads)
        out["lrc_heads"] = "" if parsed.is_default else str(parsed)
    if lead is not None:
        out["lrc_lead"] = check_lead(lead)
    return out


def _lrc_path(path: Path) -> Path:
    return path.with_suffix(".lrc")


def lrc_of(codes, lead: float, path: Path) -> str:
    """The LRC text of a song's codes (`song_lrc`), with a warning on stderr where it times no line
    (the file `path` is written all the same, empty)."""
    text = song_lrc(codes, lead=lead)
    warning = untimed_warning(text)
    if warning:
        print(f"warning: {path}: {warning}", file=sys.stderr)
    return text


def _format_for(out: Path, req: MM3Request, explicit: str | None) -> str:
    fmt = check_output_format(explicit or req.output_format)
    ext = out.suffix.lower()
    if explicit is None and ext in (".wav", ".mp3") and EXTENSIONS[fmt] != ext:
        fmt = "mp3" if ext == ".mp3" else "wav16"  # the file name decides when nothing else was said
    if EXTENSIONS[fmt] != ext:
        raise RequestError(f"{out}: a {fmt} file should end in {EXTENSIONS[fmt]}")
    return fmt


def numbered(out: Path, count: int, index: int) -> Path:
    """`song.mp3` for a single track, else `song_01.mp3`, `song_02.mp3`, ... (song-major)."""
    if count == 1:
        return out
    width = max(2, len(str(count)))
    return out.with_name(f"{out.stem}_{index + 1:0{width}d}{out.suffix}")


def _check_targets(paths: list[Path], overwrite: bool):
    """Refuse, before any work, targets that exist (without --overwrite) or cannot be created. A
    full disk only shows when writing; then nothing is left behind either (`FileBatch`)."""
    for p in paths:
        if p.is_dir():
            raise OutputError(f"cannot write {p}: it is a folder")
        if os.path.lexists(p) and not overwrite:
            raise FileExistsError(f"{p} already exists (choose another --out or pass --overwrite)")
        folder = p.parent if str(p.parent) else Path(".")
        existing = folder
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise OutputError(f"cannot write {p}: {existing} is not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise OutputError(f"cannot write {p}: the folder {existing} is not writable")


# -- progress and Ctrl+C ------------------------------------------------------------------------
class Console:
    """tqdm bars for the stages, and a SIGINT flag the engine polls between frames and steps."""

    def __init__(self, quiet: bool = False):
        self.quiet, self.bars, self.stop = quiet, {}, False
        self._old = None

    def __enter__(self):
        def handler(signum, frame):
            if self.stop:  # a second Ctrl+C: stop at once
                raise KeyboardInterrupt
            self.stop = True
            print("\nstopping after the current frame/step (Ctrl+C again to abort)", file=sys.stderr)

        self._old = signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)
        for bar in self.bars.values():
            bar.close()

    def progress(self) -> Progress:
        return Progress(on_progress=self.on_progress, should_stop=lambda: self.stop)

    def on_progress(self, stage: str, done: int, total: int, info: dict):
        if self.quiet:
            return
        from tqdm import tqdm

        key = (stage, total)
        bar = self.bars.get(key)
        if bar is None:
            for k in [k for k in self.bars if k[0] == stage]:
                self.bars.pop(k).close()
            known = STAGES.get(stage)
            desc, unit = (known.label, known.unit) if known else (stage, "it")
            bar = self.bars[key] = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
        if stage == "dit" and "window" in info:
            bar.set_postfix(window=f"{info['window'] + 1}/{info.get('windows', '?')}", refresh=False)
        bar.update(done - bar.n)
        if done >= total:
            self.bars.pop(key).close()


# -- commands -----------------------------------------------------------------------------------
def _pipeline(args):
    from ..song.pipeline import Pipeline

    if not Path(args.models).is_dir():
        raise RequestError(f"--models {args.models} is not a folder")
    try:
        pipe = Pipeline(args.models, device=args.device, dtype=args.dtype, keep_loaded=args.keep_loaded)
    except ValueError as e:  # an unavailable --device or unknown --dtype
        raise RequestError(str(e)) from None
    requests = [args.request] if isinstance(args.request, str) else list(args.request or ())  # align: several
    for request in requests:  # a replay file's LoRAs may sit beside it
        folder = str(Path(request).resolve().parent)
        if folder not in pipe.lora_folders:
            pipe.lora_folders.append(folder)
    if pipe.dit_dtype not in (None, pipe.dtype) and not getattr(args, "quiet", False):
        print(f"note: the DiT computes in {str(pipe.dit_dtype).removeprefix('torch.')} on this {pipe.device.type} "
              f"(native products); --dtype {str(pipe.dtype).removeprefix('torch.')} keeps it in that", file=sys.stderr)
    return pipe


def _match_models(pipe, req: MM3Request, args, kinds=None) -> MM3Request:
    """Warn (or with --strict refuse) where the files a request file names are missing or differ."""
    kw = {} if kinds is None else {"kinds": kinds}
    req, warnings = pipe.match_models(req, recorded=args.recorded_models, strict=args.strict,
                                      loras_recorded=getattr(args, "recorded_loras", False), **kw)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return req


def _write_tracks(tracks, out: Path, fmt: str, req: MM3Request, overwrite: bool, quiet: bool,
                  lrc: bool = False) -> list[Path]:
    """Every track and its replay JSON (and with `lrc` its lyric timestamps), all or nothing:
    staged as temporaries, then renamed."""
    start = time.perf_counter()
    lines = []
    written = replace(req.output_settings(), format=fmt)
    lrcs = {}  # a song's variations share its codes, hence its LRC
    with FileBatch(overwrite) as batch:
        for n, track in enumerate(tracks):
            path = numbered(out, len(tracks), n)
            batch.add(path, render(track.audio, written.format, peak_clip=written.peak_clip,
                                   mp3_bitrate=written.mp3_bitrate, sample_rate=track.sample_rate))
            replay_req = replace(track.request, output_format=fmt)
            if lrc:  # a later repaint --line finds the lines here
                replay_req = replace(replay_req, lyric_times=record_times(track.codes, req.lrc_lead))
            batch.add(path.with_suffix(".json"), (replay_req.to_json() + "\n").encode())
            if lrc:
                if track.song not in lrcs:
                    lrcs[track.song] = lrc_of(track.codes, req.lrc_lead, _lrc_path(path)).encode("utf-8")
                batch.add(_lrc_path(path), lrcs[track.song])
            seconds = track.audio.shape[-1] / track.sample_rate
            lines.append(f"wrote {path} ({seconds:.1f} s of audio, song {track.song + 1} variation "
                         f"{track.variation + 1}, lm_seed {replay_req.lm_seed}, seed {replay_req.seed})")
        batch.commit()
    if not quiet:
        for line in lines:
            print(line, file=sys.stderr)
        print(f"wrote {len(tracks)} track(s) in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return [numbered(out, len(tracks), n) for n in range(len(tracks))]


def _song_request(args) -> MM3Request:
    """continue / repaint: the request of the song named by --request (it must hold its codes)."""
    if not args.request:
        raise RequestError(f"{args.command} needs --request: the replay JSON of the song (written beside it)")
    req = _request_from_args(args, need_text=True)
    if not req.audio_codes:
        raise RequestError(f"{args.request}: no audio_codes (make them with `plan` or `generate`)")
    return req


def cmd_generate(args, req: MM3Request | None = None, pipe=None) -> int:
    req = _request_from_args(args, need_text=True) if req is None else req
    if args.command == "render" and not req.audio_codes:
        raise RequestError(f"{args.request}: no audio_codes to render (make them with `plan` or `generate`)")
    out = Path(args.out)
    fmt = _format_for(out, req, args.format)
    req = replace(req, output_format=fmt).validate()
    count = req.synth_batch_size * (1 if req.audio_codes else req.lm_batch_size)
    targets = [numbered(out, count, n) for n in range(count)]
    lrc = bool(getattr(args, "lrc", False))
    _check_targets(targets + [t.with_suffix(".json") for t in targets] + [_lrc_path(t) for t in targets if lrc],
                   args.overwrite)
    player = _player(args)
    stream = _both(_window_writer(args, out, req), player)
    try:
        if pipe is None:
            pipe = _pipeline(args)
            req = _match_models(pipe, req, args)
        with Console(args.quiet) as console:
            tracks = pipe.run(req, console.progress(), on_audio=stream,
                              lyric_heads=req.lyric_heads() if lrc else None)
        _print_takes(pipe, args.quiet)
        start = time.perf_counter()
        _write_tracks(tracks, out, fmt, req, args.overwrite, args.quiet, lrc)
        pipe.timings.add("write", time.perf_counter() - start)
        pipe.timings.add("load", pipe.store.load_seconds)
        if not args.quiet:
            print(f"timings: {pipe.timings.summary()}", file=sys.stderr)
        if player is not None:
            _play_to_the_end(player, args.quiet)
    finally:
        if player is not None:
            player.finish(should_stop=lambda: True)  # a failed or interrupted run stops the sound at once
    return 0


def _player(args):
    """With --play: the device player (checked before any work: the optional package, a device)."""
    if not getattr(args, "play", False):
        return None
    from .playback import DevicePlayer, open_output

    return DevicePlayer(open_output())


def _play_to_the_end(player, quiet: bool) -> None:
    if player.pending() and not quiet:
        print("playing the rest of the first track (Ctrl+C stops)", file=sys.stderr)
    try:
        player.finish()
    except KeyboardInterrupt:
        pass


def _both(*callbacks):
    """One `on_audio` callback calling each given one in turn (None when none is given)."""
    given = [c for c in callbacks if c is not None]
    if len(given) < 2:
        return given[0] if given else None

    def each(*piece):
        for c in given:
            c(*piece)

    return each


def _window_writer(args, out: Path, req: MM3Request):
    """With --stream-dir: the `Pipeline.run` callback that writes each decoded window of each track
    there at once (whole files only: written aside, then renamed), saying when the first arrived."""
    folder = getattr(args, "stream_dir", None)
    if not folder:
        return None
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"--stream-dir {folder}: {e.strerror or e}") from None
    variations, start = req.synth_batch_size, time.perf_counter()

    def write(song: int, k: int, windows: int, samples, sample_rate: int):
        for j in range(samples.shape[0]):
            track = song * variations + j
            path = folder / f"{out.stem}_{track + 1:02d}_{k + 1:03d}.wav"
            atomic_write(path, render(samples[j], "wav32", sample_rate=sample_rate))
        if (song, k) == (0, 0) and not args.quiet:
            print(f"first audio in {folder} after {time.perf_counter() - start:.1f} s", file=sys.stderr)

    return write


def _print_takes(pipe, quiet: bool):
    if pipe.candidates and not quiet:
        for c in pipe.candidates:
            print(c.describe(25), file=sys.stderr)


def cmd_continue(args) -> int:
    """The song of --request extended to --duration: its codes, then new frames from --lm-seed."""
    req = _song_request(args)
    if args.duration is None:
        raise RequestError("continue needs --duration: the length of the extended song in seconds")
    req = replace(req, continue_codes=req.audio_codes, audio_codes="", lyric_times=[])
    return cmd_generate(args, req)


def cmd_plan(args) -> int:
    req = _request_from_args(args, need_text=True)
    if req.audio_codes:
        raise RequestError("the request already has audio_codes: render it instead of planning")
    req = req.validate().resolve_seeds()
    out = Path(args.out)
    targets = [numbered(out, req.lm_batch_size, n) for n in range(req.lm_batch_size)]
    heads = req.lyric_heads() if args.lrc else None
    _check_targets(targets + [_lrc_path(t) for t in targets if heads], args.overwrite)
    pipe = _pipeline(args)
    req = _match_models(pipe, req, args, kinds=("lm", "depth"))
    pipe.preflight(req, kinds=("lm", "depth"), lyric_heads=heads)
    req = pipe.pin_models(req, kinds=("lm", "depth"))
    try:
        with Console(args.quiet) as console:
            songs, _ = pipe.plan(req, console.progress(), lyric_heads=heads)
    finally:
        pipe.store.release_all()
    _print_takes(pipe, args.quiet)
    lines = []
    with FileBatch(args.overwrite) as batch:
        for i, (song, path) in enumerate(zip(songs, targets)):
            (replay_req,) = replay_requests(song)
            if heads:
                replay_req = replace(replay_req, lyric_times=record_times(song.codes, req.lrc_lead))
            batch.add(path, (replay_req.to_json() + "\n").encode())
            if heads:
                batch.add(_lrc_path(path), lrc_of(song.codes, req.lrc_lead, _lrc_path(path)).encode("utf-8"))
            how = "ended by itself" if song.codes.ended_naturally else "reached the duration cap"
            lines.append(f"wrote {path}: {song.frames} frames ({song.frames / 25:.2f} s, {how}), "
                         f"lm_seed {replay_req.lm_seed}")
        batch.commit()
    if not args.quiet:
        print("\n".join(lines), file=sys.stderr)
    if not args.quiet:
        print(f"timings: {pipe.timings.summary()}", file=sys.stderr)
    return 0


def run_job(args) -> int:
    """generate / plan / render; errors reach `mm3.commands.main.main`, which maps them to exit codes."""
    return {"generate": cmd_generate, "render": cmd_generate, "plan": cmd_plan,
            "continue": cmd_continue}[args.command](args)


def _common(p, *, text: bool, synth: bool, out_help: str):
    p.add_argument("--models", required=True, help="folder holding the five GGUF component files")
    p.add_argument("--request", help="request JSON (minimaxmusic.cpp format); flags override its fields")
    if text:
        p.add_argument("--caption", help="the structured caption")
        p.add_argument("--lyrics", help=f"the lyrics (with [tags]); left out or empty: an instrumental (the model is "
                                        f"sent {INSTRUMENTAL_LYRICS}, which the replay JSON records)")
        p.add_argument("--caption-file", help="read the caption from a UTF-8 file")
        p.add_argument("--lyrics-file", help="read the lyrics from a UTF-8 file")
        p.add_argument("--duration", type=float, help="seconds to plan at most (default 60)")
        p.add_argument("--lm-seed", dest="lm_seed", type=int, help="AR seed (-1 = random; song i uses lm_seed + i)")
        p.add_argument("--lm-cfg", dest="lm_cfg", type=float, help="AR guidance (default 1.5)")
        p.add_argument("--lm-top-k", dest="lm_top_k", type=int, help="AR top-k (default 50)")
        p.add_argument("--songs", dest="lm_batch_size", type=int, help="songs per request (lm_batch_size)")
        p.add_argument("--temperature", dest="lm_temperature", type=float,
                       help="AR temperature of the semantic draw (default 1: the reference)")
        p.add_argument("--top-p", dest="lm_top_p", type=float, help="nucleus over the top-k (default 1: off)")
        p.add_argument("--penalty", dest="lm_penalty", choices=PENALTIES,
                       help="repetition penalty of the semantic draw (default none)")
        p.add_argument("--penalty-strength", dest="lm_penalty_strength", type=float,
                       help="dry: base of the penalty, 1.05-1.15 useful; frequency/presence: logit per occurrence")
        p.add_argument("--penalty-window", dest="lm_penalty_window", type=int,
                       help=f"frames the penalty looks back (default {DEFAULT_PENALTY_WINDOW})")
        p.add_argument("--dry-min-match", dest="lm_dry_min_match", type=int,
                       help=f"shortest repeat (frames) dry penalises (default {DEFAULT_DRY_MIN_MATCH})")
        p.add_argument("--min-duration", dest="min_duration", type=float,
                       help="seconds before which the song may not end (default 0)")
        p.add_argument("--takes", type=int, help="candidates per song, kept by whether they ended (default 1)")
        p.add_argument("--require-ending", dest="require_ending", action="store_true", default=None,
                       help="keep only takes that ended before the duration cap")
        p.add_argument("--ending-rounds", dest="ending_rounds", type=int,
                       help="rounds of takes at the next seeds while none ended (with --require-ending)")
    if synth:
        p.add_argument("--steps", type=int, help="DiT steps (default 30)")
        p.add_argument("--seed", type=int, help="DiT noise seed (-1 = random; variation j uses seed + j)")
        p.add_argument("--dit-cfg", dest="dit_cfg", type=float, help="DiT guidance (default 1.7)")
        p.add_argument("--shift", dest="dit_shift", type=float,
                       help="flow schedule shift (default 0: automatic, 29 / (steps - 1) below 30 steps; 1 = off)")
        p.add_argument("--variations", dest="synth_batch_size", type=int, help="variations per song (1..9)")
        p.add_argument("--peak-clip", dest="peak_clip", type=int, help="normalisation percentile (default 10)")
        p.add_argument("--mp3-bitrate", dest="mp3_bitrate", type=int, help="kbps (default 128)")
        p.add_argument("--format", choices=list(EXTENSIONS), help="output format (default: from --out)")
        p.add_argument("--stream-dir", dest="stream_dir",
                       help="also write each window's audio to this folder as soon as it is decoded (32-bit float "
                            "WAV at the rendered level, OUT_<track>_<window>.wav), to listen before the song is done")
        p.add_argument("--play", action="store_true",
                       help="play the first track on the default audio device as its windows are decoded (needs "
                            "the optional sounddevice package)")
    p.add_argument("--rng", choices=RNG_MODES, default=None,
                   help="random streams: independent (lm_seed for the AR, seed for the DiT noise) or reference (one "
                        "generator drives AR then DiT noise, as the diffusers pipeline); default: the request's "
                        "rng field, else independent")
    add_lrc_flags(p, "also write the lyric timestamps beside each " + ("song's replay JSON" if not synth else "track")
                  + " (OUT.lrc: each lyric line's start, from the LM's attention; lines the song never reached "
                    "are left out, and a warning says so when none was timed)")
    p.add_argument("--strict", action="store_true",
                   help="refuse a request whose model or LoRA files (named by --request) are missing or differ from "
                        "those that made it, instead of warning")
    p.add_argument("--lora", action="append", metavar="PATH[:STRENGTH[:QK,VO,MLP]]",
                   help="apply a LoRA (safetensors; the LM or the DiT, read from its tensor names), at STRENGTH "
                        "(default 1) and optional strengths of its attention q/k, attention v/out and MLP layers; "
                        "repeat to stack several (replaces the request's loras)")
    for kind in ("lm", "depth", "cond", "dit", "vae"):
        p.add_argument(f"--{kind}-model", dest=f"{kind}_model", help=f"{kind} file name in --models")
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--device", default=None, help="cuda, cuda:1, xpu, mps or cpu (default: the best available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 for every stage (default: per device; "
                                                 "on a CPU with native bfloat16 products, the DiT in bfloat16)")
    p.add_argument("--keep-loaded", action="store_true", help="keep both model groups resident")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_job)


def add_lrc_flags(p, lrc_help: str | None):
    """--lrc (when `lrc_help`), --lrc-heads and --lrc-lead (`mm3.plan.lyrics_align`)."""
    if lrc_help:
        p.add_argument("--lrc", action="store_true", help=lrc_help)
    p.add_argument("--lrc-heads", dest="lrc_heads",
                   help="LM heads whose attention times the lyrics, LAYER:HEAD or LAYER:* items (e.g. 12:3,19:*; "
                        "counted from 0); default: the released LM's 12:27,19:7,24:29, else the request's lrc_heads")
    p.add_argument("--lrc-lead", dest="lrc_lead", type=float,
                   help=f"seconds added to every lyric timestamp (default {LEAD_SECONDS:g}: the LM attends a line "
                        "about that long before it is heard)")


def add_cli(sub):
    _common(sub.add_parser("generate", help="caption + lyrics -> song files (+ replay JSON)"),
            text=True, synth=True, out_help="output file (.mp3 or .wav); batches are numbered")
    _common(sub.add_parser("plan", help="AR stage only -> replay requests with codes and seeds"),
            text=True, synth=False, out_help="output JSON; batches are numbered")
    _common(sub.add_parser("render", help="synthesise a request's audio_codes (no AR sampling)"),
            text=False, synth=True, out_help="output file (.mp3 or .wav)")
    _common(sub.add_parser("continue", help="extend the song of --request to --duration (its codes, then new ones)"),
            text=True, synth=True, out_help="output file (.mp3 or .wav); batches are numbered")
