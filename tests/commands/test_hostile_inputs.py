"""Hostile input in the real formats, through the public entry points: a malformed file in a models
folder never hides the good ones; every parser of outside data (GGUF metadata and tensor table,
safetensors headers, adapter settings, request JSON, cache records, text files) bounds its work and
answers with the engine's own one-line error (exit 2); request values outside the ranges of the
reference and the ComfyUI widgets are refused before any work; broken adapters are warned about or
refused where they would make NaN audio.
"""

import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from mm3.cache_dir import record_path, recorded
from mm3.commands.main import main as cli_main
from mm3.formats.gguf import GGUFFile, GGUFFormatError
from mm3.files.inventory import scan as inventory_scan
from mm3.lora.adapter import AdapterError, pattern_problem, read_adapter
from mm3.files.registry import Registry
from mm3.song.request import MM3Request, RequestError
from mm3.song.settings import OutputSettings, SynthSettings
from tests.helpers.gguf_util import models_with, nested_array_gguf, tensor_table, write_safetensors
from tests.helpers.lora_files import dit_modules, write_lora
from tests.commands.test_bad_input import FAST, fails
from tests.formats.test_fuzz_gguf import deadline

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent.parent
DIT = "MiniMax-Music3-tiny-transformer-F32.gguf"
TEXT = ["--caption", "a", "--lyrics", "b"]
LORA_KEY = "transformer.proj_in"  # a DiT layer in diffusers' names: 64 in, 64 out in the tiny model


def generate(folder, out, *extra) -> list[str]:
    return ["generate", "--models", str(folder), *TEXT, "--out", str(out), *FAST, *extra]


# -- one malformed file in the models folder (defect 2) -------------------------------------------
@pytest.fixture(scope="module")
def spoiled(tiny, tmp_path_factory):
    """The tiny model's folder plus a GGUF nesting arrays 5000 deep and a safetensors file whose
    header nests 100000 deep (each crashed the folder scan with a RecursionError)."""
    folder = models_with(tiny, tmp_path_factory.mktemp("spoiled"))
    (folder / "deep.gguf").write_bytes(nested_array_gguf(5000))
    write_safetensors(folder / "deep.safetensors", b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}")
    return folder


def test_malformed_files_are_skipped_with_a_reason_by_the_folder_scan(spoiled):
    reg = Registry.scan(spoiled)
    assert reg.buckets["dit"] == [DIT]
    report = reg.report()
    assert "skipped    deep.gguf: unreadable: " in report and "nests arrays more than 8 deep" in report
    inv = inventory_scan(spoiled)  # the sidebar's and the loaders' lists
    assert [f.name for f in inv.components["dit"]] == [DIT]
    problems = {f.name: f.problem for f in inv.unusable}
    assert "nests arrays more than 8 deep" in problems["deep.gguf"]


@pytest.mark.parametrize("named", [False, True], ids=["auto", "five-named"])
def test_malformed_file_does_not_stop_a_run(spoiled, tmp_path, named):
    names = []
    if named:
        for flag, part in (("--lm-model", "language_model"), ("--depth-model", "rvq_depth_decoder"),
                           ("--cond-model", "condition_encoder"), ("--dit-model", "transformer"),
                           ("--vae-model", "vocoder")):
            names += [flag, f"MiniMax-Music3-tiny-{part}-F32.gguf"]
    out = tmp_path / "x.wav"
    assert cli_main(generate(spoiled, out, "--format", "wav16", *names)) == 0
    assert out.is_file()


def test_malformed_file_does_not_stop_encode(spoiled, tmp_path):
    import numpy as np

    from mm3.synth.output import render

    wav = tmp_path / "in.wav"
    wav.write_bytes(render(np.zeros((2, 44100), np.float32) + 0.1, "wav16"))
    assert cli_main(["encode", "--models", str(spoiled), str(wav), str(tmp_path / "z.safetensors"), "--quiet"]) == 0


def test_info_names_the_nesting(spoiled, tmp_path, capsys):
    fails(capsys, ["info", str(spoiled / "deep.gguf")], "deep.gguf: metadata junk.nested[0][0][0][0][0][0][0] nests "
          "arrays more than 8 deep", tmp_path)


# -- parsers (defect 3) and the alpha_pattern hang (defect 4) --------------------------------------
def _factors(dtype="F32", down=(1, 64), up=(64, 1), size=4):
    n_down, n_up = math.prod(down) * size, math.prod(up) * size
    header = {LORA_KEY + ".lora_A.weight": {"dtype": dtype, "shape": list(down), "data_offsets": [0, n_down]},
              LORA_KEY + ".lora_B.weight": {"dtype": dtype, "shape": list(up), "data_offsets": [n_down, n_down + n_up]}}
    return header, bytes(n_down + n_up)


