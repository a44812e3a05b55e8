"""The AR stage's CPU product forms, measured on the machine (`mm3.backends.cpu.choice`): timed in whole frames
at the first plan and cached on disk by processor, cores, torch, dtype, threads and weight types;
reused without timing, timed again for another processor, named by MM3_CPU_PRODUCT, a damaged
cache ignored with a warning; the timing leaves the song as a run with the choice given; the forms
agree with each other (exactly in the reference numerics, within rounding in the fast ones).

The suite pins MM3_CPU_PRODUCT (tests/conftest.py); these tests set it themselves."""

import json
import logging
import sys
import time
import types

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


@pytest.fixture(scope="module")
def q8(tiny, tmp_path_factory):
    """The tiny LM and depth decoder in Q8_0 (int4 planes, dequantization and copies all apply)."""
    out = tmp_path_factory.mktemp("q8")
    files = {}
    for kind, arch in (("lm", "mm3-lm"), ("depth", "mm3-depth")):
        files[kind] = quantize_file(tiny.file(arch), out / f"{kind}-Q8_0.gguf", "Q8_0")
    lm_c, d_c = open_component(files["lm"], expect="lm"), open_component(files["depth"], expect="depth")
    tok = MM3Tokenizer.from_component(lm_c)
    yield types.SimpleNamespace(lm_c=lm_c, d_c=d_c, prompt=build_prompt(tok, "warm synth pop", "[verse]\nhello"))
    lm_c.close()
    d_c.close()


def _models(q8, numerics="fast"):
    return Qwen3LM.load(q8.lm_c, numerics=numerics), RVQDepthDecoder.load(q8.d_c, numerics=numerics)


