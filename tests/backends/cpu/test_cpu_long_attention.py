"""The DiT's attention in bfloat16 by the CPU kernel library (mm3.backends.cpu.long_attention): the
flash kernel's arithmetic up to the order of float32 additions, the same bits on any thread count,
torch's attention wherever the kernel does not take the tensors or does not pay."""

import ctypes

import pytest
import torch
import torch.nn.functional as F

from mm3 import compiler
from mm3.backends import steps
from mm3.backends.cpu import build as cpu_build, long_attention, native as cpu_native
from mm3.files.opener import open_component
from mm3.models.dit import FlowDiT
from mm3.weights.layers import load_tensors


def _serves() -> bool:
    q = torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16)
    return cpu_native.library() is not None and long_attention.run(q, q, q) is not None


needs_kernel = pytest.mark.skipif(not _serves(), reason="no kernel library with bfloat16 dot products here")


def _qkv(b, s, heads, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(b, s, heads, d, generator=g)).to(torch.bfloat16) for _ in range(3)]


def _torch(q, k, v, dtype=None):
    heads_first = [t.permute(0, 2, 1, 3) if dtype is None else t.permute(0, 2, 1, 3).to(dtype) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*heads_first).permute(0, 2, 1, 3).flatten(2, 3)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """A timing that says whether the kernel pays, each answer with a record of its own; returns a
    setter and the list of head shapes timed."""
    asked = []

    def set_pays(value: bool):
        monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path / f"pays-{value}"))
        def time_both(heads, head_dim, positions=0):
            asked.append((heads, head_dim))
            return {"kernel": 1.0 if value else 2.0, "torch": 2.0}
        monkeypatch.setattr(long_attention, "time_both", time_both)
        long_attention.forget()
    yield set_pays, asked
    long_attention.forget()


@needs_kernel
@pytest.mark.parametrize("b,s,heads,d", [(1, 1, 1, 32), (1, 16, 2, 64), (2, 17, 3, 64), (2, 33, 2, 96),
                                         (1, 70, 2, 128), (1, 40, 1, 256), (2, 300, 4, 64)])
def test_it_computes_torchs_attention_to_its_rounding(b, s, heads, d):
    """As close to the float64 attention as torch's own bfloat16 one, and off it by at most two
    bfloat16 steps an output, or where the values cancel, a 2^-9 share of the largest value (a
    weight's rounding to bfloat16 met in another float32 order)."""
    q, k, v = _qkv(b, s, heads, d)
    ours, theirs, exact = long_attention.run(q, k, v), _torch(q, k, v), _torch(q, k, v, torch.float64)
    assert ours.shape == (b, s, heads * d) and ours.dtype == torch.bfloat16
    assert _rel(ours, exact) <= 1.05 * _rel(theirs, exact) + 1e-6
    step = 2.0 ** (torch.floor(torch.log2(theirs.float().abs().clamp_min(2 ** -20))) - 7)  # a bfloat16 step
    assert ((ours.float() - theirs.float()).abs() <= 2 * step + 2 ** -9 * v.float().abs().max()).all()


@needs_kernel
def test_large_scores_and_equal_keys():
    """Scores far apart (a softmax of one winner) and keys all alike (weights all equal) come out
    as torch's attention gives them."""
    q, k, v = _qkv(1, 24, 2, 64, seed=1)
    sharp = long_attention.run(q * 8, k * 8, v)
    assert _rel(sharp, _torch(q * 8, k * 8, v, torch.float64)) < 1e-2
    same = k[:, :1].expand_as(k).contiguous()
    flat = long_attention.run(q, same, v)
    assert torch.allclose(flat.float(), v.float().mean(1).flatten(1).unsqueeze(1).expand_as(flat), atol=2e-2)


