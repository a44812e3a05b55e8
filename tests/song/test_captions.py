"""Captions in the trained layout (`mm3.song.captions`): the builder's exact text, the presets against the
demo captions they were copied from, heading detection on corpus and tag captions, the Prompt node's
warning, the Caption Builder node (in ComfyUI's interpreter, COMFYUI_PATH), and the shipped
workflows' default captions (layout and token budget)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mm3.song.captions import (
    KEYS, LABELS, LAYERING, PRESET_SOURCES, PRESETS, SECTIONS, CaptionError, CaptionFields, build_caption,
    caption_fields, caption_warning, has_format_headings, parse_caption, split_genres)
from mm3.constants import MAX_PROMPT_TOKENS
from mm3.plan.prompt import Prompt, clean_caption, count_tokens, normalize_lyrics
from tests.helpers.comfyui import CAPTION as HELPER_CAPTION
from tests.helpers.comfyui import COMFYUI_PATH, import_pack, needs_comfy

ROOT = Path(__file__).resolve().parents[2]
OLD_DEFAULT = ("<|genre indie pop|> <|mood bright, hopeful|>\nUpbeat indie pop with jangly electric guitars, punchy "
               "live drums, warm synth pads and a round bass line. Clear female lead vocal, airy harmonies in the "
               "chorus. 118 BPM, G major.")
TAG_CAPTIONS = [OLD_DEFAULT, HELPER_CAPTION, "dark synth", "Synth-pop, 120 bpm, female vocal, bright and driving",
                "<|genre folk|> <|mood calm|> <|key C|>", "Mood: calm. Genre: folk."]

FULL = CaptionFields(bpm=118, key="G", scale="major", genres=("Indie Pop", "Power Pop"),
                     mood_arc="Bright and expectant, lifting into a euphoric chorus",
                     production="Wide and polished.", vocal_gender="female",
                     vocal_timbre="The vocalist features a clear mezzo-soprano",
                     vocal_style="Conversational verses, a soaring octave leap in the hook!",
                     instruments="Jangly electric guitars and\n  a warm synth pad")
FULL_TEXT = (
    "Global Metadata\n"
    "Basic Attributes: bpm is 118. key is G, and scale is major. Indie Pop / Power Pop.\n"
    "Global Emotional Progression: Bright and expectant, lifting into a euphoric chorus.\n"
    "Sonics & Production Profile: Wide and polished.\n"
    "\n"
    "Vocal Details\n"
    "Vocal Gender & Timbre: Female. The vocalist features a clear mezzo-soprano.\n"
    "Vocal Style: Conversational verses, a soaring octave leap in the hook!\n"
    "\n"
    "Arrangement\n"
    "Instrument Lifecycle Description (Primary/Secondary Layering):\n"
    "Primary: Jangly electric guitars and a warm synth pad.")


# -- the builder ---------------------------------------------------------------------------------
def test_builder_writes_the_trained_layout():
    assert build_caption(FULL) == FULL_TEXT
    assert parse_caption(FULL_TEXT) == {
        "Global Metadata": {"Basic Attributes": "bpm is 118. key is G, and scale is major. Indie Pop / Power Pop.",
                            "Global Emotional Progression": "Bright and expectant, lifting into a euphoric chorus.",
                            "Sonics & Production Profile": "Wide and polished."},
        "Vocal Details": {"Vocal Gender & Timbre": "Female. The vocalist features a clear mezzo-soprano.",
                          "Vocal Style": "Conversational verses, a soaring octave leap in the hook!"},
        "Arrangement": {LAYERING: "", "Primary": "Jangly electric guitars and a warm synth pad."}}


@pytest.mark.parametrize("fields, text", [
    (CaptionFields(bpm=90), "Global Metadata\nBasic Attributes: bpm is 90."),
    (CaptionFields(key="eb"), "Global Metadata\nBasic Attributes: key is Eb."),
    (CaptionFields(scale="Minor", genres=("Soul",)), "Global Metadata\nBasic Attributes: scale is minor. Soul."),
    (CaptionFields(key="f#", scale="minor"), "Global Metadata\nBasic Attributes: key is F#, and scale is minor."),
    (CaptionFields(vocal_gender="Male"), "Vocal Details\nVocal Gender & Timbre: Male."),
    (CaptionFields(vocal_timbre="A husky alto"), "Vocal Details\nVocal Gender & Timbre: A husky alto."),
    (CaptionFields(instruments="Piano"),
     "Arrangement\nInstrument Lifecycle Description (Primary/Secondary Layering):\nPrimary: Piano."),
    (CaptionFields(mood_arc='It ends "quietly"', production="   "),
     'Global Metadata\nGlobal Emotional Progression: It ends "quietly"'),
])
def test_unset_fields_and_sections_are_left_out(fields, text):
    assert build_caption(fields) == text


def test_every_key_spelling_is_written_as_given():
    for key in KEYS:
        assert build_caption(CaptionFields(key=key.lower())) == f"Global Metadata\nBasic Attributes: key is {key}."


@pytest.mark.parametrize("fields, message", [
    (CaptionFields(bpm=39), "bpm must be a whole number 40..250, got 39"),
    (CaptionFields(bpm=251), "bpm must be a whole number 40..250, got 251"),
    (CaptionFields(bpm=120.5), "bpm must be a whole number 40..250, got 120.5"),
    (CaptionFields(bpm="120"), "bpm must be a whole number 40..250, got '120'"),
    (CaptionFields(bpm=True), "bpm must be a whole number 40..250, got True"),
    (CaptionFields(key="H"), "key must be one of C, C#, Db, D, D#, Eb, E, F, F#, Gb, G, G#, Ab, A, A#, Bb, B, got 'H'"),
    (CaptionFields(key="E#"), "got 'E#'"),
    (CaptionFields(scale="dorian"), "scale must be one of major, minor, got 'dorian'"),
    (CaptionFields(vocal_gender="robot"), "vocal_gender must be one of male, female, got 'robot'"),
    (CaptionFields(genres="Pop / Soul"), "genres must be a list of genre names, got 'Pop / Soul'"),
    (CaptionFields(), "nothing to write: choose a preset or set at least one of bpm, key, scale, genres"),
])
def test_bad_fields_name_the_value_and_what_was_expected(fields, message):
    with pytest.raises(CaptionError) as e:
        build_caption(fields)
    assert message in str(e.value)


def test_fields_over_a_preset():
    base = PRESETS["Pop Punk"]
    got = caption_fields("Pop Punk", bpm=None, key="", genres="Skate Punk, Emo", mood_arc="", vocal_style="Shouted")
    assert got == CaptionFields(**{**base.__dict__, "genres": ("Skate Punk", "Emo"), "vocal_style": "Shouted"})
    assert caption_fields(genres=["A", "B"]).genres == ("A", "B")
    assert split_genres(" Pop Rock / Power Pop,soul\n") == ("Pop Rock", "Power Pop", "soul")
    with pytest.raises(CaptionError, match=r"unknown caption preset 'Polka'; expected one of Outlaw Country, "):
        caption_fields("Polka")
    with pytest.raises(TypeError, match=r"unknown caption fields \['tempo'\]"):
        caption_fields(tempo=120)


# -- presets and the corpus ----------------------------------------------------------------------
def test_presets_build_captions_in_the_corpus_layout():
    assert 6 <= len(PRESETS) <= 10 and set(PRESETS) == set(PRESET_SOURCES)
    for name, fields in PRESETS.items():
        caption = build_caption(fields)
        assert has_format_headings(caption) and caption_warning(caption) is None, name
        parsed = parse_caption(caption)
        assert list(parsed) == list(SECTIONS), name
        assert list(parsed["Global Metadata"]) == ["Basic Attributes", "Global Emotional Progression",
                                                   "Sonics & Production Profile"], name
        assert list(parsed["Vocal Details"]) == ["Vocal Gender & Timbre", "Vocal Style"], name
        assert list(parsed["Arrangement"]) == [LAYERING, "Primary"], name
        assert parsed["Global Metadata"]["Global Emotional Progression"] == fields.mood_arc, name
        assert parsed["Arrangement"]["Primary"] == fields.instruments, name


def test_presets_are_copied_from_their_corpus_captions(corpus):
    """Each line a preset writes is a line of the demo caption it names (one corpus caption leaves the
    full stop off its genres)."""
    for name, fields in PRESETS.items():
        source = corpus[PRESET_SOURCES[name].removesuffix(".json")]["caption"]
        lines = {line.strip() for line in source.splitlines()}
        for line in build_caption(fields).splitlines():
            assert not line or line in lines or line.removesuffix(".") in lines, (name, line)


def test_corpus_captions_parse_in_the_layout(corpus):
    for name, req in corpus.items():
        caption = req["caption"]
        assert has_format_headings(caption) and caption_warning(caption) is None, name
        parsed = parse_caption(caption)
        assert list(parsed) == list(SECTIONS), name
        for section in ("Global Metadata", "Vocal Details"):
            assert tuple(parsed[section]) == LABELS[section], (name, section)
        arrangement = list(parsed["Arrangement"])
        assert arrangement[0] == LAYERING and arrangement[-2:] == list(LABELS["Arrangement"][-2:]), name
        assert parsed["Global Metadata"]["Basic Attributes"].startswith("bpm is "), name


@pytest.mark.parametrize("caption", TAG_CAPTIONS)
def test_tag_captions_have_no_headings(caption):
    assert not has_format_headings(caption)
    assert "MM3 Caption Builder" in caption_warning(caption)


@pytest.mark.parametrize("caption", ["## Vocal Details\nbreathy", "**Vocal Style:** breathy", "[Arrangement]",
                                     "dark synth\nbasic attributes: bpm is 90."])
def test_a_single_heading_is_enough(caption):
    assert has_format_headings(caption) and caption_warning(caption) is None


def test_no_warning_for_an_empty_caption():
    assert caption_warning("") is None and caption_warning("  \n") is None


# -- MM3 Prompt's summary ------------------------------------------------------------------------
@pytest.mark.parametrize("caption, warned", [(OLD_DEFAULT, True), (FULL_TEXT, False)])
def test_prompt_summary_warns_about_a_caption_without_headings(caption, warned):
    from mm3.song import stages

    logic = import_pack("nodes.logic")
    prompt = Prompt(torch.zeros(2, 7, dtype=torch.long), clean_caption(caption), normalize_lyrics("la"), None)
    lines = logic.prompt_summary(stages.PromptText(prompt, caption, "la", None), MAX_PROMPT_TOKENS).split("\n")
    assert lines[0] == f"7 / {MAX_PROMPT_TOKENS} prompt tokens"
    assert (lines[1] == f"warning: {caption_warning(OLD_DEFAULT)}") == warned
    assert lines[2 if warned else 1] == "" and lines[3 if warned else 2] == "caption (cleaned):"


# -- the node, in ComfyUI's interpreter ------------------------------------------------------------
NODE_SCRIPT = r"""
import importlib, importlib.util, json, sys
import torch
sys.path.append(sys.argv[2])
import comfy.cli_args
comfy.cli_args.args.cpu = not torch.cuda.is_available()  # model_management needs a device at import
spec = importlib.util.spec_from_file_location("pack", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pack = importlib.util.module_from_spec(spec); sys.modules["pack"] = pack; spec.loader.exec_module(pack)
node = importlib.import_module("pack.nodes.node_caption").MM3CaptionBuilder
info = node.GET_NODE_INFO_V1()
auto = dict(preset="none", bpm=0, key="auto", scale="auto", genres="", mood_arc="", vocal_gender="auto",
            vocal_timbre="", vocal_style="", instruments="", production="")
runs = [dict(auto, preset="Pop Punk"), dict(auto, preset="Pop Punk", bpm=170, key="D", vocal_gender="female"),
        dict(auto, bpm=118, key="G", scale="major", genres="Indie Pop / Power Pop")]
outs = [node.execute(**r) for r in runs]
print(json.dumps({"order": info["input_order"]["required"], "output": info["output"], "category": info["category"],
                  "presets": info["input"]["required"]["preset"][1]["options"],
                  "results": [[o.args[0], o.ui["text"]] for o in outs],
                  "registered": [n.__name__ for n in importlib.import_module("pack.nodes.extension").NODES]}))
"""


@needs_comfy
def test_caption_builder_node(tmp_path):
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    out = subprocess.run([python, "-c", NODE_SCRIPT, str(ROOT), COMFYUI_PATH], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["order"] == ["preset", "bpm", "key", "scale", "genres", "mood_arc", "vocal_gender", "vocal_timbre",
                            "vocal_style", "instruments", "production"]
    assert got["output"] == ["STRING"] and got["category"] == "MiniMax Music 3 (GGUF)"
    assert got["presets"] == ["none", *PRESETS] and "MM3CaptionBuilder" in got["registered"]
    punk = PRESETS["Pop Punk"]
    expected = [build_caption(punk),
                build_caption(CaptionFields(**{**punk.__dict__, "bpm": 170, "key": "D", "vocal_gender": "female"})),
                "Global Metadata\nBasic Attributes: bpm is 118. key is G, and scale is major. Indie Pop / Power Pop."]
    assert got["results"] == [[text, [text]] for text in expected]


# -- the shipped workflows' defaults ---------------------------------------------------------------
def _workflow_prompts() -> dict[str, tuple[str, str]]:
    """(caption, lyrics) of every MM3 Prompt node in workflows/*.json and workflows/api/*.json."""
    found = {}
    for path in sorted(ROOT.glob("workflows/*.json")) + sorted(ROOT.glob("workflows/api/*.json")):
        wf = json.loads(path.read_text(encoding="utf-8"))
        if "nodes" in wf:  # editor format: widgets in order caption, lyrics
            nodes = [(n["id"], n["widgets_values"][:2]) for n in wf["nodes"] if n["type"] == "MM3PromptAssemble"]
        else:
            nodes = [(k, [n["inputs"]["caption"], n["inputs"]["lyrics"]]) for k, n in wf.items()
                     if n["class_type"] == "MM3PromptAssemble"]
        for nid, (caption, lyrics) in nodes:
            found[f"{path.relative_to(ROOT)}#{nid}"] = (caption, lyrics)
    return found


def test_workflow_defaults_are_in_the_trained_layout():
    prompts = _workflow_prompts()
    assert len(prompts) >= 4, prompts.keys()  # text_to_song and variations, editor and API formats
    for where, (caption, lyrics) in prompts.items():
        assert "<|" not in caption and caption_warning(caption) is None, where
        parsed = parse_caption(caption)
        assert list(parsed) == list(SECTIONS), where
        for section, labels in LABELS.items():
            assert tuple(parsed[section]) == labels, (where, section)
        # Byte-level BPE: a token covers at least one byte, so this bounds every vocabulary's count.
        assert len(clean_caption(caption).encode()) + len(normalize_lyrics(lyrics).encode()) + 9 <= MAX_PROMPT_TOKENS
    assert len({caption for caption, _ in prompts.values()}) == 1  # one default, editor and API alike


def test_workflow_defaults_fit_the_token_budget(tiny_qwen3):
    """Counted with the released Qwen3 vocabulary; the corpus captions take 822..1112 tokens."""
    from mm3.files.opener import open_component
    from mm3.tokenizer import MM3Tokenizer

    comp = open_component(tiny_qwen3.file("mm3-lm"), expect="lm")
    try:
        tok = MM3Tokenizer.from_component(comp)
        for where, (caption, lyrics) in _workflow_prompts().items():
            caption_only = count_tokens(tok, caption, "")
            assert 600 <= caption_only and count_tokens(tok, caption, lyrics) <= MAX_PROMPT_TOKENS, where
    finally:
        comp.close()
