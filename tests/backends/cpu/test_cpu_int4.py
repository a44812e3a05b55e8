"""Quantized weights on the CPU through torch's int4 product (`mm3.backends.cpu.int4`): the repacking of
every type it takes (Q4_0, Q4_1, Q4_K as they are; Q8_0, Q5_0, Q5_1, Q5_K, Q6_K as two 4-bit planes)
against the torch dequantization, odd row counts, and the layers that use it (fast numerics only,
no float copy kept)."""

import mmap
import sys

import gguf
import pytest
import torch
import torch.nn.functional as F

from mm3.bench.random_models import random_tensor
from mm3.backends.cpu import int4 as cpu_int4
from mm3.weights import layers as gguf_ops
from mm3.weights import copies as weight_copies
from mm3.formats.gguf.quants import dequantize

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="this torch has no CPU int4 product")


def _raw(qtype, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.from_numpy(random_tensor("w", (n, k), qtype, g))
    return raw, dequantize(raw.reshape(-1), qtype, (n, k))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("rows", [1, 2, 16])
@pytest.mark.parametrize("n", [16, 37])
@pytest.mark.parametrize("qtype", sorted(cpu_int4.TYPES, key=int), ids=lambda t: t.name)
def test_products_match_the_dequantized_weight(qtype, n, rows):
    """Within bfloat16 rounding of inputs and group scales (the weights' own 4-bit error is ~100x more)."""
    raw, values = _raw(qtype, n, 512, n + rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    y = cpu_int4.linear(x, cpu_int4.repack(raw, qtype, n, 512), n, bias)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert _rel(y, F.linear(x.double(), values.double(), bias.double())) < 6e-3


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_repacking_in_row_chunks_is_the_whole_packing(qtype, monkeypatch):
    raw, _ = _raw(qtype, 200, 256, 21)
    whole = cpu_int4.repack(raw, qtype, 200, 256)
    monkeypatch.setattr(cpu_int4, "REPACK_ROWS", 64)
    chunked = cpu_int4.repack(raw, qtype, 200, 256)
    assert torch.equal(chunked.weight, whole.weight) and torch.equal(chunked.pairs, whole.pairs)
    assert chunked.sub == whole.sub


def _layer(qtype, n, k, seed, fast=True):
    layer = gguf_ops.Linear(k, n, bias=False)
    raw, values = _raw(qtype, n, k, seed)
    layer.set_stored("weight", qtype, raw)
    layer.decode_products = layer.fused_kernels = fast
    return layer, values


def test_fast_layers_use_it_and_keep_no_float_copy(monkeypatch):
    calls = []
    real = cpu_int4.linear
    monkeypatch.setattr(cpu_int4, "linear", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    one, values = _layer(Q.Q4_K, 48, 256, 1)
    parts = [_layer(Q.Q4_0, n, 256, 2 + n) for n in (32, 16)]
    fused = gguf_ops.Fused([p for p, _ in parts])
    assert weight_copies.cache_dequantized([one, *(p for p, _ in parts)], torch.float32) == 0
    x = torch.randn(2, 256)
    assert _rel(one(x), F.linear(x, values)) < 6e-3
    for y, (_, v) in zip(fused(x), parts):
        assert _rel(y, F.linear(x, v)) < 6e-3
    first = fused.packings()["int4"]
    fused(x)
    assert fused.packings()["int4"] is first  # packed once
    assert calls == [48, 48, 48]
    wide = torch.randn(40, 256)  # more rows than a decode: the dequantized product
    torch.testing.assert_close(one(wide), F.linear(wide, values), rtol=1e-5, atol=1e-5)
    assert len(calls) == 3


def test_reference_numerics_and_other_types_stay_exact(monkeypatch):
    monkeypatch.setattr(cpu_int4, "linear", lambda *a, **kw: pytest.fail("int4 product used"))
    x = torch.randn(2, 256)
    ref, values = _layer(Q.Q4_K, 32, 256, 3, fast=False)
    assert torch.equal(ref(x), F.linear(x, values))
    q3, values = _layer(Q.Q3_K, 32, 256, 4)  # a type the kernel does not take
    torch.testing.assert_close(q3(x), F.linear(x, values), rtol=1e-6, atol=1e-6)


def test_repacking_follows_the_weights():
    layer, _ = _layer(Q.Q4_K, 16, 256, 5)
    x = torch.randn(1, 256)
    layer(x)
    assert layer.packings()
    raw, values = _raw(Q.Q4_K, 16, 256, 6)
    layer.set_stored("weight", Q.Q4_K, raw)  # new weights: the old packing is gone
    assert not layer.packings() and _rel(layer(x), F.linear(x, values)) < 6e-3


def test_mixed_parts_each_take_their_own_product(monkeypatch):
    """q and k in Q4_K, v in Q6_K (a `_M` mix): one packing per part, no float copy of any."""
    calls = []
    real = cpu_int4.linear
    monkeypatch.setattr(cpu_int4, "linear", lambda *a, **kw: calls.append((a[2], a[1].sub)) or real(*a, **kw))
    parts = [_layer(t, 32, 256, 7 + i) for i, t in enumerate((Q.Q4_K, Q.Q4_K, Q.Q6_K))]
    fused = gguf_ops.Fused([p for p, _ in parts])
    holder = torch.nn.Module()
    holder.q, holder.k, holder.v = (p for p, _ in parts)
    holder.qkv = fused
    assert weight_copies.cache_dequantized(holder, torch.float32) == 0
    x = torch.randn(2, 256)
    ys = fused(x)
    assert calls == [(32, 0), (32, 0), (32, 16)]
    assert all(_rel(y, F.linear(x, v)) < 6e-3 for y, (_, v) in zip(ys, parts))


def test_two_plane_packings_take_ten_bits_a_weight_and_stack():
    layer, values = _layer(Q.Q8_0, 64, 512, 11)
    x = torch.randn(3, 512)
    assert _rel(layer(x), F.linear(x, values)) < 6e-3
    packing = layer.packings()["int4"]
    assert packing.sub == 32 and packing.nbytes() == 64 * 512 * 10 // 8
    parts = [_layer(Q.Q5_K, n, 512, 12 + n) for n in (48, 32)]  # gate and up: one packing of both
    fused = gguf_ops.Fused([p for p, _ in parts])
    for y, (_, v) in zip(fused(x), parts):
        assert _rel(y, F.linear(x, v)) < 6e-3
    assert fused.packings()["int4"].sub == 32
    wide = torch.randn(40, 512)  # a prefill: the float product of the dequantized parts
    for y, (_, v) in zip(fused(wide), parts):
        torch.testing.assert_close(y, F.linear(wide, v), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page release is Linux only")
def test_repacked_blocks_give_back_their_file_pages_only(tmp_path):
    """The blocks of a repacked weight are unmapped where they are a file's pages (read back on the
    next use, and unmapped again after a prefill's product); memory that is not a file's is never
    dropped."""
    raw, values = _raw(Q.Q8_0, 64, 4096, 13)  # 272 KiB of blocks: whole pages inside
    path = tmp_path / "blocks.bin"
    path.write_bytes(raw.numpy().tobytes())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    blocks = torch.frombuffer(mapped, dtype=torch.uint8).view(raw.shape)
    layer, _ = _layer(Q.Q8_0, 64, 4096, 13)
    layer.set_stored("weight", Q.Q8_0, blocks)
    x = torch.randn(2, 4096)
    released = []
    real = cpu_int4.release_pages
    cpu_int4.release_pages = lambda span: released.append(real(span)) or released[-1]
    try:
        y = layer(x)
        layer(x)
        assert released == [True]  # once, at the repacking
        wide = torch.randn(40, 4096)  # a prefill: the float product reads the blocks again
        torch.testing.assert_close(layer(wide), F.linear(wide, values), rtol=1e-5, atol=1e-5)
    finally:
        cpu_int4.release_pages = real
    assert released == [True, True]  # and gives them back after it
    assert _rel(y, F.linear(x, values)) < 6e-3
    assert torch.equal(blocks, raw)  # read back from the file
    anonymous = raw.clone()
    assert cpu_int4.file_pages(anonymous) is None and not cpu_int4.release_pages(cpu_int4.file_pages(anonymous))
    assert torch.equal(anonymous, raw)
    del blocks, layer


def test_the_packing_waits_for_a_few_row_product_and_goes_with_drop_packing():
    """A replay multiplies many rows only: it packs nothing. The first frame packs; dropping the
    packing (another form serves) lets go of the product that held it too."""
    layer, values = _layer(Q.Q8_0, 32, 256, 21)
    wide = torch.randn(40, 256)
    torch.testing.assert_close(layer(wide), F.linear(wide, values), rtol=1e-5, atol=1e-5)
    assert not layer.packings()
    layer(torch.randn(2, 256))
    assert layer.chosen_product().decode.packed is layer.packings()["int4"]
    layer.drop_packing()
    assert not layer.packings() and layer.chosen_product() is None


@pytest.mark.parametrize("rows", [16, 64, 80, 192, 1040])
def test_the_packing_laid_out_from_bytes_is_torchs(rows, monkeypatch):
    """Whole 64-row blocks are laid out here, the rest by torch's op: the same bytes as torch's
    op over the whole weight, torch's op given only the rows after the last whole block."""
    q = torch.randint(0, 16, (rows, 128), generator=torch.Generator().manual_seed(rows))
    scale = offset = torch.ones(rows, 128 // 32)
    cpu_int4.pack(q[:64].to(torch.uint8), scale[:64], offset[:64])  # the layout is checked against torch's once
    real, given = torch._convert_weight_to_int4pack_for_cpu, []
    monkeypatch.setattr(torch, "_convert_weight_to_int4pack_for_cpu", lambda w, k: given.append(w.shape[0]) or real(w, k))
    packed = cpu_int4.pack(q.to(torch.uint8), scale, offset).weight
    assert given == ([rows % 64] if rows % 64 else [])
    assert torch.equal(packed, real(q.to(torch.int32), 1))