@pytest.fixture
def timing(tmp_path, monkeypatch):
    """Forms timed (MM3_CPU_PRODUCT=auto) into a cache folder of the test's own; every call of
    `measure` counted; one thread, which the user set (so only the forms are timed)."""
    monkeypatch.setenv("MM3_CPU_PRODUCT", "auto")
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_choice, "user_threads", lambda: 1)
    cpu_choice.forget()
    calls = []
    real = cpu_choice.measure

    def counted(*args, **kwargs):
        calls.append(kwargs.get("threads"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_choice, "measure", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield calls
    torch.set_num_threads(threads)
    cpu_choice.forget()


def _plan(q8, lm, depth, seed=3):
    (song,) = plan(lm, depth, q8.prompt, PlanSettings(duration=SECONDS, lm_seed=seed), dtype=torch.float32)
    return song


def _forms(model) -> set[str]:
    return {m.cpu_form.form.name for m in model.modules() if isinstance(m, Linear) and m.qtype("weight") is not None}


def test_the_cached_choice_is_reused_and_another_processor_times_again(q8, timing, monkeypatch):
    lm, depth = _models(q8)
    first = _plan(q8, lm, depth)
    assert len(timing) == 1 and timing[0] == [1]
    entries = json.loads(cpu_choice.cache_file().read_text())["choices"]
    (key,) = entries
    assert f"cpu={cpu_choice.processor()}" in key and "lm=Q8_0:" in key and "threads=1" in key
    stored = entries[key]
    assert set(stored["forms"]) == {"lm", "depth"} and stored["threads"] == 1
    assert {"int4 x1", "dequant-linear x1", "copy-linear x1"} <= set(stored["ms_per_frame"])
    assert _forms(lm) == {stored["forms"]["lm"]} and _forms(depth) == {stored["forms"]["depth"]}

    cpu_choice.forget()  # a new process: the choice comes from the disk, without timing
    again = _plan(q8, *_models(q8))
    assert len(timing) == 1 and torch.equal(again.codes, first.codes)

    monkeypatch.setattr(cpu_choice, "processor", lambda: "Another Processor 9000")
    cpu_choice.forget()
    _plan(q8, *_models(q8))
    assert len(timing) == 2
    keys = json.loads(cpu_choice.cache_file().read_text())["choices"]
    assert len(keys) == 2 and any("cpu=Another Processor 9000" in k for k in keys)


def test_a_native_kernel_built_or_gone_times_again(q8, timing, monkeypatch):
    """The Q8_0 models' key names the native kernel's build: a compiler installed or removed
    makes a new timing, as another processor does."""
    _plan(q8, *_models(q8))
    (key,) = json.loads(cpu_choice.cache_file().read_text())["choices"]
    bits = cpu_native.vector_bits()
    assert f"native={bits}" in key
    monkeypatch.setattr(cpu_native, "vector_bits", lambda: 256 if bits == -1 else -1)
    cpu_choice.forget()
    _plan(q8, *_models(q8))
    assert len(timing) == 2 and len(json.loads(cpu_choice.cache_file().read_text())["choices"]) == 2


def test_other_weight_types_are_timed_apart(q8, tiny, timing):
    """The F32 models have no int4 or copy candidates, and their own cache entry."""
    _plan(q8, *_models(q8))
    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    try:
        plan(Qwen3LM.load(lm_c), RVQDepthDecoder.load(d_c), q8.prompt, PlanSettings(duration=SECONDS, lm_seed=1))
    finally:
        lm_c.close()
        d_c.close()
    assert len(timing) == 2
    entries = json.loads(cpu_choice.cache_file().read_text())["choices"]
    f32 = next(v for k, v in entries.items() if "lm=F32:" in k)
    assert set(f32["ms_per_frame"]) == {"dequant-linear x1", "dequant-weight-major x1"}


@pytest.mark.parametrize("form", list(cpu_forms.FORMS))
def test_the_named_form_serves_without_timing(q8, form, timing, monkeypatch):
    monkeypatch.setenv("MM3_CPU_PRODUCT", form)
    lm, depth = _models(q8)
    _plan(q8, lm, depth)
    assert timing == [] and not cpu_choice.cache_file().exists()
    assert _forms(lm) == _forms(depth) == {form}
    layer = depth.layers[0].down_proj
    product = products.for_linear(layer, torch.float32, torch.device("cpu"))
    if form in ("int4", "native"):  # Q8_0 weights: the native kernel where it builds, else the int4 planes
        assert isinstance(product, products.ByRows) and isinstance(product.decode, products.PackedProduct)
        assert product.decode.kernel == ("native" if form == "native" and cpu_native.available() else "int4")
    else:
        assert isinstance(product, products.FloatWeight) and product.major == form.endswith("weight-major")


def test_an_unknown_name_is_warned_about_and_the_forms_timed(q8, timing, monkeypatch):
    monkeypatch.setenv("MM3_CPU_PRODUCT", "fastest please")
    with pytest.warns(UserWarning, match="MM3_CPU_PRODUCT='fastest please' is not one of auto, int4, native, "
                                         "dequant-linear.*; using auto"):
        _plan(q8, *_models(q8))
    assert len(timing) == 1


@pytest.mark.parametrize("damage", ["{not json", json.dumps({"version": 99, "choices": {}}), "entry"])
def test_a_damaged_cache_is_ignored_with_a_warning(q8, timing, damage, caplog):
    lm, depth = _models(q8)
    path = cpu_choice.cache_file()
    path.parent.mkdir(parents=True)
    if damage == "entry":  # a valid file whose entry for this machine names a form that does not exist
        key = cpu_choice.key({"lm": lm, "depth": depth}, torch.float32, 1)
        damage = json.dumps({"version": cpu_choice.CACHE_VERSION, "choices": {key: {"forms": {"lm": "magic"}}}})
    path.write_text(damage)
    with caplog.at_level(logging.WARNING, logger="mm3.backends.cpu.choice"):
        _plan(q8, lm, depth)
    assert "ignoring" in caplog.text and "timing again" in caplog.text
    assert len(timing) == 1
    stored = json.loads(path.read_text())
    assert stored["version"] == cpu_choice.CACHE_VERSION and len(stored["choices"]) == 1  # written anew


def test_the_timing_leaves_the_song_as_the_choice_given(q8, timing):
    """The first plan times the forms on scratch frames, then plans; the same plan with the choice
    already made (no timing) gives the same codes and hiddens, bit for bit."""
    lm, depth = _models(q8)
    timed = _plan(q8, lm, depth)
    assert len(timing) == 1
    given = _plan(q8, *_models(q8))
    assert len(timing) == 1
    assert torch.equal(timed.codes, given.codes) and torch.equal(timed.frame_hiddens, given.frame_hiddens)


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


def test_a_thread_count_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_choice.thread_counts() == [torch.get_num_threads()]
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_choice, "physical_cores", lambda: 6)
    monkeypatch.setattr(cpu_choice, "usable_cores", lambda: 12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(6)  # torch's own default here: the forms and 1, 2, 4, 6 threads are timed
        assert cpu_choice.user_threads() is None and cpu_choice.thread_counts() == [1, 2, 4, 6]
        torch.set_num_threads(3)  # set by the user
        assert cpu_choice.user_threads() == 3 and cpu_choice.thread_counts() == [3]
    finally:
        torch.set_num_threads(threads)


def test_the_plan_runs_at_the_chosen_threads_and_gives_them_back(q8, monkeypatch):
    seen = []
    monkeypatch.setenv("MM3_CPU_PRODUCT", "int4")
    monkeypatch.setattr(cpu_choice, "serve", lambda *a, **k: cpu_choice.Choice({"lm": "int4", "depth": "int4"}, 1))
    lm, depth = _models(q8)
    monkeypatch.setattr(type(lm), "forward", _spy(type(lm).forward, seen))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _plan(q8, lm, depth)
        assert set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def _spy(forward, seen):
    def spied(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(self, *args, **kwargs)
    return spied


def _candidate(forms, threads, turn, parts, cut=False):
    c = cpu_choice.Candidate(forms, threads)
    c.turns.append(turn)
    c.parts.append(parts)
    c.cut.append(cut)
    return c


def test_after_two_rounds_the_slow_leave_and_the_components_fastest_forms_meet():
    both = lambda f: {"lm": f, "depth": f}  # noqa: E731
    first = [_candidate(both("int4"), 2, 0.100, {"lm": 0.020, "depth": 0.060}),
             _candidate(both("dequant-linear"), 2, 0.110, {"lm": 0.045, "depth": 0.045}),
             _candidate(both("copy-linear"), 2, 0.200, {"lm": 0.100, "depth": 0.080}),
             _candidate(both("int4"), 1, 0.150, {"lm": 0.010, "depth": 0.010})]  # other threads: not mixed in
    kept = cpu_choice._pruned(first, {"lm": None, "depth": None})
    assert [c.label for c in kept] == ["int4 x2", "dequant-linear x2", "lm int4 + depth dequant-linear x2"]
    assert kept[-1].turns == []


def test_a_turn_cut_short_is_a_lower_bound_and_proposes_nothing():
    c = _candidate({"lm": "int4", "depth": "int4"}, 2, 0.400, {}, cut=True)  # a burst of load
    assert c.stopped and c.best_parts is None
    c.turns.append(0.150)
    c.parts.append({"lm": 0.05, "depth": 0.08})
    c.cut.append(False)
    assert not c.stopped and c.best == 0.150 and c.best_parts == {"lm": 0.05, "depth": 0.08}


def test_a_candidate_far_slower_than_the_best_is_cut_short(q8, monkeypatch):
    """Frames that would run for long (a loaded core under many threads, a slow form) stop at the
    deadline of their turn: their figure is a lower bound, marked, and they leave after two rounds."""
    lm, depth = _models(q8)
    models = {"lm": lm, "depth": depth}
    head = lm.lm_head
    x = torch.randn(2, head.in_features)

    class Frames:
        def run(self, n):
            out = []
            for _ in range(n):
                start = time.perf_counter()
                if head.cpu_form.form.name == "dequant-weight-major":
                    time.sleep(0.2)
                head(x)
                out.append(time.perf_counter() - start)
            return out

    choice = cpu_choice.measure(models, Frames(), torch.float32, budget=1 << 30, threads=[1],
                                forms=["dequant-linear", "dequant-weight-major"])
    assert choice.forms == {"lm": "dequant-linear", "depth": "dequant-linear"}
    assert choice.stopped == ["dequant-weight-major x1"] and "dequant-weight-major x1" in choice.ms_per_frame
    assert choice.line().startswith("CPU products of the AR stage: dequant-linear x1 serves (measured; ms per frame: ")
    assert "dequant-weight-major x1 >" in choice.line()


@pytest.mark.parametrize("budget,most", [(1 << 30, 2), (0, 1)])
def test_two_packings_are_held_together_only_where_they_fit(q8, budget, most):
    """Timing int4 against the native kernel holds both packings where a second one fits in the
    weight budget (less the copies); otherwise one at a time, packed again at each switch."""
    if not (cpu_native.available() and cpu_int4.available()):
        pytest.skip("needs both the int4 product and the native kernel")
    lm, depth = _models(q8)
    layer = depth.layers[0].down_proj
    x = torch.randn(2, layer.in_features)
    held = []

    class Frames:
        def run(self, n):
            out = []
            for _ in range(n):
                start = time.perf_counter()
                layer(x)
                held.append(len(layer.packings()))
                out.append(time.perf_counter() - start)
            return out

    choice = cpu_choice.measure({"lm": lm, "depth": depth}, Frames(), torch.float32, budget=budget, threads=[1],
                                forms=["int4", "native"])
    assert max(held) == most and set(choice.forms.values()) <= {"int4", "native"}
    assert list(layer.packings()) == [choice.forms["depth"]]  # the loser's packing is gone


def test_a_form_packed_again_at_each_switch_is_timed_without_its_packing(q8, monkeypatch):
    """One packing at a time: each switch packs every layer again, which may take longer than a
    fast form's whole turn; the packing is made before the turn's clock starts, so neither form is
    cut short (a turn cut while packing left the rest unpacked, and was cut again at every turn),
    and the turns are grouped by the packing they read, so a round switches once."""
    if not (cpu_native.available() and cpu_int4.available()):
        pytest.skip("needs both the int4 product and the native kernel")
    lm, depth = _models(q8)
    layers = [block.down_proj for block in depth.layers]
    assert len(layers) > 1
    x = torch.randn(2, layers[0].in_features)

    packed = []

    def slowed(real):
        def repack(raw, qtype, n, k, *args, **kw):
            if (n, k) == (layers[0].out_features, layers[0].in_features):
                packed.append(real.__module__)
                time.sleep(0.1)
            return real(raw, qtype, n, k, *args, **kw)
        return repack

    for kernel in ("int4", "native"):
        monkeypatch.setattr(products.KERNELS[kernel], "repack", slowed(products.KERNELS[kernel].repack))

    class Frames:
        def run(self, n):
            out = []
            for _ in range(n):
                start = time.perf_counter()
                for layer in layers:
                    layer(x)
                out.append(time.perf_counter() - start)
            return out

    choice = cpu_choice.measure({"lm": lm, "depth": depth}, Frames(), torch.float32, budget=0, threads=[1],
                                forms=["int4", "native"])
    assert choice.stopped == [] and max(choice.ms_per_frame.values()) < 50
    # the turns that read the packing held go first: a round switches once (3 rounds, 2 forms)
    assert len(packed) == len(layers) * (cpu_choice.ROUNDS + 1)


def test_the_cache_folder_is_named_or_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path / "here"))
    assert cpu_choice.cache_file() == tmp_path / "here" / "cpu-products.json"
    monkeypatch.delenv("MM3_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert cpu_choice.cache_file() == tmp_path / "xdg" / "mm3" / "cpu-products.json"


def test_int4_and_native_are_candidates_only_where_a_weight_type_has_them(q8):
    lm, depth = _models(q8)
    forms = cpu_choice.candidate_forms({"lm": lm, "depth": depth}, torch.float32, 1 << 30)
    assert forms[0] == ("int4" if cpu_int4.available() else "dequant-linear")
    assert ("native" in forms) == cpu_native.available()  # the Q8_0 file's weights

    assert "copy-linear" in forms
    assert "copy-linear" not in cpu_choice.candidate_forms({"lm": lm, "depth": depth}, torch.float32, 0)


def test_fewer_threads_win_a_near_tie():
    both = lambda f: {"lm": f, "depth": f}  # noqa: E731
    two = _candidate(both("int4"), 2, 0.100, {})
    one = _candidate(both("copy-linear"), 1, 0.108, {})
    slow = _candidate(both("dequant-linear"), 1, 0.300, {})
    assert cpu_choice._fastest([two, one, slow]) is one
    one.turns[0] = 0.120  # more than 10 % slower: the threads pay
    assert cpu_choice._fastest([two, one, slow]) is two


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


def test_a_mixed_candidate_reads_copies_only_where_its_form_does(q8):
    """While the LM is timed with copies and the depth decoder with the int4 product, only the LM's
    copies are in use (a depth copy at hand would serve in place of the int4 product)."""
    from mm3.weights.copies import cache_dequantized, dequantized_nbytes, set_aside

    lm, depth = _models(q8)
    models = {"lm": lm, "depth": depth}
    cpu_choice.apply({"lm": "copy-linear", "depth": "copy-linear"}, models, free=False)
    cache_dequantized([depth, lm], torch.float32)
    copies = {name: set_aside([model]) for name, model in models.items()}
    cpu_choice._use(models, {"lm": "copy-linear", "depth": "int4"}, copies, None)
    assert dequantized_nbytes(lm) > 0 and dequantized_nbytes(depth) == 0
    product = products.for_linear(depth.layers[0].down_proj, torch.float32, torch.device("cpu"))
    assert isinstance(product.decode, products.PackedProduct) or not cpu_int4.available()
    cpu_choice._use(models, {"lm": "int4", "depth": "copy-linear"}, copies, None)
    assert dequantized_nbytes(lm) == 0 and dequantized_nbytes(depth) > 0


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
