"""`python -m mm3 bench` on the tiny config: the report's shape, and the numbers it checks against
the diffusers reference (AR codes equal, DiT velocities within float rounding) on the same weights."""

import argparse
import json
import sys

import pytest
import torch

from mm3.bench import cli as bench
from mm3.commands.main import build_parser


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
    switched = report["settings"]["switches"]  # the switches in force: a JSON says how it was run
    assert switched["MM3_GPU_INT8_INPUTS"] in ("on", "off") and "MM3_CACHE_DIR" not in switched


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


def test_quantized_weights_are_compared_on_the_same_values(work, monkeypatch):
    """The CPU product forms reported are the rule's."""
    pytest.importorskip("diffusers")
    monkeypatch.setenv("MM3_CPU_PRODUCT", "auto")
    r = bench.run(_args(work, "--quant", "Q8_0", "--stages", "ar,dit"))
    assert r["quant"] == "Q8_0" and r["ar"]["codes_equal"]  # the reference holds the dequantized blocks
    products = r["ar"]["cpu_products"]
    from mm3.backends.cpu import native as cpu_native

    native = cpu_native.available()
    assert products["source"] == "rule" and products["chosen"] == ("native" if native else "int4")
    assert products["forms"] == {"lm": products["chosen"], "depth": products["chosen"]}
    assert products["native_vector_bits"] == (cpu_native.vector_bits() if native else None)
    assert 0 < r["ar"]["weight_bandwidth_share"] < 1 and r["ar"]["machine_copy_gb_per_s"] > 0
    assert r["dit"]["rel_diff_vs_diffusers"] < 1e-5 and r["dit"]["kept_dequantized_mib"] > 0


def test_a_bfloat16_dit_is_timed_and_compared_beside_the_float32_one(work, monkeypatch):
    """Where the engine computes the DiT in bfloat16 on the CPU (mm3.backends.cpu.bf16), "ours" is that run,
    the bench's float32 run is reported beside it, and the error is set against the reference's own
    bfloat16 forward."""
    pytest.importorskip("diffusers")
    monkeypatch.setenv("MM3_CPU_BF16", "on")
    r = bench.run(_args(work, "--quant", "Q8_0", "--stages", "dit,e2e"))["dit"]
    assert r["compute_dtype"] == "bfloat16" and r["ours_float32_ms_per_step"] > 0 and r["ours_ms_per_step"] > 0
    assert r["float32_rel_diff_vs_diffusers"] < 1e-5
    assert 0 < r["rel_diff_vs_diffusers"] <= 1.25 * r["diffusers_bfloat16_rel_diff"]
    assert "bfloat16 (mm3.backends.cpu.bf16); in float32" in bench.summary({**_summary_base(), "dit": r})
    alone = {k: v for k, v in r.items() if k != "ours_float32_ms_per_step"}  # released sizes: ours alone
    assert "(mm3.backends.cpu.bf16)\n" in bench.summary({**_summary_base(), "dit": alone}) + "\n"
    named = bench.run(_args(work, "--quant", "Q8_0", "--stages", "dit", "--dtype", "float32"))["dit"]
    assert named["compute_dtype"] == "float32" and named["rel_diff_vs_diffusers"] < 1e-5


def _summary_base():
    return {"config": "tiny", "quant": "Q8_0", "dtype": "float32", "date": "", "notes": [],
            "machine": {"device": "cpu", "cpu": "x", "threads": 1, "torch": torch.__version__}}


