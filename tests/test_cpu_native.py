"""The integer kernel built on the machine (`mm3.gguf.cpu_native`): its products for every type it
reads (8-bit values, 4-bit values, with and without offsets) against gguf-py's dequantization, its packing, the layers and forms that use it, its build cache, and what happens
where it cannot be built (no compiler, switched off, a wrong product): torch's kernels serve."""

import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mm3.bench.random_models import random_tensor
from mm3.gguf import cpu_forms, cpu_int4, cpu_native, products
from mm3.gguf import ops as gguf_ops
from mm3.gguf.cpu_forms import FORMS, Serving

Q = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(not cpu_native.available(),
                                  reason="the native integer kernel cannot be built here (no C compiler, or not x86-64)")


def _raw(n, k, seed, qtype=Q.Q8_0):
    """Random blocks of `qtype` [n, row bytes] and their values by gguf-py's own dequantization."""
    raw = random_tensor("w", (n, k), qtype, torch.Generator().manual_seed(seed))
    values = gguf.quants.dequantize(np.asarray(raw), qtype).reshape(n, k)
    return torch.from_numpy(raw), torch.from_numpy(values.astype(np.float64))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def rebuilt(monkeypatch):
    """The kernel library looked up afresh in this test (and again after it)."""
    monkeypatch.setattr(cpu_native, "_LIBRARY", [])
    yield
    cpu_native._LIBRARY.clear()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(16, 256), (40, 512), (100, 1024), (1040, 256)])
