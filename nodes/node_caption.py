"""MM3 Caption Builder: a caption in the layout the model was trained on, from a preset and fields.

The writing is the engine's (`mm3.song.captions`); this node maps its widgets onto the fields: "auto",
0 and empty text mean "the preset's value, or left out without a preset".
"""

from __future__ import annotations

from comfy_api.latest import io

from mm3.song.captions import (
    BPM_MAX, KEYS, PRESET_SOURCES, PRESETS, SCALES, VOCAL_GENDERS, build_caption, caption_fields)
from .common import CATEGORY

NO_PRESET = "none"
AUTO = "auto"
_UNSET = " Empty: the preset's, or left out."


def _text(name: str, tooltip: str, multiline: bool = True) -> io.String.Input:
    return io.String.Input(name, multiline=multiline, default="", tooltip=tooltip + _UNSET)


class MM3CaptionBuilder(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        sources = ", ".join(f"{name} ({src})" for name, src in PRESET_SOURCES.items())
        return io.Schema(
            node_id="MM3CaptionBuilder", display_name="MM3 Caption Builder", category=CATEGORY,
            description="Writes a caption in the long structured layout the model was trained on (Global Metadata, "
                        "Vocal Details, Arrangement), from a preset and the fields set here. Wire its output into "
                        "MM3 Prompt's caption.",
            inputs=[
                io.Combo.Input("preset", options=[NO_PRESET, *PRESETS], default=NO_PRESET,
                               tooltip=f"Field values copied from a demo caption: {sources}. Fields set below "
                                       "replace the preset's."),
                io.Int.Input("bpm", default=0, min=0, max=BPM_MAX, tooltip="Tempo. 0: the preset's, or left out."),
                io.Combo.Input("key", options=[AUTO, *KEYS], default=AUTO,
                               tooltip="Key. auto: the preset's, or left out."),
                io.Combo.Input("scale", options=[AUTO, *SCALES], default=AUTO,
                               tooltip="Scale. auto: the preset's, or left out."),
                _text("genres", "Genres separated by '/' or ',', e.g. 'Indie Pop / Power Pop'.", multiline=False),
                _text("mood_arc", "How the mood moves through the song (Global Emotional Progression)."),
                io.Combo.Input("vocal_gender", options=[AUTO, *VOCAL_GENDERS], default=AUTO,
                               tooltip="Lead vocal. auto: the preset's, or left out."),
                _text("vocal_timbre", "The lead voice: range, texture, resonance (after 'Male.' / 'Female.')."),
                _text("vocal_style", "Phrasing, melodic contour, articulations."),
                _text("instruments", "The main instruments and how they evolve (Arrangement, Primary)."),
                _text("production", "Soundstage, frequency balance, dynamics (Sonics & Production Profile)."),
            ],
            outputs=[io.String.Output("caption", display_name="caption")],
        )

    @classmethod
    def execute(cls, preset: str, bpm: int, key: str, scale: str, genres: str, mood_arc: str, vocal_gender: str,
                vocal_timbre: str, vocal_style: str, instruments: str, production: str) -> io.NodeOutput:
        fields = caption_fields(
            "" if preset == NO_PRESET else preset, bpm=bpm or None, key="" if key == AUTO else key,
            scale="" if scale == AUTO else scale, genres=genres, mood_arc=mood_arc,
            vocal_gender="" if vocal_gender == AUTO else vocal_gender, vocal_timbre=vocal_timbre,
            vocal_style=vocal_style, instruments=instruments, production=production)
        caption = build_caption(fields)
        return io.NodeOutput(caption, ui={"text": [caption]})


NODES = [MM3CaptionBuilder]