def test_without_diffusers_the_reference_is_skipped(work, monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` now fails
    r = bench.run(_args(work, "--stages", "dit"))
    assert r["dit"]["ours_ms_per_step"] > 0 and r["dit"]["diffusers_ms_per_step"] is None
    assert r["dit"]["ratio"] is None and any("diffusers is not installed" in n for n in r["notes"])


def test_real_dimensions_off_cuda_run_ar_and_dit_only(tmp_path):
    with pytest.raises(SystemExit, match="config real on cpu runs the stages ar, dit .* not ar, dit, vocoder, e2e"):
        bench.run(_args(tmp_path, "--config", "real", "--device", "cpu", "--stages", "ar,dit,vocoder,e2e"))
    assert not any(tmp_path.iterdir())  # refused before building anything


def test_directly_written_random_files(tmp_path):
    """Random GGUF files written straight in a quant mix (the released sizes off CUDA use them): they
    load as published files do, weights have the intended spread, END's head row is zero, and the
    light bench measures ours alone with its peak memory."""
    from mm3.bench import ar, synth
    from mm3.bench.checkpoints import build_direct
    from mm3.bench.context import Context
    from mm3.formats.gguf.quants import dequantize

    ckpt = build_direct("tiny", tmp_path, "Q8_0", seed=3)  # tiny rows of 64 hold no 256-value K-quant block
    assert ckpt.diffusers is None and len(list(ckpt.models.glob("*.gguf"))) == 4
    ctx = Context(ckpt, torch.device("cpu"), torch.float32, False, 1, 3)
    lm = ctx.file("lm")
    try:
        types = {t.qtype.name for t in lm.tensors.values()}
        assert types == {"Q8_0", "F32"}  # matrices in the mix's type, vectors F32, as mm3.tools.quantize writes
        gate = lm.tensors["model.layers.0.mlp.gate_proj.weight"]
        values = dequantize(gate.raw, gate.qtype, gate.shape)
        assert 0.5 < float(values.std()) * gate.shape[-1] ** 0.5 < 2.0
        head = lm.tensors["lm_head.weight"]
        end = ckpt.special_ids["<|audio_end|>"]
        rows = dequantize(head.raw, head.qtype, head.shape)
        assert not rows[end].any() and rows[end + 1].any()
    finally:
        lm.close()
    r = ar.measure(ctx, 6)
    assert r["ours_ms_per_frame"] > 0 and set(r) >= {"memory", "weights_per_frame_mib"}
    assert "ours_reference_numerics_ms_per_frame" not in r and r["memory"]["ours"]["peak_rss_mib"] > 0
    d = synth.measure_dit(ctx)
    assert d["ours_ms_per_step"] > 0 and "ours_mkl_ms_per_step" not in d


def test_registered_as_a_subcommand(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert "--quant" in capsys.readouterr().out


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q5_0", "Q4_0", "Q4_1"])
def test_random_blocks_have_the_spread_of_the_fan_in(qtype):
    import gguf

    from mm3.bench.random_models import random_tensor
    from mm3.formats.gguf.quants import dequantize

    t = gguf.GGMLQuantizationType[qtype]
    raw = torch.from_numpy(random_tensor("w", (64, 1024), t, torch.Generator().manual_seed(0)))
    values = dequantize(raw.reshape(-1), t, (64, 1024))
    assert 0.7 < float(values.std()) * 1024 ** 0.5 < 1.4 and abs(float(values.mean())) < 0.01


def test_the_profile_names_where_a_frame_goes(tmp_path):
    """`--profile N`: N eager frames of ours under torch's profiler, the most expensive operations
    first, per frame."""
    from mm3.bench.checkpoints import build_direct
    from mm3.bench.context import Context
    from mm3.bench.profile import lines, profile_frames

    ctx = Context(build_direct("tiny", tmp_path, "Q8_0", seed=3), torch.device("cpu"), torch.float32, False, 1, 3)
    p = profile_frames(ctx, 3)
    json.dumps(p)
    assert p["frames"] == 3 and p["side"] == "cpu" and p["wall_ms_per_frame"] > 0 and p["busy_ms_per_frame"] > 0
    times = [e["ms_per_frame"] for e in p["top"]]
    assert 0 < len(times) <= 20 and times == sorted(times, reverse=True)
    assert sum(times) <= p["busy_ms_per_frame"] + 1e-3
    names = [e["name"] for e in p["top"]]
    assert any(n.startswith("aten::") for n in names) and all(e["calls_per_frame"] > 0 for e in p["top"])
    shown = lines(p, shown=3)
    assert len(shown) == 4 and "3 eager frames" in shown[0] and names[0][:70] in shown[1]


def test_a_device_profile_counts_kernel_time_per_frame():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from mm3.bench.profile import summarize

    def event(key, count, cpu_us, device_us, kind=DeviceType.CUDA):
        return SimpleNamespace(key=key, count=count, self_cpu_time_total=cpu_us, self_device_time_total=device_us,
                               device_type=kind)

    events = [event("copy", 8, 900.0, 40.0), event("gemv", 4, 50.0, 400.0), event("launch", 4, 80.0, 0.0),
              event("aten::mm", 4, 120.0, 400.0, DeviceType.CPU)]  # the operation that launched gemv
    p = summarize(events, 4, 0.01, "device", top=5)
    assert [e["name"] for e in p["top"]] == ["gemv", "copy"]  # kernels by device time; none on it left out
    assert p["top"][0] == {"name": "gemv", "calls_per_frame": 1.0, "ms_per_frame": 0.1}
    assert p["busy_ms_per_frame"] == 0.11 and p["wall_ms_per_frame"] == 2.5  # gemv's time counted once
    assert [e["name"] for e in summarize(events, 4, 0.01, "cpu")["top"]] == ["copy", "aten::mm", "launch", "gemv"]


@pytest.mark.parametrize("extra, message", [(("--profile", "-1"), "--profile takes a number of frames"),
                                            (("--profile", "2", "--stages", "dit"), "add ar to --stages")])
def test_a_profile_is_refused_before_building(tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        bench.run(_args(tmp_path / "w", *extra))
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())
