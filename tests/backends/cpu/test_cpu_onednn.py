"""Kept bfloat16 copies in oneDNN's layout on the CPU (mm3.backends.cpu.onednn): the same bits as the
plain copy's product, the plain floats still there for any other use, and the DiT's forward unchanged."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mm3.backends.cpu import onednn
from mm3.files.opener import open_component
from mm3.models.dit import FlowDiT
from mm3.weights import layers as ops
from mm3.weights.copies import cache_dequantized, dequantized_nbytes, release_dequantized

needs_onednn = pytest.mark.skipif(not onednn.works(), reason="this torch has no oneDNN layout for bfloat16 weights")


def _linear(n=48, k=64, seed=0):
    rng = np.random.default_rng(seed)
    layer = ops.Linear(k, n, bias=True)
    blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    layer.set_stored("weight", gguf.GGMLQuantizationType.Q8_0, torch.from_numpy(blocks))
    layer.set_float("bias", torch.from_numpy(rng.standard_normal(n).astype(np.float32)))
    return layer


@needs_onednn
def test_a_kept_bfloat16_copy_multiplies_in_onednns_layout_with_the_same_bits():
    layer = _linear()
    plain = layer.get("weight", torch.bfloat16).clone()
    bias = layer.get("bias", torch.bfloat16)
    x = torch.randn(2, 33, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = layer(x)
    kept = cache_dequantized(layer, torch.bfloat16)
    assert kept == dequantized_nbytes(layer) == (48 * 64 + 48) * 2  # the weight and the bias
    assert onednn.is_laid_out(layer.kept_copy(torch.bfloat16, torch.device("cpu")))
    assert torch.equal(layer(x), before) and torch.equal(layer(x), F.linear(x, plain, bias))
    one = x[:, :1].contiguous()
    assert torch.equal(layer(one), F.linear(one, plain, bias))  # a row a batch too
    got = layer.get("weight", torch.bfloat16)  # any other use still gets plain floats
    assert got.layout == torch.strided and torch.equal(got, plain)
    release_dequantized(layer)
    assert layer.kept_copy(torch.bfloat16, torch.device("cpu")) is None and torch.equal(layer(x), before)


def test_other_copies_stay_plain():
    """float32 copies (and any copy where the check fails) are kept as plain tensors."""
    layer = _linear(seed=2)
    cache_dequantized(layer, torch.float32)
    kept = layer.kept_copy(torch.float32, torch.device("cpu"))
    assert kept is not None and not onednn.is_laid_out(kept) and kept.layout == torch.strided


@needs_onednn
def test_the_dits_bfloat16_forward_keeps_its_bits(tiny):
    dit = FlowDiT.load(open_component(tiny.file("mm3-dit"), "dit"))
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(2, dit.in_channels, 30, generator=g).bfloat16(), torch.tensor([0.2, 0.2]).bfloat16()
    cond = torch.randn(2, 30, dit.condition_dim, generator=g).bfloat16()
    with torch.no_grad():
        per_use = dit(x, t, cond)
        cache_dequantized(dit, torch.bfloat16)
        laid = [m for m in dit.modules() if isinstance(m, ops.Linear) and
                onednn.is_laid_out(m.kept_copy(torch.bfloat16, torch.device("cpu")))]
        kept = dit(x, t, cond)
        release_dequantized(dit)
    assert len(laid) >= 4 * len(dit.transformer_blocks)
    assert torch.equal(kept, per_use)
