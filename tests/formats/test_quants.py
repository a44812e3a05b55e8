"""Torch dequantization against gguf-py's numpy `gguf.quants.dequantize`, bit for bit, for every type."""

import gguf
import numpy as np
import pytest
import torch

from mm3.formats.gguf import quants
from mm3.formats.gguf.quants import (
    SCALE_OFFSETS, SUPPORTED_TYPES, UnsupportedQuantType, dequantize, dequantize_rows, row_nbytes)

Q = gguf.GGMLQuantizationType
SIZES = gguf.GGML_QUANT_SIZES
TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.name)
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16}

# f16 bit patterns for scales: zero and -0, the smallest and largest subnormal, the smallest
# normal, +-1, the largest finite (65504, both signs), and a few ordinary magnitudes.
EXTREME_SCALES = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF,
                           0x1400, 0x2E66, 0xA0CD], dtype=np.uint16)


def random_blocks(qtype, n_blocks, rng):
    """Random block bytes whose f16 scale fields hold finite values, many of them extreme."""
    block, size = SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in SCALE_OFFSETS.get(qtype, ()):
        bits = rng.choice(EXTREME_SCALES, size=n_blocks)
        ordinary = rng.random(n_blocks) < 0.5
        bits[ordinary] = rng.uniform(-4, 4, size=ordinary.sum()).astype(np.float16).view(np.uint16)
        raw[:, off:off + 2] = bits.view(np.uint8).reshape(n_blocks, 2)
    return raw


def float_bits(qtype, n_values, rng):
    """Raw F32/F16/BF16 bytes from random bit patterns (NaN and Inf included)."""
    width = SIZES[qtype][1]
    return rng.integers(0, 256, size=n_values * width, dtype=np.uint8)


def reference(raw: np.ndarray, qtype, shape):
    """gguf-py's float32 result for raw bytes, reshaped to the logical shape."""
    rows = raw.reshape(-1, row_nbytes(qtype, shape[-1]))
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(rows, qtype))).reshape(shape)


def assert_same_float32(ours: torch.Tensor, ref: torch.Tensor):
    """Equal bit for bit; NaN only needs to be NaN (CPU torch canonicalises f16 NaN payloads)."""
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours.view(torch.int32)[~nan], ref.view(torch.int32)[~nan])