@pytest.mark.parametrize("qtype", list(cpu_native.TYPES), ids=lambda t: t.name)
def test_products_match_the_dequantized_weight(qtype, n, k, rows):
    """float32 products up to the int16 rounding of the inputs (about 1e-5; 15 bits for 4-bit values
    with VNNI), whole tiles or not."""
    raw, values = _raw(n, k, n + k + rows, qtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    bias = torch.randn(n)
    packed = cpu_native.repack(raw, qtype, n, k)
    assert packed.layout == cpu_native.TYPES[qtype]
    y = cpu_native.linear(x, packed, n, bias)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert _rel(y, x.double() @ values.T + bias.double()) < (1e-4 if packed.layout.bits == 4 else 5e-5)


@needs_kernel
def test_zero_and_huge_inputs_round_without_overflow():
    raw, values = _raw(32, 256, 1)
    packed = cpu_native.repack(raw, Q.Q8_0, 32, 256)
    assert torch.equal(cpu_native.linear(torch.zeros(2, 256), packed, 32), torch.zeros(2, 32))
    x = torch.full((1, 256), 3e4)
    x[0, ::2] = -3e4
    assert _rel(cpu_native.linear(x, packed, 32), x.double() @ values.T) < 5e-5


@needs_kernel
def test_a_nan_or_infinite_input_gives_nan_outputs_in_its_row():
    """As a float product's would be: a diverging run is caught downstream, not rounded away."""
    raw, values = _raw(32, 256, 1)
    packed = cpu_native.repack(raw, Q.Q8_0, 32, 256)
    x = torch.randn(3, 256)
    x[0, 5], x[2, 200] = float("nan"), float("-inf")
    y = cpu_native.linear(x, packed, 32)
    assert y[0].isnan().all() and y[2].isnan().all()
    assert _rel(y[1], x[1].double() @ values.T) < 5e-5


@needs_kernel
def test_a_group_too_small_for_its_scale_counts_as_zero():
    raw, values = _raw(32, 256, 1)
    x = torch.randn(1, 256)
    x[0, 32:64] = 1e-36  # its scale would be subnormal: the group is taken as zero, nothing undefined
    y = cpu_native.linear(x, cpu_native.repack(raw, Q.Q8_0, 32, 256), 32)
    assert y.isfinite().all() and _rel(y, x.double() @ values.T) < 5e-5


@needs_kernel
def test_an_input_that_does_not_fit_the_packing_is_refused_before_the_kernel_reads_it():
    raw, _ = _raw(32, 256, 1)
    packed = cpu_native.repack(raw, Q.Q8_0, 32, 256)
    with pytest.raises(ValueError, match=r"a \[2, 512\] input does not fit a packing of 256 columns"):
        cpu_native.product(torch.randn(2, 512), packed)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.product(torch.randn(2, 256), packed._replace(weight=packed.weight[:, :-4]))
    y = cpu_native.product(torch.randn(256, 2).T, packed)  # not contiguous: copied first
    assert y.shape == (2, 32)


@needs_kernel
def test_without_openmp_a_one_thread_build_serves(monkeypatch, tmp_path, rebuilt):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    real = cpu_native.build
    monkeypatch.setattr(cpu_native, "build", lambda openmp=True: None if openmp else real(openmp=False))
    assert cpu_native.available()
    assert len(list((tmp_path / "native").glob("*.so"))) == 1


@needs_kernel
def test_other_dtypes_and_shapes_come_back_as_given():
    raw, values = _raw(48, 128, 2)
    packed = cpu_native.repack(raw, Q.Q8_0, 48, 128)
    x = torch.randn(2, 1, 128, dtype=torch.bfloat16)
    y = cpu_native.linear(x, packed, 48)
    assert y.shape == (2, 1, 48) and y.dtype == torch.bfloat16
    assert _rel(y, x.double() @ values.T) < 1e-2


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


VARIANTS = [  # (-march and more, what the processor must have, the vector bits the build reports)
    (("-march=x86-64-v4",), {"avx512bw"}, 512),  # AVX-512 without VNNI: multiply-add, then add
    (("-march=x86-64-v4", "-mavx512vnni"), {"avx512bw", "avx512_vnni"}, 512),
    (("-march=x86-64-v3",), {"avx2", "fma", "f16c"}, 256),
    (("-march=x86-64-v3", "-mno-f16c"), {"avx2", "fma"}, 256),  # float16 scales converted one by one
    (("-march=x86-64-v3", "-mavxvnni"), {"avx2", "fma", "f16c", "avx_vnni"}, 256),
    (("-march=x86-64",), set(), 0),  # plain C
]


@needs_kernel
@pytest.mark.parametrize("march,needs,bits", VARIANTS, ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_every_code_path_of_the_source_multiplies_right(march, needs, bits, monkeypatch, tmp_path):
    """Each vector width the C file has (whichever `-march=native` picks on another processor),
    built on its own and run here where the processor can."""
    if not needs <= _cpu_flags():
        pytest.skip(f"this processor lacks {', '.join(sorted(needs - _cpu_flags()))}")
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    path = cpu_native.build(("-O3", *march, "-shared", "-fPIC", "-std=c11"))
    assert path is not None
    lib = cpu_native.load(path)
    assert lib.mm3_integer_vector_bits() == bits
    for qtype, n, k, rows in ((Q.Q8_0, 40, 96, 3), (Q.Q6_K, 272, 512, 2), (Q.Q8_0, 16, 32, 1), (Q.Q4_K, 48, 256, 3),
                              (Q.Q5_K, 32, 512, 2), (Q.Q4_0, 16, 64, 1)):
        raw, values = _raw(n, k, n + rows, qtype)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).contiguous()
        for scales in ("f32", "super" if qtype in cpu_native.SUPER_TYPES else "f16"):
            packed = cpu_native.repack(raw, qtype, n, k, quads=cpu_native.nibble_quads(lib), scales=scales)
            y = cpu_native.product(x, packed, lib)[:, :n]
            assert _rel(y, x.double() @ values.T) < 1e-4, scales


BITS_A_VALUE = {Q.Q8_0: 8.5, Q.Q5_0: 8.5, Q.Q5_1: 9, Q.Q4_0: 5, Q.Q4_1: 5,  # float16 scales (and offsets)
                Q.Q4_K: 4.625, Q.Q5_K: 8.625, Q.Q6_K: 8.5625}  # a float16 per 256 values, an int8 per group


@pytest.mark.parametrize("qtype", list(cpu_native.TYPES), ids=lambda t: t.name)
def test_repacking_in_row_chunks_is_the_whole_packing(qtype, monkeypatch):
    raw, _ = _raw(200, 512, 3, qtype)
    whole = cpu_native.repack(raw, qtype, 200, 512)
    assert whole.scales == ("super" if qtype in cpu_native.SUPER_TYPES else "f16")
    assert whole.weight.shape == (13, 16 * 512 * BITS_A_VALUE[qtype] / 8)
    assert whole.weight.shape[1] == cpu_native.tile_bytes(512, whole.layout, whole.scales)
    assert whole.nbytes() == whole.weight.numel()
    monkeypatch.setattr(cpu_native, "REPACK_ROWS", 48)
    assert torch.equal(cpu_native.repack(raw, qtype, 200, 512).weight, whole.weight)


@needs_kernel
@pytest.mark.parametrize("qtype", list(cpu_native.TYPES), ids=lambda t: t.name)
def test_every_form_of_the_scales_gives_the_same_products(qtype):
    """The smaller forms hold the same scales exactly: the products are equal bit for bit."""
    raw, _ = _raw(72, 512, 7, qtype)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    wide = cpu_native.product(x, cpu_native.repack(raw, qtype, 72, 512, scales="f32"))
    small = cpu_native.repack(raw, qtype, 72, 512)
    assert small.nbytes() < cpu_native.repack(raw, qtype, 72, 512, scales="f32").nbytes()
    assert torch.equal(cpu_native.product(x, small), wide)


@needs_kernel
def test_scales_that_are_no_float16_are_kept_in_float32():
    """A Q4_0 block's offset is 8 d: beyond float16 where d is above 8188."""
    raw, _ = _raw(32, 256, 8, Q.Q4_0)
    raw = raw.clone()
    raw.view(32, -1, 18)[5, 2, :2] = torch.tensor([10000.0], dtype=torch.float16).view(torch.uint8)
    values = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q.Q4_0).reshape(32, 256).astype(np.float64))
    packed = cpu_native.repack(raw, Q.Q4_0, 32, 256)
    assert packed.scales == "f32"
    x = torch.randn(2, 256)
    assert _rel(cpu_native.linear(x, packed, 32), x.double() @ values.T) < 3e-4  # one row of 1e5 dominates
    with pytest.raises(ValueError, match="not all float16 values"):
        cpu_native.repack(raw, Q.Q4_0, 32, 256, scales="f16")
    with pytest.raises(ValueError, match="cannot be held as 'super'"):
        cpu_native.repack(raw, Q.Q4_0, 32, 256, scales="super")


