"""The DiT in bfloat16 on the CPU (mm3.backends.cpu.bf16): when it is chosen, and that it is as close to the
float32 reference as the reference's own bfloat16 forward is; the AR stage's many-row products
(prefill, replay) in bfloat16 on the same processors.

conftest pins MM3_CPU_BF16=off for the float32 parity tests; these tests set it themselves.
"""

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mm3.backends.cpu import bf16 as cpu_bf16
from mm3.files.opener import open_component
from mm3.synth.flow import encode_conditions, sample_latents
from mm3.models.cond import ConditionEncoder
from mm3.models.dit import FlowDiT
from mm3.song.pipeline import Pipeline
from tests.helpers.comfyui import COMFYUI_PATH, needs_comfy

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def models(tiny):
    return (ConditionEncoder.load(open_component(tiny.file("mm3-cond"), "cond")),
            FlowDiT.load(open_component(tiny.file("mm3-dit"), "dit")))


@pytest.fixture(scope="module")
def conditions(models):
    cond, _ = models
    width = int(cond.hp["num_condition_layers"]) * int(cond.hp["condition_hidden_dim"])
    fh = torch.randn(250, width, generator=torch.Generator().manual_seed(3))  # two windows
    return encode_conditions(cond, fh)


@pytest.fixture
def processor(monkeypatch, tmp_path):
    """Set what `native` answers without asking the processor and whether bfloat16 products time
    faster than float32 ones there (`pays`), each processor with a CPU record of its own; returns a
    setter."""
    def set_native(value: bool, pays: bool = True):
        monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path / f"{value}-{pays}"))
        monkeypatch.setattr(cpu_bf16, "native", lambda: value)
        ms = {"float32": 10.0, "onednn": 11.0, "bfloat16": 5.0 if pays else 12.0}
        monkeypatch.setattr(cpu_bf16, "time_products", lambda shapes, among, rows=0: {f: ms[f] for f in among})
        cpu_bf16.forget()
    return set_native


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_auto_times_the_models_products_where_the_processor_has_bfloat16(monkeypatch, processor, models):
    """Emulated bfloat16 never serves (a rule); with bfloat16 dot products, the faster dtype over the
    model's own products does: float32 on a processor whose bfloat16 products are slower (AVX512-BF16
    without AMX, where torch's bfloat16 products lose)."""
    _, dit = models
    monkeypatch.setenv("MM3_CPU_BF16", "auto")
    processor(True)
    assert cpu_bf16.ruled("cpu", torch.float32) is None  # a timing decides
    assert cpu_bf16.dit_dtype("cpu", torch.float32, dit) == torch.bfloat16
    processor(True, pays=False)
    assert cpu_bf16.dit_dtype("cpu", torch.float32, dit) == torch.float32
    processor(False)
    assert cpu_bf16.ruled("cpu", torch.float32) == torch.float32
    assert cpu_bf16.dit_dtype("cpu", torch.float32, dit) == torch.float32


def test_the_timing_is_of_the_models_shapes_and_kept_per_machine(monkeypatch, tmp_path, models):
    _, dit = models
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MM3_CPU_BF16", "auto")
    monkeypatch.setattr(cpu_bf16, "native", lambda: True)
    timed, ms = [], {"float32": 4.0, "onednn": 6.0, "bfloat16": 9.0}
    monkeypatch.setattr(cpu_bf16, "time_products",
                        lambda shapes, among, rows=0: timed.append(dict(shapes)) or {f: ms[f] for f in among})
    cpu_bf16.forget()
    assert cpu_bf16.dit_dtype("cpu", torch.float32, dit) == torch.float32
    every = {}
    for m in dit.modules():
        if hasattr(m, "in_features") and hasattr(m, "out_features") and m.qtype("weight") is not None:
            every[(m.out_features, m.in_features)] = every.get((m.out_features, m.in_features), 0) + 1
    assert timed == [{shape: n for shape, n in every.items() if n > 1}]  # the blocks' repeated products
    cpu_bf16.forget()  # another process on the same machine: the record answers
    assert cpu_bf16.dit_dtype("cpu", torch.float32, dit) == torch.float32 and len(timed) == 1
    record = json.loads((tmp_path / "record.json").read_text())
    entry = next(v for k, v in record["sections"][cpu_bf16.SECTION].items() if k.startswith("large products;"))
    assert entry["form"] == "float32" and entry["ms"] == {f: ms[f] for f in cpu_bf16.candidates()}


