"""`python -m mm3 bench` on the tiny config: the report's shape, and the numbers it checks against
the diffusers reference (AR codes equal, DiT velocities within float rounding) on the same weights."""

import argparse
import json
import sys

import pytest
import torch

from mm3.bench import cli as bench
from mm3.cli import build_parser


def _args(tmp, *extra):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(["--config", "tiny", "--work", str(tmp), "--frames", "8", "--seconds", "1", "--steps", "2",
                         "--repeat", "1", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def report(work):
    pytest.importorskip("diffusers")
    n = torch.get_num_threads()
    report = bench.run(_args(work))
    assert torch.get_num_threads() == n  # the run's --threads does not outlive it
    return report


def test_report_names_machine_and_settings(report):
    json.dumps(report)  # serialisable as is
    m = report["machine"]
    assert m["cores"] >= 1 and m["threads"] == 1 and m["torch"] == torch.__version__ and m["cpu"]
    assert report["config"] == "tiny" and report["quant"] == "F32" and report["dtype"] == "float32"
    assert report["sizes"]["language_model"]["hidden_size"] == 64
    assert report["settings"]["frames"] == 8 and report["date"]


def test_every_stage_has_both_sides_and_their_ratio(report):
    for stage, key in (("ar", "ms_per_frame"), ("dit", "ms_per_step"), ("vocoder", "s_per_min"),
                       ("e2e", "s_per_min")):
        r = report[stage]
        ours, ref = r[f"ours_{key}"], r[f"diffusers_{key}"]
        assert ours > 0 and ref > 0
        assert r["ratio"] == pytest.approx(ref / ours, abs=0.01)
    assert report["ar"]["ours_reference_numerics_ms_per_frame"] > 0
    assert report["e2e"]["audio_seconds"] == pytest.approx(1.0, abs=0.05)
    assert set(report["e2e"]["ours_stages_s"]) >= {"plan", "dit", "vae"}
    assert report["ar"]["memory"]["ours"]["peak_rss_mib"] > 0


def test_ours_computes_what_the_reference_computes(report):
    assert report["ar"]["codes_equal"] and report["ar"]["first_differing_frame"] is None
    assert report["dit"]["rel_diff_vs_diffusers"] < 1e-5
    assert report["dit"]["mkl_rel_diff_vs_diffusers"] < 1e-5


def test_quantized_weights_are_compared_on_the_same_values(work):
    pytest.importorskip("diffusers")
    r = bench.run(_args(work, "--quant", "Q8_0", "--stages", "ar,dit"))
    assert r["quant"] == "Q8_0" and r["ar"]["codes_equal"]  # the reference holds the dequantized blocks
    assert r["ar"]["ours_per_product_dequant_ms_per_frame"] > 0
    assert r["dit"]["rel_diff_vs_diffusers"] < 1e-5 and r["dit"]["kept_dequantized_mib"] > 0


def test_without_diffusers_the_reference_is_skipped(work, monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` now fails
    r = bench.run(_args(work, "--stages", "dit"))
    assert r["dit"]["ours_ms_per_step"] > 0 and r["dit"]["diffusers_ms_per_step"] is None
    assert r["dit"]["ratio"] is None and any("diffusers is not installed" in n for n in r["notes"])


def test_real_dimensions_refuse_a_cpu(tmp_path):
    with pytest.raises(SystemExit, match="config real needs a CUDA device"):
        bench.run(_args(tmp_path, "--config", "real", "--device", "cpu"))
    assert not any(tmp_path.iterdir())  # refused before building anything


def test_registered_as_a_subcommand(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert "--quant" in capsys.readouterr().out
