"""The block writers: bytes gguf-py accepts and decodes back close to the input, per type."""

import gguf
import numpy as np
import pytest
import torch

from mm3.formats.gguf.encode import WRITABLE_TYPES, quantize
from mm3.formats.gguf.quants import UnsupportedQuantType, dequantize

Q = gguf.GGMLQuantizationType
SIZES = gguf.GGML_QUANT_SIZES

# Relative RMS error bounds on N(0, 1) rows of 512, about 1.2x what was measured (gguf 0.19,
# 64 x 4096 values: F16 2.1e-4, BF16 1.7e-3, Q8_0 5.4e-3, Q6_K 0.0178, Q5_1 0.0379, Q5_K 0.0362,
# Q5_0 0.0428, Q4_1 0.0783, Q4_K 0.0715, Q4_0 0.0861). The K-quant bytes are those of ggml's
# reference quantizers (test_k_quants_equal_ggml_reference_arithmetic below).
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


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_threads_write_the_same_bytes(qtype):
    """The K-quant search runs its chunks on several threads: the bytes are those of one thread,
    whatever the chunking (each sub-block's arithmetic is its own)."""
    from mm3.formats.gguf import encode

    x = np.random.default_rng(5).standard_normal((9, 1024)).astype(np.float32)
    x[2, :300] = 0  # a zero super-block and part of the next
    whole = encode.quantize(x, qtype, threads=1)  # one chunk
    # 36 super-blocks in chunks of 5: 8 chunks, the last one short
    assert np.array_equal(encode.quantize(x, qtype, threads=1, chunk_blocks=5), whole)
    assert np.array_equal(encode.quantize(x, qtype, threads=3, chunk_blocks=5), whole)
    assert np.array_equal(encode.quantize(x, qtype), whole)  # the machine's own thread count


# ------------------------------------------------------------------------------------------------
# Byte-exactness against ggml's reference K quantizers (quantize_row_q{4,5,6}_K_ref, as llama-quantize
# and minimaxmusic.cpp's quantize tool run them without an importance matrix). The oracle below is a
# plain scalar transcription of that C code (ggml-quants.c: nearest_int, make_qkx2_quants,
# make_qx_quants), every operation a numpy float32 scalar operation in C's order, written
# independently of the vectorised writer.

F = np.float32