def test_onednn_serves_the_float32_products_only_where_it_times_faster(monkeypatch, tmp_path, models):
    _, dit = models
    monkeypatch.setattr(cpu_bf16.matmul, "accurate", lambda: True)
    for onednn_ms, want in ((5.0, True), (9.5, False)):  # within 10 % of the default library's: not taken
        monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path / str(onednn_ms)))
        ms = {"float32": 10.0, "onednn": onednn_ms, "bfloat16": 20.0}
        monkeypatch.setattr(cpu_bf16, "time_products", lambda shapes, among, rows=0: {f: ms[f] for f in among})
        cpu_bf16.forget()
        assert cpu_bf16.onednn_pays("cpu", torch.float32, dit) is want
    assert not cpu_bf16.onednn_pays("cpu", torch.bfloat16, dit) and not cpu_bf16.onednn_pays("meta", torch.float32, dit)


def test_a_real_timing_of_every_form():
    ms = cpu_bf16.time_products({(48, 32): 2, (32, 96): 1}, rows=16)
    assert set(ms) == set(cpu_bf16.FORMS) and all(0 < v < 1e4 for v in ms.values())


def test_named_and_other_devices(monkeypatch, processor):
    processor(False)
    monkeypatch.setenv("MM3_CPU_BF16", "on")
    assert cpu_bf16.dit_dtype("cpu", torch.float32) == torch.bfloat16
    assert cpu_bf16.dit_dtype("cpu", torch.float16) == torch.float16  # a named non-float32 dtype stays
    processor(True)
    monkeypatch.setenv("MM3_CPU_BF16", "off")
    assert cpu_bf16.dit_dtype("cpu", torch.float32) == torch.float32
    monkeypatch.setenv("MM3_CPU_BF16", "on")
    assert cpu_bf16.dit_dtype("meta", torch.float32) == torch.float32  # only the CPU is affected


def test_bad_value_warns_and_asks_the_processor(monkeypatch, processor, models):
    monkeypatch.setenv("MM3_CPU_BF16", "yes please")
    processor(True)
    with pytest.warns(UserWarning, match=r"MM3_CPU_BF16='yes please' is not one of auto, on, off; using auto"):
        assert cpu_bf16.dit_dtype("cpu", torch.float32, models[1]) == torch.bfloat16


@pytest.mark.parametrize("avx512_bf16, amx, onednn, want", [
    (True, False, True, True), (False, True, True, True), (False, False, True, False), (True, True, False, False)])
def test_native_reads_torchs_processor_flags(monkeypatch, avx512_bf16, amx, onednn, want):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: onednn)
    assert cpu_bf16.native() is want


def test_native_without_the_flags_in_this_torch(monkeypatch):
    for name in cpu_bf16.NATIVE_FLAGS:
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert cpu_bf16.native() is False


def test_forward_as_close_as_the_references_bf16(models, tiny):
    """Our DiT forward in bfloat16 against diffusers' in float32 is within the error of diffusers' own
    bfloat16 forward (what a GPU runs), and the float32 forwards agree to float32 rounding."""
    pytest.importorskip("diffusers")
    from tests.helpers.reference_synth import load_reference

    _, dit = models
    ref32 = load_reference(tiny.diffusers).transformer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' advice on casting with to(): nothing is kept float32 here
        ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    length = 300
    x = torch.randn(2, dit.in_channels, length, generator=g)
    t = torch.tensor([0.3, 0.3])
    cond = torch.randn(2, length, dit.condition_dim, generator=g)
    cond[1] = 0

    def reference(model, dtype):
        with torch.no_grad():
            return model(hidden_states=x.to(dtype), timestep=t.to(dtype), encoder_hidden_states=cond.to(dtype),
                         return_dict=False)[0].float()

    want = reference(ref32, torch.float32)
    ref_err = rel(reference(ref16, torch.bfloat16), want)
    with torch.no_grad():
        ours32 = dit(x, t, cond)
        ours16 = copy.deepcopy(dit)(x.bfloat16(), t.bfloat16(), cond.bfloat16())
    assert ours16.dtype == torch.bfloat16
    assert rel(ours32, want) < 1e-5
    # Same math in the same dtype: here the two bfloat16 forwards agree exactly (0.89 % off float32).
    assert 0 < rel(ours16, want) <= 1.25 * ref_err, (rel(ours16, want), ref_err)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_many_rows_of_an_ar_layer_multiply_in_bfloat16_when_set(qtype):
    """A prefill's or replay's rows through an LM layer (fast numerics) set to bfloat16: within
    that rounding of float32; a frame's few rows keep their measured form; the reference numerics
    stay float32."""
    from gguf import GGMLQuantizationType as Q
    from mm3.weights import layers as gguf_ops
    from mm3.backends import products
    from tests.backends.cpu.test_cpu_int4 import _layer

    layer, values = _layer(Q[qtype], 64, 256, 1)
    parts = [_layer(Q[qtype], n, 256, 2 + n)[0] for n in (32, 48)]
    fused = gguf_ops.Fused(parts)
    holder = torch.nn.ModuleList([layer, *parts])
    wide, few = torch.randn(40, 256), torch.randn(2, 256)

    def run(on):
        gguf_ops.set_many_rows_bf16(holder, on)
        return layer(wide), layer(few), torch.cat(fused(wide), dim=-1), torch.cat(fused(few), dim=-1)

    off, on = run(False), run(True)
    assert isinstance(layer.chosen_product().wide, products.Bf16Product)
    torch.testing.assert_close(off[0], torch.nn.functional.linear(wide, values), rtol=1e-5, atol=1e-5)
    for a, b in ((on[0], off[0]), (on[2], off[2])):
        assert 1e-4 < rel(a, b) < 1e-2  # bfloat16's rounding of the rows and weights, no more
    assert torch.equal(on[1], off[1]) and torch.equal(on[3], off[3])
    layer.decode_products = False  # the reference numerics: float32 whatever the setting
    assert torch.equal(layer(wide), torch.nn.functional.linear(wide, values))


