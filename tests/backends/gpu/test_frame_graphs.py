"""The AR frame step compiled and replayed from graphs: `torch.compile(fullgraph=True)` traces the
step through the layout kernels (custom ops, run by Triton's interpreter here) with no graph break
and gives the eager codes; the CUDA-graph runner (`mm3.backends.gpu.frame_graphs`) keeps a graph only when its
first frame agrees with an eager one and otherwise warns, naming the device, and runs eagerly, with
the eager codes either way. Without a GPU the capture is simulated: these test the decision, not
the driver."""

import warnings

import pytest
import torch

from mm3.backends.gpu import frame_graphs
from mm3.plan.ar import PlanSettings, plan
import torch.nn.functional as F

from mm3.backends.gpu import kernels, layout_kernels, placement
from mm3.backends.gpu import device_layout as dl
from mm3.files.opener import open_component
from mm3.plan.prompt import build_prompt
from mm3.tokenizer import MM3Tokenizer


@pytest.fixture(scope="module")
def models(tiny):
    from mm3.models.depth import RVQDepthDecoder
    from mm3.models.lm import Qwen3LM

    from tests.backends.gpu.test_kernels import _Requantized

    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    try:  # float vectors stay views of the files: open while the models run
        lm, depth = Qwen3LM.load(_Requantized(lm_c)), RVQDepthDecoder.load(_Requantized(d_c))
        prompt = build_prompt(MM3Tokenizer.from_component(lm_c), "warm synth pop", "[verse]\nhello")
        yield lm, depth, prompt
    finally:
        lm_c.close()
        d_c.close()


SETTINGS = PlanSettings(duration=0.12, lm_seed=5)  # 3 frames


def _codes(lm, depth, prompt, **kw):
    return plan(lm, depth, prompt, SETTINGS, weight_budget=0, **kw)[0].codes


def _torch_layout_linear(x, planes, qtype, k, bias=None, config=None):
    """The layout kernels' product computed by torch (the dequantized planes' F.linear): the op's
    body for a CPU test that would otherwise interpret hundreds of kernel launches per frame."""
    return F.linear(x, dl.dequantize(planes, qtype, k, x.dtype), bias)


def test_fullgraph_compile_through_the_layout_kernels(models, monkeypatch):
    """Every product of the LM and depth decoder goes through `torch.ops.mm3.layout_linear` (its
    body here torch's, see above; the kernels themselves are tested in test_layout_kernels.py),
    gate/up with SiLU x up through `torch.ops.mm3.layout_swiglu`."""
    pytest.importorskip("triton")
    lm, depth, prompt = models
    monkeypatch.setattr(layout_kernels, "linear", _torch_layout_linear)
    monkeypatch.setattr(layout_kernels, "_WORKS", {})
    kernels.configure("layout")
    monkeypatch.setattr(kernels, "available", lambda device_type: True)  # the CPU models, also beside CUDA
    try:
        assert placement.relayout(lm) > 0 and placement.relayout(depth) > 0  # Q8_0 weights in the layout
        want = _codes(lm, depth, prompt, graphs=False)
        compiled, targets = [], []
        real = torch.compile

        def backend(gm, example_inputs):  # the traced graph, run as traced
            targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        def fullgraph(fn, **kw):  # what plan(compile=True) asks for, with no graph break allowed
            compiled.append(fn)
            return real(fn, fullgraph=True, backend=backend, dynamic=False)

        monkeypatch.setattr(torch, "compile", fullgraph)
        torch._dynamo.reset()
        got = _codes(lm, depth, prompt, compile=True)
    finally:
        kernels.configure()
        placement.relayout(lm)
        placement.relayout(depth)
        torch._dynamo.reset()
    assert len(compiled) == 1 and torch.equal(got, want)
    ops = {t for t in targets if t.startswith("mm3.")}
    assert ops == {"mm3.layout_linear", "mm3.layout_swiglu", "mm3.dequantize"}, ops
    # One graph (a second would mean a recompile) holding every product of a frame: per depth step
    # its layers' 3 products (q/k/v, out, down) and gate/up with SiLU x up, its head and the
    # projection of its input; the LM's layers' 3 and gate/up, and its head.
    steps = depth.num_codebooks - 1
    per_frame = steps * (3 * len(depth.layers) + 2) + 3 * len(lm.model.layers) + 1
    assert targets.count("mm3.layout_linear") == per_frame
    assert targets.count("mm3.layout_swiglu") == steps * len(depth.layers) + len(lm.model.layers)
    layouts = [m for m in list(lm.modules()) + list(depth.modules()) if getattr(m, "form", None) and m.form("weight")]
    assert not layouts  # settled back to the blocks after the test

def _faithful(sampler, q_sem, q_dep):
    return lambda a, b: sampler.step(a, b)


def _nan_hiddens(sampler, q_sem, q_dep):
    def replay(a, b):
        codes, end, hidden = sampler.step(a, b)
        return codes, end, hidden * float("nan")
    return replay


def _refused(sampler, q_sem, q_dep):
    raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("capture, agreed, why", [(_faithful, True, ""), (_nan_hiddens, False, "non-finite hiddens"),
                                                  (_refused, False, "capture failed (RuntimeError")])