class RefK:
    """Scalar float32 transcription of ggml-quants.c's reference K quantizers; counts the exact
    rounding ties nearest_int sees (the data below is meant to be full of them)."""

    def __init__(self):
        self.ties = 0

    def nearest_int(self, fval):
        fval = F(fval)
        if np.isfinite(fval) and fval - F(np.floor(fval)) == F(0.5):
            self.ties += 1
        val = F(fval + F(12582912.0))
        i = int(np.array(val, dtype=F).view(np.int32))
        return (i & 0x007FFFFF) - 0x00400000

    def make_qkx2_quants(self, nmax, x, weights, rmin, rdelta, nstep):
        n = len(x)
        mn, mx = x[0], x[0]
        sum_w = weights[0]
        sum_x = F(sum_w * x[0])
        for i in range(1, n):
            if x[i] < mn:
                mn = x[i]
            if x[i] > mx:
                mx = x[i]
            w = weights[i]
            sum_w = F(sum_w + w)
            sum_x = F(sum_x + F(w * x[i]))
        if mn > 0:
            mn = F(0)
        if mx == mn:
            return F(0), F(-mn), [0] * n
        iscale = F(F(nmax) / F(mx - mn))
        scale = F(F(1) / iscale)
        best_error = F(0)
        L = [0] * n
        for i in range(n):
            L[i] = max(0, min(nmax, self.nearest_int(F(iscale * F(x[i] - mn)))))
            diff = F(F(F(scale * F(L[i])) + mn) - x[i])
            best_error = F(best_error + F(weights[i] * F(diff * diff)))
        for step in range(nstep + 1):
            iscale = F(F(F(F(rmin) + F(F(rdelta) * F(step))) + F(nmax)) / F(mx - mn))
            sum_l = sum_l2 = sum_xl = F(0)
            laux = [0] * n
            for i in range(n):
                l = max(0, min(nmax, self.nearest_int(F(iscale * F(x[i] - mn)))))
                laux[i] = l
                w = weights[i]
                sum_l = F(sum_l + F(w * F(l)))
                sum_l2 = F(sum_l2 + F(F(w * F(l)) * F(l)))
                sum_xl = F(sum_xl + F(F(w * F(l)) * x[i]))
            D = F(F(sum_w * sum_l2) - F(sum_l * sum_l))
            if D > 0:
                this_scale = F(F(F(sum_w * sum_xl) - F(sum_x * sum_l)) / D)
                this_min = F(F(F(sum_l2 * sum_x) - F(sum_l * sum_xl)) / D)
                if this_min > 0:
                    this_min = F(0)
                    this_scale = F(sum_xl / sum_l2)
                cur_error = F(0)
                for i in range(n):
                    diff = F(F(F(this_scale * F(laux[i])) + this_min) - x[i])
                    cur_error = F(cur_error + F(weights[i] * F(diff * diff)))
                if cur_error < best_error:
                    L, best_error, scale, mn = laux, cur_error, this_scale, this_min
        return scale, F(-mn), L

    def make_qx_quants(self, nmax, x):  # rmse_type 1, no quant weights
        n = len(x)
        mx = amax = F(0)
        for i in range(n):
            ax = F(abs(x[i]))
            if ax > amax:
                amax, mx = ax, x[i]
        if amax < F(1e-15):
            return F(0), [0] * n

        def sums(iscale):
            sumlx = suml2 = F(0)
            levels = []
            for i in range(n):
                l = max(-nmax, min(nmax - 1, self.nearest_int(F(iscale * x[i]))))
                levels.append(l + nmax)
                w = F(x[i] * x[i])
                sumlx = F(sumlx + F(F(w * x[i]) * F(l)))
                suml2 = F(suml2 + F(F(w * F(l)) * F(l)))
            return levels, sumlx, suml2

        L, sumlx, suml2 = sums(F(F(-nmax) / mx))
        scale = F(sumlx / suml2) if suml2 else F(0)
        best = F(scale * sumlx)
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = F(F(-F(F(nmax) + F(F(0.1) * F(step)))) / mx)
            levels, sumlx, suml2 = sums(iscale)
            if suml2 > 0 and F(sumlx * sumlx) > F(best * suml2):
                L, scale = levels, F(sumlx / suml2)
                best = F(scale * sumlx)
        return scale, L

    def q45_k(self, x, five):
        """quantize_row_q4_K_ref / quantize_row_q5_K_ref of one super-block x[256] -> bytes."""
        nmax = 31 if five else 15
        L, scales, mins = [0] * 256, [F(0)] * 8, [F(0)] * 8
        max_scale = max_min = F(0)
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            sum_x2 = F(0)
            for v in xs:
                sum_x2 = F(sum_x2 + F(v * v))
            av_x = F(np.sqrt(F(sum_x2 / F(32))))
            weights = [F(av_x + F(abs(v))) for v in xs]
            args = (31, xs, weights, -0.5, 0.1, 15) if five else (15, xs, weights, -1.0, 0.1, 20)
            scales[j], mins[j], L[32 * j:32 * j + 32] = self.make_qkx2_quants(*args)
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        inv_scale = F(F(63) / max_scale) if max_scale > 0 else F(0)
        inv_min = F(F(63) / max_min) if max_min > 0 else F(0)
        sc = [0] * 12
        for j in range(8):
            ls = min(63, self.nearest_int(F(inv_scale * scales[j])) & 0xFF)  # uint8_t, then MIN
            lm = min(63, self.nearest_int(F(inv_min * mins[j])) & 0xFF)
            if j < 4:
                sc[j], sc[j + 4] = ls, lm
            else:
                sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
                sc[j - 4] |= (ls >> 4) << 6
                sc[j] |= (lm >> 4) << 6
        d, dmin = np.float16(F(max_scale / F(63))), np.float16(F(max_min / F(63)))
        for j in range(8):  # get_scale_min_k4
            if j < 4:
                s, m = sc[j] & 63, sc[j + 4] & 63
            else:
                s, m = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
            dd = F(F(d) * F(s))
            if not dd:
                continue
            dm = F(F(dmin) * F(m))
            for ii in range(32):
                L[32 * j + ii] = max(0, min(nmax, self.nearest_int(F(F(x[32 * j + ii] + dm) / dd))))
        out = bytearray(d.tobytes() + dmin.tobytes() + bytes(sc))
        if five:
            qh, ql = [0] * 32, [0] * 128
            m1, m2 = 1, 2
            for n in range(0, 256, 64):
                for j in range(32):
                    l1, l2 = L[n + j], L[n + j + 32]
                    if l1 > 15:
                        l1 -= 16
                        qh[j] |= m1
                    if l2 > 15:
                        l2 -= 16
                        qh[j] |= m2
                    ql[n // 2 + j] = l1 | (l2 << 4)
                m1, m2 = m1 << 2, m2 << 2
            out += bytes(qh) + bytes(ql)
        else:
            out += bytes(L[j + l] | (L[j + l + 32] << 4) for j in range(0, 256, 64) for l in range(32))
        return bytes(out)

    def q6_k(self, x):
        """quantize_row_q6_K_ref of one super-block x[256] -> bytes."""
        L, scales = [0] * 256, [F(0)] * 16
        max_scale = max_abs_scale = F(0)
        for ib in range(16):
            scales[ib], L[16 * ib:16 * ib + 16] = self.make_qx_quants(32, x[16 * ib:16 * ib + 16])
            if F(abs(scales[ib])) > max_abs_scale:
                max_abs_scale, max_scale = F(abs(scales[ib])), scales[ib]
        if max_abs_scale < F(1e-15):
            return bytes(210)
        iscale = F(F(-128) / max_scale)
        d = np.float16(F(F(1) / iscale))
        sc = [np.int8(np.int32(min(127, self.nearest_int(F(iscale * s)))).astype(np.int8)) for s in scales]
        for j in range(16):
            dd = F(F(d) * F(sc[j]))
            if not dd:
                continue
            for ii in range(16):
                L[16 * j + ii] = max(-32, min(31, self.nearest_int(F(x[16 * j + ii] / dd)))) + 32
        ql, qh = [0] * 128, [0] * 64
        for half, j in enumerate(range(0, 256, 128)):
            for l in range(32):
                q = [L[j + l + 32 * c] for c in range(4)]
                ql[64 * half + l] = (q[0] & 0xF) | ((q[2] & 0xF) << 4)
                ql[64 * half + l + 32] = (q[1] & 0xF) | ((q[3] & 0xF) << 4)
                qh[32 * half + l] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6)
        return bytes(ql) + bytes(qh) + np.array(sc, dtype=np.int8).tobytes() + d.tobytes()

    def quantize(self, rows, qtype):
        blocks = np.asarray(rows, dtype=F).reshape(-1, 256)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if qtype == Q.Q6_K:
                return [self.q6_k(list(b)) for b in blocks]
            return [self.q45_k(list(b), qtype == Q.Q5_K) for b in blocks]


