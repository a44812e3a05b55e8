"""File nodes: Save / Load Audio Codes (the replay request JSON) and Save Song."""

from __future__ import annotations

import json
import os
from pathlib import Path

import folder_paths
from comfy_api.latest import io, ui

from mm3.constants import DEFAULT_MP3_BITRATE, DEFAULT_PEAK_CLIP, MAX_PEAK_CLIP, MP3_BITRATES, OUTPUT_FORMATS
from mm3.filecache import FileCache
from mm3.song.numerics import Numerics
from mm3.synth.output import atomic_write
from mm3.song.stages import MODEL_CHECKS, request_of
from . import logic
from .comfy_models import compute_dtype, dit_compute_dtype, load, patcher
from .common import ADVANCED, AUDIO_CODES, CATEGORY, DEPTH, LM, interruptible, node_progress
from .handles import file_fingerprint

OUTPUT_TAG = " [output]"  # ComfyUI's annotation for a file in the output folder
_CODES_FILES = FileCache(1024)


def _is_codes_file(path: str) -> bool:
    """A JSON object with a non-empty audio_codes string (cached by path, size, mtime)."""
    try:
        return _CODES_FILES.get(path, lambda st: _holds_codes(path))
    except OSError:
        return False


def _holds_codes(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return isinstance(data, dict) and bool(data.get("audio_codes"))
    except (OSError, ValueError):
        return False


def codes_files() -> list[str]:
    """Replay request files in the input folder and (annotated) in the output folder."""
    out = []
    for base, tag in ((folder_paths.get_input_directory(), ""), (folder_paths.get_output_directory(), OUTPUT_TAG)):
        for root, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for f in sorted(files):
                if f.endswith(".json") and _is_codes_file(os.path.join(root, f)):
                    out.append(os.path.relpath(os.path.join(root, f), base).replace(os.sep, "/") + tag)
    return out


def _save_path(prefix: str):
    folder, stem, counter, subfolder, _ = folder_paths.get_save_image_path(prefix, folder_paths.get_output_directory())
    return Path(folder), stem, counter, subfolder


class MM3SaveAudioCodes(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3SaveAudioCodes", display_name="MM3 Save Audio Codes", category=CATEGORY,
            description="Writes the song's replay request (caption, lyrics, settings, seeds and audio_codes) as "
                        "JSON in the output folder; Load Audio Codes or the command line render it again.",
            inputs=[AUDIO_CODES.Input("codes"),
                    io.String.Input("filename_prefix", default="mm3/codes",
                                    tooltip="Where the plan is saved, under ComfyUI's output folder: mm3/codes "
                                            "writes output/mm3/codes_00001_.json (numbered on). Folders are made "
                                            "as needed.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, codes, filename_prefix: str) -> io.NodeOutput:
        folder, stem, counter, subfolder = _save_path(filename_prefix)
        path = atomic_write(folder / f"{stem}_{counter:05}_.json", request_of(codes).to_json().encode("utf-8"))
        rel = "/".join(p for p in (subfolder, path.name) if p)
        # "codes": the file as /view serves it, for scripts that fetch a run's outputs
        return io.NodeOutput(ui={"text": [f"{rel} ({codes.frames} frames)"],
                                 "codes": [{"filename": path.name, "subfolder": subfolder, "type": "output"}]})


class MM3LoadAudioCodes(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3LoadAudioCodes", display_name="MM3 Load Audio Codes", category=CATEGORY,
            description="Reads a replay request JSON (input folder, or [output]) and rebuilds the frame hiddens of "
                        "its codes by teacher forcing (no sampling). Also outputs the file's DiT settings.",
            inputs=[LM.Input("lm"), DEPTH.Input("depth"),
                    io.Combo.Input("codes_file", options=codes_files(),
                                   tooltip="The saved song to render again: a replay JSON with audio_codes (written "
                                           "by Save Song or Save Audio Codes; [output]: in the output folder). The "
                                           "list is read when the page loads."),
                    io.Combo.Input("model_check", options=list(MODEL_CHECKS), default="warn",
                                   extra_dict=ADVANCED,
                                   tooltip="When a model file of this graph is not the one that made the song "
                                           "(compared by the fingerprints the file records): warn, or refuse to run.")],
            outputs=[AUDIO_CODES.Output("codes", display_name="codes"), io.Int.Output("seed", display_name="seed"),
                     io.Int.Output("steps", display_name="steps"), io.Float.Output("dit_cfg", display_name="dit_cfg")],
        )

    @classmethod
    def fingerprint_inputs(cls, codes_file: str, **kwargs):
        try:
            return file_fingerprint(folder_paths.get_annotated_filepath(codes_file))
        except OSError:
            return codes_file

    @classmethod
    def execute(cls, lm, depth, codes_file: str, model_check: str = "warn") -> io.NodeOutput:
        path = folder_paths.get_annotated_filepath(codes_file)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return replay_codes_text(lm, depth, text, codes_file, model_check)


def replay_codes_text(lm, depth, text: str, source: str, model_check: str) -> io.NodeOutput:
    """What Load Audio Codes outputs for a replay request's JSON text (`source` names it in messages):
    its song by teacher forcing, after the check of this machine's LM and depth files against the
    fingerprints the request records; the request's seed, steps and dit_cfg."""
    request, prompt, codes = logic.read_codes_request(text, source, lm, depth)
    problems = logic.codes_file_problems(request, lm, depth)
    if problems and model_check == "refuse":
        raise ValueError(f"{source}: {problems[0]} (refused: model_check is refuse)")
    for p in problems:
        logic.log.warning("MM3: %s: %s", source, p)
    with interruptible():
        device = patcher(lm).load_device
        lm_model, depth_model = load([lm, depth])
        dtype = compute_dtype(device)
        song = logic.replay_codes(lm_model, depth_model, depth, request, prompt, codes, device=device, dtype=dtype,
                                  progress=node_progress(), model_check=model_check,
                                  numerics=Numerics(compute_dtype=dit_compute_dtype(dtype)))
    text = f"{song.frames} frames, lm_seed {request.lm_seed}; file settings: seed {request.seed}, steps " \
           f"{request.steps}, dit_cfg {request.dit_cfg:g}"
    text += "".join(f"\nwarning: {p}" for p in problems)
    seed = max(request.seed, 0)
    return io.NodeOutput(song, seed, request.steps, request.dit_cfg, ui={"text": [text]})


class MM3SaveSong(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3SaveSong", display_name="MM3 Save Song", category=CATEGORY,
            description="Writes each item of the audio batch as MP3 or WAV (16/24-bit PCM peak-normalised, 32-bit "
                        "float raw) in the output folder; MM3 audio also gets its replay request JSON beside it.",
            inputs=[
                io.Audio.Input("audio"),
                io.String.Input("filename_prefix", default="mm3/song",
                                tooltip="Where the song is saved, under ComfyUI's output folder: mm3/song writes "
                                        "output/mm3/song_00001_.mp3 (numbered on) and its replay .json beside it. "
                                        "Folders are made as needed; %batch_num% becomes the item's number."),
                io.Combo.Input("format", options=list(OUTPUT_FORMATS), default="mp3",
                               tooltip="mp3: small, for listening and sharing; wav16 / wav24: lossless, made as loud "
                                       "as it goes without clipping; wav32: lossless float, the level as rendered "
                                       "(for mixing)."),
                io.Combo.Input("mp3_bitrate", options=[str(b) for b in MP3_BITRATES], default=str(DEFAULT_MP3_BITRATE),
                               tooltip=f"MP3 quality in kbit/s: {DEFAULT_MP3_BITRATE} is the default, 192-320 sounds "
                                       "best, below 96 audibly worse. Ignored for WAV."),
                io.Int.Input("peak_clip", default=DEFAULT_PEAK_CLIP, min=0, max=MAX_PEAK_CLIP, extra_dict=ADVANCED,
                             tooltip="How loud the file is made: samples per million allowed to clip when "
                                     f"normalising. {DEFAULT_PEAK_CLIP} is the default (louder, inaudible clipping); "
                                     "0 never clips; above 100 can crackle. Not for wav32."),
                io.String.Input("lyrics_lrc", optional=True, force_input=True,
                                tooltip="The song's lyric timestamps from MM3 Lyric Timestamps, saved as a .lrc file "
                                        "beside each song (same name) for karaoke players and lyric videos; "
                                        "unconnected: none."),
            ],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, audio: dict, filename_prefix: str, format: str, mp3_bitrate: str,
                peak_clip: int = DEFAULT_PEAK_CLIP, lyrics_lrc: str | None = None) -> io.NodeOutput:
        folder, stem, counter, subfolder = _save_path(filename_prefix)
        ext = "mp3" if format == "mp3" else "wav"
        requests = audio.get(logic.AUDIO_REQUESTS_KEY)
        results = []
        for b, wave in enumerate(audio["waveform"]):
            name = f"{stem.replace('%batch_num%', str(b))}_{counter:05}_.{ext}"
            request = requests[b] if requests and b < len(requests) else None
            logic.write_track(folder / name, wave, audio["sample_rate"], format, mp3_bitrate=int(mp3_bitrate),
                              peak_clip=peak_clip, request=request, lrc=lyrics_lrc)
            results.append(ui.SavedResult(name, subfolder, io.FolderType.output))
            counter += 1
        return io.NodeOutput(ui=ui.SavedAudios(results))


NODES = [MM3SaveAudioCodes, MM3LoadAudioCodes, MM3SaveSong]
