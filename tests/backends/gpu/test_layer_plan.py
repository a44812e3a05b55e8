"""A tiny AR plan on the GPU code path (`emulated()`: Triton's interpreter over CPU tensors) with the
decoder layers' kernels (`mm3.backends.gpu.norm_kernels`, `attention_kernels`) against the same
plan with the models' torch operations in their place: the same codes, hiddens within float32
rounding; through the static-shape step a CUDA graph captures (`cache.bucket` set, the
position read from the device only) the same codes and hiddens as the eager step (the graph
runner's own check against an eager frame: tests/backends/gpu/test_frame_graphs.py); and the
kernels a decode step launches per layer besides its products."""

import functools
import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from mm3.backends.gpu import attention_kernels, norm_kernels
from mm3.backends.gpu import steps as gpu_steps
from mm3.backends.gpu.emulation import emulated
from mm3.files.opener import open_component
from mm3.plan import ar
from mm3.plan.ar import PlanSettings, plan
from mm3.plan.prompt import build_prompt
from mm3.tokenizer import MM3Tokenizer
from mm3.weights import layers as L

pytest.importorskip("triton", reason="this torch installation has no Triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")

SETTINGS = PlanSettings(duration=0.04, lm_seed=5)  # the prompt, then 2 frames
KERNELS = ("rms_norm", "add_rms_norm", "rope_table", "attention_step", "short_attention")


@pytest.fixture(scope="module")
def emulated_models(tiny):
    from mm3.models.depth import RVQDepthDecoder
    from mm3.models.lm import Qwen3LM

    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    try:
        with emulated():
            lm, depth = Qwen3LM.load(lm_c), RVQDepthDecoder.load(d_c)
            prompt = build_prompt(MM3Tokenizer.from_component(lm_c), "warm synth pop", "[verse]\nhello")
            yield lm, depth, prompt
    finally:
        lm_c.close()
        d_c.close()


def _plan(models, **kw):
    lm, depth, prompt = models
    return plan(lm, depth, prompt, SETTINGS, weight_budget=0, graphs=False, **kw)[0]


@pytest.fixture(scope="module")
def eager(emulated_models):
    """The plan with the kernels, and which of them served it."""
    served = []
    with pytest.MonkeyPatch.context() as mp:
        for name in KERNELS:
            real = getattr(gpu_steps, name)
            mp.setattr(gpu_steps, name, lambda *a, real=real, name=name: served.append(name) or real(*a))
        song = _plan(emulated_models)
    return song, set(served)


def test_the_kernels_give_the_torch_operations_codes(emulated_models, eager, monkeypatch):
    song, served = eager
    assert served == set(KERNELS)  # every kernel served the plan
    apart_served = set()
    with monkeypatch.context() as mp:  # the attention's preparation and the attention apart: the same codes
        mp.setattr(gpu_steps, "attention_step", lambda *a: None)
        for name in ("prepare_attention", "decode_attention"):
            real = getattr(gpu_steps, name)
            mp.setattr(gpu_steps, name, lambda *a, real=real, name=name: apart_served.add(name) or real(*a))
        apart = _plan(emulated_models)
    assert apart_served == {"prepare_attention", "decode_attention"} and torch.equal(apart.codes, song.codes)
    for name in KERNELS:
        monkeypatch.setattr(gpu_steps, name, lambda *a: None)
    want = _plan(emulated_models)
    assert song.codes.shape[0] >= 2 and torch.equal(song.codes, want.codes)
    err = ((song.frame_hiddens - want.frame_hiddens).norm() / want.frame_hiddens.norm()).item()
    assert err < 1e-5


def test_the_static_step_reads_the_position_from_the_device(emulated_models, eager, monkeypatch):
    """The frame step as a CUDA graph captures it (`static_shapes`: `cache.bucket` set), with the
    host's count of filled positions hidden while it runs: the kernels read `cache.pos` only."""
    real_frames, real_step = ar.sample_frames, ar.FrameSampler.step
    buckets = []

    def hidden_count(sampler, q_sem, q_dep):
        cache = sampler.cache
        buckets.append(cache.bucket)
        length, cache.length = cache.length, -(10 ** 9)
        try:
            return real_step(sampler, q_sem, q_dep)
        finally:
            cache.length = length

    monkeypatch.setattr(ar, "sample_frames", functools.partial(real_frames, static_shapes=True))
    monkeypatch.setattr(ar.FrameSampler, "step", hidden_count)
    got = _plan(emulated_models)
    assert buckets and all(b is not None for b in buckets)
    assert torch.equal(got.codes, eager[0].codes)
    torch.testing.assert_close(got.frame_hiddens, eager[0].frame_hiddens, rtol=0, atol=0)


