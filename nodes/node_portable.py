"""Nodes for songs made on several ComfyUI servers (ComfyUI-Distributed's master and workers):
a plan carried inside the workflow as text, and songs packed for the Distributed Collector and
unpacked on the master (`song_cards`)."""

from __future__ import annotations

from comfy_api.latest import io

from mm3.plan.codes import AudioCodesError, count_code_frames
from mm3.song.request import MM3Request, RequestError
from mm3.song.stages import MODEL_CHECKS
from . import song_cards
from .common import ADVANCED, AUDIO_CODES, CATEGORY, DEPTH, LM
from .node_files import replay_codes_text


def replay_text_problem(text) -> str | None:
    """Why a replay JSON text cannot be rendered, checked without model files (None: it can be)."""
    if not isinstance(text, str):
        return None  # linked: checked when it runs
    if not text.strip():
        return ("MM3 Audio Codes From Text: replay_json is empty; paste the text of a replay JSON (Save Song, Save "
                "Audio Codes or `python -m mm3 plan` write one)")
    try:
        request = MM3Request.from_json(text).validate()
        if not request.audio_codes:
            return "MM3 Audio Codes From Text: this replay JSON holds no audio_codes (a plan's file has them)"
        count_code_frames(request.audio_codes)
    except (RequestError, AudioCodesError) as e:
        return f"MM3 Audio Codes From Text: {e}"
    return None


class MM3AudioCodesFromText(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3AudioCodesFromText", display_name="MM3 Audio Codes From Text", category=CATEGORY,
            description="Load Audio Codes for a replay JSON given as text: the workflow carries the plan, so every "
                        "server it is sent to (ComfyUI-Distributed's workers) renders the same codes without a "
                        "shared file. Each server checks its own LM and depth files against the fingerprints the "
                        "text records.",
            inputs=[LM.Input("lm"), DEPTH.Input("depth"),
                    io.String.Input("replay_json", multiline=True, default="",
                                    placeholder="The text of a replay JSON with audio_codes (Save Song, Save Audio "
                                                "Codes or python -m mm3 plan write one)",
                                    tooltip="The plan to render: the whole text of a replay JSON with audio_codes "
                                            "(what Save Song and Save Audio Codes write beside a song). It travels "
                                            "inside the workflow to every server that runs it."),
                    io.Combo.Input("model_check", options=list(MODEL_CHECKS), default="warn", extra_dict=ADVANCED,
                                   tooltip="When a model file on the server that runs this is not the one that "
                                           "made the song (compared by the fingerprints the text records): warn, "
                                           "or refuse to run.")],
            outputs=[AUDIO_CODES.Output("codes", display_name="codes"), io.Int.Output("seed", display_name="seed"),
                     io.Int.Output("steps", display_name="steps"), io.Float.Output("dit_cfg", display_name="dit_cfg")],
        )

    @classmethod
    def validate_inputs(cls, replay_json=None) -> bool | str:
        return replay_text_problem(replay_json) or True

    @classmethod
    def execute(cls, lm, depth, replay_json: str, model_check: str = "warn") -> io.NodeOutput:
        return replay_codes_text(lm, depth, replay_json, "replay_json", model_check)


class MM3PackSongs(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3PackSongs", display_name="MM3 Pack Songs", category=CATEGORY,
            description="Joins this server's songs into one AUDIO and writes each song's length and replay requests "
                        "into a small card image: wire both into the Distributed Collector, which brings every "
                        "server's audio and images to the master; MM3 Unpack Songs cuts the songs apart there.",
            inputs=[io.Audio.Input("audio", tooltip="The songs of this server (MM3 Stitch's audio).")],
            outputs=[io.Audio.Output("audio", display_name="audio"), io.Image.Output("card", display_name="card")],
            is_input_list=True,
        )

    @classmethod
    def execute(cls, audio: list[dict]) -> io.NodeOutput:
        joined, card = song_cards.pack_songs(audio)
        return io.NodeOutput(joined, card)


class MM3UnpackSongs(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MM3UnpackSongs", display_name="MM3 Unpack Songs", category=CATEGORY,
            description="Cuts the Distributed Collector's audio back into the songs every server made (the master's "
                        "first, then each worker's), each with its replay requests, as a list for Save Song.",
            inputs=[io.Image.Input("cards", tooltip="The collector's images: the cards of MM3 Pack Songs."),
                    io.Audio.Input("audio", tooltip="The collector's audio: every server's songs joined.")],
            outputs=[io.Audio.Output("audio", display_name="audio", is_output_list=True)],
        )

    @classmethod
    def execute(cls, cards, audio: dict) -> io.NodeOutput:
        songs = song_cards.unpack_songs(cards, audio)
        rate = int(audio["sample_rate"])
        lines = [f"{len(songs)} songs from {cards.shape[0]} servers"] + [
            f"song {i + 1}: {s['waveform'].shape[-1] / rate:.2f} s" +
            "".join(f", lm_seed {r.get('lm_seed')} seed {r.get('seed')}" for r in s.get(song_cards.AUDIO_REQUESTS_KEY) or [])
            for i, s in enumerate(songs)]
        return io.NodeOutput(songs, ui={"text": ["\n".join(lines)]})


NODES = [MM3AudioCodesFromText, MM3PackSongs, MM3UnpackSongs]
