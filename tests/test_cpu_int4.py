"""4-bit weights on the CPU through torch's int4 product (`mm3.gguf.cpu_int4`): the repacking of
Q4_0, Q4_1 and Q4_K blocks against the torch dequantization, odd row counts, and the layers that use
it (fast numerics only, no float copy kept)."""

import gguf
import pytest
import torch
import torch.nn.functional as F

from mm3.bench.random_models import random_tensor
from mm3.gguf import cpu_int4
from mm3.gguf import ops as gguf_ops
from mm3.gguf.quants import dequantize

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
@pytest.mark.parametrize("qtype", sorted(cpu_int4.INT4_TYPES, key=int), ids=lambda t: t.name)
def test_products_match_the_dequantized_weight(qtype, n, rows):
    """Within bfloat16 rounding of inputs and group scales (the weights' own 4-bit error is ~100x more)."""
    raw, values = _raw(qtype, n, 512, n + rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    y = cpu_int4.linear(x, cpu_int4.repack(raw, qtype, n, 512), n, bias)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert _rel(y, F.linear(x.double(), values.double(), bias.double())) < 6e-3


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
    assert gguf_ops.cache_dequantized([one, *(p for p, _ in parts)], torch.float32) == 0
    x = torch.randn(2, 256)
    assert _rel(one(x), F.linear(x, values)) < 6e-3
    for y, (_, v) in zip(fused(x), parts):
        assert _rel(y, F.linear(x, v)) < 6e-3
    first = fused._int4
    fused(x)
    assert fused._int4 is first  # packed once
    assert calls == [48, 48, 48]
    wide = torch.randn(40, 256)  # more rows than a decode: the dequantized product
    torch.testing.assert_close(one(wide), F.linear(wide, values), rtol=1e-5, atol=1e-5)
    assert len(calls) == 3


def test_reference_numerics_and_other_types_stay_exact(monkeypatch):
    monkeypatch.setattr(cpu_int4, "linear", lambda *a, **kw: pytest.fail("int4 product used"))
    x = torch.randn(2, 256)
    ref, values = _layer(Q.Q4_K, 32, 256, 3, fast=False)
    assert torch.equal(ref(x), F.linear(x, values))
    q8, values = _layer(Q.Q8_0, 32, 256, 4)
    torch.testing.assert_close(q8(x), F.linear(x, values), rtol=1e-6, atol=1e-6)


def test_repacking_follows_the_weights():
    layer, _ = _layer(Q.Q4_K, 16, 256, 5)
    x = torch.randn(1, 256)
    layer(x)
    assert "int4" in layer._derived
    raw, values = _raw(Q.Q4_K, 16, 256, 6)
    layer.set_stored("weight", Q.Q4_K, raw)  # new weights: the old packing is gone
    assert "int4" not in layer._derived and _rel(layer(x), F.linear(x, values)) < 6e-3


def test_mixed_parts_each_take_their_own_product(monkeypatch):
    """q and k in Q4_K, v in Q6_K (a `_M` mix): q and k through the int4 product, v dequantized."""
    calls = []
    real = cpu_int4.linear
    monkeypatch.setattr(cpu_int4, "linear", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    parts = [_layer(t, 32, 256, 7 + i) for i, t in enumerate((Q.Q4_K, Q.Q4_K, Q.Q6_K))]
    fused = gguf_ops.Fused([p for p, _ in parts])
    holder = torch.nn.Module()
    holder.q, holder.k, holder.v = (p for p, _ in parts)
    holder.qkv = fused
    kept = gguf_ops.cache_dequantized(holder, torch.float32)
    assert kept == 32 * 256 * 4 and set(p.qtype("weight") for p, _ in parts if p._dequantized) == {Q.Q6_K}
    x = torch.randn(2, 256)
    ys = fused(x)
    assert calls == [32, 32]
    torch.testing.assert_close(ys[2], F.linear(x, parts[2][1]), rtol=1e-5, atol=1e-5)
    assert all(_rel(y, F.linear(x, v)) < 6e-3 for y, (_, v) in zip(ys[:2], parts))
