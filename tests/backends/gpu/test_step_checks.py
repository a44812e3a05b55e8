"""The GPU steps' first-use checks (`mm3.backends.gpu.step_checks`), on a CUDA device where there is
one (`.ci/gpu` runs them there: every step kernel against torch, natively), else on the GPU code
path emulated (Triton's interpreter over CPU tensors): each passes for the kernels as they are; a
kernel that computes wrongly or cannot run is reported once and its step declines, so the model's
torch operations serve and a plan draws the same codes; a check runs once a process and its
launches are not a frame's."""

import os
import warnings

import pytest
import torch

pytest.importorskip("triton", reason="this torch installation has no Triton")

from mm3.backends.gpu import attention_kernels, norm_kernels, step_checks, steps as gpu_steps  # noqa: E402
from mm3.backends.gpu.emulation import emulated  # noqa: E402
from mm3.backends.gpu.frame_count import KernelCounter  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
B16 = torch.bfloat16

pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no CUDA device, and emulating the GPU code path needs TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Every test asks its checks anew."""
    monkeypatch.setattr(step_checks, "_CHECKED", {})


CASES = [("norms", (B16, 256)), ("norms", (torch.float32, 64)), ("norms", (torch.float16, 128)),
         ("rope", (B16, 64)), ("rope", (torch.float32, 128)),
         ("attention", (B16, 4, 2, 32, 0)), ("attention", (torch.float32, 4, 2, 32, 0)),
         ("attention", (B16, 4, 2, 32, 32)), ("attention", (torch.float16, 8, 2, 16, 16)),
         ("short", (B16, 2, 32, 1, 9)), ("short", (torch.float32, 2, 16, 3, 9)),
         ("lookup", (B16, "Q4_K", 256)), ("lookup", (torch.float32, "Q8_0", 64)), ("lookup", (B16, "BF16", 64)),
         ("feedback", (B16, "Q8_0", "Q4_K", 256, 4)), ("feedback", (torch.float32, "F16", "Q8_0", 64, 3)),
         ("draw", (torch.float32, 1024, 2, False, False, False)), ("draw", (B16, 300, 2, True, True, True)),
         ("draw", (torch.float32, 5000, 2, True, True, True)), ("draw", (torch.float16, 77, 1, False, False, True))]


@pytest.mark.parametrize("step,key", CASES, ids=[f"{s}-{i}" for i, (s, _) in enumerate(CASES)])
def test_every_check_passes_for_the_kernels_as_they_are(step, key):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step_checks.serves(step, DEVICE, *key)
    worst, _ = step_checks.CHECKS[step](DEVICE, *key)
    assert 0 <= worst <= 1


def _scaled(real, factor):
    """A kernel launcher whose attention is off by a softmax temperature: what a misread scale makes."""
    def wrong(*args, **kwargs):
        names = list(real.__code__.co_varnames[:real.__code__.co_argcount])
        at = names.index("scale")
        args = list(args)
        if at < len(args):
            args[at] *= factor
        else:
            kwargs["scale"] *= factor
        return real(*args, **kwargs)
    return wrong


@pytest.mark.parametrize("bits", [0, 32])
def test_a_wrong_attention_kernel_is_declined(bits, monkeypatch):
    monkeypatch.setattr(attention_kernels, "decode", _scaled(attention_kernels.decode, 1.5))
    told = rf"GPU attention kernel computes wrongly on {DEVICE} .*torch's operations serve"
    with pytest.warns(UserWarning, match=told):
        assert not step_checks.serves("attention", DEVICE, B16, 4, 2, 32, bits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once
        assert not step_checks.serves("attention", DEVICE, B16, 4, 2, 32, bits)
    assert step_checks.serves("attention", DEVICE, B16, 4, 2, 16, bits and 16) is False  # every variant: one decode


def test_draw_and_lookup_checks_catch_a_wrong_answer(monkeypatch):
    from mm3.backends.gpu import draw_kernels, lookup_kernels

    real_draw, real_rows = draw_kernels.draw, lookup_kernels.rows
    # the draw reading its exponentials in the wrong order; the lookup one row off
    monkeypatch.setattr(draw_kernels, "draw", lambda logits, r, cfg, k, q, *a: real_draw(logits, r, cfg, k,
                                                                                           q.flip(-1).contiguous(), *a))
    monkeypatch.setattr(lookup_kernels, "rows",
                        lambda table, kind, codes, *a, **k: real_rows(table, kind, codes + 1, *a, **k))
    with pytest.warns(UserWarning, match="draw kernel computes wrongly"):
        assert not step_checks.serves("draw", DEVICE, torch.float32, 1024, 2, False, False, False)
    with pytest.warns(UserWarning, match="lookup kernel computes wrongly"):
        assert not step_checks.serves("lookup", DEVICE, B16, "Q8_0", 64)


def test_a_kernel_that_cannot_run_is_declined_and_its_step_gives_none(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")
    monkeypatch.setattr(norm_kernels, "rms_norm", broken)
    x, w = torch.randn(2, 64).to(DEVICE, B16), torch.ones(64, dtype=B16, device=DEVICE)
    with pytest.warns(UserWarning, match=rf"norms kernel cannot run on {DEVICE} .*RuntimeError: no kernel"):
        assert gpu_steps.rms_norm(x, w, 1e-6) is None
        assert gpu_steps.add_rms_norm(x, x, w, 1e-6) is None  # the same check's answer
    assert step_checks.serves("norms", DEVICE, torch.float32, 64) is False  # (so is every dtype's, here)


def test_a_check_runs_once_a_process_and_its_launches_are_not_counted(monkeypatch):
    calls = []
    real = step_checks.CHECKS["norms"]
    monkeypatch.setitem(step_checks.CHECKS, "norms", lambda *a: calls.append(a) or real(*a))
    x, w = torch.randn(3, 128).to(DEVICE, B16), (torch.rand(128) + 0.5).to(DEVICE, B16)
    with KernelCounter() as counter:
        y = gpu_steps.rms_norm(x, w, 1e-6)
    assert y is not None and counter.total() == 1  # the norm's launch; not the check's three, nor its torch
    gpu_steps.rms_norm(x, w, 1e-6)
    gpu_steps.rms_norm(x.float(), w.float(), 1e-6)
    assert calls == [(DEVICE, B16, 128), (DEVICE, torch.float32, 128)]


@pytest.mark.skipif(CUDA, reason="the plan runs on the emulated GPU path")
def test_a_plan_with_a_wrong_attention_kernel_draws_torchs_codes(tiny, monkeypatch):
    """A tiny plan on the emulated GPU path whose decode attention kernels compute wrongly: they
    are declined at their first step, the model's torch attention serves, and the codes are those
    of the plan whose kernels are right."""
    from mm3.files.opener import open_component
    from mm3.models.depth import RVQDepthDecoder
    from mm3.models.lm import Qwen3LM
    from mm3.plan.ar import PlanSettings, plan
    from mm3.plan.prompt import build_prompt
    from mm3.tokenizer import MM3Tokenizer

    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    try:
        prompt = build_prompt(MM3Tokenizer.from_component(lm_c), "a calm piano piece", "[verse]\nla la")
        codes = []
        with emulated(), torch.inference_mode():
            lm, depth = Qwen3LM.load(lm_c), RVQDepthDecoder.load(d_c)
            for wrong in (False, True):
                with monkeypatch.context() as m:
                    m.setattr(step_checks, "_CHECKED", {})
                    if wrong:
                        for name in ("step", "decode"):
                            m.setattr(attention_kernels, name, _scaled(getattr(attention_kernels, name), 3.0))
                    with warnings.catch_warnings(record=True) as told:
                        warnings.simplefilter("always")
                        codes.append(plan(lm, depth, prompt, PlanSettings(duration=0.08, lm_seed=3),
                                          keep_hiddens=False)[0].codes)
                    said = [str(w.message) for w in told if "attention kernel" in str(w.message)]
                    assert len(said) == (1 if wrong else 0), said
                    answers = [ok for key, ok in step_checks._CHECKED.items() if key[0] == "attention"]
                    assert answers == [not wrong]  # asked, of the LM's one shape
    finally:
        lm_c.close()
        d_c.close()
    assert codes[0].shape[0] >= 2 and torch.equal(codes[0], codes[1])