@needs_kernel
def test_views_at_any_offset_and_row_stride():
    """q, k, v as views of wider rows at an odd element offset (a fused q/k/v output, say) give the
    bits of the same tensors made contiguous."""
    b, s, heads, d = 2, 19, 2, 32
    rows = torch.randn(b, s, 3 * heads * d + 1, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    q, k, v = (rows[..., 1 + i * heads * d:1 + (i + 1) * heads * d].unflatten(-1, (heads, d)) for i in range(3))
    assert q.storage_offset() % 2 == 1 and not q.is_contiguous()
    assert torch.equal(long_attention.run(q, k, v), long_attention.run(q.contiguous(), k.contiguous(), v.contiguous()))


@needs_kernel
def test_threads_do_not_change_a_bit():
    """Each query row is one thread's work from start to end: one thread and two give the same bits."""
    q, k, v = _qkv(2, 45, 2, 64, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = long_attention.run(q, k, v)
        torch.set_num_threads(2)
        two = long_attention.run(q, k, v)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("what", ["float32", "head of 16", "head of 48", "another layout", "no positions",
                                  "a gradient"])
def test_what_it_does_not_take_goes_to_torch(what, timed):
    set_pays, asked = timed
    set_pays(True)
    q, k, v = _qkv(1, 8, 2, 64)
    if what == "float32":
        q, k, v = q.float(), k.float(), v.float()
    elif what.startswith("head of"):
        d = int(what.split()[-1])
        q, k, v = _qkv(1, 8, 2, d)
    elif what == "another layout":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif what == "a gradient":
        q.requires_grad_(True)
    else:
        q, k, v = _qkv(1, 0, 2, 64)
    assert steps.long_attention(q, k, v) is None
    assert what == "a gradient" or not long_attention.takes(q, k, v)
    assert asked == []


def test_the_timing_is_kept_per_machine_and_head_shape(timed):
    """Timed once a head shape (kept in the record, read by the next process); where the kernel is
    not faster by `PAYS`, torch's attention serves."""
    set_pays, asked = timed
    set_pays(True)
    assert long_attention.pays(8, 64) and asked == [(8, 64)]
    long_attention.forget()  # as a new process: the record answers
    assert long_attention.pays(8, 64) and asked == [(8, 64)]
    set_pays(False)
    assert not long_attention.pays(4, 32) and asked == [(8, 64), (4, 32)]
    q, k, v = _qkv(1, 8, 4, 32)
    assert steps.long_attention(q, k, v) is None


@needs_kernel
def test_a_real_timing_of_both():
    ms = long_attention.time_both(2, 64, positions=64)
    assert set(ms) == {"kernel", "torch"} and all(0 < v < 1e4 for v in ms.values())


def test_a_build_without_bfloat16_dot_products_says_so(tmp_path):
    """The C file builds for any x86-64 processor; without AVX512-BF16 its function answers 1 and
    torch's attention serves."""
    cc = compiler.find()
    if cc is None:
        pytest.skip("no C compiler")
    source = next(p for p in cpu_build.SOURCES if p.name == "long_attention.c")
    out = tmp_path / "attention.so"
    done = compiler.run([cc, "-O2", "-march=x86-64-v3", "-shared", "-fPIC", "-std=c11", str(source), "-o", str(out)],
                        120)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(out))
    q = torch.zeros(1, 4, 1, 32, dtype=torch.bfloat16)
    out_t = torch.empty(1, 4, 32, dtype=torch.bfloat16)
    status = lib.mm3_long_attention(*[ctypes.c_void_p(q.data_ptr())] * 3, *map(ctypes.c_int64, (1, 4, 1, 32, 32, 128)),
                                    ctypes.c_float(0.5), ctypes.c_void_p(out_t.data_ptr()), ctypes.c_int(1))
    assert status == 1


@needs_kernel
def test_the_dit_attends_by_the_kernel_where_it_pays(tiny, timed, monkeypatch):
    """The tiny DiT's weights as two heads of 32 (a head size the kernel takes): in bfloat16 its
    forward runs the kernel where it pays, torch's attention where not, the two as close as two
    bfloat16 forwards."""
    set_pays, _ = timed
    component = open_component(tiny.file("mm3-dit"), "dit")
    inner = int(component.hparams["num_attention_heads"]) * int(component.hparams["attention_head_dim"])
    dit = FlowDiT(dict(component.hparams, num_attention_heads=inner // 32, attention_head_dim=32))
    load_tensors(dit, component.tensors, source=component.path)
    ran = []
    real_run = long_attention.run
    monkeypatch.setattr(long_attention, "run", lambda q, k, v: ran.append(q.shape) or real_run(q, k, v))
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(2, dit.in_channels, 40, generator=g), torch.tensor([0.4, 0.4])
    cond = torch.randn(2, 40, dit.condition_dim, generator=g)
    with torch.no_grad():
        exact = dit(x, t, cond)
        set_pays(False)
        by_torch = dit(x.bfloat16(), t.bfloat16(), cond.bfloat16())
        assert ran == []
        set_pays(True)
        by_kernel = dit(x.bfloat16(), t.bfloat16(), cond.bfloat16())
    assert len(ran) == len(dit.transformer_blocks)
    assert _rel(by_kernel, exact) <= 1.25 * _rel(by_torch, exact)
