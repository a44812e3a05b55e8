"""The integer kernel built on the machine (`mm3.backends.cpu.native`): its products for every type it
reads (8-bit values, 4-bit values, with and without offsets) against gguf-py's dequantization, its packing, the layers and forms that use it, its build cache, and what happens
where it cannot be built (no compiler, switched off, a wrong product): torch's kernels serve."""

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mm3.bench.random_models import random_tensor
from mm3.backends.cpu import build as cpu_build, forms as cpu_forms, int4 as cpu_int4, native as cpu_native
from mm3.backends import products
from mm3.weights import layers as gguf_ops
from mm3.backends.cpu.forms import FORMS, Serving

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
def rebuilt():
    """The kernel library looked up afresh in this test (and again after it)."""
    cpu_native.forget()
    yield
    cpu_native.forget()


def _logging_compiler(folder: Path, refuse: str | None = None) -> tuple[Path, Path]:
    """A C compiler that writes each call's arguments to a log, then runs the system's (`refuse`: an
    argument it fails on, as a compiler without that option does): (the compiler, its log)."""
    real = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    log, cc = folder / "cc.log", folder / "logging-cc"
    refusal = f'for a in "$@"; do [ "$a" = "{refuse}" ] && {{ echo "unknown option $a" >&2; exit 1; }}; done\n' \
        if refuse else ""
    cc.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n{refusal}exec "{real}" "$@"\n')
    cc.chmod(0o755)
    return cc, log


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


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
    cc, log = _logging_compiler(tmp_path, refuse="-fopenmp")
    monkeypatch.setenv("CC", str(cc))
    assert cpu_native.available()
    assert len(list((tmp_path / "native").glob("*.so"))) == 1
    builds = [call for call in _calls(log) if call != "--version"]
    assert len(builds) == 2 and "-fopenmp" in builds[0] and "-fopenmp" not in builds[1]


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
    path = cpu_build.build(("-O3", *march, "-shared", "-fPIC", "-std=c11"))
    assert path is not None
    lib = cpu_build.load(path)
    assert lib.mm3_integer_vector_bits() == bits
    for qtype, n, k, rows in ((Q.Q8_0, 40, 96, 3), (Q.Q6_K, 272, 512, 2), (Q.Q8_0, 16, 32, 1), (Q.Q4_K, 48, 256, 3),
                              (Q.Q5_K, 32, 512, 2), (Q.Q4_0, 16, 64, 1)):
        raw, values = _raw(n, k, n + rows, qtype)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).contiguous()
        for scales in ("f32", "super" if qtype in cpu_native.SUPER_TYPES else "f16"):
            packed = cpu_native.repack(raw, qtype, n, k, quads=cpu_native.nibble_quads(lib), scales=scales)
            y = cpu_native.product(x, packed, lib)[:, :n]
            assert _rel(y, x.double() @ values.T) < 1e-4, scales



