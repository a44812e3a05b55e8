"""A tiny plan on the GPU code path (`emulated()`: Triton's interpreter over CPU tensors): its draws
and embedding rows are the GPU back end's kernels (one launch each: 8 draws, 7 lookups and the
feedback a frame), and its codes are those of the same plan with those steps left to torch."""

import collections
import os

import pytest
import torch

from mm3.backends.gpu import steps as gpu_steps
from mm3.backends.gpu.emulation import emulated
from mm3.files.opener import open_component
from mm3.models.depth import RVQDepthDecoder
from mm3.models.lm import Qwen3LM
from mm3.plan.ar import PlanSettings, plan
from mm3.plan.prompt import build_prompt
from mm3.tokenizer import MM3Tokenizer

pytest.importorskip("triton", reason="this torch installation has no Triton")

SEAMS = ("top_k_draw", "semantic_draw", "code_rows", "frame_feedback")


@pytest.fixture(scope="module")
def components(tiny):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("emulating the GPU code path needs TRITON_INTERPRET=1")
    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    yield lm_c, d_c
    lm_c.close()
    d_c.close()


def test_a_tiny_plans_codes_are_the_torch_paths(components, monkeypatch):
    lm_c, d_c = components
    prompt = build_prompt(MM3Tokenizer.from_component(lm_c), "a bright synth pop song", "[verse]\nhello")
    settings = PlanSettings(duration=0.04, lm_seed=11, songs=2)  # frames 0-1 of two songs, [cond, uncond] each
    served = collections.Counter()

    def counted(name, real):
        def seam(*args, **kwargs):
            out = real(*args, **kwargs)
            served[name] += out is not None
            return out
        return seam

    runs = []
    with emulated():
        lm, depth = Qwen3LM.load(lm_c), RVQDepthDecoder.load(d_c)
        for kernels in (True, False):
            with monkeypatch.context() as m:
                for name in SEAMS:
                    m.setattr(gpu_steps, name, counted(name, getattr(gpu_steps, name)) if kernels else
                              lambda *a, **k: None)
                runs.append(plan(lm, depth, prompt, settings, keep_hiddens=False))
    frames = 2
    assert served == {"semantic_draw": frames, "top_k_draw": 7 * frames, "code_rows": 7 * frames,
                      "frame_feedback": frames}
    for with_kernels, with_torch in zip(*runs):
        assert with_kernels.codes.shape == (frames, 8)
        assert torch.equal(with_kernels.codes, with_torch.codes)
