"""The device layout (`mm3.backends.gpu.device_layout`): GGUF blocks to planes and back bit for bit, its
dequantization equal to gguf-py's, every plane 16-byte aligned with row strides that are
multiples of 16 words, at the file's bits per weight."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from mm3.backends.gpu import device_layout as dl

Q = gguf.GGMLQuantizationType
TYPES = sorted(dl.LAYOUT_TYPES, key=int)


def _shapes(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    shapes = [(5, 256), (3, 768), (2, 4096)]
    return shapes + ([(4, 32), (3, 96), (2, 288)] if block == 32 else [])  # 32-value types: a padded last chunk


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_round_trip_bit_for_bit(qtype):
    """Random bytes (every bit pattern, NaN scales included) survive blocks -> planes -> blocks."""
    g = torch.Generator().manual_seed(int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    for n, k in _shapes(qtype):
        raw = torch.randint(0, 256, (n, k // block * size), dtype=torch.uint8, generator=g)
        planes = dl.to_planes(raw, qtype, k, rows_per_pass=2)  # several passes
        assert planes.shape == (n, dl.layout_of(qtype, k).row_bytes)
        assert torch.equal(dl.to_blocks(planes, qtype, k), raw)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantization_equals_gguf_py(qtype):
    g = torch.Generator().manual_seed(10 + int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    n, k = 6, 512
    raw = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, generator=g)
    from mm3.formats.gguf.quants import SCALE_OFFSETS

    for offset in SCALE_OFFSETS[qtype]:  # finite scales: NaN never equals NaN
        raw[:, offset:offset + 2] = (torch.rand(raw.shape[0], generator=g) * 0.1).half().view(torch.uint8).view(-1, 2)
    raw = raw.reshape(n, -1)
    want = gguf.quants.dequantize(raw.numpy(), qtype).reshape(n, k)
    got = dl.dequantize(dl.to_planes(raw, qtype, k), qtype, k)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_planes_are_aligned_for_wide_loads(qtype):
    for k in (32 if GGML_QUANT_SIZES[qtype][0] == 32 else 256, 2304, 4096, 12288):
        lay = dl.layout_of(qtype, k)
        assert lay.row_bytes % 64 == 0
        buffer = torch.zeros(3, lay.row_bytes, dtype=torch.uint8)
        for name, _ in dl.PLANES[qtype]:
            assert lay.offsets[name] % 16 == 0
            plane = lay.plane(buffer, name)
            assert plane.dtype == torch.int32 and plane.stride(0) % 16 == 0 and plane.stride(0) * 4 == lay.row_bytes


def test_bits_per_weight():
    """The file's bits per weight, every type."""
    file_bits = {t: GGML_QUANT_SIZES[t][1] * 8 / GGML_QUANT_SIZES[t][0] for t in TYPES}
    stated = {t: dl.bits_per_weight(t) for t in TYPES}
    assert stated == file_bits
    for t in TYPES:  # a released row (4096 values) takes what the stated bits say, padding to 64 bytes aside
        assert dl.layout_of(t, 4096).row_bytes - stated[t] * 4096 / 8 < 64


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="Q2_K has no device layout"):
        dl.layout_of(Q.Q2_K, 256)
    with pytest.raises(ValueError, match="Q4_K rows of 300 values are not whole blocks of 256"):
        dl.layout_of(Q.Q4_K, 300)
    with pytest.raises(ValueError, match=r"Q8_0 rows of 64 values are \[n, 68\] uint8 blocks"):
        dl.to_planes(torch.zeros(2, 70, dtype=torch.uint8), Q.Q8_0, 64)
    with pytest.raises(ValueError, match=r"a Q8_0 layout of rows of 64 values is \[n, 320\] uint8"):
        dl.to_blocks(torch.zeros(2, 68, dtype=torch.uint8), Q.Q8_0, 64)
