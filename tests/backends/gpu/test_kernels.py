"""The fused dequantize-and-multiply kernels (`mm3.backends.gpu.kernels`) against the torch dequantization
(itself bit-exact against gguf-py): every type they read, odd row counts, 1-40 input rows, tails of
K, bias, half-precision inputs; the layers and the AR stage running on them; their compilation for
real GPUs. On a machine with CUDA they run natively; elsewhere through Triton's interpreter on the
CPU (`TRITON_INTERPRET=1`)."""

import os

import gguf
import pytest
import torch
import torch.nn.functional as F

from mm3.backends.gpu import kernels
from mm3.weights import layers as gguf_ops
from mm3.weights import copies as weight_copies
from mm3.formats.gguf.quants import SCALE_OFFSETS, dequantize

triton = pytest.importorskip("triton", reason="this torch installation has no Triton")

Q = gguf.GGMLQuantizationType
QUANTS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
NATIVE = torch.cuda.is_available()
DEVICE = torch.device("cuda" if NATIVE else "cpu")


@pytest.fixture(scope="module", autouse=True)
def kernels_on():
    """Kernels forced on for this module (interpreted on the CPU: see conftest.py), then as they were."""
    if not NATIVE and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the kernels cannot run here")
    kernels.configure("triton")
    yield
    kernels.configure()


def _weight(qtype, n, k, g):
    """A random weight as stored (uint8 block rows with sane f16 scales, or floats) and its float32 values."""
    if qtype in FLOATS:
        w = torch.randn(n, k, generator=g).to(FLOATS[qtype])
        return w.to(DEVICE), w.float()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, generator=g)
    for offset in SCALE_OFFSETS[qtype]:
        scales = (torch.rand(raw.shape[0], generator=g) * 0.02 + 1e-3).half()
        raw[:, offset:offset + 2] = scales.view(torch.uint8).view(-1, 2)
    raw = raw.reshape(n, -1)
    return raw.to(DEVICE), dequantize(raw, qtype, (n, k))


def _k_for(qtype):
    return 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 96  # 96: K tiles of one 32-value block


@pytest.mark.parametrize("qtype", QUANTS + list(FLOATS), ids=lambda t: t.name)
def test_weight_tiles_equal_the_torch_dequantization(qtype):
    """x = identity: the product is the kernel's own expansion of the weight, which must be exact."""
    g = torch.Generator().manual_seed(int(qtype))
    k = _k_for(qtype)
    w, values = _weight(qtype, 37, k, g)
    got = kernels.fused_linear(torch.eye(k, device=DEVICE), w, qtype)
    assert torch.equal(got.cpu(), values.T)


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 40])
@pytest.mark.parametrize("qtype", QUANTS + [Q.BF16], ids=lambda t: t.name)
def test_products_match_float64(qtype, rows):
    g = torch.Generator().manual_seed(100 * int(qtype) + rows)
    k = _k_for(qtype)
    w, values = _weight(qtype, 45, k, g)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(45, generator=g)
    got = kernels.fused_linear(x.to(DEVICE), w, qtype, bias.to(DEVICE)).cpu()
    want = F.linear(x.double(), values.double(), bias.double())
    assert got.shape == (rows, 45) and got.dtype == torch.float32
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_half_precision_inputs(qtype):
    g = torch.Generator().manual_seed(7)
    w, values = _weight(qtype, 33, 256, g)
    x = torch.randn(2, 3, 256, generator=g)
    # Triton 3.8's interpreter multiplies bfloat16 tiles wrongly (its f32 -> bf16 casts truncate, its
    # bf16 dot is off by orders of magnitude): bfloat16 is checked natively, and compiled below.
    for dtype in (torch.bfloat16, torch.float16) if NATIVE else (torch.float16,):
        got = kernels.fused_linear(x.to(DEVICE, dtype), w, qtype).cpu()
        want = F.linear(x.to(dtype).double(), values.double())
        assert got.shape == (2, 3, 33) and got.dtype == dtype
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


def test_wrong_weight_bytes_are_refused():
    g = torch.Generator().manual_seed(1)
    w, _ = _weight(Q.Q8_0, 8, 64, g)
    with pytest.raises(ValueError, match="Q8_0 rows of 68 bytes do not hold 96 values"):
        kernels.fused_linear(torch.zeros(1, 96, device=DEVICE), w, Q.Q8_0)


