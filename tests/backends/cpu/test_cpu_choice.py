"""The AR stage's CPU product forms by rule (`mm3.backends.cpu.choice`): the native integer kernel where it
builds and reads a weight type, else torch's int4 product, a type neither reads dequantized or copied;
nothing timed and nothing written to the cache folder; MM3_CPU_PRODUCT names a form instead; the
forms agree with each other (exactly in the reference numerics, within rounding in the fast ones).

The suite pins MM3_CPU_PRODUCT (tests/conftest.py); these tests set it themselves."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mm3.backends.cpu import choice as cpu_choice
from mm3.plan.ar import PlanSettings, plan
from mm3.backends.cpu import forms as cpu_forms, int4 as cpu_int4, native as cpu_native
from mm3.backends import products
from mm3.weights.layers import Linear
from mm3.models.depth import RVQDepthDecoder
from mm3.models.lm import Qwen3LM
from mm3.files.opener import open_component
from mm3.plan.prompt import build_prompt
from mm3.tokenizer import MM3Tokenizer
from mm3.tools.quantize import quantize_file

SECONDS = 0.6  # frames of a planned song (the tiny model's frame rate)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def q8(tiny, tmp_path_factory):
    """The tiny LM and depth decoder in Q8_0 (int4 planes, the native kernel, dequantization and
    copies all apply)."""
    out = tmp_path_factory.mktemp("q8")
    files = {}
    for kind, arch in (("lm", "mm3-lm"), ("depth", "mm3-depth")):
        files[kind] = quantize_file(tiny.file(arch), out / f"{kind}-Q8_0.gguf", "Q8_0")
    lm_c, d_c = open_component(files["lm"], expect="lm"), open_component(files["depth"], expect="depth")
    tok = MM3Tokenizer.from_component(lm_c)
    yield types.SimpleNamespace(lm_c=lm_c, d_c=d_c, files=files, prompt=build_prompt(tok, "warm synth pop", "[verse]\nhello"))
    lm_c.close()
    d_c.close()


def _models(q8, numerics="fast"):
    return Qwen3LM.load(q8.lm_c, numerics=numerics), RVQDepthDecoder.load(q8.d_c, numerics=numerics)


def _plan(q8, lm, depth, seed=3):
    (song,) = plan(lm, depth, q8.prompt, PlanSettings(duration=SECONDS, lm_seed=seed), dtype=torch.float32)
    return song


def _forms(model) -> set[str]:
    return {m.cpu_form.form.name for m in model.modules() if isinstance(m, Linear) and m.qtype("weight") is not None}


def _decode_kernel(layer):
    """The packed kernel a layer's few-row products go to, or None (a float product serves)."""
    product = products.for_linear(layer, torch.float32, torch.device("cpu"))
    decode = product.decode if isinstance(product, products.ByRows) else product
    return decode.kernel if isinstance(decode, products.PackedProduct) else None


@pytest.fixture
def ruled(tmp_path, monkeypatch):
    """The rule in force (MM3_CPU_PRODUCT=auto) with a cache folder of the test's own."""
    monkeypatch.setenv("MM3_CPU_PRODUCT", "auto")
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_rule_takes_the_native_kernel_where_it_builds_and_times_nothing(q8, ruled, monkeypatch):
    """Q8_0 weights: the native integer kernel serves every few-row product where it builds here,
    else torch's int4 product; the plan starts without timing (nothing but the kernel library is
    written to the cache folder) and gives the song the named form gives."""
    lm, depth = _models(q8)
    song = _plan(q8, lm, depth)
    want = "native" if cpu_native.available() else "int4"
    assert _forms(lm) == _forms(depth) == {want}
    assert _decode_kernel(depth.layers[0].down_proj) == (want if want == "native" or cpu_int4.available() else None)
    written = sorted(p.name for p in ruled.iterdir()) if ruled.exists() else []
    assert written in ([], ["native"])
    monkeypatch.setenv("MM3_CPU_PRODUCT", want)
    named = _plan(q8, *_models(q8))
    assert torch.equal(song.codes, named.codes) and torch.equal(song.frame_hiddens, named.frame_hiddens)