@pytest.fixture(params=["cpu", "accelerator"])
def code_path(request, monkeypatch):
    """Run a test on the CPU form (per-field unpacking, forced here into many small chunks) and on
    the form accelerators take (broadcast shifts, one pass)."""
    cpu = request.param == "cpu"
    monkeypatch.setattr(quants, "BROADCAST_SHIFTS_ON_CPU", not cpu)
    monkeypatch.setattr(quants, "CPU_CHUNK_VALUES", 3 * 256 if cpu else 1 << 62)
    return request.param


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bit_exact_against_gguf_py(qtype, code_path):
    rng = np.random.default_rng(int(qtype))
    block = SIZES[qtype][0]
    shape = (8, 4 * max(block, 32))
    n_values = shape[0] * shape[1]
    if qtype in FLOAT_TYPES:
        raw = float_bits(qtype, n_values, rng)
    else:
        raw = random_blocks(qtype, n_values // block, rng).reshape(-1)
    ref = reference(raw, qtype, shape)
    ours = dequantize(torch.from_numpy(raw), qtype, shape)
    assert_same_float32(ours, ref)
    if qtype not in FLOAT_TYPES:
        assert torch.isfinite(ref).all()  # the scale fields above were finite
        assert (ref != 0).any()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_output_is_the_float32_result_cast(qtype, dtype, code_path):
    rng = np.random.default_rng(7)
    block = SIZES[qtype][0]
    shape = (2, max(block, 64))
    n = shape[0] * shape[1]
    raw = torch.from_numpy(float_bits(qtype, n, rng) if qtype in FLOAT_TYPES
                           else random_blocks(qtype, n // block, rng).reshape(-1))
    full = dequantize(raw, qtype, shape)
    low = dequantize(raw, qtype, shape, dtype)
    assert low.dtype == dtype
    expect = full.to(dtype)
    nan = torch.isnan(expect)
    assert torch.equal(torch.isnan(low), nan)
    assert torch.equal(low[~nan], expect[~nan])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.BF16], ids=lambda t: t.name)
def test_multi_dim_shapes_and_raw_layouts(qtype):
    rng = np.random.default_rng(11)
    block = SIZES[qtype][0]
    shape = (2, 3, max(block, 32) * 2)  # e.g. a conv weight [out, in, k] with k the GGML row
    n = int(np.prod(shape))
    if qtype == Q.BF16:  # the top halves of float32 values
        raw = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = random_blocks(qtype, n // block, rng).reshape(-1)
    ref = reference(raw, qtype, shape)
    flat = torch.from_numpy(raw)
    assert_same_float32(dequantize(flat, qtype, list(shape)), ref)  # shape as a list
    per_row = flat.view(-1, row_nbytes(qtype, shape[-1]))
    assert_same_float32(dequantize(per_row, qtype, shape), ref)  # raw given as [rows, row_bytes]
    # raw not at an aligned start of its storage (a sliced mapping): still read correctly
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), flat])[1:]
    assert shifted.storage_offset() == 1
    assert_same_float32(dequantize(shifted, qtype, shape), ref)
    # a non-contiguous raw (every other byte of a wider buffer)
    wide = torch.zeros(flat.numel(), 2, dtype=torch.uint8)
    wide[:, 0] = flat
    assert_same_float32(dequantize(wide[:, 0], qtype, shape), ref)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q5_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_buffer_is_filled_and_checked(qtype, dtype, monkeypatch):
    monkeypatch.setattr(quants, "CPU_CHUNK_VALUES", 512)  # several chunks
    rng = np.random.default_rng(9)
    block = SIZES[qtype][0]
    shape = (4, max(block, 32) * 2)
    n = shape[0] * shape[1]
    raw = torch.from_numpy(rng.standard_normal(n).astype(np.float32).view(np.uint8) if qtype == Q.F32 else
                           rng.standard_normal(n).astype(np.float16).view(np.uint8) if qtype == Q.F16 else
                           random_blocks(qtype, n // block, rng).reshape(-1))
    out = torch.full(shape, float("nan"), dtype=dtype)
    assert dequantize(raw, qtype, shape, dtype, out=out) is out
    assert torch.equal(out, dequantize(raw, qtype, shape, dtype))
    with pytest.raises(ValueError, match=r"w: out must be a contiguous torch.float32 tensor of shape \[4, \d+\] "
                                         r"on cpu"):
        dequantize(raw, qtype, shape, torch.float32, out=torch.empty(shape, dtype=torch.float16), name="w")
    with pytest.raises(ValueError, match="out must be a contiguous"):
        dequantize(raw, qtype, shape, dtype, out=torch.empty(shape[::-1], dtype=dtype).t())


def test_f32_result_shares_memory_and_other_dtypes_copy():
    values = torch.arange(64, dtype=torch.float32)
    raw = values.view(torch.uint8)
    out = dequantize(raw, Q.F32, (2, 32))
    assert torch.equal(out.reshape(-1), values)
    assert out.data_ptr() == values.data_ptr()
    assert dequantize(raw, Q.F32, (2, 32), torch.float16).dtype == torch.float16


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.Q3_K], ids=lambda t: t.name)
def test_rows_subset_matches_full_table(qtype):
    rng = np.random.default_rng(5)
    block = SIZES[qtype][0]
    rows, row_len = 10, max(block, 32) * 2
    raw = (random_blocks(qtype, rows * row_len // block, rng) if qtype not in FLOAT_TYPES
           else rng.standard_normal(rows * row_len).astype(np.float16).view(np.uint8)).reshape(-1)
    table = torch.from_numpy(raw).view(rows, row_nbytes(qtype, row_len))
    full = dequantize(table, qtype, (rows, row_len))
    ids = torch.tensor([[3, 7], [3, 0]])
    picked = dequantize_rows(table[ids], qtype, row_len)
    assert picked.shape == (2, 2, row_len)
    assert torch.equal(picked, full[ids])
    assert_same_float32(dequantize_rows(table[[9]], qtype, row_len), reference(raw, qtype, (rows, row_len))[[9]])
    assert dequantize_rows(table[[1]], qtype, row_len, torch.bfloat16).dtype == torch.bfloat16


def test_row_nbytes():
    assert row_nbytes(Q.Q4_K, 4096) == 4096 // 256 * 144
    assert row_nbytes(Q.Q8_0, 64) == 68
    assert row_nbytes(Q.BF16, 3) == 6
    assert row_nbytes("Q6_K", 512) == 420
    with pytest.raises(ValueError, match="Q4_K stores blocks of 256 values; a row of 100"):
        row_nbytes(Q.Q4_K, 100)


def test_scale_offsets_are_the_f16_fields():
    """Zeroing the listed fields (and nothing else) must zero every value gguf-py decodes."""
    rng = np.random.default_rng(2)
    for qtype, offsets in SCALE_OFFSETS.items():
        raw = rng.integers(0, 256, size=(4, SIZES[qtype][1]), dtype=np.uint8)
        for off in offsets:
            raw[:, off:off + 2] = 0
        with np.errstate(invalid="ignore"):
            assert not gguf.quants.dequantize(raw, qtype).any(), qtype.name


def test_non_finite_scales_behave_like_gguf_py():
    """Inf/NaN scale bytes (never written by quantizers) still give gguf-py's values, NaN as NaN."""
    rng = np.random.default_rng(4)
    for qtype in (Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K):
        raw = random_blocks(qtype, 4, rng)
        off = SCALE_OFFSETS[qtype][0]
        raw[0, off:off + 2] = np.array([0x7C00], dtype=np.uint16).view(np.uint8)  # +Inf
        raw[1, off:off + 2] = np.array([0x7E00], dtype=np.uint16).view(np.uint8)  # NaN
        shape = (4, SIZES[qtype][0])
        with np.errstate(invalid="ignore"):
            ref = reference(raw.reshape(-1), qtype, shape)
        assert_same_float32(dequantize(torch.from_numpy(raw.reshape(-1)), qtype, shape), ref)


def test_wrong_byte_count_names_type_and_expected_size():
    raw = torch.zeros(144 * 3 + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"blk.0.w: Q4_K tensor of shape \[3, 256\] needs 432 bytes, got 433"):
        dequantize(raw, Q.Q4_K, (3, 256), name="blk.0.w")
    with pytest.raises(ValueError, match=r"Q8_0 stores blocks of 32 values along the last dimension; "
                                         r"shape \[4, 48\] has rows of 48"):
        dequantize(torch.zeros(4 * 51, dtype=torch.uint8), Q.Q8_0, (4, 48))
    with pytest.raises(ValueError, match=r"Q6_K rows of 256 values take 210 bytes each, "
                                         r"got raw rows of shape \[2, 200\]"):
        dequantize_rows(torch.zeros(2, 200, dtype=torch.uint8), Q.Q6_K, 256)
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(8), Q.F32, (8,))


def test_unsupported_types_are_refused_clearly():
    with pytest.raises(UnsupportedQuantType, match=r"IQ2_XS \(\d+\) cannot be dequantized; supported: BF16, F16"):
        dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XS, (256,))
    with pytest.raises(UnsupportedQuantType, match="unknown GGML tensor type 999"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 999, (1,))
    assert issubclass(UnsupportedQuantType, ValueError)
    assert int(Q.Q4_K) in {int(t) for t in SUPPORTED_TYPES}
    # integer ids and names are accepted too
    raw = torch.from_numpy(random_blocks(Q.Q8_0, 1, np.random.default_rng(0)).reshape(-1))
    assert torch.equal(dequantize(raw, int(Q.Q8_0), (32,)), dequantize(raw, "Q8_0", (32,)))


def test_empty_tensor():
    out = dequantize(torch.zeros(0, dtype=torch.uint8), Q.Q4_K, (0, 256))
    assert out.shape == (0, 256) and out.dtype == torch.float32