def _layer(qtype, k, n, g, bias=False):
    layer = gguf_ops.Linear(k, n, bias=bias)
    w, values = _weight(qtype, n, k, g)
    layer.set_stored("weight", qtype, w)
    if bias:
        layer.set_float("bias", torch.randn(n, generator=g).to(DEVICE))
    return layer, values


def test_layers_read_quantized_weights_through_the_kernel(monkeypatch):
    """Linear and Fused (stacked block rows, as views) go through the kernel, with no float weight made."""
    assert kernels.works(Q.Q4_K, torch.float32, DEVICE) and kernels.works(Q.Q6_K, torch.float32, DEVICE)
    calls = []
    real = kernels.fused_linear
    monkeypatch.setattr(kernels, "fused_linear", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    monkeypatch.setattr(gguf_ops.WeightSlots, "get", _no_dequantize(gguf_ops.WeightSlots.get))
    g = torch.Generator().manual_seed(3)
    one, values = _layer(Q.Q4_K, 256, 40, g, bias=True)
    x = torch.randn(2, 256, generator=g).to(DEVICE)
    want = F.linear(x.cpu().double(), values.double(), one.stored("bias").cpu().double())
    assert ((one(x).cpu().double() - want).norm() / want.norm()).item() < 1e-6
    parts = [_layer(Q.Q6_K, 256, n, g) for n in (24, 8, 8)]
    fused = gguf_ops.Fused([p for p, _ in parts])
    ys = fused(x)
    for y, (_, v) in zip(ys, parts):
        want = F.linear(x.cpu().double(), v.double())
        assert ((y.cpu().double() - want).norm() / want.norm()).item() < 1e-6
    stored = [p.stored("weight") for p, _ in parts]
    assert gguf_ops.adjacent(stored)  # restacked once: the parts are views of one block stack
    assert calls == [Q.Q4_K, Q.Q6_K]


def _no_dequantize(get):
    def guarded(self, name, dtype, device=None, **kw):
        qtype = self.qtype(name)
        assert name != "weight" or qtype is None, f"{type(self).__name__}.{name} ({qtype.name}) was dequantized"
        return get(self, name, dtype, device, **kw)
    return guarded


def test_kept_copies_and_reference_numerics_bypass_the_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "fused_linear", lambda *a, **kw: pytest.fail("kernel used"))
    g = torch.Generator().manual_seed(4)
    layer, values = _layer(Q.Q8_0, 64, 16, g)
    x = torch.randn(2, 64, generator=g).to(DEVICE)
    want = F.linear(x, values.to(DEVICE))  # on the same device: the same library's product
    layer.fused_kernels = False  # reference numerics
    assert torch.equal(layer(x), want)
    layer.fused_kernels = True
    weight_copies.cache_dequantized(layer, torch.float32)
    assert torch.equal(layer(x), want)


def test_availability():
    kernels.configure("off")
    assert not kernels.available("cuda") and not kernels.available("cpu")
    kernels.configure("triton")
    assert not kernels.available("mps")
    assert kernels.available(DEVICE.type)
    with pytest.raises(ValueError, match="kernel mode 'fast'"):
        kernels.configure("fast")


