"""The block writers: bytes gguf-py accepts and decodes back close to the input, per type."""

import gguf
import numpy as np
import pytest
import torch

from mm3.gguf.encode import WRITABLE_TYPES, quantize
from mm3.gguf.quants import UnsupportedQuantType, dequantize

Q = gguf.GGMLQuantizationType
SIZES = gguf.GGML_QUANT_SIZES

# Relative RMS error bounds on N(0, 1) rows of 512, about 1.2x what was measured (gguf 0.19,
# 64 x 4096 values: F16 2.1e-4, BF16 1.7e-3, Q8_0 5.4e-3, Q6_K 0.0178, Q5_1 0.0379, Q5_K 0.0362,
# Q5_0 0.0428, Q4_1 0.0783, Q4_K 0.0715, Q4_0 0.0861). llama.cpp's reference K quantizers give the
# same errors to 0.1% on such data (compared outside the test suite, see the module docstring).
REL_RMSE_BOUND = {
    Q.F32: 0.0, Q.F16: 2.6e-4, Q.BF16: 2.1e-3, Q.Q8_0: 6.5e-3, Q.Q6_K: 0.022, Q.Q5_1: 0.046, Q.Q5_K: 0.044,
    Q.Q5_0: 0.052, Q.Q4_1: 0.095, Q.Q4_K: 0.086, Q.Q4_0: 0.104,
}
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def rel_rmse(approx, exact):
    return float(np.sqrt(np.mean((approx.astype(np.float64) - exact) ** 2) / np.mean(exact.astype(np.float64) ** 2)))


@pytest.fixture(scope="module")
def normal_rows():
    return np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)


def test_bounds_cover_every_writable_type():
    assert set(REL_RMSE_BOUND) == set(WRITABLE_TYPES)


@pytest.mark.parametrize("qtype", sorted(WRITABLE_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_round_trip_through_gguf_py(qtype, normal_rows):
    x = normal_rows.reshape(2, 8, 512)  # leading dims are kept
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8
    assert raw.shape == gguf.quants.quant_shape_to_byte_shape(x.shape, qtype)
    back = gguf.quants.dequantize(raw, qtype)
    assert back.shape == x.shape
    assert rel_rmse(back, x) <= REL_RMSE_BOUND[qtype]
    # our torch reader decodes the same bytes to the same values
    ours = dequantize(torch.from_numpy(raw), qtype, x.shape)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)))


def test_k_quants_beat_legacy_types_with_more_bits(normal_rows):
    """Q4_K (4.5 bits/value) must beat Q4_1 (5.0) and Q5_K (5.5) beat Q5_1 (6.0): the point of the search."""
    err = {t: rel_rmse(gguf.quants.dequantize(quantize(normal_rows, t), t), normal_rows)
           for t in (Q.Q4_K, Q.Q4_1, Q.Q5_K, Q.Q5_1, Q.Q6_K)}
    assert err[Q.Q4_K] < err[Q.Q4_1]
    assert err[Q.Q5_K] < err[Q.Q5_1]
    assert err[Q.Q6_K] < 0.55 * err[Q.Q5_K]


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quants_on_awkward_blocks(qtype):
    rng = np.random.default_rng(1)
    n = 256
    rows = {
        "zeros": np.zeros(n),
        "constant_negative": np.full(n, -0.75),
        "constant_positive": np.full(n, 3.0),
        "all_positive": rng.uniform(1.0, 2.0, n),
        "outlier": np.where(np.arange(n) == 17, 40.0, rng.standard_normal(n) * 0.01),
        "one_dead_subblock": np.where(np.arange(n) < 32, 0.0, rng.standard_normal(n)),
        "wide_range": rng.standard_normal(n) * np.logspace(-3, 2, n),
        "large": rng.standard_normal(n) * 1e3,
    }
    x = np.stack(list(rows.values())).astype(np.float32)
    back = gguf.quants.dequantize(quantize(x, qtype), qtype)
    assert np.isfinite(back).all()
    assert not back[0].any()  # zeros stay exactly zero
    bits = {Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}[qtype]
    for i, name in enumerate(rows):
        err = np.abs(back[i] - x[i]).max()
        # within a few quantization steps of the block's range including 0 (K-quant mins are <= 0, so
        # all-positive data spends levels on [0, min]; scales are 6-8 bit and f16-rounded)
        step = (max(x[i].max(), 0) - min(x[i].min(), 0)) / (2 ** bits - 1)
        assert err <= 4 * step + 1e-6, (name, err, step)


def test_q4_k_uses_the_full_scale_range():
    """Sub-blocks with different magnitudes get different 6-bit scales, the largest near 63."""
    x = np.concatenate([np.linspace(-1, 1, 32) * 2.0 ** -k for k in range(8)]).astype(np.float32)[None]
    raw = quantize(x, Q.Q4_K)[0]
    scales = raw[4:8] & 0x3F  # sub-blocks 0-3
    assert scales[0] >= 60 and list(scales) == sorted(scales, reverse=True)
    back = gguf.quants.dequantize(raw[None], Q.Q4_K)[0]
    for k in range(4):  # the large sub-blocks are reproduced to 4-bit precision
        sl = slice(32 * k, 32 * k + 32)
        assert np.abs(back[sl] - x[0, sl]).max() <= 2.0 ** -k * 2 / 15


def test_refusals():
    x = np.zeros((2, 256), dtype=np.float32)
    for qtype in (Q.Q2_K, Q.Q3_K, Q.IQ4_XS):
        with pytest.raises(UnsupportedQuantType, match=f"writing GGML type {qtype.name} is not supported"):
            quantize(x, qtype)
    with pytest.raises(ValueError, match=r"Q4_K stores blocks of 256 values; the last dimension of shape \[2, 128\]"):
        quantize(np.zeros((2, 128), dtype=np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(np.full((1, 32), np.nan, dtype=np.float32), Q.Q8_0)
    with pytest.raises(ValueError, match="overflows float16"):
        quantize(np.full((1, 256), 1e12, dtype=np.float32), Q.Q6_K)
    with pytest.raises(ValueError, match="overflow float16"):
        quantize(np.full((1, 4), 1e5, dtype=np.float32), Q.F16)
    with pytest.raises(UnsupportedQuantType, match="unknown GGML tensor type"):
        quantize(x, "Q9_9")


def test_bytes_load_through_gguf_writer_and_reader(tmp_path):
    """K-quant bytes written with GGUFWriter come back from GGUFReader with the logical shape."""
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    for qtype in K_TYPES:
        w.add_tensor(qtype.name, quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        assert t.tensor_type.name == t.name
        assert list(t.shape) == [512, 4]  # ggml order
        back = gguf.quants.dequantize(t.data, t.tensor_type)
        assert rel_rmse(back, x) <= REL_RMSE_BOUND[t.tensor_type]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_threads_write_the_same_bytes(qtype, monkeypatch):
    """The K-quant search runs its chunks on several threads: the bytes are those of one thread."""
    from mm3.gguf import encode

    x = np.random.default_rng(5).standard_normal((9, 1024)).astype(np.float32)
    monkeypatch.setattr(encode, "_CHUNK_BLOCKS", 4)  # 36 super-blocks: 9 chunks
    monkeypatch.setattr(encode, "_workers", lambda: 1)
    one = encode.quantize(x, qtype)
    monkeypatch.setattr(encode, "_workers", lambda: 3)
    assert np.array_equal(encode.quantize(x, qtype), one)
