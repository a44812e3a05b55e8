"""Every kind of bad input through the command line: exit code 2, one "error: ..." line that names
the value and what was expected, no traceback, and nothing written (no output, no temporary).

Broken model files are made from the tiny model by rewriting one of its GGUFs with our writer
(`tests.helpers.gguf_util.rewrite`), so each case differs from a working folder in exactly one way.
"""

import errno
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from mm3.synth import output
from mm3.commands.main import main as cli_main
from tests.helpers.gguf_util import models_with, rewrite

Q = gguf.GGMLQuantizationType
FAST = ["--duration", "0.5", "--steps", "2", "--seed", "1", "--lm-seed", "1", "--quiet"]
pytestmark = pytest.mark.usefixtures("one_thread")  # stable timing on a shared CPU
def listing(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


def fails(capsys, argv, message, out_dir) -> str:
    """Run the CLI; it must exit 2 with "error: <...message...>" and leave `out_dir` as it was."""
    before = listing(out_dir)
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert message in err, err
    assert listing(out_dir) == before  # no output file, no temporary
    return err


@pytest.fixture(scope="module")
def broken(tiny, tmp_path_factory):
    """Model folders that differ from the tiny model in one file each (built once)."""
    root = tmp_path_factory.mktemp("broken")
    rng = np.random.default_rng(0)

    def truncate(n):
        return lambda src, dst: dst.write_bytes(src.read_bytes()[:n])

    cases = {
        "not_gguf": ("dit", lambda src, dst: dst.write_bytes(b"PK\x03\x04" + bytes(4000))),
        "cut_header": ("dit", truncate(200)),
        "cut_data": ("dit", lambda src, dst: dst.write_bytes(src.read_bytes()[:-1000])),
        "missing": ("dit", lambda s, d: rewrite(s, d, drop={"proj_in.weight"})),
        "misshaped": ("dit", lambda s, d: rewrite(s, d, drop={"proj_in.weight"},
                                                  tensors={"proj_in.weight": rng.standard_normal((64, 32))})),
        # Q8_1 is a GGML type (block 32, 40 bytes) the engine does not dequantize
        "q8_1": ("dit", lambda s, d: rewrite(s, d, drop={"proj_in.weight"},
                                             tensors={"proj_in.weight": (Q.Q8_1, np.zeros((64, 80), np.uint8))})),
        "depth_hidden": ("depth", lambda s, d: rewrite(s, d, kv={"mm3-depth.hidden_size": 32})),
        "dit_cond": ("dit", lambda s, d: rewrite(s, d, kv={"mm3-dit.condition_dim": 48})),
        "vae_latent": ("vae", lambda s, d: rewrite(s, d, kv={"mm3-vae.latent_channels": 8})),
        "vae_hop": ("vae", lambda s, d: rewrite(s, d, kv={"mm3-vae.upsampling_ratios": [8, 8, 4, 4]})),
        "hparam_type": ("dit", lambda s, d: rewrite(s, d, kv={"mm3-dit.num_layers": "two"})),
        "hparam_huge": ("dit", lambda s, d: rewrite(s, d, kv={"mm3-dit.num_layers": 1 << 30})),
        "lm_config": ("lm", lambda s, d: rewrite(s, d, kv={"mm3.config_json": '{"hidden_size": 64}'})),
    }
    return {name: models_with(tiny, root / name, kind, make) for name, (kind, make) in cases.items()}


# -- model files --------------------------------------------------------------------------------
@pytest.mark.parametrize("case, message", [
    ("not_gguf", "no mm3-dit (flow DiT) file in"),
    ("cut_header", "MiniMax-Music3-tiny-transformer-F32.gguf: truncated GGUF header while reading"),
    ("cut_data", "MiniMax-Music3-tiny-transformer-F32.gguf: truncated: tensor"),
    ("missing", "MiniMax-Music3-tiny-transformer-F32.gguf: missing tensor(s) proj_in.weight"),
    ("misshaped", "MiniMax-Music3-tiny-transformer-F32.gguf: tensor proj_in.weight has shape [64, 32], "
                  "expected [64, 64]"),
    ("q8_1", "tensor proj_in.weight is Q8_1, which this engine cannot dequantize (supported: BF16, F16, F32, Q2_K"),
    ("depth_hidden", "LM and depth decoder do not fit together: MiniMax-Music3-tiny-language_model-F32.gguf has "
                     "hidden_size 64, MiniMax-Music3-tiny-rvq_depth_decoder-F32.gguf has hidden_size 32"),
    ("dit_cond", "condition encoder and DiT do not fit together: MiniMax-Music3-tiny-condition_encoder-F32.gguf has "
                 "out_dim 32, MiniMax-Music3-tiny-transformer-F32.gguf has condition_dim 48"),
    ("vae_latent", "DiT and vocoder do not fit together: MiniMax-Music3-tiny-transformer-F32.gguf has in_channels 16, "
                   "MiniMax-Music3-tiny-vocoder-F32.gguf has latent_channels 8"),
    ("vae_hop", "MiniMax-Music3-tiny-condition_encoder-F32.gguf has output_hop_length 512, "
                "MiniMax-Music3-tiny-vocoder-F32.gguf upsamples by 8 x 8 x 4 x 4 = 1024"),
    ("hparam_type", "metadata mm3-dit.num_layers must be a positive integer, got 'two'"),
    ("hparam_huge", "num_layers 1073741824 is more than the 33 tensors the file holds"),
    ("lm_config", "mm3.config_json lacks vocab_size"),
])
def test_broken_model_file(broken, tmp_path, capsys, case, message):
    out = tmp_path / "out"
    out.mkdir()
    fails(capsys, ["generate", "--models", str(broken[case]), "--caption", "a", "--lyrics", "b",
                   "--out", str(out / "x.wav"), *FAST], message, out)


def test_not_a_gguf_named_explicitly(broken, tmp_path, capsys):
    err = fails(capsys, ["generate", "--models", str(broken["not_gguf"]), "--caption", "a", "--lyrics", "b",
                         "--dit-model", "MiniMax-Music3-tiny-transformer-F32.gguf", "--out", str(tmp_path / "x.wav"),
                         *FAST], "MiniMax-Music3-tiny-transformer-F32.gguf cannot be the mm3-dit model: unreadable:",
                tmp_path)
    assert "not a GGUF file (magic b'PK\\x03\\x04', expected b'GGUF')" in err


def test_wrong_architecture_for_the_slot(tiny, tmp_path, capsys):
    fails(capsys, ["generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b", "--dit-model",
                   "MiniMax-Music3-tiny-language_model-F32.gguf", "--out", str(tmp_path / "x.wav"), *FAST],
          "MiniMax-Music3-tiny-language_model-F32.gguf is mm3-lm (language model (Qwen3)), expected mm3-dit (flow DiT)",
          tmp_path)


def test_models_folder_missing(tmp_path, capsys):
    fails(capsys, ["generate", "--models", str(tmp_path / "nope"), "--caption", "a", "--lyrics", "b",
                   "--out", str(tmp_path / "x.wav"), *FAST], f"--models {tmp_path / 'nope'} is not a folder", tmp_path)


# -- prompt -------------------------------------------------------------------------------------
@pytest.mark.parametrize("caption, lyrics, message", [
    ("", "b", "caption is required: say what the song sounds like (empty lyrics make an instrumental)"),
    ("x " * 3000, "b", "Prompt exceeds the 5000 token budget: the assembled prompt has 60"),
    ("dark\x1b[31m synth", "b", "caption contains the control character U+001B at position 4 (line 1, column 5); "
                                "only tab, newline and carriage return are allowed"),
    ("a", "la\nla\x00", "lyrics contains the control character U+0000 at position 5 (line 2, column 3)"),
    ("a\x85b", "b", "caption contains the control character U+0085 at position 1"),
], ids=["empty-caption", "over-budget", "escape", "nul", "c1-control"])
def test_bad_prompt(tiny, tmp_path, capsys, caption, lyrics, message):
    fails(capsys, ["generate", "--models", str(tiny.gguf), "--caption", caption, "--lyrics", lyrics,
                   "--out", str(tmp_path / "x.wav"), *FAST], message, tmp_path)


def test_unpaired_surrogate_from_json(tiny, tmp_path, capsys):
    req = tmp_path / "r.json"
    req.write_text('{"caption": "pop \\ud800", "lyrics": "b"}')
    fails(capsys, ["generate", "--models", str(tiny.gguf), "--request", str(req), "--out", str(tmp_path / "x.wav"),
                   *FAST], "caption contains an unpaired surrogate U+D800 at position 4 (not valid Unicode text)",
          tmp_path)


@pytest.mark.parametrize("flag", ["--caption-file", "--lyrics-file"])
def test_text_file_not_utf8(tiny, tmp_path, capsys, flag):
    text = tmp_path / "text.txt"
    text.write_bytes("first line\nsecond caf".encode() + b"\xe9 line")  # Latin-1 e-acute
    other = "--lyrics" if flag == "--caption-file" else "--caption"
    fails(capsys, ["generate", "--models", str(tiny.gguf), flag, str(text), other, "x",
                   "--out", str(tmp_path / "x.wav"), *FAST],
          f"{flag} {text} is not valid UTF-8 text: byte 0xe9 at offset 21 (line 2); save it as UTF-8", tmp_path)


def test_text_file_missing(tiny, tmp_path, capsys):
    fails(capsys, ["generate", "--models", str(tiny.gguf), "--caption-file", str(tmp_path / "no.txt"), "--lyrics",
                   "x", "--out", str(tmp_path / "x.wav"), *FAST],
          f"cannot read --caption-file {tmp_path / 'no.txt'}: No such file or directory", tmp_path)


# -- request and codes --------------------------------------------------------------------------
CODES_16 = ",".join(["1"] * 16)


@pytest.mark.parametrize("body, message", [
    ("{not json", "Malformed JSON"),
    ('["caption"]', "Malformed JSON"),
    ({"steps": "30"}, 'steps must be an integer, got "30"'),
    ({"duration": [1]}, "duration must be a number, got [1]"),
    ({"lyrics": 3}, "lyrics must be a string, got 3"),
    ({"duration": 0}, "duration must be positive, got 0"),
    ({"duration": -2}, "duration must be positive, got -2"),
    ({"duration": 361}, "duration must be at most 360 seconds (9000 frames), got 361"),
    ({"duration": 0.01}, "duration must be at least 0.04 seconds (one frame), got 0.01"),
    ({"steps": 1}, "steps must be at least 2, got 1"),
    ({"synth_batch_size": 0}, "synth_batch_size must be between 1 and 9, got 0"),
    ({"synth_batch_size": 10}, "synth_batch_size must be between 1 and 9, got 10"),
    ({"dit_cfg": 1e400}, "dit_cfg must be a finite number, got inf"),
    ({"audio_codes": "1,2,x"}, "Invalid audio_codes: character 'x' at position 4"),
    ({"audio_codes": "1,2.5," + CODES_16}, "Invalid audio_codes: character '.' at position 3"),
    ({"audio_codes": "1,,2," + ",".join(["1"] * 13)}, "Invalid audio_codes: item 1 is an empty item, expected an integer"),
    ({"audio_codes": ",".join(["1"] * 20)}, "audio_codes needs 8 codes per frame, at least 2 frames (got 20 codes)"),
    ({"audio_codes": ",".join(["1"] * 8)}, "audio_codes needs 8 codes per frame, at least 2 frames (got 8 codes)"),
    ({"audio_codes": ",".join(["1"] * 8 + ["64"] + ["1"] * 7)},
     "audio_codes frame 1 position 0: semantic code c0 64 is out of range 0..63"),
    ({"audio_codes": ",".join(["1"] * 15 + ["9" * 18])},
     f"audio_codes frame 1 position 7: acoustic code c7 {'9' * 18} is out of range 0..63"),
    ({"audio_codes": ",".join(["1"] * 15 + ["9" * 5000])}, "Invalid audio_codes: item 15 has 5000 digits"),
    ({"audio_codes": ",".join(["1"] * 9 + ["-1"] + ["1"] * 6)},
     "audio_codes frame 1 position 1: acoustic code c1 -1 is out of range 0..63"),
    ({"dit_model": "nope.gguf"}, "unknown mm3-dit model 'nope.gguf' in"),
    ({"lm_model": "other.gguf"}, "unknown mm3-lm model 'other.gguf' in"),
])
def test_bad_request(tiny, tmp_path, capsys, body, message):
    """Codes through `render`, everything else through `generate` (which plans, so the duration
    checks apply)."""
    command = "render" if isinstance(body, dict) and "audio_codes" in body else "generate"
    req = tmp_path / "r.json"
    if isinstance(body, dict):
        body = json.dumps({"caption": "a", "lyrics": "b", "duration": 0.5, "steps": 2, **body})
    req.write_text(body)
    err = fails(capsys, [command, "--models", str(tiny.gguf), "--request", str(req),
                         "--out", str(tmp_path / "x.wav"), "--quiet"], message, tmp_path)
    if "JSON" in message or "must be a string" in message or "must be an integer" in message:
        assert f"(in --request {req})" in err  # errors of the file's syntax and types name the file


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda:7"], "device 'cuda:7' is not available here"),
    (["--dtype", "fp8"], "dtype 'fp8' is not one of float32"),
    (["--variations", "10"], "synth_batch_size must be between 1 and 9, got 10"),
    (["--songs", "0"], "lm_batch_size must be between 1 and 16, got 0"),
])
def test_bad_flags(tiny, tmp_path, capsys, argv, message):
    argv = ["generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b", "--out",
            str(tmp_path / "x.wav"), *FAST, *argv]
    fails(capsys, argv, message, tmp_path)