class _Launches(TorchDispatchMode):
    """Kernels a step launches besides its products: torch operations that compute (views and
    allocations are none) and the layer kernels' Triton launches, counted by kind."""

    FREE = frozenset({"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "_local_scalar_dense"})

    def __init__(self):
        super().__init__()
        self.kinds: Counter = Counter()
        self.in_product = 0
        self.patches = pytest.MonkeyPatch()

    def __enter__(self):
        for cls, name in ((L.Linear, "forward"), (L.Fused, "__call__")):
            self.patches.setattr(cls, name, self._product(getattr(cls, name)))
        for module in (norm_kernels, attention_kernels):
            for name in dir(module):
                if name.endswith("_kernel"):
                    self.patches.setattr(module, name, _Counted(self, name, getattr(module, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        self.patches.undo()
        return super().__exit__(*exc)

    def _product(self, real):
        def product(layer, *a, **kw):
            self.in_product += 1
            try:
                return real(layer, *a, **kw)
            finally:
                self.in_product -= 1
        return product

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_product and not func.is_view and name not in self.FREE:
            self.kinds["torch " + name] += 1
        return func(*args, **(kwargs or {}))


class _Counted:
    """A Triton kernel whose launches are counted, run outside the counting mode (the
    interpreter's own tensor copies are no kernels)."""

    def __init__(self, launches, name, kernel):
        self.launches, self.name, self.kernel = launches, name, kernel

    def __getitem__(self, grid):
        def launch(*a, **kw):
            self.launches.kinds[self.name] += 1
            with _disable_current_modes():
                return self.kernel[grid](*a, **kw)
        return launch


def test_a_decode_step_launches_a_few_kernels_a_layer(emulated_models):
    """An LM decode step through the static (captured) path and a depth step, in bfloat16: per LM
    layer its attention with its preparation (1) and the two residual adds with their norms, beside the MLP's activation; per depth block its short attention and the two adds with
    norms; per step the rotation tables (LM) or the position add with the first norm (depth)."""
    lm, depth, _ = emulated_models
    dt, rows = torch.bfloat16, 2
    n_lm, n_depth = len(lm.model.layers), len(depth.layers)
    g = torch.Generator().manual_seed(0)
    with emulated(), torch.no_grad():
        cache = lm.new_cache(rows, 32, dt, "cpu")
        lm(torch.randn(rows, 3, lm.hidden_size, generator=g).to(dt), cache)
        cache.bucket, cache.host_counting = 16, False
        x = torch.randn(rows, 1, lm.hidden_size, generator=g).to(dt)
        lm(x, cache)  # the first step: the casts and products made
        depth_cache = depth.new_cache(rows, dt, "cpu")
        y = torch.randn(rows, 1, depth.hidden_size, generator=g).to(dt)
        depth(torch.randn(rows, 2, depth.hidden_size, generator=g).to(dt), depth_cache)
        depth(y, depth_cache)
        with _Launches() as lm_step:
            lm(x, cache)
        with _Launches() as depth_step:
            depth(y, depth_cache)
    activation = {"torch silu": n_lm, "torch mul": n_lm}  # the MLP's SiLU x up (apart from these kernels)
    assert lm_step.kinds == Counter({"rope_table_kernel": 1, "torch add_": 1, "norm_rms_kernel": 1,
                                     "attention_step_kernel": n_lm, "norm_add_rms_kernel": 2 * n_lm,
                                     **activation}), lm_step.kinds
    assert depth_step.kinds == Counter({"norm_add_rms_kernel": 2 * n_depth + 1, "attention_short_kernel": n_depth,
                                        "torch silu": n_depth, "torch mul": n_depth}), depth_step.kinds
