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


I64, I32 = torch.int64, torch.int32
CASES = [("norms", (B16, 256)), ("norms", (torch.float32, 64)), ("norms", (torch.float16, 128)),
         ("rope", (B16, 64)), ("rope", (torch.float32, 128)),
         ("attention", (B16, 4, 2, 32, 0, True)), ("attention", (torch.float32, 4, 2, 32, 0, True)),
         ("attention", (B16, 4, 2, 32, 32, True)), ("attention", (torch.float16, 8, 2, 16, 16, True)),
         ("attention", (B16, 8, 8, 128, 0, True)), ("attention", (B16, 4, 2, 8, 0, False)),
         ("short", (B16, 2, 32, 1, 9)), ("short", (torch.float32, 2, 16, 3, 9)),
         ("lookup", (B16, "Q4_K", 256, 2, I64)), ("lookup", (torch.float32, "Q8_0", 64, 1, I32)),
         ("lookup", (B16, "BF16", 64, 1, I64)),
         ("feedback", (B16, "Q8_0", "Q4_K", 256, 4, 2, I64)),
         ("feedback", (torch.float32, "F16", "Q8_0", 64, 3, 1, I32)),
         ("draw", (torch.float32, 1024, 2, False, False, False)), ("draw", (B16, 300, 2, True, True, True)),
         ("draw", (torch.float32, 5000, 2, True, True, True)), ("draw", (torch.float16, 77, 1, False, False, True))]
