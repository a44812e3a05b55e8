"""Where the device layout replaces the blocks (`mm3.backends.gpu.placement`) and which kernels serve a
weight (`mm3.backends.gpu.kernel_choice`, `MM3_KERNELS`): one copy of the weight in the form its products
read, the file's blocks back bit for bit when it leaves, memory counted as held, products routed to
the layout kernels (fused parts stacked as views), and the family given by rule, nothing timed or kept.
The layout runs on CUDA where there is one, else on CPU tensors through Triton's interpreter
(`MM3_KERNELS=layout`)."""

import json
import os
import warnings

import gguf
import pytest
import torch
import torch.nn.functional as F

from mm3.cache_dir import cache_dir
from mm3.backends.gpu import device_layout as dl
from mm3.backends.gpu import kernel_choice, kernels, layout_kernels, placement
from mm3.backends import products
from mm3.weights import layers as gguf_ops
from mm3.weights.copies import compressed_nbytes
from tests.backends.gpu.test_layout_kernels import DEVICE
from tests.backends.gpu.test_layout_kernels import weight as layout_weight

Q = gguf.GGMLQuantizationType
pytest.importorskip("triton", reason="this torch installation has no Triton")


@pytest.fixture
def layout_mode():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the kernels cannot run here")
    kernels.configure("layout")
    yield
    kernels.configure()


def _blocks(qtype, n, k, seed):
    from mm3.formats.gguf.quants import dequantize

    g = torch.Generator().manual_seed(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, generator=g)
    from mm3.formats.gguf.quants import SCALE_OFFSETS

    for offset in SCALE_OFFSETS[qtype]:
        raw[:, offset:offset + 2] = (torch.rand(raw.shape[0], generator=g) * 0.02 + 1e-3).half().view(
            torch.uint8).view(-1, 2)
    raw = raw.reshape(n, -1)
    return raw, dequantize(raw, qtype, (n, k))


def _linear(qtype, n, k, seed, device=torch.device("cpu")):
    """A layer holding random `qtype` blocks on `device` as the file has them (no layout yet)."""
    layer = gguf_ops.Linear(k, n, bias=False)
    raw, values = _blocks(qtype, n, k, seed)
    layer.set_stored("weight", qtype, raw.to(device))
    return layer, raw, values


def test_the_layout_replaces_the_blocks_and_the_file_view_returns(layout_mode):
    layer, raw, values = _linear(Q.Q4_K, 12, 256, 1)
    layer.to(DEVICE)  # a placement: the kernel mode in force asks for the layout here
    assert layer.form("weight") == "layout"
    held = layer.stored("weight")
    assert held.shape == (12, dl.layout_of(Q.Q4_K, 256).row_bytes) and held.data_ptr() != raw.data_ptr()
    assert compressed_nbytes(layer) == held.numel()  # what a memory manager counts is what is held
    assert torch.equal(layer.fetch("weight", None).cpu(), raw)  # the file's form, for whatever reads it
    x = torch.randn(2, 256)
    want = F.linear(x.double(), values.double())
    got = layer(x.to(DEVICE)).cpu()
    assert isinstance(layer.chosen_product(), products.LayoutProduct)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6
    kernels.configure("off")
    layer.to(DEVICE)  # the layout is not wanted any more: the file's blocks, bit for bit
    assert layer.form("weight") is None and torch.equal(layer.stored("weight").cpu(), raw)
    if DEVICE.type == "cpu":  # at home, the file's own view again, and the plain product's numbers
        assert layer.stored("weight").data_ptr() == raw.data_ptr()
        assert torch.equal(layer(x), F.linear(x, values))
    got = layer(x.to(DEVICE)).cpu()
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


def test_relayout_and_reference_numerics(layout_mode):
    layer, raw, values = _linear(Q.Q8_0, 8, 64, 2, DEVICE)
    assert placement.relayout(layer) == 1 and layer.form("weight") == "layout"
    assert placement.relayout(layer) == 0
    layer.fused_kernels = False  # reference numerics: the dequantized weight's F.linear
    x = torch.randn(3, 64)
    assert torch.equal(layer(x.to(DEVICE)).cpu(), F.linear(x.to(DEVICE), values.to(DEVICE)).cpu())
    assert placement.relayout(layer) == 1 and layer.form("weight") is None  # the layout is not wanted there
    assert torch.equal(layer.stored("weight").cpu(), raw)


