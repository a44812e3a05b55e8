"""A tiny AR plan on the GPU code path (`emulated()`: Triton's interpreter over CPU tensors) with the
decoder layers' kernels (`mm3.backends.gpu.norm_kernels`, `attention_kernels`) against the same
plan with the models' torch operations in their place: the same codes, hiddens within float32
rounding; and through the static-shape step a CUDA graph captures (`cache.bucket` set, the
position read from the device only) the same codes and hiddens as the eager step. (The graph
runner's own check against an eager frame: tests/backends/gpu/test_frame_graphs.py.)"""

import functools
import os

import pytest
import torch

from mm3.backends.gpu import steps as gpu_steps
from mm3.backends.gpu.emulation import emulated
from mm3.files.opener import open_component
from mm3.plan import ar
from mm3.plan.ar import PlanSettings, plan
from mm3.plan.prompt import build_prompt
from mm3.tokenizer import MM3Tokenizer

pytest.importorskip("triton", reason="this torch installation has no Triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")

SETTINGS = PlanSettings(duration=0.04, lm_seed=5)  # the prompt, then 2 frames
KERNELS = ("rms_norm", "add_rms_norm", "rope_table", "prepare_attention", "decode_attention", "short_attention")


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
    for name in KERNELS:
        monkeypatch.setattr(gpu_steps, name, lambda *a: None)
    want = _plan(emulated_models)
    assert song.codes.shape[0] >= 2 and torch.equal(song.codes, want.codes)
    err = ((song.frame_hiddens - want.frame_hiddens).norm() / want.frame_hiddens.norm()).item()
    assert err < 1e-5


def test_the_static_step_reads_the_position_from_the_device(emulated_models, eager, monkeypatch):
    """The frame step as a CUDA graph captures it (`static_shapes`: `cache.bucket` set), with the
    host's count of filled positions hidden while it runs: the kernels read `cache.pos` only."""
    real_frames, real_step = ar._sample_frames, ar.FrameSampler.step
    buckets = []

    def hidden_count(sampler, q_sem, q_dep):
        cache = sampler.cache
        buckets.append(cache.bucket)
        length, cache.length = cache.length, -(10 ** 9)
        try:
            return real_step(sampler, q_sem, q_dep)
        finally:
            cache.length = length

    monkeypatch.setattr(ar, "_sample_frames", functools.partial(real_frames, static_shapes=True))
    monkeypatch.setattr(ar.FrameSampler, "step", hidden_count)
    got = _plan(emulated_models)
    assert buckets and all(b is not None for b in buckets)
    assert torch.equal(got.codes, eager[0].codes)
    torch.testing.assert_close(got.frame_hiddens, eager[0].frame_hiddens, rtol=0, atol=0)