def test_a_graph_is_kept_only_when_its_first_frame_agrees(models, monkeypatch, capture, agreed, why):
    lm, depth, prompt = models
    want = _codes(lm, depth, prompt, graphs=False)
    runners = []
    real = frame_graphs.GraphedStep

    def runner(sampler, device):
        runners.append(real(sampler, device, capture=capture))
        return runners[-1]

    monkeypatch.setattr(frame_graphs, "GraphedStep", runner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _codes(lm, depth, prompt, graphs=True)
    assert torch.equal(got, want)
    (r,) = runners
    assert r.checks and r.checks[0][1] == agreed and r.checks[0][2].startswith(why)
    messages = [str(w.message) for w in caught if "CUDA graphs" in str(w.message)]
    if agreed:
        assert not messages and not r.eager and set(r.graphs) == {b for b, _, _ in r.checks}
    else:
        assert r.eager and len(r.checks) == 1
        assert messages == [f"CUDA graphs on cpu (cpu): the captured AR frame step differs from the eager one ({r.checks[0][2]}); "
                            "running the AR stage without graphs"]


def test_the_graphs_capture_the_compiled_step(models, monkeypatch):
    """`compile` with graphs: the step is compiled once, without torch's own CUDA graphs (whose
    outputs a later frame would overwrite: the step's state lives outside it), and the graph
    runner checks and captures the compiled step; the codes are the eager ones."""
    lm, depth, prompt = models
    want = _codes(lm, depth, prompt, graphs=False)
    modes, calls, captured = [], [], []

    def compile_(fn, **kw):
        modes.append(kw.get("mode"))

        def compiled(*args):
            calls.append(1)
            return fn(*args)
        return compiled

    def capture(sampler, q_sem, q_dep):
        captured.append(sampler.step)
        return lambda a, b: sampler.step(a, b)

    runners = []
    real = frame_graphs.GraphedStep
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(frame_graphs, "GraphedStep", lambda s, d: runners.append(real(s, d, capture=capture)) or runners[-1])
    got = _codes(lm, depth, prompt, compile=True, graphs=True)
    assert torch.equal(got, want)
    (r,) = runners
    assert modes == [None] and r.checks and all(agreed for _, agreed, _ in r.checks)
    assert captured and all(f.__name__ == "compiled" for f in captured)
    assert len(calls) >= 4  # the 3 frames and the bucket's eager check, all through it


def test_different_codes_are_a_disagreement():
    codes = torch.tensor([[1, 2]])
    end = torch.tensor([False])
    hidden = torch.ones(1, 2, 4)
    last = torch.ones(2, 4)
    assert frame_graphs.agree((codes, end, hidden), last, (codes, end, hidden), last) == (True, "")
    assert frame_graphs.agree((codes, end, hidden), last, (codes + 1, end, hidden), last)[1] == "different codes"
    assert frame_graphs.agree((codes, end, hidden), last, (codes, end, hidden * 1.1), last)[1].startswith("hiddens")
    assert frame_graphs.agree((codes, end, hidden), last, (codes, end, hidden), last * float("inf"))[1] == \
        "non-finite LM state"


def test_graphs_are_the_cuda_default(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("MM3_CUDA_GRAPHS", raising=False)
    assert frame_graphs.wanted(cuda, shaping=False) and not frame_graphs.wanted(cpu, shaping=False)
    assert not frame_graphs.wanted(cuda, shaping=True)
    monkeypatch.setenv("MM3_CUDA_GRAPHS", "0")
    assert not frame_graphs.wanted(cuda, shaping=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the capture itself)")
@pytest.mark.parametrize("int8_cache", [False, True], ids=["16-bit cache", "8-bit cache"])
def test_cuda_graphs_give_the_eager_codes(tiny, int8_cache, monkeypatch):
    """On a GPU: the frame step captured per bucket, checked, replayed; the codes of an eager run,
    over either KV cache (`MM3_GPU_INT8_KV_CACHE`)."""
    from mm3.models import build_model

    monkeypatch.setenv("MM3_GPU_INT8_KV_CACHE", "on" if int8_cache else "off")

    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    try:
        lm, depth = build_model(lm_c).to("cuda"), build_model(d_c).to("cuda")
        prompt = build_prompt(MM3Tokenizer.from_component(lm_c), "warm synth pop", "[verse]\nhello")
        settings = PlanSettings(duration=2.0, lm_seed=5)
        want = plan(lm, depth, prompt, settings, graphs=False)[0].codes
        runners = []
        real = frame_graphs.GraphedStep
        frame_graphs.GraphedStep = lambda s, d: runners.append(real(s, d)) or runners[-1]
        try:
            got = plan(lm, depth, prompt, settings, graphs=True)[0].codes
        finally:
            frame_graphs.GraphedStep = real
    finally:
        lm_c.close()
        d_c.close()
    (r,) = runners
    assert r.checks and all(agreed for _, agreed, _ in r.checks), r.checks
    assert torch.equal(got, want)


def test_a_compiled_run_leaves_no_cycle_holding_its_caches(models, monkeypatch):
    """The sampler's compiled step points back at the sampler; it is dropped when the run ends, so
    the KV caches go when `plan` returns, not at the next garbage collection."""
    import gc
    import weakref

    lm, depth, prompt = models
    samplers = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: samplers.append(weakref.ref(fn.__self__)) or fn)
    gc.collect()
    gc.disable()
    try:
        _codes(lm, depth, prompt, compile=True, graphs=False)
        (sampler,) = samplers
        assert sampler() is None
    finally:
        gc.enable()