def test_weights_no_packed_kernel_reads_take_float_products(q8, tiny, ruled):
    """F32 models: neither kernel reads the type; the rule's form (int4) leaves the floats at hand
    to torch's product, and the choice says which form the rule gave."""
    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    try:
        lm, depth = Qwen3LM.load(lm_c), RVQDepthDecoder.load(d_c)
        choice = cpu_choice.serve({"lm": lm, "depth": depth}, torch.device("cpu"))
        assert choice.forms == {"lm": "int4", "depth": "int4"} and choice.source == "rule"
        assert choice.line() == "CPU products of the AR stage: int4 (rule)"
        assert _decode_kernel(depth.layers[0].down_proj) is None
        assert isinstance(products.for_linear(depth.layers[0].down_proj, torch.float32, torch.device("cpu")),
                          products.FloatWeight)
    finally:
        lm_c.close()
        d_c.close()


def test_no_form_off_the_cpu(q8, ruled):
    lm, depth = _models(q8)
    assert cpu_choice.serve({"lm": lm, "depth": depth}, torch.device("meta")) is None
    assert all(m.cpu_form is None for m in lm.modules() if isinstance(m, Linear))


@pytest.mark.skipif(not cpu_int4.available(), reason="this torch has no CPU int4 product")
def test_without_the_native_kernel_the_rule_takes_int4(q8, tmp_path):
    """MM3_CPU_NATIVE=off (read once a process: a process of its own) leaves torch's int4 product."""
    code = ("import sys, torch; from mm3.backends.cpu import choice; from mm3.files.opener import open_component; "
            "from mm3.models.lm import Qwen3LM; c = open_component(sys.argv[1], expect='lm'); "
            "print(choice.serve({'lm': Qwen3LM.load(c)}, torch.device('cpu')).line())")
    env = {**os.environ, "MM3_CPU_NATIVE": "off", "MM3_CPU_PRODUCT": "auto", "MM3_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code, str(q8.files["lm"])], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "CPU products of the AR stage: int4 (rule)"


@pytest.mark.parametrize("form", list(cpu_forms.FORMS))
def test_the_named_form_serves(q8, form, ruled, monkeypatch):
    monkeypatch.setenv("MM3_CPU_PRODUCT", form)
    lm, depth = _models(q8)
    _plan(q8, lm, depth)
    assert _forms(lm) == _forms(depth) == {form}
    assert not (ruled / "record.json").exists()
    layer = depth.layers[0].down_proj
    product = products.for_linear(layer, torch.float32, torch.device("cpu"))
    if form in ("int4", "native"):  # Q8_0 weights: the native kernel where it builds, else the int4 planes
        assert isinstance(product, products.ByRows) and isinstance(product.decode, products.PackedProduct)
        assert product.decode.kernel == ("native" if form == "native" and cpu_native.available() else "int4")
    else:
        assert isinstance(product, products.FloatWeight) and product.major == form.endswith("weight-major")


def test_an_unknown_name_is_warned_about_and_the_rule_serves(q8, ruled, monkeypatch):
    monkeypatch.setenv("MM3_CPU_PRODUCT", "fastest please")
    lm, depth = _models(q8)
    with pytest.warns(UserWarning, match="MM3_CPU_PRODUCT='fastest please' is not one of auto, int4, native, "
                                         "dequant-linear.*; using auto"):
        _plan(q8, lm, depth)
    assert _forms(lm) == {"native" if cpu_native.available() else "int4"}


def test_a_form_given_again_frees_the_packing_no_longer_read(q8, ruled, monkeypatch):
    """Named int4, then the rule's native: the int4 packing is let go (one packing held a weight)."""
    if not (cpu_native.available() and cpu_int4.available()):
        pytest.skip("needs both packed kernels")
    lm, depth = _models(q8)
    layer = depth.layers[0].down_proj
    x = torch.randn(2, layer.in_features)
    held = []
    for form in ("int4", "auto"):
        monkeypatch.setenv("MM3_CPU_PRODUCT", form)
        cpu_choice.serve({"lm": lm, "depth": depth}, torch.device("cpu"))
        layer(x)
        held.append(list(layer.packings()))
    assert held == [["int4"], ["native"]]


def test_the_reference_numerics_take_no_form(q8, monkeypatch):
    """Forms apply to the fast numerics only: the reference's codes and hiddens are the same whatever
    is named, and nothing is timed."""
    songs = []
    for form in cpu_forms.FORMS:
        monkeypatch.setenv("MM3_CPU_PRODUCT", form)
        lm, depth = _models(q8, "reference")
        songs.append(_plan(q8, lm, depth))
        assert all(m.cpu_form is None for m in lm.modules() if isinstance(m, Linear))
    for s in songs[1:]:
        assert torch.equal(s.codes, songs[0].codes) and torch.equal(s.frame_hiddens, songs[0].frame_hiddens)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_the_fast_forms_agree_within_rounding(q8, monkeypatch):
    """Dequantization per product and kept copies multiply the same floats (the same bits);
    weight-major sums in another order: the same codes, hiddens within float rounding. int4 rounds
    inputs and scales to bfloat16, so a near tie may draw another code: up to the first frame that
    differs (not before half the song) its codes and hiddens agree within that rounding. The native
    integer kernel rounds inputs to int16 per 16 or 32 values (about 1e-5): the same codes, hiddens within
    1e-4."""
    songs = {}
    for form in cpu_forms.FORMS:
        monkeypatch.setenv("MM3_CPU_PRODUCT", form)
        songs[form] = _plan(q8, *_models(q8))
    base = songs["dequant-linear"]
    assert torch.equal(songs["copy-linear"].frame_hiddens, base.frame_hiddens)
    for form, song in songs.items():
        frames = len(base.codes)  # code rows; the hiddens are one fewer, row i made with code row i + 1
        if form == "int4":
            differing = (song.codes != base.codes).any(1).nonzero().flatten().tolist()
            frames = differing[0] if differing else frames
            assert frames >= len(base.codes) // 2, differing
        assert torch.equal(song.codes[:frames], base.codes[:frames]), form
        rel = _rel(song.frame_hiddens[:frames - 1], base.frame_hiddens[:frames - 1])
        assert rel < {"int4": 1e-2, "native": 1e-4}.get(form, 1e-5), (form, rel)


def test_weights_that_are_no_product_keep_their_copies():
    """Norm vectors and convolutions have no CPU form: a copy in another dtype (the bfloat16 DiT's)
    is kept for them as before."""
    from mm3.weights import layers as gguf_ops
    from mm3.weights.copies import cache_dequantized

    holder = torch.nn.Module()
    holder.norm, holder.conv = gguf_ops.Vector(8), gguf_ops.Conv1d(8, 8, 3)
    holder.norm.set_float("weight", torch.ones(8))
    holder.conv.set_float("weight", torch.ones(8, 8, 3))
    holder.conv.set_float("bias", torch.zeros(8))
    assert cpu_forms.form_of(holder.norm, torch.device("cpu")) is None
    assert cache_dequantized(holder, torch.bfloat16) == (8 + 8 * 8 * 3 + 8) * 2


@pytest.mark.skipif(not cpu_int4.available(), reason="this torch has no CPU int4 product")
@pytest.mark.parametrize("form", ["int4", "native"])
def test_the_packed_frame_step_compiles_whole_and_once(q8, form, monkeypatch):
    """The frame step over int4 or native products traces as one graph (no break: a product reads
    only its packing's tensors; the native kernel is a custom op) and a second song reuses it (no
    guard on state a plan changes)."""
    if form == "native" and not cpu_native.available():
        pytest.skip("the native integer kernel cannot be built here (no C compiler, or not x86-64)")
    monkeypatch.setenv("MM3_CPU_PRODUCT", form)
    graphs = []

    def backend(gm, example_inputs):  # dynamo's graph, run as traced: counts compilations
        graphs.append(gm)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=backend, fullgraph=True, dynamic=False))
    torch._dynamo.reset()
    try:
        lm, depth = _models(q8)
        eager = _plan(q8, lm, depth)
        songs = [plan(lm, depth, q8.prompt, PlanSettings(duration=SECONDS, lm_seed=3), dtype=torch.float32,
                      compile=True)[0] for _ in range(2)]
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1  # one KV bucket covers the tiny song: one graph, for both songs
    for song in songs:
        assert torch.equal(song.codes, eager.codes)
        if form == "native":  # the inputs' int16 rounding follows float rounding of the traced ops
            assert _rel(song.frame_hiddens, eager.frame_hiddens) < 1e-4
        else:
            torch.testing.assert_close(song.frame_hiddens, eager.frame_hiddens, rtol=1e-4, atol=1e-4)
