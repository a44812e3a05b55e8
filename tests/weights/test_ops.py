"""The operations seam: layers built from compressed GGUF tensors compute what the dequantized
weights (gguf-py's dequantization) compute with plain torch layers."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.gguf_util import write_gguf
from mm3.formats.gguf import ComponentError, GGUFFile
from mm3.weights import layers as ops
from mm3.weights.layers import load_tensors
from mm3.weights.copies import compressed_nbytes

Q = gguf.GGMLQuantizationType


def reference_weight(f: GGUFFile, name: str) -> torch.Tensor:
    """The tensor as gguf-py's reader and numpy dequantizer see it, in torch order."""
    ref = {t.name: t for t in gguf.GGUFReader(f.path).tensors}[name]
    values = gguf.quants.dequantize(np.asarray(ref.data), ref.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(f.tensors[name].shape)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = ops.Linear(64, 8, bias=True)
        self.table = ops.Embedding(40, 256)
        self.conv = ops.Conv1d(6, 4, 3, padding=1)
        self.up = ops.ConvTranspose1d(4, 2, 4, stride=2, padding=1)
        self.scale = ops.Vector(8)


@pytest.fixture
def model_file(tmp_path):
    rng = np.random.default_rng(1)
    return write_gguf(tmp_path / "m.gguf", "mm3-test", {}, {
        "proj.weight": (Q.Q8_0, rng.standard_normal((8, 64))),
        "proj.bias": rng.standard_normal(8).astype(np.float32),
        "table.weight": (Q.Q5_0, rng.standard_normal((40, 256))),
        "conv.weight": rng.standard_normal((4, 6, 3)).astype(np.float16),
        "conv.bias": rng.standard_normal(4).astype(np.float32),
        "up.weight": rng.standard_normal((4, 2, 4)).astype(np.float32),
        "up.bias": rng.standard_normal(2).astype(np.float32),
        "scale.weight": rng.standard_normal(8).astype(np.float32),
    })


def test_layers_match_plain_torch(model_file):
    f = GGUFFile(model_file)
    m = Tiny()
    used = load_tensors(m, f.tensors, source=f.path)
    assert len(used) == 8
    x = torch.randn(3, 64)
    w = reference_weight(f, "proj.weight")
    torch.testing.assert_close(m.proj(x), F.linear(x, w, reference_weight(f, "proj.bias")), rtol=0, atol=0)

    ids = torch.tensor([[0, 39, 7], [7, 7, 1]])
    table = reference_weight(f, "table.weight")
    assert torch.equal(m.table.lookup(ids, torch.float32), F.embedding(ids, table))
    assert m.table.lookup(ids, torch.bfloat16).dtype == torch.bfloat16

    x = torch.randn(2, 6, 10)
    ref = F.conv1d(x, reference_weight(f, "conv.weight"), reference_weight(f, "conv.bias"), padding=1)
    torch.testing.assert_close(m.conv(x), ref, rtol=0, atol=0)
    y = torch.randn(2, 4, 10)
    ref = F.conv_transpose1d(y, reference_weight(f, "up.weight"), reference_weight(f, "up.bias"), stride=2, padding=1)
    torch.testing.assert_close(m.up(y), ref, rtol=0, atol=0)
    assert torch.equal(m.scale(), reference_weight(f, "scale.weight"))


@pytest.mark.parametrize("installed", ["portable", "backends"])
def test_either_binder_multiplies_as_plain_torch(model_file, installed):
    """Without a back end (the portable binder: torch's own operations) and with the back ends'
    binder, a layer's product and a table's rows are the dequantized weights' through plain torch."""
    from mm3.backends.binder import Backends  # importing the back ends installs theirs: the binder to restore
    from mm3.weights import binding

    previous = binding.binder()
    binding.install(binding.Portable() if installed == "portable" else Backends())
    try:
        f = GGUFFile(model_file)
        m = Tiny()
        load_tensors(m, f.tensors, source=f.path)
        x = torch.randn(3, 64)
        want = F.linear(x, reference_weight(f, "proj.weight"), reference_weight(f, "proj.bias"))
        assert torch.equal(m.proj(x), want)
        assert (type(m.proj.chosen_product()).__module__ == "mm3.backends.products") == (installed == "backends")
        ids = torch.tensor([[0, 39, 7], [7, 7, 1]])
        assert torch.equal(m.table.lookup(ids, torch.float32), F.embedding(ids, reference_weight(f, "table.weight")))
    finally:
        binding.install(previous)


def test_weights_stay_compressed(model_file):
    f = GGUFFile(model_file)
    m = Tiny()
    load_tensors(m, f.tensors, source=f.path)
    assert m.proj.weight.dtype == torch.uint8 and m.table.weight.dtype == torch.uint8
    expected = sum(t.nbytes for t in f.tensors.values())
    assert compressed_nbytes(m) == expected
    m.to(torch.bfloat16)  # a dtype move must not touch the block bytes
    assert m.proj.weight.dtype == torch.uint8
    assert m.proj(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_missing_misshaped_and_unexpected_tensors(tmp_path, model_file):
    f = GGUFFile(model_file)
    tensors = dict(f.tensors)
    del tensors["conv.bias"]
    with pytest.raises(ComponentError, match=r"m\.gguf: missing tensor\(s\) conv\.bias"):
        load_tensors(Tiny(), tensors, source=f.path)

    class Wrong(Tiny):
        def __init__(self):
            super().__init__()
            self.proj = ops.Linear(32, 8)

    with pytest.raises(ComponentError, match=r"m\.gguf: tensor proj\.weight has shape \[8, 64\], expected \[8, 32\]"):
        load_tensors(Wrong(), f.tensors, source=f.path)

    class Fewer(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = ops.Vector(8)

    with pytest.raises(ComponentError, match=r"unexpected tensor\(s\) conv\.bias"):
        load_tensors(Fewer(), f.tensors, source=f.path)
    assert load_tensors(Fewer(), f.tensors, source=f.path, strict=False) == ["scale.weight"]


def test_unloaded_slot_is_a_clear_error():
    with pytest.raises(ComponentError, match="never loaded"):
        ops.Linear(4, 4)(torch.randn(1, 4))


def test_weights_on_another_device_are_fetched_per_use_and_come_home(model_file):
    """Layers a memory manager left behind still compute on the input's device (the `meta` device
    stands in for an accelerator: any op mixing devices would raise), and moving a layer back puts
    the very tensor it was built with (the file mapping's view) back, nothing copied."""
    f = GGUFFile(model_file)
    m = Tiny()
    load_tensors(m, f.tensors, source=f.path)
    homes = {n: p for n, p in m.named_parameters()}
    m.proj.to("meta")  # resident on the "device"; the others stay on the CPU
    assert m.proj.weight.device.type == "meta" and m.conv.weight.device.type == "cpu"
    x = torch.randn(3, 64, device="meta")
    assert m.proj(x).device.type == "meta"
    assert m.conv(torch.randn(2, 6, 10, device="meta")).device.type == "meta"  # CPU weight fetched for this use
    # a table left on the CPU expands only the rows asked for there; the rows then go to the device
    assert m.table.lookup(torch.tensor([1, 2]), torch.float32, "meta").device.type == "meta"
    assert m.scale(torch.float32, "meta").device.type == "meta"
    assert m.conv.weight.device.type == "cpu"  # the fetch left the weight where it was
    m.to("cpu")
    assert all(p.data_ptr() == homes[n].data_ptr() and p.dtype == homes[n].dtype for n, p in m.named_parameters())


def test_a_layers_product_is_chosen_once_per_placement(monkeypatch):
    """`forward` calls the product chosen on the first use; filling, moving, keeping or dropping a
    float copy, or setting the numerics chooses again (and only then), for a layer and for a fused
    pair alike."""
    from mm3.backends import products
    from mm3.weights.copies import cache_dequantized, release_dequantized

    chosen = []
    for name in ("for_linear", "for_fused"):
        real = getattr(products, name)
        monkeypatch.setattr(products, name, lambda *a, real=real, name=name: chosen.append(name) or real(*a))
    g = torch.Generator().manual_seed(0)
    layers = []
    for n in (16, 8):
        layer = ops.Linear(32, n, bias=False)
        layer.set_float("weight", torch.randn(n, 32, generator=g).half())
        layers.append(layer)
    fused = ops.Fused(layers)
    x = torch.randn(2, 32, generator=g)
    want = F.linear(x, torch.cat([layer.stored("weight").float() for layer in layers]))
    for _ in range(3):
        assert torch.equal(layers[0](x), want[:, :16]) and torch.equal(torch.cat(fused(x), -1), want)
    assert chosen == ["for_linear", "for_fused"]
    cache_dequantized(layers, torch.float32)  # a copy kept: the next use chooses again
    for _ in range(2):
        assert torch.equal(layers[0](x), want[:, :16]) and torch.equal(torch.cat(fused(x), -1), want)
    assert chosen[2:] == ["for_linear", "for_fused"]
    release_dequantized(layers)
    layers[1].to(torch.float32)
    layers[0].decode_products = True
    fused(x), layers[0](x), layers[0](x)
    assert chosen[4:] == ["for_fused", "for_linear"]
    assert not hasattr(ops, "_GENERATION")  # no process-wide counter: each layer knows its own changes


def test_a_vectors_cast_is_kept_until_its_weights_change():
    """A norm scale asked for in another dtype is cast once: later uses get the same tensor (no
    cast kernel per use); filling or moving the slot makes a new one."""
    v = ops.Vector(8)
    v.set_float("weight", torch.randn(8))
    first = v(torch.bfloat16)
    assert first.dtype == torch.bfloat16 and v(torch.bfloat16) is first
    assert torch.equal(first, v.stored("weight").to(torch.bfloat16))
    v.set_float("weight", torch.ones(8))
    refilled = v(torch.bfloat16)
    assert refilled is not first and torch.equal(refilled, torch.ones(8, dtype=torch.bfloat16))
    v.to(torch.float64)
    assert v(torch.bfloat16) is not refilled