def test_a_fused_product_stacks_the_layouts_as_views(layout_mode, monkeypatch):
    parts = [_linear(Q.Q6_K, n, 256, 10 + n, DEVICE) for n in (8, 4, 4)]
    layers = [p for p, _, _ in parts]
    for layer in layers:
        placement.relayout(layer)
    assert layout_kernels.works(Q.Q6_K, torch.float32, DEVICE)  # checked once, before counting
    calls = []
    real = layout_kernels.linear
    monkeypatch.setattr(layout_kernels, "linear", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    fused = gguf_ops.Fused(layers)
    x = torch.randn(2, 256)
    for y, (_, _, values) in zip(fused(x.to(DEVICE)), parts):
        y, want = y.cpu(), F.linear(x.double(), values.double())
        assert ((y.double() - want).norm() / want.norm()).item() < 1e-6
    assert calls == [(16, dl.layout_of(Q.Q6_K, 256).row_bytes)]  # one product over the stacked rows
    assert gguf_ops.adjacent([p.stored("weight") for p in layers])
    assert all(p.form("weight") == "layout" for p in layers)
    mixed = gguf_ops.Fused([_linear(Q.Q4_K, 4, 256, 20, DEVICE)[0], _linear(Q.Q6_K, 4, 256, 21, DEVICE)[0],
                            _linear(Q.Q4_K, 4, 256, 22, DEVICE)[0]])
    for p in mixed.parts:
        placement.relayout(p)
    assert isinstance(mixed.choose(torch.float32, DEVICE)[3], products.Separate)  # three runs of types: each its own


def test_q_k_v_of_two_types_are_one_product(layout_mode, monkeypatch):
    """q and k in one type, v in another (Q4_K_M): one two-type launch over each run's stacked
    layout, each part's output as its own product gives it."""
    parts = [_linear(qtype, n, 256, 40 + i, DEVICE) for i, (qtype, n) in enumerate(((Q.Q4_K, 8), (Q.Q4_K, 4),
                                                                                      (Q.Q6_K, 4)))]
    layers = [p for p, _, _ in parts]
    for layer in layers:
        placement.relayout(layer)
    assert layout_kernels.fused_works("segments", Q.Q4_K, torch.float32, DEVICE, Q.Q6_K)  # checked before counting
    calls = []
    real = layout_kernels.linear_segments
    monkeypatch.setattr(layout_kernels, "linear_segments", lambda *a, **kw: calls.append(
        [(w.shape, q) for w, q in a[1]]) or real(*a, **kw))
    fused = gguf_ops.Fused(layers)
    x = torch.randn(2, 256)
    outs = fused(x.to(DEVICE))
    assert isinstance(fused.chosen_product().product, products.LayoutSegments)
    for y, (_, _, values) in zip(outs, parts):
        want = F.linear(x.double(), values.double())
        assert y.shape == (2, values.shape[0]) and ((y.cpu().double() - want).norm() / want.norm()).item() < 1e-6
    row_bytes = dl.layout_of(Q.Q4_K, 256).row_bytes
    assert calls == [[((12, row_bytes), Q.Q4_K), ((4, dl.layout_of(Q.Q6_K, 256).row_bytes), Q.Q6_K)]]
    assert gguf_ops.adjacent([p.stored("weight") for p in layers[:2]])  # q and k: views of one stack


def test_a_gate_up_group_gives_silu_times_up_from_one_launch(layout_mode, monkeypatch):
    """`Fused.swiglu` over parts held in the layout: one `layout_kernels.swiglu` launch, the numbers
    of `F.silu(gate) * up` over the fused product's outputs; parts that cannot (another type each,
    or no fusing) give the same through torch's ops."""
    layers = [_linear(Q.Q4_K, 8, 256, 30 + i, DEVICE)[0] for i in range(2)]
    for layer in layers:
        placement.relayout(layer)
    assert layout_kernels.fused_works("swiglu", Q.Q4_K, torch.float16, DEVICE)  # checked once, before counting
    calls = []
    real = layout_kernels.swiglu
    monkeypatch.setattr(layout_kernels, "swiglu", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    fused = gguf_ops.Fused(layers)
    x = torch.randn(2, 256).to(DEVICE, torch.float16)
    gate, up = fused(x)
    assert torch.equal(fused.swiglu(x), F.silu(gate) * up)
    assert calls == [(16, dl.layout_of(Q.Q4_K, 256).row_bytes)]
    fused.fuse = False
    assert torch.equal(fused.swiglu(x), F.silu(gate) * up) and len(calls) == 1
    mixed = gguf_ops.Fused([layers[0], _linear(Q.Q6_K, 8, 256, 32, DEVICE)[0]])
    placement.relayout(mixed.parts[1])
    gate, up = mixed(x)
    assert torch.equal(mixed.swiglu(x), F.silu(gate) * up) and len(calls) == 1


def test_rows_of_a_layout_keep_its_form(layout_mode):
    layer, raw, values = _linear(Q.Q4_0, 10, 64, 3, DEVICE)
    placement.relayout(layer)
    part = layer.rows(2, 7)
    assert part.form("weight") == "layout"
    x = torch.randn(1, 64)
    want = F.linear(x.double(), values[2:7].double())
    assert ((part(x.to(DEVICE)).cpu().double() - want).norm() / want.norm()).item() < 1e-6


def test_auto_takes_no_layout_on_the_cpu():
    kernels.configure("auto")
    try:
        layer, raw, _ = _linear(Q.Q4_K, 4, 256, 4)
        layer.to("cpu")
        assert layer.form("weight") is None and layer.stored("weight") is raw or \
            layer.stored("weight").data_ptr() == raw.data_ptr()
        assert kernel_choice.family(Q.Q4_K, 4, 256, torch.device("cpu")) is None
    finally:
        kernels.configure()


def test_auto_takes_the_layout_by_rule():
    """On an accelerator "auto" takes the layout kernels wherever the layout holds the type and
    row length (every quantized type and length the block kernel reads), nothing for floats or a
    type or length no kernel reads."""
    assert kernel_choice.rule(Q.Q4_K, 4096) == "layout" and kernel_choice.rule(Q.Q8_0, 4096) == "layout"
    assert all(kernel_choice.rule(t, 4096) == "layout" for t in dl.LAYOUT_TYPES)
    assert kernel_choice.rule(Q.Q8_0, 32 * 3) == "layout" and kernel_choice.rule(Q.Q4_K, 128) is None  # a part super-block
    assert kernel_choice.rule(Q.Q2_K, 4096) is None  # no kernel reads it
    assert kernel_choice.rule(Q.BF16, 4096) is None and kernel_choice.rule(Q.F32, 4096) is None


def test_auto_on_an_accelerator_times_nothing_and_drops_the_old_record(tmp_path, monkeypatch):
    """No per-shape timing and no record: the kernel families' old record (`choices.json`, ours) is
    removed, another program's file of that name left alone. Where a layout kernel does not run on
    the device (an XPU this machine lacks), the block kernel serves; on CUDA, the layout."""
    old = {"xpu | driver unknown | torch 2 | triton 3": {"Q4_K/4096x4096": {"family": "triton", "ms": {}}}}
    for folder, content in (("ours", old), ("theirs", {"note": "not ours"})):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "choices.json").write_text(json.dumps(content))
        monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path / folder))
        monkeypatch.setenv("MM3_KERNELS", "auto")
        kernels.configure()
        try:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("xpu")
            if not kernels.available(device.type):
                pytest.skip("Triton does not run here")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a layout kernel that cannot run on the device says so
                got = kernel_choice.family(Q.Q4_K, 4096, 4096, device)
            assert got == ("layout" if device.type == "cuda" else "triton")
            assert kernel_choice.family(Q.Q2_K, 4096, 4096, device) is None
        finally:
            monkeypatch.delenv("MM3_KERNELS")
            kernels.configure()
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ([] if folder == "ours" else ["choices.json"])