def test_the_ar_stage_multiplies_many_rows_as_the_dit_computes(monkeypatch, processor, models):
    """bfloat16 where the DiT's forward is pinned to it, else where the rule or a timing of the
    model's products says so, in the fast numerics of a float32 stage on the CPU only."""
    from mm3.song.numerics import FAST, Numerics

    monkeypatch.setenv("MM3_CPU_BF16", "auto")
    processor(True)
    assert FAST.many_rows_bf16("cpu", torch.float32, models[1])
    assert not FAST.many_rows_bf16("cpu", torch.float32)  # nothing to time: float32
    assert not Numerics(compute_dtype=torch.float32).many_rows_bf16("cpu", torch.float32)  # --force-fp32
    assert not Numerics("reference", torch.float32).many_rows_bf16("cpu", torch.float32)
    assert not FAST.many_rows_bf16("cpu", torch.bfloat16) and not FAST.many_rows_bf16("cuda", torch.float32)
    processor(False)
    assert not FAST.many_rows_bf16("cpu", torch.float32)
    assert Numerics(compute_dtype=torch.bfloat16).many_rows_bf16("cpu", torch.float32)


def test_pipeline_sets_the_ar_models_as_its_dit(tiny, monkeypatch, processor):
    """`generate` sets the LM's and depth decoder's many-row products as its DiT computes: in
    bfloat16 where its products time faster, in float32 where the user named float32."""
    from mm3.weights.layers import Linear

    monkeypatch.setenv("MM3_CPU_BF16", "auto")
    processor(True)
    from mm3.song.request import MM3Request

    for named, want in ((None, True), ("float32", False)):
        pipe = Pipeline(tiny.gguf, device="cpu", dtype=named, keep_loaded=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe.plan(MM3Request(caption="warm synth pop", lyrics="[verse]\nhello", duration=0.4, lm_seed=1))
        flags = {m.many_rows_bf16 for kind in ("lm", "depth") for m in pipe.store.model(kind).modules()
                 if isinstance(m, Linear)}
        assert flags == {want}, named


def test_sampler_keeps_float32_latents(models, conditions):
    _, dit = models
    f32 = sample_latents(dit, conditions, steps=4, seed=2, compute_dtype=torch.float32)
    b16 = sample_latents(dit, conditions, steps=4, seed=2, compute_dtype=torch.bfloat16)
    for a, b in zip(f32, b16):
        assert b.dtype == torch.float32 and a.shape == b.shape
        assert 0 < rel(b, a) < 0.05  # bfloat16 forwards, not float32 ones, and close
    assert all(p.dtype == torch.float32 for p in dit.parameters())  # the model itself is not re-typed


def test_automatic_choice_in_the_sampler(monkeypatch, processor, models, conditions):
    _, dit = models
    f32 = sample_latents(dit, conditions, steps=3, seed=5, compute_dtype=torch.float32)
    b16 = sample_latents(dit, conditions, steps=3, seed=5, compute_dtype=torch.bfloat16)
    monkeypatch.setenv("MM3_CPU_BF16", "auto")
    processor(True)
    auto = sample_latents(dit, conditions, steps=3, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(auto, b16))
    # The reference mode (two CFG calls) reproduces the reference: float32 on any processor.
    ref_mode = sample_latents(dit, conditions, steps=3, seed=5, cfg_batch=False)
    exact = sample_latents(dit, conditions, steps=3, seed=5, cfg_batch=False, compute_dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(ref_mode, exact))
    processor(False)
    plain = sample_latents(dit, conditions, steps=3, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(plain, f32))


def test_quantized_weight_copies_in_the_compute_dtype(monkeypatch, models, conditions):
    """Weight copies the sampler keeps are made in the DiT's compute dtype (half the memory in bf16)."""
    import mm3.synth.flow as flow

    _, dit = models
    seen = []
    real = flow.cache_dequantized
    monkeypatch.setattr(flow, "dequantized_nbytes", lambda model: 0)
    monkeypatch.setattr(flow, "cache_dequantized", lambda m, dtype, *a, **k: seen.append(dtype) or real(m, dtype, *a, **k))
    sample_latents(dit, conditions, steps=2, seed=0, compute_dtype=torch.bfloat16, weight_cache=1 << 30)
    assert seen == [torch.bfloat16]


def test_pipeline_named_dtype_pins_the_dit(tiny, monkeypatch, processor):
    processor(True)
    monkeypatch.setenv("MM3_CPU_BF16", "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for named in (None, "", "auto"):  # timed on the DiT's products at its first window
            assert Pipeline(tiny.gguf, device="cpu", dtype=named).dit_dtype is None
        assert Pipeline(tiny.gguf, device="cpu", dtype="float32").dit_dtype == torch.float32
        processor(False)
        assert Pipeline(tiny.gguf, device="cpu").dit_dtype == torch.float32


def test_pipeline_reference_rng_stays_float32(tiny, monkeypatch):
    """--rng reference renders the reference's audio: the DiT stays float32 where bfloat16 is on, and
    the independent mode does use it."""
    from mm3.song.request import MM3Request

    request = MM3Request(caption="dark synth", lyrics="[verse]\nla la", duration=0.6, steps=2, seed=3, lm_seed=3,
                         output_format="wav32")
    runs = {}
    for setting in ("off", "on"):
        monkeypatch.setenv("MM3_CPU_BF16", setting)
        pipe = Pipeline(tiny.gguf, device="cpu", keep_loaded=True)
        runs[setting] = {rng: pipe.run(request, rng=rng)[0].audio for rng in ("reference", "independent")}
    assert torch.equal(runs["on"]["reference"], runs["off"]["reference"])
    assert not torch.equal(runs["on"]["independent"], runs["off"]["independent"])


NODE_SCRIPT = r"""
import importlib, importlib.util, json, sys
import torch
sys.path.append(sys.argv[2])
import comfy.cli_args
args = comfy.cli_args.args
args.cpu = not torch.cuda.is_available()  # model_management needs a device at import
spec = importlib.util.spec_from_file_location("pack", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pack = importlib.util.module_from_spec(spec); sys.modules["pack"] = pack; spec.loader.exec_module(pack)
pick = importlib.import_module("pack.nodes.comfy_models").dit_compute_dtype
seen = [str(pick(torch.float32))]
args.force_fp32 = True
seen.append(str(pick(torch.float32)))
args.force_fp32, args.fp32_unet = False, True
seen.append(str(pick(torch.float32)))
print(json.dumps(seen))
"""


@needs_comfy
def test_comfyui_fp32_switches_pin_the_dit():
    """In ComfyUI the engine decides, unless ComfyUI was told to keep float32 (--force-fp32, --fp32-unet)."""
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    out = subprocess.run([python, "-c", NODE_SCRIPT, str(ROOT), COMFYUI_PATH], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["None", "torch.float32", "torch.float32"]


def test_command_line_says_when_the_dit_is_bfloat16(tiny, tmp_path, monkeypatch, capsys):
    from mm3.commands.main import main as cli_main

    def generate(*extra):
        capsys.readouterr()
        assert cli_main(["generate", "--models", str(tiny.gguf), "--caption", "dark synth", "--lyrics", "[verse] la",
                         "--duration", "0.6", "--steps", "2", "--seed", "1", "--lm-seed", "1", "--overwrite",
                         "--out", str(tmp_path / "a.wav"), *extra]) == 0
        return capsys.readouterr().err

    monkeypatch.setenv("MM3_CPU_BF16", "on")
    assert "note: the DiT computes in bfloat16 on this cpu (native products); --dtype float32 keeps it" in generate()
    assert "note: the DiT" not in generate("--dtype", "float32")
    assert "note: the DiT" not in generate("--quiet")
    monkeypatch.setenv("MM3_CPU_BF16", "off")
    assert "note: the DiT" not in generate()