def test_other_types_are_refused():
    with pytest.raises(ValueError, match="reads Q8_0, .*Q4_K, not Q2_K"):
        cpu_native.repack(torch.zeros(16, 84, dtype=torch.uint8), Q.Q2_K, 16, 256)


def _layer(qtype, n, k, seed):
    layer = gguf_ops.Linear(k, n, bias=False)
    raw = torch.from_numpy(random_tensor("w", (n, k), qtype, torch.Generator().manual_seed(seed)))
    layer.set_stored("weight", qtype, raw)
    layer.decode_products = layer.fused_kernels = True
    layer.cpu_form = Serving(FORMS["native"], "depth")
    return layer


@needs_kernel
def test_a_native_layer_packs_once_for_few_rows_and_dequantizes_for_many(monkeypatch):
    calls = []
    real = cpu_native.Bound.__call__
    monkeypatch.setattr(cpu_native.Bound, "__call__", lambda self, *a, **kw: calls.append(self.out_features) or
                        real(self, *a, **kw))
    layer = _layer(Q.Q8_0, 48, 256, 4)
    values = layer.get("weight", torch.float32, torch.device("cpu"))
    wide = torch.randn(40, 256)
    torch.testing.assert_close(layer(wide), F.linear(wide, values), rtol=1e-5, atol=1e-5)
    assert not layer._packing and calls == []  # many rows: nothing packed
    x = torch.randn(2, 256)
    assert _rel(layer(x), F.linear(x.double(), values.double())) < 5e-5
    first = layer._packing["native"]
    layer(x)
    assert layer._packing["native"] is first and list(layer._packing) == ["native"] and calls == [48, 48]


