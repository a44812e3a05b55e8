"""A tiny plan on the GPU code path (`emulated()`: Triton's interpreter over CPU tensors): its draws
and embedding rows are the GPU back end's kernels (one launch each: 8 draws, 7 lookups and the
feedback a frame), and its codes are those of the same plan with those steps left to torch; one
frame step's kernels counted with and without them."""

import collections
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mm3.backends.gpu import step_checks, steps as gpu_steps
from mm3.backends.gpu.emulation import emulated
from mm3.files.opener import open_component
from mm3.models.depth import RVQDepthDecoder
from mm3.models.lm import Qwen3LM
from mm3.plan.ar import FrameSampler, PlanSettings, plan
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


class _Kernels(TorchDispatchMode):
    """torch's operations that launch a kernel (views and allocations left out), and Triton's launches;
    the operations Triton's interpreter runs inside a launch are not the step's, nor a kernel's
    first-use check (`step_checks`)."""

    FREE = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute",
            "as_strided", "alias", "reshape", "detach", "split", "unbind", "lift_fresh", "empty", "empty_strided"}

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.inside = collections.Counter(), collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name not in self.FREE and not step_checks.running():
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        import triton.runtime.interpreter as interpreter

        real = self._real = interpreter.InterpretedFunction.run

        def run(fn, *args, **kwargs):
            if not step_checks.running():
                self.launches[fn.fn.__name__] += 1
            self.inside = True
            try:
                return real(fn, *args, **kwargs)
            finally:
                self.inside = False
        interpreter.InterpretedFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        import triton.runtime.interpreter as interpreter

        interpreter.InterpretedFunction.run = self._real
        return super().__exit__(*exc)


@pytest.mark.filterwarnings("ignore:the fused F32 kernel computes wrongly")  # the interpreter's bfloat16 products
def test_a_frames_draws_and_lookups_are_sixteen_launches(components, monkeypatch):
    """One frame step (bfloat16, Q8_0 tables, one song's [cond, uncond] rows): with the kernels its
    8 draws, 7 lookups and the feedback are 16 Triton launches and no torch operation of theirs is
    left; without them torch runs ~200 operations for the same work. The same codes and hiddens."""
    import gguf

    lm_c, d_c = components
    prompt = build_prompt(MM3Tokenizer.from_component(lm_c), "a bright synth pop song", "[verse]\nhello")
    dt, cpu = torch.bfloat16, torch.device("cpu")
    results = []
    with emulated():
        lm, depth = Qwen3LM.load(lm_c), RVQDepthDecoder.load(d_c)
        for table in (lm.model.embed_tokens, depth.audio_embeddings):
            blocks = gguf.quants.quantize(table.stored("weight").float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            table.set_stored("weight", gguf.GGMLQuantizationType.Q8_0, torch.from_numpy(blocks))
        g = torch.Generator().manual_seed(0)
        q_sem = torch.empty(1, lm.head_ids[1] - lm.head_ids[0]).exponential_(generator=g)
        q_dep = torch.empty(1, depth.num_codebooks - 1, depth.audio_vocab).exponential_(generator=g)
        for kernels in (True, False):
            with monkeypatch.context() as m:
                if not kernels:
                    for name in SEAMS:
                        m.setattr(gpu_steps, name, lambda *a, **k: None)
                cache = lm.new_cache(2, prompt.num_tokens + 2, dt, cpu)
                sampler = FrameSampler(lm, depth, prompt.codes, cache, PlanSettings(duration=1.0), dt, cpu, 1)
                sampler.last = lm(lm.embed(prompt.ids[:2], dt), cache)[:, -1].contiguous()
                with _Kernels() as counted:
                    codes, _, hidden = sampler.step(q_sem, q_dep)
            results.append((codes, hidden, counted))
    (codes, hidden, fused), (codes_torch, hidden_torch, plain) = results
    assert torch.equal(codes, codes_torch) and torch.equal(hidden, hidden_torch)
    ours = {name: n for name, n in fused.launches.items() if name.startswith(("draw_", "lookup_"))}
    assert ours == {"draw_top_k_kernel": 8, "lookup_rows_kernel": 7, "lookup_feedback_kernel": 1}
    drawing = {"topk", "_softmax", "argmax", "nan_to_num", "masked_fill", "lt", "clamp_min", "index", "eq", "sum"}
    assert not drawing & set(fused.ops) and drawing <= set(plain.ops)
    assert sum(plain.ops.values()) - sum(fused.ops.values()) >= 150
