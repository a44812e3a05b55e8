"""LoRA on the command line: `--lora` on generate / plan / render, the replay JSON's `loras`, render
finding and checking the files like model files, `info ADAPTER --base FILE`, `bench --lora-rank`."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
from safetensors.torch import load_file

from mm3.commands.main import main as cli_main
from tests.helpers.lora_files import dit_modules, lm_modules, write_lora

CAPTION = "## Mood\n- **dark** synth pop\n<|bpm 120|>"
LYRICS = "[Verse]\nneon lights ^ falling rain"


@pytest.fixture(scope="module")
def loras(tiny, tmp_path_factory):
    """A kohya LoRA of the LM and a diffusers one of the DiT."""
    folder = tmp_path_factory.mktemp("loras")
    lm = load_file(tiny.diffusers / "language_model" / "model.safetensors")
    dit = load_file(tiny.diffusers / "transformer" / "diffusion_pytorch_model.safetensors")
    write_lora(folder / "lm_style.safetensors", lm, lm_modules(lm), "kohya", "lm", seed=1)
    write_lora(folder / "dit_style.safetensors", dit, dit_modules(dit), "diffusers", "dit", seed=2)
    return folder


def _generate(tiny, out, *extra):
    return cli_main(["generate", "--models", str(tiny.gguf), "--caption", CAPTION, "--lyrics", LYRICS, "--duration", "2",
                     "--steps", "3", "--seed", "4", "--lm-seed", "5", "--out", str(out), "--quiet", *extra])


def test_generate_records_its_loras_and_render_reproduces_them(tiny, loras, tmp_path, capsys):
    lm, dit = loras / "lm_style.safetensors", loras / "dit_style.safetensors"
    out = tmp_path / "song.wav"
    assert _generate(tiny, out, "--lora", f"{lm}:0.8", "--lora", f"{dit}:1:0,1,0.5") == 0
    replay = json.loads(out.with_suffix(".json").read_text())
    entries = [(e["file"], e["component"], e["strength"], e["groups"]) for e in replay["loras"]]
    assert entries == [(str(lm), "lm", 0.8, {"attn_qk": 1.0, "attn_vo": 1.0, "mlp": 1.0}),
                       (str(dit), "dit", 1.0, {"attn_qk": 0.0, "attn_vo": 1.0, "mlp": 0.5})]
    assert all(e["fingerprint"] for e in replay["loras"])
    plain = tmp_path / "plain.wav"
    assert _generate(tiny, plain) == 0
    assert plain.read_bytes() != out.read_bytes()
    assert "loras" not in json.loads(plain.with_suffix(".json").read_text())
    again = tmp_path / "again.wav"
    assert cli_main(["render", "--models", str(tiny.gguf), "--request", str(out.with_suffix(".json")), "--out",
                     str(again), "--quiet", "--strict"]) == 0
    assert again.read_bytes() == out.read_bytes()

    # A replay file moved with its LoRAs beside it, their recorded paths gone: found by name.
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in (lm, dit):
        shutil.copy(f, moved / f.name)
    replay["loras"] = [{**e, "file": "/nowhere/" + e["file"].rsplit("/", 1)[-1]} for e in replay["loras"]]
    (moved / "replay.json").write_text(json.dumps(replay))
    capsys.readouterr()
    assert cli_main(["render", "--models", str(tiny.gguf), "--request", str(moved / "replay.json"), "--out",
                     str(moved / "song.wav"), "--quiet", "--strict"]) == 0
    assert (moved / "song.wav").read_bytes() == out.read_bytes()

    # Another file under that name: a warning, and --strict refuses; a missing one is left out.
    write_lora(moved / dit.name, load_file(tiny.diffusers / "transformer" / "diffusion_pytorch_model.safetensors"),
               ["proj_in"], "diffusers", "dit", seed=9)
    code = cli_main(["render", "--models", str(tiny.gguf), "--request", str(moved / "replay.json"), "--out",
                     str(moved / "other.wav"), "--quiet", "--strict"])
    err = capsys.readouterr().err
    assert code == 2 and "is not the file that made this song" in err and "refused with --strict" in err
    (moved / lm.name).unlink()
    assert cli_main(["render", "--models", str(tiny.gguf), "--request", str(moved / "replay.json"), "--out",
                     str(moved / "other.wav"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"LoRA /nowhere/{lm.name} is not found" in err and "rendering without it" in err
    assert "is not the file that made this song" in err


def test_a_plan_keeps_the_dits_lora_for_its_render(tiny, loras, tmp_path):
    """plan --lora (LM and DiT) then render the plan: the song generate makes with the same flags."""
    flags = ["--lora", str(loras / "lm_style.safetensors"), "--lora", f"{loras / 'dit_style.safetensors'}:0.6"]
    plan = tmp_path / "plan.json"
    assert cli_main(["plan", "--models", str(tiny.gguf), "--caption", CAPTION, "--lyrics", LYRICS, "--duration", "2",
                     "--lm-seed", "5", "--out", str(plan), "--quiet", *flags]) == 0
    assert [e["component"] for e in json.loads(plan.read_text())["loras"]] == ["lm", "dit"]
    rendered = tmp_path / "rendered.wav"
    assert cli_main(["render", "--models", str(tiny.gguf), "--request", str(plan), "--steps", "3", "--seed", "4",
                     "--out", str(rendered), "--quiet"]) == 0
    generated = tmp_path / "generated.wav"
    assert _generate(tiny, generated, *flags) == 0
    assert rendered.read_bytes() == generated.read_bytes()


def test_bad_loras_are_refused_before_any_work(tiny, loras, tmp_path, capsys):
    out = tmp_path / "x.wav"
    cases = [(["--lora", str(tmp_path / "missing.safetensors")], "LoRA " + str(tmp_path / "missing.safetensors")
              + " not found"),
             (["--lora", f"{loras / 'dit_style.safetensors'}:0,1,1"], "group strengths follow a strength"),
             (["--lora", str(tiny.file("mm3-dit"))], "a LoRA is read from a .safetensors file")]
    for flags, said in cases:
        assert _generate(tiny, out, *flags) == 2
        assert said in capsys.readouterr().err
    request = tmp_path / "r.json"
    request.write_text(json.dumps({"caption": CAPTION, "lyrics": LYRICS, "loras": [
        {"file": str(loras / "dit_style.safetensors"), "component": "lm"}]}))
    assert cli_main(["generate", "--models", str(tiny.gguf), "--request", str(request), "--out", str(out),
                     "--quiet"]) == 2
    assert "changes the DiT, not the LM its entry names" in capsys.readouterr().err
    assert not out.exists()


def test_info_prints_each_groups_change_and_warns_above_ten_percent(tiny, tmp_path, capsys):
    dit = load_file(tiny.diffusers / "transformer" / "diffusion_pytorch_model.safetensors")
    strong = tmp_path / "strong.safetensors"
    write_lora(strong, dit, dit_modules(dit), "diffusers", "dit", seed=3, magnitude=0.2)
    assert cli_main(["info", str(strong), "--base", str(tiny.file("mm3-dit")), "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)
    assert d["components"] == ["dit"] and d["layout"] == "diffusers" and d["ranks"] == [4]
    (change,) = d["changes"]
    groups = {g["group"]: g for g in change["groups"]}
    assert set(groups) == {"attn_qk", "attn_vo", "mlp", "other"}
    assert all(g["relative"] > 0.1 for g in groups.values()) and len(change["warnings"]) == 4
    assert cli_main(["info", str(strong), "--base", str(tiny.file("mm3-dit")), "--strength", "0.01"]) == 0
    text = capsys.readouterr().out
    assert "attn_qk" in text and "warning" not in text
    assert cli_main(["info", str(strong), "--base", str(tiny.file("mm3-lm"))]) == 2
    assert "strong.safetensors changes the DiT; --base gave" in capsys.readouterr().err


def test_bench_times_ours_with_a_random_lora(tmp_path):
    pytest.importorskip("diffusers")
    from mm3.bench import cli as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--config", "tiny", "--work", str(tmp_path), "--stages", "dit", "--repeat", "1",
                         "--threads", "1", "--lora-rank", "2"])
    report = bench.run(args)
    assert report["settings"]["lora_rank"] == 2 and report["dit"]["ours_ms_per_step"] > 0
    assert report["dit"]["rel_diff_vs_diffusers"] > 1e-4  # the adapter is there: ours no longer the reference's
    assert any("random rank-2 LoRA" in n for n in report["notes"])