# -- output -------------------------------------------------------------------------------------
def test_out_under_a_file(tiny, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    fails(capsys, ["generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b",
                   "--out", str(tmp_path / "afile" / "sub" / "x.wav"), *FAST],
          f"cannot write {tmp_path / 'afile' / 'sub' / 'x.wav'}: {tmp_path / 'afile'} is not a folder", tmp_path)


def test_out_is_a_folder(tiny, tmp_path, capsys):
    (tmp_path / "x.wav").mkdir()
    fails(capsys, ["generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b",
                   "--out", str(tmp_path / "x.wav"), *FAST], f"cannot write {tmp_path / 'x.wav'}: it is a folder",
          tmp_path)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_folder(tiny, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        fails(capsys, ["generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b",
                       "--out", str(ro / "x.wav"), *FAST], f"the folder {ro} is not writable", tmp_path)
    finally:
        ro.chmod(0o755)


def test_permission_denied_at_write_time(tiny, tmp_path, capsys, monkeypatch):
    """As root a chmod'ed folder is still writable, so the refusal is simulated where it happens."""
    real_open = os.open

    def deny(path, *a, **k):
        if str(path).endswith(".part"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(output.os, "open", deny)
    fails(capsys, ["generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b",
                   "--out", str(tmp_path / "x.wav"), *FAST], f"cannot write {tmp_path / 'x.wav'}: Permission denied",
          tmp_path)


@pytest.mark.parametrize("where", ["write", "rename"])
def test_disk_full_leaves_nothing(tiny, tmp_path, capsys, monkeypatch, where):
    """Two variations = four files; the disk fills on the third (while staging, or while renaming
    into place): the files already staged or renamed are removed too."""
    calls = []
    real = {"write": os.fsync, "rename": os.replace}[where]

    def full(*a):
        calls.append(a)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a)

    monkeypatch.setattr(output.os, "fsync" if where == "write" else "replace", full)
    err = fails(capsys, ["generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b",
                         "--variations", "2", "--out", str(tmp_path / "x.wav"), *FAST],
                "cannot write ", tmp_path)
    assert "No space left on device" in err and str(tmp_path) in err and len(calls) == 3


@pytest.mark.parametrize("existing", ["x.wav", "x.json", "b_02.wav"])
def test_existing_files_are_never_overwritten(tiny, tmp_path, capsys, existing):
    (tmp_path / existing).write_bytes(b"keep me")
    out = "b.wav" if existing.startswith("b_") else "x.wav"
    argv = ["generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b", "--out",
            str(tmp_path / out), *FAST] + (["--variations", "2"] if out == "b.wav" else [])
    fails(capsys, argv, f"{tmp_path / existing} already exists (choose another --out or pass --overwrite)", tmp_path)
    assert (tmp_path / existing).read_bytes() == b"keep me"


def test_plan_never_overwrites(tiny, tmp_path, capsys):
    (tmp_path / "p.json").write_text("{}")
    fails(capsys, ["plan", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b", "--duration", "0.5",
                   "--out", str(tmp_path / "p.json"), "--quiet"], "already exists", tmp_path)
    assert (tmp_path / "p.json").read_text() == "{}"
