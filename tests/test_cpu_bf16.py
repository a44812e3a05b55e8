"""The DiT in bfloat16 on the CPU (mm3.cpu_bf16): when it is chosen, and that it is as close to the
float32 reference as the reference's own bfloat16 forward is.

conftest pins MM3_CPU_BF16=off for the float32 parity tests; these tests set it themselves.
"""

import copy
import warnings

import pytest
import torch

from mm3 import cpu_bf16
from mm3.components import open_component
from mm3.flow import encode_conditions, sample_latents
from mm3.models.cond import ConditionEncoder
from mm3.models.dit import FlowDiT
from mm3.pipeline import Pipeline


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
def probe(monkeypatch):
    """Set the timed speedup without timing anything; returns a setter."""
    def set_speedup(value: float):
        monkeypatch.setattr(cpu_bf16, "_SPEEDUP", [value])
    return set_speedup


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_auto_follows_the_timing(monkeypatch, probe):
    monkeypatch.setenv("MM3_CPU_BF16", "auto")
    probe(cpu_bf16.MIN_SPEEDUP + 0.1)
    assert cpu_bf16.dit_dtype("cpu", torch.float32) == torch.bfloat16
    probe(cpu_bf16.MIN_SPEEDUP - 0.1)
    assert cpu_bf16.dit_dtype("cpu", torch.float32) == torch.float32
    probe(0.0)  # bfloat16 products failed or were wrong
    assert cpu_bf16.dit_dtype("cpu", torch.float32) == torch.float32


def test_named_and_other_devices(monkeypatch, probe):
    probe(0.0)
    monkeypatch.setenv("MM3_CPU_BF16", "on")
    assert cpu_bf16.dit_dtype("cpu", torch.float32) == torch.bfloat16
    assert cpu_bf16.dit_dtype("cpu", torch.float16) == torch.float16  # a named non-float32 dtype stays
    probe(9.0)
    monkeypatch.setenv("MM3_CPU_BF16", "off")
    assert cpu_bf16.dit_dtype("cpu", torch.float32) == torch.float32
    monkeypatch.setenv("MM3_CPU_BF16", "on")
    assert cpu_bf16.dit_dtype("meta", torch.float32) == torch.float32  # only the CPU is affected


def test_bad_value_warns_and_times(monkeypatch, probe):
    monkeypatch.setenv("MM3_CPU_BF16", "yes please")
    probe(cpu_bf16.MIN_SPEEDUP + 1)
    with pytest.warns(UserWarning, match=r"MM3_CPU_BF16='yes please' is not one of auto, on, off"):
        assert cpu_bf16.dit_dtype("cpu", torch.float32) == torch.bfloat16


def test_timing_runs_once(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_bf16, "_SPEEDUP", [])
    monkeypatch.setattr(cpu_bf16, "_measure", lambda: calls.append(1) or 1.25)
    assert cpu_bf16.speedup() == 1.25 and cpu_bf16.speedup() == 1.25
    assert calls == [1]


def test_measure_times_real_products(monkeypatch):
    monkeypatch.setattr(cpu_bf16, "PROBE_SHAPE", (32, 256, 128))
    assert 0.0 < cpu_bf16._measure() < 1e3  # a ratio of two real timings on this processor


def test_measure_refuses_wrong_bf16_products(monkeypatch):
    real = torch.nn.functional.linear

    def wrong(x, w, b=None):
        y = real(x, w, b)
        return y * 1.1 if x.dtype == torch.bfloat16 else y

    monkeypatch.setattr(cpu_bf16.F, "linear", wrong)
    monkeypatch.setattr(cpu_bf16, "PROBE_SHAPE", (32, 256, 128))
    assert cpu_bf16._measure() == 0.0


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


def test_sampler_keeps_float32_latents(models, conditions):
    _, dit = models
    f32 = sample_latents(dit, conditions, steps=4, seed=2, compute_dtype=torch.float32)
    b16 = sample_latents(dit, conditions, steps=4, seed=2, compute_dtype=torch.bfloat16)
    for a, b in zip(f32, b16):
        assert b.dtype == torch.float32 and a.shape == b.shape
        assert 0 < rel(b, a) < 0.05  # bfloat16 forwards, not float32 ones, and close
    assert all(p.dtype == torch.float32 for p in dit.parameters())  # the model itself is not re-typed


def test_automatic_choice_in_the_sampler(monkeypatch, probe, models, conditions):
    _, dit = models
    f32 = sample_latents(dit, conditions, steps=3, seed=5, compute_dtype=torch.float32)
    b16 = sample_latents(dit, conditions, steps=3, seed=5, compute_dtype=torch.bfloat16)
    monkeypatch.setenv("MM3_CPU_BF16", "auto")
    probe(cpu_bf16.MIN_SPEEDUP + 1)
    auto = sample_latents(dit, conditions, steps=3, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(auto, b16))
    # The reference mode (two CFG calls) reproduces the reference: float32 whatever the timing says.
    ref_mode = sample_latents(dit, conditions, steps=3, seed=5, cfg_batch=False)
    exact = sample_latents(dit, conditions, steps=3, seed=5, cfg_batch=False, compute_dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(ref_mode, exact))
    probe(0.0)
    slow = sample_latents(dit, conditions, steps=3, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(slow, f32))


def test_quantized_weight_copies_in_the_compute_dtype(monkeypatch, models, conditions):
    """Weight copies the sampler keeps are made in the DiT's compute dtype (half the memory in bf16)."""
    import mm3.flow as flow

    _, dit = models
    seen = []
    real = flow.cache_dequantized
    monkeypatch.setattr(flow, "dequantized_nbytes", lambda model: 0)
    monkeypatch.setattr(flow, "cache_dequantized", lambda m, dtype, *a, **k: seen.append(dtype) or real(m, dtype, *a, **k))
    sample_latents(dit, conditions, steps=2, seed=0, compute_dtype=torch.bfloat16, weight_cache=1 << 30)
    assert seen == [torch.bfloat16]


def test_pipeline_named_dtype_pins_the_dit(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Pipeline(tiny.gguf, device="cpu").dit_dtype is None  # automatic: the sampler decides
        assert Pipeline(tiny.gguf, device="cpu", dtype="float32").dit_dtype == torch.float32
        assert Pipeline(tiny.gguf, device="cpu", dtype="auto").dit_dtype is None