@needs_kernel
def test_a_fused_layer_stacks_its_parts_for_the_kernel():
    parts = [_layer(Q.Q8_0, n, 256, 5 + n) for n in (64, 32, 32)]
    fused = gguf_ops.Fused(parts)
    x = torch.randn(2, 256)
    product = products.for_fused(fused, torch.float32, torch.device("cpu"))
    assert product.decode.product.kernel == "native"
    for y, p in zip(fused(x), parts):
        assert _rel(y, F.linear(x.double(), p.get("weight", torch.float64, torch.device("cpu")))) < 5e-5
    assert fused._packing["native"][1].weight.shape[0] == 8


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q3_K, Q.F16], ids=lambda t: t.name)
def test_under_the_native_form_each_type_takes_what_reads_it(qtype):
    """The native kernel where it reads the type, else the int4 planes where they do (where the
    kernel cannot be built), else a float copy."""
    cpu = torch.device("cpu")
    layer = _layer(qtype, 32, 256, 6)
    want = "native" if qtype in cpu_native.TYPES and cpu_native.available() else \
        "int4" if qtype in cpu_int4.TYPES and cpu_int4.available() else None
    assert cpu_forms.packed_kernel(layer, qtype, cpu) == want
    assert cpu_forms.wants_copy(layer, qtype, cpu) == (want is None)


@needs_kernel
def test_dropping_packings_keeps_the_one_that_serves():
    layer = _layer(Q.Q8_0, 32, 256, 9)
    layer.packing("int4")
    layer.packing("native")
    layer.drop_packing(keep="native")
    assert list(layer._packing) == ["native"]
    layer.drop_packing()
    assert not layer._packing


@needs_kernel
def test_a_compiled_function_traces_the_kernel_as_one_op():
    layer = _layer(Q.Q8_0, 48, 256, 10)
    x = torch.randn(2, 256)
    eager = layer(x)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda t: layer(t) * 2, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), eager * 2, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()


@needs_kernel
def test_the_build_is_cached_per_source_compiler_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    runs = []
    real = cpu_native._run
    monkeypatch.setattr(cpu_native, "_run", lambda cmd: runs.append(cmd) or real(cmd))
    first = cpu_native.build()
    assert first is not None and first.parent == tmp_path / "native" and len(runs) == 2  # --version, the build
    assert cpu_native.build() == first and len(runs) == 3  # found: only --version
    monkeypatch.setattr(cpu_native, "_machine", lambda: "Another Processor 9000")
    other = cpu_native.build()
    assert other != first and other.is_file() and len(runs) == 5


def test_without_a_compiler_torchs_kernels_serve(monkeypatch, tmp_path, rebuilt, caplog):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.INFO, logger="mm3.gguf.cpu_native"):
        assert not cpu_native.available() and cpu_native.vector_bits() == -1
    assert "torch's kernels alone" in caplog.text
    q8 = _layer(Q.Q8_0, 32, 256, 11)
    assert cpu_forms.packed_kernel(q8, Q.Q8_0, torch.device("cpu")) == ("int4" if cpu_int4.available() else None)
    assert not list((tmp_path / "native").glob("*.so")) if (tmp_path / "native").exists() else True


def test_the_switch_keeps_it_from_being_built(monkeypatch, rebuilt):
    monkeypatch.setenv("MM3_CPU_NATIVE", "off")
    monkeypatch.setattr(cpu_native, "build", lambda: pytest.fail("built although switched off"))
    assert not cpu_native.available()


@needs_kernel
def test_a_kernel_that_multiplies_wrong_is_not_used(monkeypatch, rebuilt, caplog):
    monkeypatch.setattr(cpu_native, "product",
                        lambda x2, packed, lib=None: torch.zeros(x2.shape[0], packed.weight.shape[0] * 16))
    with caplog.at_level(logging.WARNING, logger="mm3.gguf.cpu_native"):
        assert not cpu_native.available()
    assert "computes wrong products" in caplog.text