def _identity_q8_0(n):
    """Q8_0 blocks of the n x n identity with every scale 1: a product gives back each input as the
    kernel rounded it (its int16 times the group's scale, one rounding in every build)."""
    blocks = np.zeros((n, n // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    for r in range(n):
        blocks[r, r // 32, 2 + r % 32] = 1
    return torch.from_numpy(blocks.reshape(n, -1))


@needs_kernel
def test_every_code_path_rounds_the_inputs_alike(monkeypatch, tmp_path):
    """The vector builds round each group of inputs to int16 as the plain C does, bit for bit: ties to
    even (the scale a power of two, the values half-way), zero and tiny groups, random ones."""
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    n = 128
    packed = cpu_native.repack(_identity_q8_0(n), Q.Q8_0, n, n)
    ties = (torch.arange(n, dtype=torch.float32) - 60.5) * 2.0 ** -3
    ties[::32] = 32767 * 2.0 ** -3  # each group's largest: its scale 2^-3
    x = torch.cat([ties[None], -ties[None], torch.randn(3, n, generator=torch.Generator().manual_seed(5)) * 40,
                   torch.full((1, n), 1e-38), torch.zeros(1, n)])
    results = []
    for march, needs, _ in VARIANTS:
        if needs <= _cpu_flags():
            path = cpu_build.build(("-O3", *march, "-shared", "-fPIC", "-std=c11"))
            assert path is not None
            results.append((march, cpu_native.product(x, packed, cpu_build.load(path))[:, :n]))
    plain = results[-1][1]
    assert torch.equal(plain[0], torch.round(ties * 8) / 8)  # halves to even
    for march, y in results[:-1]:
        assert torch.equal(y.view(torch.int32), plain.view(torch.int32)), march

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
    assert not layer.packings() and calls == []  # many rows: nothing packed
    x = torch.randn(2, 256)
    assert _rel(layer(x), F.linear(x.double(), values.double())) < 5e-5
    first = layer.packings()["native"]
    layer(x)
    assert layer.packings()["native"] is first and list(layer.packings()) == ["native"] and calls == [48, 48]


@needs_kernel
def test_a_fused_layer_stacks_its_parts_for_the_kernel():
    parts = [_layer(Q.Q8_0, n, 256, 5 + n) for n in (64, 32, 32)]
    fused = gguf_ops.Fused(parts)
    x = torch.randn(2, 256)
    product = products.for_fused(fused, torch.float32, torch.device("cpu"))
    assert product.decode.product.kernel == "native"
    for y, p in zip(fused(x), parts):
        assert _rel(y, F.linear(x.double(), p.get("weight", torch.float64, torch.device("cpu")))) < 5e-5
    assert fused.packings()["native"].weight.shape[0] == 8


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
    assert list(layer.packings()) == ["native"]
    layer.drop_packing()
    assert not layer.packings()


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
    cc, log = _logging_compiler(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    first = cpu_build.build()
    assert first is not None and first.parent == tmp_path / "native" and len(_calls(log)) == 2  # --version, the build
    assert cpu_build.build() == first and len(_calls(log)) == 3  # found: only --version
    monkeypatch.setattr(cpu_build, "machine", lambda: "Another Processor 9000")
    other = cpu_build.build()
    assert other != first and other.is_file() and len(_calls(log)) == 5


def test_without_a_compiler_torchs_kernels_serve(monkeypatch, tmp_path, rebuilt, caplog):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.INFO, logger="mm3.backends.cpu"):
        assert not cpu_native.available() and cpu_native.vector_bits() == -1
    assert "torch's kernels alone" in caplog.text
    q8 = _layer(Q.Q8_0, 32, 256, 11)
    assert cpu_forms.packed_kernel(q8, Q.Q8_0, torch.device("cpu")) == ("int4" if cpu_int4.available() else None)
    assert not list((tmp_path / "native").glob("*.so")) if (tmp_path / "native").exists() else True


def test_the_switch_keeps_it_from_being_built(monkeypatch, tmp_path, rebuilt):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    cc, log = _logging_compiler(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("MM3_CPU_NATIVE", "off")
    assert not cpu_native.available() and cpu_native.vector_bits() == -1
    assert _calls(log) == []  # the compiler was not even asked its version


@needs_kernel
def test_a_kernel_that_multiplies_wrong_is_not_used(monkeypatch, rebuilt, caplog):
    monkeypatch.setattr(cpu_native, "product",
                        lambda x2, packed, lib=None: torch.zeros(x2.shape[0], packed.weight.shape[0] * 16))
    with caplog.at_level(logging.WARNING, logger="mm3.backends.cpu.native"):
        assert not cpu_native.available()
    assert "computes wrong products" in caplog.text


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
    """The library is asked to repack (`mm3_repack`) only the types and scale forms it makes
    (`LIBRARY_REPACKS`); the others are packed by the tensor operations, the same bytes."""
    lib, calls = cpu_native.library(), []
    real = lib.mm3_repack
    monkeypatch.setattr(lib, "mm3_repack", lambda *a: calls.append(a[1]) or real(*a))
    raw, _ = _raw(32, 256, 3, Q.Q4_K)
    made = cpu_native.repack(raw, Q.Q4_K, 32, 256)
    assert calls == [int(Q.Q4_K)] and made.scales == "super"  # the library's
    wide = cpu_native.repack(raw, Q.Q4_K, 32, 256, scales="f32")
    raw1, _ = _raw(32, 256, 3, Q.Q4_1)
    other = cpu_native.repack(raw1, Q.Q4_1, 32, 256)
    assert calls == [int(Q.Q4_K)]  # float32 scales, and a type it does not make: not asked
    assert wide.scales == "f32" and other.layout == cpu_native.TYPES[Q.Q4_1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the tie to the parent is Linux's PR_SET_PDEATHSIG")
def test_a_build_whose_process_is_killed_leaves_no_compiler_running(tmp_path):
    """kill -9 of a process while it builds the library: the compiler (here a stand-in that writes
    its process id, then works for a minute, with a child process of its own, as a compiler's
    passes are) is killed too."""
    pids = tmp_path / "pids"
    fake = tmp_path / "slow-cc"
    fake.write_text("#!/bin/sh\n"
                    'case "$1" in --version) echo "slow-cc 1.0"; exit 0;; esac\n'
                    f'sleep 60 & echo $! >> "{pids}"\n'
                    f'echo $$ >> "{pids}"\n'
                    "wait\n")
    fake.chmod(0o755)
    env = {**os.environ, "CC": str(fake), "MM3_CACHE_DIR": str(tmp_path / "cache")}
    builder = subprocess.Popen([sys.executable, "-c", "from mm3.backends.cpu import build; build.build()"], env=env,
                               cwd=str(Path(__file__).resolve().parents[3]))
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert time.monotonic() < deadline and builder.poll() is None, "the build never started the compiler"
            time.sleep(0.1)
        builder.kill()
        builder.wait()
        started = [int(p) for p in pids.read_text().split()]
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if _alive(p)], "the compiler outlived the process that started it"
    finally:
        if builder.poll() is None:
            builder.kill()
        for p in pids.read_text().split() if pids.exists() else ():
            with contextlib.suppress(OSError):
                os.kill(int(p), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