def _peft(folder: Path, tiny, **config) -> Path:
    """A PEFT adapter of the tiny DiT with `config` over its adapter_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    dit = load_file(tiny.diffusers / "transformer" / "diffusion_pytorch_model.safetensors")
    path = folder / "adapter_model.safetensors"
    write_lora(path, dit, dit_modules(dit), "peft", "dit", seed=3)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return path


HOSTILE_LORAS = {
    "header-list": ([], b"", "safetensors header is a JSON list, expected an object"),
    "integer-entry": ({LORA_KEY + ".lora_A.weight": 5}, b"", "is a JSON int, expected {dtype, shape, data_offsets}"),
    "nested-metadata": ({"__metadata__": {"lora_adapter_metadata": {"a": {"b": [1]}}}, **_factors()[0]},
                        _factors()[1], "safetensors __metadata__ must map strings to strings"),
    "deep-header": (b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}", b"",
                    "the safetensors header nests 100001 levels deep (at most 64)"),
    "rank-0": (*_factors(down=(0, 64), up=(64, 0)), "expected down [rank, in] and up [out, rank], each with at "
                                                     "least one value"),
    "shape-2^32": (*_factors(down=(2**32, 0), up=(0, 2**32)), "has factors [4294967296, 0] and [0, 4294967296]"),
    "shape-2^64": ({LORA_KEY + f".lora_{x}.weight": {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}
                    for x in "AB"}, b"", "has 0 bytes, expected 73786976294838206464 for F32"),  # 0 in int64
    "i32": (*_factors("I32"), "tensor transformer.proj_in.lora_A.weight is I32; LoRA factors are read as F32"),
    "f8": (*_factors("F8_E4M3", size=1), "tensor transformer.proj_in.lora_A.weight is F8_E4M3; LoRA factors"),
    "overlap": ({k: {**v, "data_offsets": [0, 256]} for k, v in _factors()[0].items()}, bytes(512),
                "starts at data byte 0, expected 256 (the tensors' ranges must follow each other"),
    "huge-number": (b'{"' + LORA_KEY.encode() + b'.lora_A.weight": {"dtype": "F32", "shape": [' + b"9" * 5000 +
                    b'], "data_offsets": [0, 0]}}', b"", "holds a number of 5000 characters (at most 40)"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_LORAS))
def test_hostile_lora_header(tiny, tmp_path, capsys, case):
    header, data, message = HOSTILE_LORAS[case]
    path = write_safetensors(tmp_path / f"{case}.safetensors", header, data)
    fails(capsys, ["info", str(path)], message, tmp_path)
    with pytest.raises(AdapterError):
        read_adapter(path)


@pytest.mark.parametrize("config, message", [
    ({"alpha_pattern": {"(": 2}}, "alpha_pattern '(' is not a regular expression (missing ), unterminated"),
    ({"alpha_pattern": {"proj_in": "x"}}, "alpha_pattern 'proj_in' has alpha 'x', expected a number"),
    ({"alpha_pattern": [1]}, "alpha_pattern must map patterns to numbers, got list"),
], ids=["not-a-regex", "alpha-not-a-number", "not-a-mapping"])
def test_bad_alpha_pattern(tiny, tmp_path, capsys, config, message):
    path = _peft(tmp_path / "peft", tiny, **config)
    fails(capsys, ["info", str(path)], message, tmp_path)
    fails(capsys, generate(tiny.gguf, tmp_path / "x.wav", "--lora", str(path)), message, tmp_path)


def test_catastrophic_alpha_pattern_is_refused_at_once(tiny, tmp_path):
    """`((\\w|\\.)*)*Q` backtracks exponentially on every module name: `info` ran for ever."""
    path = _peft(tmp_path / "peft", tiny, alpha_pattern={"((\\w|\\.)*)*Q": 2})
    for argv in (["info", str(path)], generate(tiny.gguf, tmp_path / "x.wav", "--lora", str(path))):
        done = subprocess.run([sys.executable, "-m", "mm3", *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
        assert "has a repeat inside a repeat (its matching can take exponential time)" in done.stderr


@pytest.mark.parametrize("pattern, refused", [
    ("proj_in", ""), ("transformer_blocks\\.(\\d+)\\.attn\\.to_(q|k)", ""), (".*ff_(in|out)", ""),
    ("[a-z_.0-9]*attn.*", ""), ("(a|b)*c", ""),
    ("(a+)+b", "repeat inside a repeat"), ("(ab|a)*c", "alternation inside a repeat"),
    ("(\\w)\\1", "backreference"), ("(?=x)y", "lookaround"), (".*.*.*x", "has 3 repeats (at most 2"),
    ("x" * 300, "is 300 characters long"), ("(?i)x", "global flags not at the start"),
])
def test_alpha_patterns_matched_with_bounded_work(pattern, refused):
    problem = pattern_problem(pattern)
    assert (refused in problem) if refused else problem == "", problem
    if not refused:  # the worst an accepted pattern does: a long name it almost matches, in a few ms
        start = time.perf_counter()
        re.match(rf"(.*\.)?({pattern})$", "base_model.model." + "transformer_blocks.0.attn." * 8 + "!")
        assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("text, message", [
    ('{"caption": ' + "[" * 100000 + "]" * 100000 + "}", "Malformed JSON: the request nests 100001 levels deep "
                                                          "(at most 64)"),
    ('{"caption": "a", "lyrics": "b", "steps": ' + "9" * 5000 + "}", "Malformed JSON: the request holds a number "
                                                                      "of 5000 characters (at most 40)"),
], ids=["deep", "huge-integer"])
def test_hostile_request_json(tiny, tmp_path, capsys, text, message):
    req = tmp_path / "r.json"
    req.write_text(text)
    fails(capsys, ["generate", "--models", str(tiny.gguf), "--request", str(req), "--out", str(tmp_path / "x.wav"),
                   "--quiet"], message, tmp_path)


def test_deep_cache_record_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    record_path().write_text('{"version": ' + "[" * 100000 + "]" * 100000 + "}")
    assert recorded("any section") == {}
    assert "the record nests 100001 levels deep" in caplog.text


# -- request values and text inputs (defects 5 and 10) ---------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--steps", "1000000000"], "steps must be between 2 and 200, got 1000000000"),
    (["--steps", "100000"], "steps must be between 2 and 200, got 100000"),
    (["--lm-cfg", "1e9"], "lm_cfg must be between 0 and 10, got 1e+09"),
    (["--dit-cfg", "-5"], "dit_cfg must be between 0 and 10, got -5"),
    (["--lm-top-k", "1000000000"], "lm_top_k must be between 1 and 16384, got 1000000000"),
    (["--penalty", "frequency", "--penalty-strength", "1", "--penalty-window", "1000000000"],
     "lm_penalty_window must be between 1 and 9000 frames, got 1000000000"),
    (["--peak-clip", "-1"], "peak_clip must be between 0 and 999, got -1"),
    (["--peak-clip", "5000"], "peak_clip must be between 0 and 999, got 5000"),
    (["--format", "wav16", "--mp3-bitrate", "7"], "mp3_bitrate must be one of 32, 40, 48"),
], ids=["steps-1e9", "steps-1e5", "lm-cfg", "dit-cfg", "top-k", "penalty-window", "peak-clip-neg", "peak-clip-big",
        "bitrate-wav"])
def test_values_out_of_range_refused_before_work(tiny, tmp_path, capsys, flags, message):
    with deadline(60):  # 100000 steps ran for 77 minutes
        fails(capsys, generate(tiny.gguf, tmp_path / "x.wav", *flags), message, tmp_path)


@pytest.mark.parametrize("field, value, message", [
    ("steps", 10**9, "steps must be between 2 and 200"), ("peak_clip", -1, "peak_clip must be between 0 and 999"),
    ("mp3_bitrate", 7, "mp3_bitrate must be one of"), ("dit_cfg", 11.0, "dit_cfg must be between 0 and 10"),
    ("lm_take", 10**12, "lm_take must be -1 (none) or a take number 0..2559"),
])
def test_request_values_out_of_range(tiny, tmp_path, capsys, field, value, message):
    req = tmp_path / "r.json"
    req.write_text(json.dumps({"caption": "a", "lyrics": "b", "output_format": "wav16", field: value}))
    with deadline(60):
        fails(capsys, ["generate", "--models", str(tiny.gguf), "--request", str(req), "--out", str(tmp_path / "x.wav"),
                       "--quiet"], message, tmp_path)
    with pytest.raises(RequestError, match=re.escape(message)):
        MM3Request.from_json(req.read_text()).validate()


def test_settings_objects_hold_the_same_ranges():
    """The nodes build these directly: the same ranges as a request."""
    with pytest.raises(ValueError, match="peak_clip must be between 0 and 999, got -1"):
        OutputSettings("wav16", 128, -1)
    with pytest.raises(ValueError, match="mp3_bitrate must be one of"):
        OutputSettings("wav16", 7, 10)
    with pytest.raises(ValueError, match="steps must be between 2 and 200, got 201"):
        SynthSettings(seed=1, steps=201)


@pytest.mark.skipif(not (os.path.exists("/dev/zero") and os.path.exists("/dev/urandom")), reason="no /dev/zero")
@pytest.mark.parametrize("flags, message", [
    (["--request", "/dev/zero"], "--request /dev/zero is larger than 16 MiB"),
    (["--caption", "a", "--lyrics-file", "/dev/urandom"], "--lyrics-file /dev/urandom is larger than 2 MiB"),
    (["--lyrics", "b", "--caption-file", "/dev/zero"], "--caption-file /dev/zero is larger than 2 MiB"),
], ids=["request", "lyrics-file", "caption-file"])
def test_endless_inputs_are_read_with_a_bound(tiny, tmp_path, capsys, flags, message):
    fails(capsys, ["generate", "--models", str(tiny.gguf), *flags, "--out", str(tmp_path / "x.wav"), "--quiet"],
          message, tmp_path)


# -- the GGUF tensor layout (defect 7) ---------------------------------------------------------------
def _patched(src: Path, dst: Path, patch) -> None:
    data = bytearray(src.read_bytes())
    patch(data, tensor_table(bytes(data)))
    dst.write_bytes(bytes(data))


def _offsets_zero(data, table):
    for _, _, offset_at in table:
        struct.pack_into("<Q", data, offset_at, 0)


def _relabel_f16(data, table):
    _, type_at, _ = table[0]  # an F32 tensor read as F16 is half as long: it still fits in the file
    struct.pack_into("<I", data, type_at, 1)


@pytest.mark.parametrize("patch, message", [
    (_offsets_zero, "is at data offset 0, expected "),
    (_relabel_f16, "ends): the tensors' data must follow each other in table order, each padded to 32 bytes"),
], ids=["offsets-zero", "f32-as-f16"])
def test_tensor_layout_checked_as_ggml_does(tiny, tmp_path, capsys, patch, message):
    folder = models_with(tiny, tmp_path / "m", "dit", lambda s, d: _patched(s, d, patch))
    with pytest.raises(GGUFFormatError, match="expected"):
        GGUFFile(folder / DIT, header_only=True)
    fails(capsys, generate(folder, tmp_path / "x.wav", "--dit-model", DIT), message, tmp_path)


# -- broken adapters (defect 9) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def broken_loras(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken_loras")
    nan_alpha = _peft(root / "nan_alpha", tiny, lora_alpha=float("nan"))
    big_alpha = _peft(root / "big_alpha", tiny, lora_alpha=1e30)
    nan_factor = _peft(root / "nan_factor", tiny)
    state = load_file(nan_factor)
    key = min(k for k in state if "lora_B" in k)
    state[key][0, 0] = float("inf")
    save_file(state, nan_factor)
    return {"nan_alpha": nan_alpha, "big_alpha": big_alpha, "nan_factor": nan_factor}


def test_info_warns_of_non_finite_factors_and_alpha(tiny, broken_loras, capsys):
    dit = str(tiny.file("mm3-dit"))
    assert cli_main(["info", str(broken_loras["nan_factor"]), "--base", dit]) == 0
    out = capsys.readouterr().out
    assert "factor holds 1 NaN or infinite value(s)" in out
    assert " 0.00 %" not in out and "(its factors or alpha are not finite numbers): it cannot be used" in out
    assert cli_main(["info", str(broken_loras["nan_alpha"])]) == 0
    out = capsys.readouterr().out
    assert "warning: module base_model.model.proj_in has alpha nan (scale nan), not a finite number" in out


def test_generate_refuses_non_finite_adapters_before_work(tiny, broken_loras, tmp_path, capsys):
    for case in ("nan_factor", "nan_alpha"):
        fails(capsys, generate(tiny.gguf, tmp_path / "x.wav", "--lora", str(broken_loras[case])),
              "NaN or infinite" if case == "nan_factor" else "has alpha nan (scale nan), not a finite number", tmp_path)


def test_generate_warns_of_an_extreme_alpha_as_info_does(tiny, broken_loras, tmp_path, capsys, caplog):
    dit = str(tiny.file("mm3-dit"))
    assert cli_main(["info", str(broken_loras["big_alpha"]), "--base", dit]) == 0
    assert "warning: adapter_model.safetensors changes the attn_qk weights by" in capsys.readouterr().out
    cli_main(generate(tiny.gguf, tmp_path / "x.wav", "--lora", str(broken_loras["big_alpha"])))
    assert "adapter_model.safetensors changes the attn_qk weights by" in caplog.text