def test_a_named_family_is_taken_where_it_reads_the_type(monkeypatch):
    for name in ("triton", "layout"):
        monkeypatch.setenv("MM3_KERNELS", name)
        kernels.configure()
        try:
            if not kernels.available("xpu"):
                pytest.skip("Triton does not run here")
            assert kernel_choice.family(Q.Q4_K, 4096, 4096, torch.device("xpu")) == name
            assert kernel_choice.family(Q.Q2_K, 4096, 4096, torch.device("xpu")) is None
        finally:
            monkeypatch.delenv("MM3_KERNELS")
            kernels.configure()


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv("MM3_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if os.name == "posix" and not os.uname().sysname == "Darwin":
        assert cache_dir() == tmp_path / "xdg" / "mm3"


def test_the_layout_kernels_serve_the_placed_weight(layout_mode):
    """The product of a placed layer is the layout kernels' over the held planes."""
    w, values = layout_weight(Q.Q5_K, 6, 256, torch.Generator().manual_seed(9))
    layer = gguf_ops.Linear(256, 6, bias=False)
    layer.set_stored("weight", Q.Q5_K, dl.to_blocks(w.cpu(), Q.Q5_K, 256).to(DEVICE))
    placement.relayout(layer)
    assert torch.equal(layer.stored("weight").cpu(), w.cpu())


def test_a_fused_form_that_fails_its_check_is_left_out(layout_mode, monkeypatch):
    """A SwiGLU kernel that cannot run (a compiler that refuses it) is left out with a warning:
    the group's stacked product serves and torch's ops make silu(gate) * up."""
    monkeypatch.setattr(layout_kernels, "_WORKS", {})

    def broken(*args, **kw):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(layout_kernels, "swiglu", broken)
    layers = [_linear(Q.Q8_0, 4, 64, 50 + i, DEVICE)[0] for i in range(2)]
    for layer in layers:
        placement.relayout(layer)
    fused = gguf_ops.Fused(layers)
    x = torch.randn(2, 64).to(DEVICE)
    with pytest.warns(UserWarning, match="Q8_0 swiglu kernel cannot run"):
        got = fused.swiglu(x)
    assert fused.chosen_product().swiglu is None
    gate, up = fused(x)
    assert torch.equal(got, F.silu(gate) * up)