@needs_kernel
def test_the_kernels_rms_norm_is_torchs_up_to_rounding():
    """Rows contiguous or the heads of a wider row (q and k of the fused q/k/v product), one row a
    position or many; a layout it does not read is left to torch (None)."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 5, 1536, generator=g) * 7
    w = torch.randn(128, generator=g)
    cases = [torch.randn(2, 1, 1024, generator=g), torch.randn(2, 173, 1000, generator=g),
             wide[:, :, :1024].view(3, 5, 8, 128), wide[:1, :, 256:512].view(1, 5, 2, 128),
             wide[:, :1, 1024:].reshape(3, 1, 512)[:, :, :256].view(3, 1, 2, 128)]
    for x in cases:
        weight = torch.randn(x.shape[-1], generator=g)
        want = F.rms_norm(x, (x.shape[-1],), weight, 1e-6)
        got = cpu_native.rms_norm(x, weight, 1e-6)
        assert got.shape == x.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert cpu_native.rms_norm(wide.transpose(0, 1)[..., :1024].reshape(5, 3, 8, 128)[:, :, ::2], w, 1e-6) is None
    assert cpu_native.rms_norm(torch.randn(2, 128, dtype=torch.bfloat16), w, 1e-6) is None



@needs_kernel
@pytest.mark.parametrize("qtype", cpu_native.ROW_TYPES, ids=lambda t: t.name)
def test_an_embedding_lookup_is_gguf_pys_dequantization_bit_for_bit(qtype):
    n, k = 60, 512
    raw = torch.from_numpy(random_tensor("w", (n, k), qtype, torch.Generator().manual_seed(3))).reshape(n, -1)
    values = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).reshape(n, k))
    ids = torch.tensor([[59, 0, 17], [17, 3, 41]])
    assert torch.equal(cpu_native.lookup(raw, qtype, ids, k), values[ids.reshape(-1)])
    layer = gguf_ops.Embedding(n, k)
    layer.set_stored("weight", qtype, raw)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(layer.lookup(ids, dtype), values[ids].to(dtype))
    with pytest.raises(IndexError, match="outside the table's 60 rows"):
        layer.lookup(torch.tensor([60]), torch.float32)


def test_an_embedding_of_a_type_the_library_does_not_read_is_dequantized_by_torch():
    n, k = 20, 256
    raw = torch.from_numpy(random_tensor("w", (n, k), Q.Q3_K, torch.Generator().manual_seed(4))).reshape(n, -1)
    assert cpu_native.lookup(raw, Q.Q3_K, torch.tensor([1]), k) is None
    layer = gguf_ops.Embedding(n, k)
    layer.set_stored("weight", Q.Q3_K, raw)
    values = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q.Q3_K).reshape(n, k))
    ids = torch.tensor([[2, 19]])
    assert torch.equal(layer.lookup(ids, torch.float32), values[ids])


def test_the_library_is_not_loaded_for_what_it_cannot_serve(monkeypatch):
    """A norm or lookup on another device, or traced by torch.compile, is torch's: the library is
    neither built nor loaded for it (its lock would break a compiled graph)."""
    monkeypatch.setattr(cpu_native, "_LIBRARY", [])
    monkeypatch.setattr(cpu_native, "library", lambda: pytest.fail("the library was looked up"))
    x, w = torch.empty(2, 1, 64, device="meta"), torch.empty(64, device="meta")
    assert cpu_native.rms_norm(x, w, 1e-6) is None
    assert cpu_native.lookup(torch.empty(4, 34, dtype=torch.uint8, device="meta"), Q.Q8_0, torch.tensor([1]), 32) is None
    assert cpu_native.lookup(torch.zeros(4, 34, dtype=torch.uint8), Q.Q8_0, torch.tensor([1.0]), 32) is None
    assert cpu_native.attend(x, x, x, torch.empty(2, 1, 4, 64, device="meta"), torch.empty(2, 1, 4, 64, device="meta"),
                             0, 0.125) is None

    from mm3.models.lm import rms_norm

    torch._dynamo.reset()
    try:
        cpu = torch.randn(2, 1, 64), torch.randn(64)
        compiled = torch.compile(lambda a, b: rms_norm(a, b, 1e-6, True), backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(*cpu), F.rms_norm(cpu[0], (64,), cpu[1], 1e-6))
    finally:
        torch._dynamo.reset()


def _attention_reference(q, k, v, cache_k, cache_v, at):
    """torch's: the new keys and values written into copies of the caches, then SDPA with each new
    position seeing the cached ones and itself (query head h reads key head h // group)."""
    b, s, width = q.shape
    kv_heads, d = cache_k.shape[1], cache_k.shape[3]
    keys, values = cache_k.clone(), cache_v.clone()
    keys[:, :, at:at + s] = k.reshape(b, s, kv_heads, d).transpose(1, 2)
    values[:, :, at:at + s] = v.reshape(b, s, kv_heads, d).transpose(1, 2)
    mask = torch.arange(at + s)[None] <= torch.arange(at, at + s)[:, None]
    out = F.scaled_dot_product_attention(q.reshape(b, s, -1, d).transpose(1, 2), keys[:, :, :at + s],
                                         values[:, :, :at + s], attn_mask=mask, enable_gqa=width // d != kv_heads)
    return out.transpose(1, 2).reshape(b, s, width), keys, values


@needs_kernel
@pytest.mark.parametrize("b,s,heads,kv_heads,d,capacity,at", [(2, 1, 4, 4, 256, 16, 0), (2, 1, 4, 4, 256, 16, 7),
                                                              (2, 2, 4, 4, 256, 16, 0), (3, 3, 8, 2, 40, 12, 5),
                                                              (1, 1, 8, 2, 64, 300, 299)])
def test_the_kernels_attention_is_torchs_up_to_rounding(b, s, heads, kv_heads, d, capacity, at):
    """The new positions' keys and values land in the caches exactly; each new position attends
    over the cached ones and itself (the fused q/k/v product's output views, as the depth decoder
    has them)."""
    g = torch.Generator().manual_seed(at)
    fused = torch.randn(b, s, (heads + 2 * kv_heads) * d, generator=g)
    q, k, v = fused.split_with_sizes([heads * d, kv_heads * d, kv_heads * d], -1)
    cache_k, cache_v = (torch.randn(b, kv_heads, capacity, d, generator=g) for _ in range(2))
    want, keys, values = _attention_reference(q, k, v, cache_k, cache_v, at)
    got = cpu_native.attend(q, k, v, cache_k, cache_v, at, d ** -0.5)
    assert torch.equal(cache_k, keys) and torch.equal(cache_v, values)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_attention_the_kernel_cannot_take_is_left_to_torch():
    q = k = v = torch.randn(2, 1, 64)
    cache = torch.zeros(2, 1, 8, 64)
    assert cpu_native.attend(q, k, v, cache, cache.clone(), 8, 0.125) is None  # past the cache's end
    assert cpu_native.attend(q.double(), k.double(), v.double(), cache.double(), cache.double(), 0, 0.125) is None
    assert cpu_native.attend(q, k, v, cache.transpose(2, 3), cache.clone(), 0, 0.125) is None  # not contiguous
    assert cpu_native.attend(q, k, v, torch.zeros(3, 1, 8, 64), torch.zeros(3, 1, 8, 64), 0, 0.125) is None  # rows
    wide = torch.randn(2, 1, 128)
    assert cpu_native.attend(q, wide[..., :64], wide[..., 64:], cache, cache.clone(), 0, 0.125) is None  # strides
    assert torch.equal(cache, torch.zeros(2, 1, 8, 64))  # nothing written


@needs_kernel
def test_the_depth_decoders_fast_attention_matches_its_reference_step_by_step(monkeypatch):
    from mm3.models.depth import DepthAttention, DepthCache

    served = []
    real = cpu_native.attend
    monkeypatch.setattr(cpu_native, "attend", lambda *a: served.append(real(*a)) or served[-1])
    torch.manual_seed(0)
    ops = gguf_ops
    attention = DepthAttention(64, 4, ops)
    for layer in (attention.to_q, attention.to_k, attention.to_v, attention.to_out):
        layer.set_stored("weight", Q.F32, torch.randn(64, 64) / 8)
    caches = [DepthCache(2, 2, 4, 8, 16, torch.float32, torch.device("cpu")) for _ in range(2)]
    for s in (2, 1, 1, 1):
        x = torch.randn(2, s, 64)
        outs = []
        for fast, cache in zip((False, True), caches):
            attention.fast_numerics = fast
            outs.append(attention(x, cache, 1))
            cache.length += s
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert len(served) == 4 and all(out is not None for out in served)  # each fast step was the library's


@needs_kernel
@pytest.mark.parametrize("qtype,n", [(Q.Q8_0, 48), (Q.Q4_K, 40)], ids=["Q8_0", "Q4_K rows padded"])
def test_a_bound_product_is_linear_for_every_input(qtype, n):
    """The packing checked once (`Bound`), what each call reads checked then: the same outputs as
    `linear` for contiguous float32 rows, others, other dtypes and a bias."""
    raw, _ = _raw(n, 256, 9, qtype)
    packed = cpu_native.repack(raw, qtype, n, 256)
    bound = cpu_native.bind(packed, n)
    bias = torch.randn(n)
    for x in (torch.randn(2, 1, 256), torch.randn(256, 3).T, torch.randn(1, 256, dtype=torch.bfloat16),
              torch.randn(0, 256)):
        for b in (None, bias):
            want = cpu_native.linear(x, packed, n, b)
            got = bound(x, b)
            assert got.shape == want.shape == (*x.shape[:-1], n) and got.dtype == want.dtype
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"a \[\.\., 512\] input does not fit a packing of 256 columns"):
        bound(torch.randn(2, 512))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.bind(packed._replace(weight=packed.weight[:, :-4].contiguous()), n)


@needs_kernel
@pytest.mark.parametrize("qtype", list(cpu_native.LIBRARY_REPACKS), ids=lambda t: t.name)
def test_the_librarys_repacking_is_the_tensor_operations_byte_for_byte(qtype, monkeypatch):
    """For whole and partial tiles, both 4-bit layouts and several widths; the tensor operations
    (`_values`, `_tile`) stay the reference and serve every other type and form."""
    for n, k in ((40, 256), (16, 512), (1043, 768)):
        raw, _ = _raw(n, k, n + k, qtype)
        for quads in (False, True):
            fast = cpu_native.repack(raw, qtype, n, k, quads=quads)
            with monkeypatch.context() as m:
                m.setattr(cpu_native, "LIBRARY_REPACKS", {})
                slow = cpu_native.repack(raw, qtype, n, k, quads=quads)
            assert fast._replace(weight=None) == slow._replace(weight=None)
            assert torch.equal(fast.weight, slow.weight), (n, k, quads)
    with pytest.raises(ValueError, match="do not hold 512 values"):
        cpu_native.repack(raw[:, :-1], qtype, n, 512)


@needs_kernel
def test_the_library_leaves_the_forms_it_does_not_make_to_the_tensor_operations(monkeypatch):
    calls = []
    real_tile = cpu_native._tile
    monkeypatch.setattr(cpu_native, "_tile", lambda *a, **kw: calls.append(a[2]) or real_tile(*a, **kw))
    raw, _ = _raw(32, 256, 3, Q.Q4_K)
    cpu_native.repack(raw, Q.Q4_K, 32, 256)
    assert calls == []  # the library's
    cpu_native.repack(raw, Q.Q4_K, 32, 256, scales="f32")
    raw1, _ = _raw(32, 256, 3, Q.Q4_1)
    cpu_native.repack(raw1, Q.Q4_1, 32, 256)
    assert calls == [4, 4]  # float32 scales, and a type it does not make


def _semantic_draw(logits, r, cfg, k, q, excluded):
    """FrameSampler's semantic draw by torch's operations (no shaping)."""
    from mm3.sampling import draw, guide, kth_largest, top_k_probs

    c, u = (logits[0::2], logits[1::2]) if r == 2 else (logits, logits)
    if excluded is not None:
        c, u = c.masked_fill(excluded, -float("inf")), u.masked_fill(excluded, -float("inf"))
    guided = (guide(c, u, cfg) if r == 2 else c).masked_fill(c < kth_largest(c, k), -float("inf"))
    if excluded is not None:
        guided = guided.masked_fill(excluded, -float("inf"))
    return draw(top_k_probs(guided, k), q)


@needs_kernel
@pytest.mark.parametrize("gate", [False, True], ids=["acoustic", "semantic"])
def test_the_librarys_draws_are_torchs(gate):
    """Guided or not, one song or several, top-k below or above the width, many ties (rounded
    logits), infinite and NaN logits, excluded columns: the same index as torch's operations."""
    from mm3.sampling import draw, exponential_draws, guide, top_k_probs

    g = torch.Generator().manual_seed(int(gate))
    for trial in range(400):
        songs, r = 1 + trial % 3, 1 + (trial // 3) % 2
        n, k = (1024, 300, 7, 50)[trial % 4], (50, 1, 5, 2000)[(trial // 7) % 4]
        logits = torch.randn(songs * r, n, generator=g) * (1, 5, 30)[trial % 3]
        if trial % 11 == 0:
            logits = logits.round()
        if trial % 13 == 0:
            logits[0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0 if gate else float("nan")])
        excluded = None if not gate or trial % 4 == 0 else torch.rand(n, generator=g) < 0.3
        q = torch.cat([exponential_draws(n, g) for _ in range(songs)])
        if gate:
            want = _semantic_draw(logits, r, 1.7, k, q, excluded)
        else:
            want = draw(top_k_probs(guide(logits[0::2], logits[1::2], 1.7) if r == 2 else logits, k), q)
        got = cpu_native.top_k_draw(logits, r, 1.7, k, q, excluded, gate)
        assert torch.equal(got, want), trial


@needs_kernel
def test_draws_the_library_does_not_take_are_left_to_torch():
    logits, q = torch.randn(4, 64), torch.rand(2, 64) + 0.1
    assert cpu_native.top_k_draw(logits.double(), 2, 1.5, 5, q) is None
    assert cpu_native.top_k_draw(logits.T.contiguous().T, 2, 1.5, 5, q) is None  # rows not contiguous
    assert cpu_native.top_k_draw(logits, 2, 1.5, 5, torch.rand(3, 64)) is None  # draws of other songs
    assert cpu_native.top_k_draw(logits, 3, 1.5, 5, q) is None
    assert cpu_native.top_k_draw(logits, 2, 1.5, 5, q, torch.zeros(63, dtype=torch.bool)) is None
    nan = logits.clone()
    nan[0, 3] = float("nan")
    assert cpu_native.top_k_draw(nan, 2, 1.5, 5, q, gate=True) is None  # torch's order of NaNs is its own


@needs_kernel
def test_the_lms_decode_step_matches_its_torch_path_step_by_step(monkeypatch):
    """A prefill, then decode steps through the kernel library's one call (norms, rotation, cache
    write) and torch's attention, against the same layer's torch operations; the caches agree too."""
    from mm3.models.lm import KVCache, Qwen3Attention

    served = []
    real = cpu_native.decode_prepare
    monkeypatch.setattr(cpu_native, "decode_prepare", lambda *a: served.append(real(*a)) or served[-1])
    torch.manual_seed(0)
    cfg = {"hidden_size": 64, "head_dim": 16, "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-6}
    attention = Qwen3Attention(cfg, gguf_ops)
    for layer in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
        layer.set_stored("weight", Q.F32, torch.randn(layer.out_features, layer.in_features) / 8)
    for norm in (attention.q_norm, attention.k_norm):
        norm.set_stored("weight", Q.F32, torch.rand(16) + 0.5)
    caches = [KVCache.empty(2, 3, 2, 12, 16, torch.float32, torch.device("cpu")) for _ in range(2)]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    for s in (4, 1, 1, 1):
        x = torch.randn(3, s, 64)
        angles = (caches[0].length + torch.arange(s))[:, None].float() * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        outs = []
        for fast, cache in zip((False, True), caches):
            attention.fast_numerics = fast
            outs.append(attention(x, cos, sin, cache, 1))
            cache.advance(s)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-6)
        assert torch.equal(caches[1].v, caches[0].v)
    assert len(served) == 3 and all(out is not None for out in served)  # the decode steps were the library's


@needs_kernel
def test_decode_steps_the_library_cannot_take_are_left_to_torch():
    q, kv = torch.randn(2, 1, 64), torch.randn(2, 1, 32)
    w, angles = torch.ones(16), torch.zeros(16)
    cache = torch.zeros(2, 2, 4, 16)
    args = (w, w, 1e-6, angles, angles)
    assert cpu_native.decode_prepare(q, kv, kv, *args, cache, cache.clone(), 4) is None  # past the end
    assert cpu_native.decode_prepare(torch.randn(2, 2, 64), torch.randn(2, 2, 32), torch.randn(2, 2, 32), *args, cache,
                                     cache.clone(), 0) is None  # two positions: not a decode step
    assert cpu_native.decode_prepare(q, kv, kv, w, w, 1e-6, torch.zeros(8), angles, cache, cache.clone(),
                                     0) is None  # angles of another width
    assert cpu_native.decode_prepare(q.double(), kv, kv, *args, cache, cache.clone(), 0) is None
    assert torch.equal(cache, torch.zeros(2, 2, 4, 16))
