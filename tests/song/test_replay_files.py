"""A replay request reproduces its track: the random-stream mode and the model files travel in it.

`generate` writes each track's replay request; `render` of that request (no flag) must give the
same file byte for byte whatever RNG mode made it, use the files it names (with their
fingerprints), and warn, or with --strict refuse, when those files are missing or differ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mm3.synth import output
from mm3.commands.main import main as cli_main
from mm3.formats.fingerprint import file_fingerprint, is_fingerprint
from mm3.song.request import MM3Request, RequestError

CAPTION = "dark synth pop, 120 bpm"
LYRICS = "[verse]\nneon lights ^ falling rain"
FAST = ["--duration", "1", "--steps", "2"]
MODEL_FIELDS = ("lm_model", "depth_model", "cond_model", "dit_model", "vae_model")


def _copy_models(tiny, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for p in Path(tiny.gguf).glob("*.gguf"):
        shutil.copy(p, dest / p.name)
    return dest


def _generate(models, out, *extra) -> int:
    return cli_main(["generate", "--models", str(models), "--caption", CAPTION, "--lyrics", LYRICS, "--out", str(out),
                     "--quiet", "--lm-seed", "5", "--seed", "9", *FAST, *extra])


def _render(models, req, out, *extra) -> int:
    return cli_main(["render", "--models", str(models), "--request", str(req), "--out", str(out), "--quiet", *extra])


@pytest.mark.parametrize("rng", ["reference", "independent"])
def test_render_of_a_replay_request_is_byte_identical(tiny, tmp_path, rng):
    """The replay request records the RNG mode, so `render` without --rng reproduces the track."""
    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    assert _generate(tiny.gguf, a, "--rng", rng) == 0
    replay = json.loads((tmp_path / "a.json").read_text())
    assert replay["rng"] == rng
    assert _render(tiny.gguf, tmp_path / "a.json", b) == 0
    assert b.read_bytes() == a.read_bytes()
    assert json.loads((tmp_path / "b.json").read_text())["rng"] == rng


def test_replay_request_names_the_files_used_with_fingerprints(tiny, tmp_path):
    assert _generate(tiny.gguf, tmp_path / "a.wav") == 0
    replay = json.loads((tmp_path / "a.json").read_text())
    for field in MODEL_FIELDS:
        path = Path(tiny.gguf) / replay[field]
        assert path.is_file(), f"{field} names {replay[field]!r}"
        assert replay["model_fingerprints"][field] == file_fingerprint(path)


def test_render_keeps_the_recorded_file_when_the_folder_gains_another_quant(tiny, tmp_path):
    """A file that sorts first (what an empty name would pick) arrives after the song was made:
    the render still uses the recorded DiT, so the audio is the same."""
    models = _copy_models(tiny, tmp_path / "models")
    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    assert _generate(models, a) == 0
    dit = next(models.glob("*transformer*"))
    shutil.copy(_other_dit(tiny, tmp_path), models / "A-transformer-Q8_0.gguf")
    assert _render(models, tmp_path / "a.json", b) == 0
    assert b.read_bytes() == a.read_bytes()
    assert json.loads((tmp_path / "b.json").read_text())["dit_model"] == dit.name


def _other_dit(tiny, tmp_path) -> Path:
    """The tiny DiT quantized to Q8_0: same architecture, other weights."""
    out = tmp_path / "dit_q8.gguf"
    if not out.exists():
        src = next(Path(tiny.gguf).glob("*transformer*"))
        assert cli_main(["quantize", str(src), str(out), "--type", "Q8_0"]) == 0
    return out


def test_missing_file_warns_and_falls_back_strict_refuses(tiny, tmp_path, capsys):
    models = _copy_models(tiny, tmp_path / "models")
    assert _generate(models, tmp_path / "a.wav") == 0
    dit = next(models.glob("*transformer*"))
    dit.rename(models / "other-transformer.gguf.bak")
    shutil.copy(_other_dit(tiny, tmp_path), models / "B-transformer-Q8_0.gguf")
    capsys.readouterr()
    assert _render(models, tmp_path / "a.json", tmp_path / "strict.wav", "--strict") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: dit_model ") and f"{dit.name} is not in {models}" in err and "--strict" in err
    assert not (tmp_path / "strict.wav").exists()
    assert _render(models, tmp_path / "a.json", tmp_path / "b.wav") == 0
    err = capsys.readouterr().err
    assert f"warning: dit_model {dit.name} is not in {models}; using B-transformer-Q8_0.gguf instead" in err
    replay = json.loads((tmp_path / "b.json").read_text())
    assert replay["dit_model"] == "B-transformer-Q8_0.gguf"
    assert replay["model_fingerprints"]["dit_model"] == file_fingerprint(models / "B-transformer-Q8_0.gguf")


def test_renamed_file_is_found_by_its_fingerprint(tiny, tmp_path, capsys):
    models = _copy_models(tiny, tmp_path / "models")
    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    assert _generate(models, a) == 0
    dit = next(models.glob("*transformer*"))
    shutil.copy(_other_dit(tiny, tmp_path), models / "A-transformer-Q8_0.gguf")
    dit.rename(models / "renamed-transformer.gguf")
    capsys.readouterr()
    assert _render(models, tmp_path / "a.json", b) == 0
    assert "using renamed-transformer.gguf, which has the same fingerprint" in capsys.readouterr().err
    assert b.read_bytes() == a.read_bytes()


def test_replaced_file_warns_strict_refuses(tiny, tmp_path, capsys):
    models = _copy_models(tiny, tmp_path / "models")
    assert _generate(models, tmp_path / "a.wav") == 0
    dit = next(models.glob("*transformer*"))
    shutil.copy(_other_dit(tiny, tmp_path), dit)  # same name, other content
    capsys.readouterr()
    assert _render(models, tmp_path / "a.json", tmp_path / "s.wav", "--strict") == 2
    assert "is not the file that made this song" in capsys.readouterr().err
    assert _render(models, tmp_path / "a.json", tmp_path / "b.wav") == 0
    assert f"warning: dit_model: {dit.name} (fingerprint " in capsys.readouterr().err


def test_explicit_flag_overrides_the_recorded_file_without_warning(tiny, tmp_path, capsys):
    models = _copy_models(tiny, tmp_path / "models")
    assert _generate(models, tmp_path / "a.wav") == 0
    shutil.copy(_other_dit(tiny, tmp_path), models / "B-transformer-Q8_0.gguf")
    capsys.readouterr()
    assert _render(models, tmp_path / "a.json", tmp_path / "b.wav", "--dit-model", "B-transformer-Q8_0.gguf",
                   "--strict") == 0
    assert "warning" not in capsys.readouterr().err
    assert json.loads((tmp_path / "b.json").read_text())["dit_model"] == "B-transformer-Q8_0.gguf"


def test_unknown_model_in_a_new_request_is_still_an_error(tiny, tmp_path, capsys):
    """Only a replay request (with audio_codes) falls back; a request for a new song naming an
    unknown file is refused, as by the reference server."""
    req = tmp_path / "r.json"
    req.write_text(json.dumps({"caption": "a", "lyrics": "b", "duration": 0.5, "dit_model": "nope.gguf"}))
    assert cli_main(["generate", "--models", str(tiny.gguf), "--request", str(req), "--out",
                     str(tmp_path / "x.wav"), "--quiet"]) == 2
    assert "unknown mm3-dit model 'nope.gguf'" in capsys.readouterr().err


def test_new_fields_round_trip_and_are_validated():
    r = MM3Request(caption="a", lyrics="b", rng="reference", model_fingerprints={"dit_model": "12-0123456789abcdef"})
    assert MM3Request.from_json(r.to_json()) == r
    assert MM3Request.from_json('{"caption": "a", "lyrics": "b"}').rng == "independent"  # a C++ request
    with pytest.raises(RequestError, match='rng must be one of independent, reference, got "philox"'):
        MM3Request(caption="a", lyrics="b", rng="philox").validate()
    with pytest.raises(RequestError, match='model_fingerprints has an unknown key "dit"'):
        MM3Request(caption="a", lyrics="b", model_fingerprints={"dit": "12-0123456789abcdef"}).validate()
    with pytest.raises(RequestError, match="model_fingerprints dit_model must be"):
        MM3Request(caption="a", lyrics="b", model_fingerprints={"dit_model": "abc"}).validate()
    with pytest.raises(RequestError, match="model_fingerprints must be an object"):
        MM3Request.from_json('{"model_fingerprints": [1]}')


def test_fingerprint_covers_the_header_and_first_data_only(tmp_path):
    """Size, header and the first DATA_BYTES of tensor data decide the fingerprint; bytes after
    that are not read (a 17 GB file is not hashed whole)."""
    import numpy as np
    from tests.helpers.gguf_util import write_gguf

    from mm3.formats.fingerprint import DATA_BYTES
    from mm3.formats.gguf.reader import GGUFFile

    src = write_gguf(tmp_path / "big.gguf", "mm3-cond", {}, {"w": np.zeros(DATA_BYTES, np.float32)})  # 4 MiB of data
    with GGUFFile(src, header_only=True) as g:
        start = g.data_offset
    fp = file_fingerprint(src)
    assert is_fingerprint(fp) and fp.startswith(f"{src.stat().st_size}-")

    def flipped(offset: int) -> str:
        data = bytearray(src.read_bytes())
        data[offset] ^= 0xFF
        p = tmp_path / f"flip_{offset}.gguf"
        p.write_bytes(data)
        return file_fingerprint(p)

    assert flipped(20) != fp  # header
    assert flipped(start + 100) != fp  # first tensor data
    assert flipped(start + DATA_BYTES + 100) == fp  # beyond what is hashed
    with open(tmp_path / "grown.gguf", "wb") as f:
        f.write(src.read_bytes() + b"\0" * 64)
    assert file_fingerprint(tmp_path / "grown.gguf") != fp  # the size is part of it


def test_output_formats_have_one_definition():
    """A request accepts exactly the formats and MP3 bitrates the writer writes."""
    for fmt in ("ogg", "flac", "MP3", *output.OUTPUT_FORMATS):
        try:
            accepted = MM3Request(caption="x", output_format=fmt).validate().output_settings().format == fmt
        except RequestError:
            accepted = False
        assert accepted == (fmt in output.OUTPUT_FORMATS), fmt
    for rate in range(max(output.MP3_BITRATES) + 2):
        try:
            accepted = MM3Request(caption="x", mp3_bitrate=rate).validate().output_settings().mp3_bitrate == rate
        except RequestError:
            accepted = False
        assert accepted == (rate in output.MP3_BITRATES), rate


@pytest.mark.parametrize("command", ["generate", "render", "plan"])
def test_bad_output_format_in_a_request_is_one_error_line(tiny, tmp_path, capsys, command):
    """Was a KeyError traceback from the output-format lookup before the request was validated."""
    body = {"caption": "a", "lyrics": "b", "duration": 0.5, "output_format": "ogg"}
    if command == "render":
        body["audio_codes"] = ",".join(["1"] * 16)
    (tmp_path / "r.json").write_text(json.dumps(body))
    out = tmp_path / ("x.json" if command == "plan" else "x.wav")
    rc = cli_main([command, "--models", str(tiny.gguf), "--request", str(tmp_path / "r.json"), "--out", str(out),
                   "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: Invalid output_format (use: mp3, wav16, wav24, wav32)"), err
    assert "Traceback" not in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_empty_lyrics_make_an_instrumental_everywhere(tiny, tmp_path):
    """No --lyrics, empty --lyrics and a request with empty lyrics each make the instrumental of
    lyrics "[instrumental]" (the same file), and the replay JSON records what the model was sent;
    rendering that JSON gives the track again."""
    def song(name: str, *argv: str) -> Path:
        out = tmp_path / f"{name}.wav"
        assert cli_main(["generate", "--models", str(tiny.gguf), "--out", str(out), "--quiet", "--lm-seed", "5",
                         "--seed", "9", *FAST, *argv]) == 0
        assert json.loads(out.with_suffix(".json").read_text())["lyrics"] == "[instrumental]"
        return out

    request = tmp_path / "ask.json"
    request.write_text(json.dumps({"caption": CAPTION, "lyrics": ""}))
    tracks = [song("none", "--caption", CAPTION), song("empty", "--caption", CAPTION, "--lyrics", " \n"),
              song("request", "--request", str(request)),
              song("tag", "--caption", CAPTION, "--lyrics", "[instrumental]")]
    assert len({t.read_bytes() for t in tracks}) == 1
    assert _render(tiny.gguf, tmp_path / "none.json", tmp_path / "again.wav") == 0
    assert (tmp_path / "again.wav").read_bytes() == tracks[0].read_bytes()