ATTENTION = (B16, 4, 2, 32, 0, True)


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
        assert not step_checks.serves("attention", DEVICE, B16, 4, 2, 32, bits, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once
        assert not step_checks.serves("attention", DEVICE, B16, 4, 2, 32, bits, True)
    with pytest.warns(UserWarning, match=told):  # every variant has the one decode
        assert not step_checks.serves("attention", DEVICE, B16, 4, 2, 16, bits and 16, True)


def _missing_the_new_position(real):
    """A decode that reads the filled keys but the one just written (the count one short)."""
    def decode(q, cache_k, cache_v, pos, *args, **kwargs):
        return real(q, cache_k, cache_v, pos - 1, *args, **kwargs)
    return decode


def _with_args(real, **changed):
    """`real` with some of its arguments (by name) changed: `value` or a function of the value."""
    names = real.__code__.co_varnames[:real.__code__.co_argcount]

    def wrong(*args, **kwargs):
        bound = dict(zip(names, args), **kwargs)
        for name, change in changed.items():
            bound[name] = change(bound.get(name)) if callable(change) else change
        return real(**bound)
    return wrong


def _wrong_kernels():
    from mm3.backends.gpu import draw_kernels, lookup_kernels

    draw = ("draw", (torch.float32, 1024, 2, True, True, True))
    return [
        ("a decode missing the new position", ("attention", ATTENTION), attention_kernels, "decode",
         _missing_the_new_position),
        ("a decode of one query a key head missing the new position", ("attention", (B16, 8, 8, 128, 0, True)),
         attention_kernels, "decode", _missing_the_new_position),
        ("a preparation with the q and k norms swapped", ("attention", (B16, 8, 8, 128, 0, True)), attention_kernels,
         "prepare", _norms_swapped),
        ("a norm reading strided rows as dense", ("norms", (B16, 128)), norm_kernels, "rms_norm", _dense),
        ("a preparation writing scales 10 % large", ("attention", (B16, 4, 2, 32, 32, True)), attention_kernels,
         "prepare", _scales_off),
        ("a rotation table one position on", ("rope", (B16, 64)), attention_kernels, "rope_table",
         lambda real: _with_args(real, pos=lambda p: p + 1)),
        ("a short attention off its scale", ("short", (B16, 2, 32, 1, 9)), attention_kernels, "short",
         lambda real: _with_args(real, scale=lambda v: v * 1.1)),
        ("a feedback over the wrong LM rows", ("feedback", (B16, "Q8_0", "Q4_K", 256, 4, 2, I64)), lookup_kernels,
         "feedback", lambda real: _with_args(real, code_offset=lambda v: v + 1)),
        ("a draw keeping top_k - 1", draw, draw_kernels, "draw", lambda real: _with_args(real, top_k=lambda k: k - 1)),
        ("a draw keeping top_k + 1", draw, draw_kernels, "draw", lambda real: _with_args(real, top_k=lambda k: k + 1)),
        ("a draw ignoring the exclusions", draw, draw_kernels, "draw", lambda real: _with_args(real, excluded=None)),
        ("a draw ignoring the gate", draw, draw_kernels, "draw", lambda real: _with_args(real, gate=False)),
        ("a draw ignoring the guidance", draw, draw_kernels, "draw", lambda real: _with_args(real, cfg=1.0)),
    ]


def _norms_swapped(real):
    names = real.__code__.co_varnames[:real.__code__.co_argcount]

    def swapped(*args, **kwargs):
        bound = dict(zip(names, args), **kwargs)
        bound["q_norm"], bound["k_norm"] = bound["k_norm"], bound["q_norm"]
        return real(**bound)
    return swapped


def _dense(real):
    """A norm that reads its rows as if they were dense, whatever their strides."""
    def dense(x, *args, **kwargs):
        strides = torch.empty(x.shape).stride()
        return real(torch.as_strided(x, x.shape, strides, x.storage_offset()), *args, **kwargs)
    return dense


def _scales_off(real, factor=1.1):
    """A preparation whose written 8-bit scales come out `factor` times too large."""
    names = real.__code__.co_varnames[:real.__code__.co_argcount]

    def prepare(*args, **kwargs):
        out = real(*args, **kwargs)
        bound = dict(zip(names, args), **kwargs)
        for scales in bound["scales"]:
            scales[:, :, int(bound["pos"])] *= factor
        return out
    return prepare


@pytest.mark.parametrize("case", range(13), ids=lambda i: _wrong_kernels()[i][0].replace(" ", "-"))
def test_each_check_catches_a_subtly_wrong_kernel(case, monkeypatch):
    """Each check's bound is tight enough for the faults a kernel plausibly has: a key count one
    short (heads grouped, or one query a key head of 128 values), the q and k norms swapped, a
    norm blind to its rows' strides, an 8-bit scale written 10 % off, the rotation of the next
    position, the attention's scale 10 % off, the wrong table rows, a draw keeping one candidate
    too few or too many, or ignoring its exclusions, its gate or its guidance."""
    name, (step, key), module, function, wrong = _wrong_kernels()[case]
    monkeypatch.setattr(module, function, wrong(getattr(module, function)))
    with pytest.warns(UserWarning, match=f"GPU {step} kernel computes wrongly"):
        assert not step_checks.serves(step, DEVICE, *key), name


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
        assert not step_checks.serves("lookup", DEVICE, B16, "Q8_0", 64, 2, I64)


def test_a_kernel_that_cannot_run_is_declined_and_its_step_gives_none(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")
    monkeypatch.setattr(norm_kernels, "rms_norm", broken)
    x, w = torch.randn(2, 64).to(DEVICE, B16), torch.ones(64, dtype=B16, device=DEVICE)
    with pytest.warns(UserWarning, match=rf"norms kernel cannot run on {DEVICE} .*RuntimeError: no kernel"):
        assert gpu_steps.rms_norm(x, w, 1e-6) is None
        assert gpu_steps.add_rms_norm(x, x, w, 1e-6) is None  # the same check's answer
    assert step_checks.serves("norms", DEVICE, torch.float32, 64) is False  # (so is every dtype's, here)


def test_heads_the_attention_kernels_do_not_take_check_the_preparation_alone(monkeypatch):
    """Heads of 8 values (under the tensor cores' 16) or a query count that is not a multiple of the
    key heads: only the preparation serves them, so only it is checked; it serves."""
    def refused(*args, **kwargs):
        raise RuntimeError("a 16-bit dot of K < 16")
    for name in ("step", "decode"):
        monkeypatch.setattr(attention_kernels, name, refused)
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, d, cap = 2, 4, 2, 8, 16
    q, k, v = (torch.randn(b, 1, n * d, generator=g).to(DEVICE, B16) for n in (heads, kv_heads, kv_heads))
    ones = torch.ones(d, dtype=B16, device=DEVICE)
    caches = [torch.zeros(b, kv_heads, cap, d, dtype=B16, device=DEVICE) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rotated = gpu_steps.prepare_attention(q, k, v, ones, ones, 1e-6, ones, ones * 0, *caches,
                                              torch.tensor([3], device=DEVICE))
    assert rotated is not None and list(step_checks._CHECKED) == [("attention", DEVICE, B16, 4, 2, 8, 0, False)]
    assert torch.equal(caches[1][:, :, 3], v.view(b, kv_heads, d))


def test_a_failed_check_leaves_the_products_counters_zero(monkeypatch):
    """A kernel that fails its check after leaving the split counters set (a combine that never ran)
    does not hand them to the next product: they are zero again."""
    from mm3.backends.gpu.layout_kernels import counters

    def leaves_counts(*args, **kwargs):
        counters(DEVICE, 8)[:8] = 1
        raise RuntimeError("an illegal memory access was encountered")
    monkeypatch.setattr(attention_kernels, "prepare", leaves_counts)
    with pytest.warns(UserWarning, match="attention kernel cannot run"):
        assert not step_checks.serves("attention", DEVICE, *ATTENTION)
    assert not counters(DEVICE, 8).any()


def test_a_fault_that_leaves_the_device_unusable_says_how_to_run_without_the_kernels(monkeypatch):
    """An illegal access poisons a CUDA context: torch cannot serve either, so the warning says to
    restart with the pack's GPU kernels off (here the fault is simulated: the device answers as
    a poisoned one would)."""
    def faulting(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(norm_kernels, "rms_norm", faulting)
    monkeypatch.setattr(step_checks, "_faulted", lambda device: True)
    with pytest.warns(UserWarning, match=r"norms kernel faulted on .*illegal memory access.*MM3_KERNELS=off"):
        assert not step_checks.serves("norms", DEVICE, B16, 64)


def test_a_check_out_of_memory_lets_torch_serve_and_is_asked_again_later(monkeypatch):
    real, calls = step_checks.CHECKS["norms"], []

    def short_of_memory(*args):
        calls.append(args)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(*args)
    monkeypatch.setitem(step_checks.CHECKS, "norms", short_of_memory)
    monkeypatch.setattr(step_checks, "_RETRY", {})
    with pytest.warns(UserWarning, match="no memory on .* to check the GPU norms kernel"):
        assert not step_checks.serves("norms", DEVICE, B16, 64)
    assert not step_checks.serves("norms", DEVICE, B16, 64) and len(calls) == 1  # not asked again at once
    monkeypatch.setattr(step_checks, "RETRY_S", 0.0)
    monkeypatch.setattr(step_checks, "_RETRY", {})
    assert step_checks.serves("norms", DEVICE, B16, 64) and len(calls) == 2


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