def test_ar_stage_on_the_kernels_keeps_no_float_copies(tiny, one_thread, monkeypatch):
    """The tiny model with Q8_0 LM and depth: the AR stage on the kernels gives the codes of the torch
    path (dequantize, then multiply: the CPU int4 product, which rounds to bfloat16, is off), hiddens
    within float rounding, and keeps no dequantized copy. With CUDA the models run there."""
    from mm3.plan.ar import PlanSettings, plan
    from mm3.backends.cpu import int4 as cpu_int4
    from mm3.files.opener import open_component
    from mm3.models.depth import RVQDepthDecoder
    from mm3.models.lm import Qwen3LM, set_numerics
    from mm3.plan.prompt import build_prompt
    from mm3.tokenizer import MM3Tokenizer
    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    try:
        lm, depth = Qwen3LM.load(_Requantized(lm_c)), RVQDepthDecoder.load(_Requantized(d_c))
        prompt = build_prompt(MM3Tokenizer.from_component(lm_c), "warm synth pop", "[verse]\nhello")
        settings = PlanSettings(duration=0.2, lm_seed=5)
        kernels.configure("off")
        lm.to(DEVICE)
        depth.to(DEVICE)
        monkeypatch.setattr(cpu_int4, "serves", lambda *a: False)
        want = plan(lm, depth, prompt, settings, weight_budget=0, graphs=False)[0]
        kernels.configure("triton")
        for model in (lm, depth):  # the layers choose their products again (mm3.backends.products)
            set_numerics(model, "fast")
        assert kernels.works(Q.Q8_0, torch.float32, DEVICE)
        kept = []
        monkeypatch.setattr("mm3.plan.ar.cache_dequantized", lambda *a, **kw: kept.append(a) or 0)
        calls = []
        real = kernels.fused_linear
        monkeypatch.setattr(kernels, "fused_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        got = plan(lm, depth, prompt, settings, graphs=False)[0]  # default budget: none where the kernels run
    finally:
        lm_c.close()
        d_c.close()
    assert calls and not kept
    assert torch.equal(got.codes, want.codes)
    err = ((got.frame_hiddens - want.frame_hiddens).norm() / want.frame_hiddens.norm()).item()
    assert err < 1e-5


class _Requantized:
    """An opened component whose float matrices are served as Q8_0 blocks (vectors stay float)."""

    def __init__(self, component):
        from mm3.formats.gguf.encode import quantize
        from mm3.formats.gguf.reader import CompressedTensor

        self._component = component
        self.tensors = {}
        for name, t in component.tensors.items():
            if len(t.shape) == 2 and t.shape[-1] % 32 == 0:
                values = dequantize(t.raw, t.qtype, t.shape).numpy()
                blocks = torch.from_numpy(quantize(values, Q.Q8_0).copy()).reshape(-1)
                t = CompressedTensor(name, Q.Q8_0, tuple(t.shape), blocks)
            self.tensors[name] = t

    def __getattr__(self, name):
        return getattr(self._component, name)


_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from mm3.backends.gpu import kernels, triton_gguf
arch = int(sys.argv[1])
base = {"b_ptr": "*fp32", "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "x_stride": "i32",
        "y_stride": "i32", "w_stride": "i32"}
for qtype, code in kernels.CODES.items():
    floats = qtype.name in ("F32", "F16", "BF16")
    if floats and qtype.name != "BF16":
        continue
    # float32 compute (IEEE dot) with the decode tiles, bfloat16 compute (tensor cores) with the wide ones
    for x_type, rows in (("fp32", 2), ("bf16", 256)):
        bm, bn, bk = kernels._tiles(rows)
        signature = {"x_ptr": "*" + x_type, "w_ptr": "*bf16" if floats else "*u8", **base, "y_ptr": "*" + x_type}
        signature.update(dict.fromkeys(("QTYPE", "HAS_BIAS", "BLOCK_M", "BLOCK_N", "BLOCK_K"), "constexpr"))
        source = ASTSource(fn=triton_gguf.fused_linear_kernel, signature=signature,
                           constexprs={"QTYPE": code, "HAS_BIAS": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk})
        binary = compile(source, target=GPUTarget("cuda", arch, 32)).asm.get("cubin")
        print(f"{qtype.name}/{x_type}", len(binary or b""))
"""


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_cuda(arch):
    """Every type's kernel compiles to a CUDA binary (no GPU needed: Triton ships its compilers).
    In a fresh process: under the interpreter the kernel is not a JIT function."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(arch)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = dict(line.split() for line in done.stdout.splitlines())
    names = {f"{t}/{x}" for t in [q.name for q in QUANTS] + ["BF16"] for x in ("fp32", "bf16")}
    assert set(sizes) == names and all(int(v) > 0 for v in sizes.values()), sizes


def test_a_kernel_that_fails_leaves_torch_products(monkeypatch):
    """A kernel that cannot build, or computes wrongly, on this device is checked once and left out."""
    monkeypatch.setattr(kernels, "_WORKS", {})
    assert kernels.works(Q.Q8_0, torch.float32, DEVICE)

    def broken(*a, **kw):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(kernels, "fused_linear", broken)
    with pytest.warns(UserWarning, match="fused Q4_K kernel cannot run"):
        assert not kernels.works(Q.Q4_K, torch.float32, DEVICE)
    monkeypatch.setattr(kernels, "fused_linear", lambda x, w, q, b=None: torch.zeros(x.shape[0], w.shape[0]))
    with pytest.warns(UserWarning, match="fused Q6_K kernel computes wrongly"):
        assert not kernels.works(Q.Q6_K, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(8)
    layer, values = _layer(Q.Q6_K, 256, 16, g)
    x = torch.randn(2, 256, generator=g).to(DEVICE)
    torch.testing.assert_close(layer(x).cpu(), F.linear(x.cpu(), values), rtol=1e-5, atol=1e-5)