def tie_heavy_blocks(seed=11):
    """Super-blocks whose values sit on coarse grids (so nearest_int meets exact .5 ties and the
    scale search meets equal errors), with the awkward cases mixed in."""
    rng = np.random.default_rng(seed)
    sub32 = lambda f: np.concatenate([f(j) for j in range(8)])  # noqa: E731  one grid per sub-block
    rows = [
        rng.integers(-8, 9, 256) / 8,  # eighths on [-1, 1]
        rng.integers(-7, 8, 256).astype(float),  # small integers
        rng.integers(-4, 5, 256) / 2,  # halves
        sub32(lambda j: rng.integers(-15, 16, 32) * 2.0 ** -j),  # a grid per sub-block, scales 1 .. 2^-7
        *(sub32(lambda j: rng.integers(0, 16, 32) / 4 + j) for _ in range(4)),  # positive: the min is clipped to 0
        *(rng.integers(1, 17, 256) / 8 for _ in range(2)),  # positive eighths
        sub32(lambda j: np.full(32, (j - 4) / 2)),  # constant sub-blocks, one of them zero
        np.where(np.arange(256) // 32 == 3, 0.0, rng.integers(-3, 4, 256) / 4),  # one dead sub-block
        *(np.where(rng.random(256) < 0.8, 0.0, rng.integers(-2, 3, 256) / 2) for _ in range(2)),  # sparse grid
        np.repeat(rng.integers(-3, 4, 16) / 4, 16),  # constant sub-blocks of 16 (Q6_K)
        *(np.round(rng.standard_normal(256) * 6) / 6 for _ in range(2)),  # sixths
        *(np.where(rng.random(256) < 0.9, 0.0, rng.standard_normal(256)) for _ in range(3)),  # sparse, no grid
        rng.standard_normal(256) * 1e-6,  # small: f16 super-scales near their subnormal range
        rng.standard_normal(256),  # no grid
        (rng.standard_normal(256).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32) * 0.02,  # BF16
    ]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quants_equal_ggml_reference_arithmetic(qtype):
    """Every block equals the float32 scalar transcription of ggml's reference quantizer, on data
    full of rounding ties (where numpy's pairwise sums used to pick the other candidate)."""
    x = tie_heavy_blocks()
    ref = RefK()
    want = ref.quantize(x, qtype)
    assert ref.ties > 500  # the data does exercise nearest_int's round-half-to-even
    got = quantize(x, qtype).reshape(len(want), -1)
    bad = [i for i, w in enumerate(want) if got[i].tobytes() != w]
    assert not bad, f"blocks {bad} differ from ggml's reference arithmetic"
