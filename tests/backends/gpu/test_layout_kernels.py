"""The kernels over the device layout (`mm3.backends.gpu.layout_kernels`) against the torch dequantization
(itself bit-exact against gguf-py): every type, the decode kernel (1-5 input rows, K split over
programs, bias) and the tiled one (more rows), their expansion of the weight bit for bit, half
precision inputs. On a machine with CUDA natively; elsewhere through Triton's interpreter."""

import os

import gguf
import pytest
import torch
import torch.nn.functional as F

from mm3.backends.gpu import device_layout as dl
from mm3.backends.gpu import layout_kernels as lk
from mm3.formats.gguf.quants import SCALE_OFFSETS, dequantize

triton = pytest.importorskip("triton", reason="this torch installation has no Triton")

Q = gguf.GGMLQuantizationType
QUANTS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
NATIVE = torch.cuda.is_available()
DEVICE = torch.device("cuda" if NATIVE else "cpu")
SPLIT = lk.Config(block_n=4, block_c=1, num_warps=2)  # one chunk per tile: K splits over programs


@pytest.fixture(scope="module", autouse=True)
def runnable():
    if not NATIVE and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the kernels cannot run here")


def weight(qtype, n, k, g):
    """(the layout on DEVICE, or the float weight; its float32 values)."""
    if qtype in lk.FLOATS:
        w = torch.randn(n, k, generator=g).to(lk.FLOATS[qtype])
        return w.to(DEVICE), w.float()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, generator=g)
    for offset in SCALE_OFFSETS[qtype]:
        raw[:, offset:offset + 2] = (torch.rand(raw.shape[0], generator=g) * 0.02 + 1e-3).half().view(
            torch.uint8).view(-1, 2)
    raw = raw.reshape(n, -1)
    return dl.to_planes(raw, qtype, k).to(DEVICE), dequantize(raw, qtype, (n, k))


def _k(qtype):
    return 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 320  # 32-value types: a padded last chunk


@pytest.mark.parametrize("qtype", QUANTS + [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_products_match_float64(qtype):
    g = torch.Generator().manual_seed(int(qtype))
    k, n = _k(qtype), 9
    w, values = weight(qtype, n, k, g)
    bias = torch.randn(n, generator=g)
    for rows, config in ((1, None), (3, SPLIT), (5, None), (lk.GEMV_MAX_ROWS + 3, None)):
        x = torch.randn(rows, k, generator=g)
        got = lk.linear(x.to(DEVICE), w, qtype, k, bias.to(DEVICE), config=config).cpu()
        want = F.linear(x.double(), values.double(), bias.double())
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-6, rows


@pytest.mark.parametrize("qtype", QUANTS, ids=lambda t: t.name)
def test_the_weight_expands_bit_for_bit(qtype):
    """x = rows of the identity: the product is the kernels' own expansion of the weight."""
    g = torch.Generator().manual_seed(50 + int(qtype))
    k = _k(qtype)
    w, values = weight(qtype, 6, k, g)
    eye = torch.eye(k, device=DEVICE)
    assert torch.equal(lk.linear(eye[:2], w, qtype, k).cpu(), values.T[:2])  # decode
    assert torch.equal(lk.linear(eye[:lk.GEMV_MAX_ROWS + 1], w, qtype, k).cpu(), values.T[:lk.GEMV_MAX_ROWS + 1])


@pytest.mark.parametrize("int8", [False, True], ids=["float32 inputs", "8-bit inputs"])
def test_split_k_sums_in_a_fixed_order(int8):
    """K split over programs, partial sums added in a fixed order by each tile's last program
    (which sets the tile's counter back for the next call): the same bits every call, with either
    k-loop (the 8-bit one's rounding of the inputs within a percent)."""
    g = torch.Generator().manual_seed(3)
    k = 1024
    config = lk.dataclasses.replace(SPLIT, int8_inputs=int8)
    w, values = weight(Q.Q4_K, 5, k, g)
    x = torch.randn(2, k, generator=g).to(DEVICE)
    assert lk.decode_grid(2, 5, k, lk.REFERENCE_SMS, config)[-1] == 4
    first = lk.linear(x, w, Q.Q4_K, k, config=config)
    assert torch.equal(first, lk.linear(x, w, Q.Q4_K, k, config=config))
    want = x.cpu().double() @ values.double().T
    assert ((first.cpu().double() - want).norm() / want.norm()).item() < (1e-2 if int8 else 1e-6)


def test_half_precision_inputs():
    g = torch.Generator().manual_seed(7)
    w, values = weight(Q.Q6_K, 5, 256, g)
    x = torch.randn(2, 3, 256, generator=g)
    # Triton 3.8's interpreter multiplies bfloat16 tiles wrongly: bfloat16 natively only.
    for dtype in (torch.bfloat16, torch.float16) if NATIVE else (torch.float16,):
        for rows in (2, 7):
            xs = x.reshape(-1, 256)[:rows]
            got = lk.linear(xs.to(DEVICE, dtype), w, Q.Q6_K, 256).cpu()
            want = F.linear(xs.to(dtype).double(), values.double())
            assert got.dtype == dtype and ((got.double() - want).norm() / want.norm()).item() < 1e-2


def test_grids_fill_the_gpu_at_the_released_shapes():
    """Decode grids: K is split until a 132-SM GPU gets 4 programs per multiprocessor, in whole
    tiles, never past a row."""
    assert lk.decode_grid(2, 1024, 4096, 132) == (2, 8, 1, 256, 2)  # an audio head: 16 chunks, 2 tiles
    assert lk.decode_grid(2, 24576, 4096, 132) == (2, 8, 1, 6144, 1)  # the LM's gate and up: no split needed
    assert lk.decode_grid(5, 4096, 12288, 132) == (4, 8, 2, 1024, 1)
    assert lk.decode_tiles(2304) == 1 and lk.decode_tiles(6144) == 8  # 9 and 24 chunks


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_the_wide_decode_tile_computes_the_same_products(qtype):
    """The 8-row tile (`MM3_GPU_DECODE_ROWS=8`): the products of the CFG pair, plain, with SwiGLU
    and with the norm inside, against float64 as the default tile's."""
    g = torch.Generator().manual_seed(70 + int(qtype))
    k, n = 512, 20
    w, values = weight(qtype, n, k, g)
    x = torch.randn(2, k, generator=g)
    got = lk.linear(x.to(DEVICE), w, qtype, k, config=lk.DECODE_WIDE).cpu()
    want = F.linear(x.double(), values.double())
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6
    norm_weight = torch.rand(k, generator=g) + 0.5
    both = lk.swiglu(x.to(DEVICE), w, qtype, k, config=lk.DECODE_WIDE, norm=(norm_weight.to(DEVICE), 1e-6)).cpu()
    h = lk.torch_rms_norm(x, (norm_weight, 1e-6)).double() @ values.double().T
    gate, up = h.split(n // 2, dim=-1)
    want = F.silu(gate) * up
    assert ((both.double() - want).norm() / want.norm()).item() < 1e-5


def switched_tile(monkeypatch, name, value):
    """`decode_config()` read again with switch `name` set to `value` (unset where None)."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    lk.decode_config.cache_clear()
    return lk.decode_config()


def test_the_decode_tile_follows_its_switch(monkeypatch):
    """`MM3_GPU_DECODE_ROWS`, read once a process: 8 rows a program, or the default 4; the grid
    splits K further to fill the GPU with the fewer, wider tiles, never below a whole tile."""
    def tile_with(value):
        return switched_tile(monkeypatch, "MM3_GPU_DECODE_ROWS", value)

    try:
        assert tile_with(None) == lk.DECODE and lk.DECODE.block_n == 4
        assert lk.decode_grid(2, 1024, 4096, 132) == (2, 8, 1, 256, 2)
        assert tile_with("8") == lk.DECODE_WIDE and lk.DECODE_WIDE.block_n == 8
        monkeypatch.delenv("MM3_GPU_DECODE_ROWS")
        assert lk.decode_config() == lk.DECODE_WIDE  # kept until asked again
        assert lk.decode_grid(2, 1024, 4096, 132) == (2, 8, 1, 128, 2)  # 16 chunks: 2 tiles of 8 at most
        assert lk.decode_grid(2, 4096, 4096, 132) == (2, 8, 1, 512, 2)  # 512 tiles: K split in 2 to reach 528
        assert tile_with("4") == lk.DECODE
        assert lk.decode_grid(2, 4096, 4096, 132) == (2, 8, 1, 1024, 1)  # 1024 tiles of 4 rows: no split
    finally:
        monkeypatch.undo()
        lk.decode_config.cache_clear()


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match=r"a Q8_0 layout of rows of 64 values is \[n, 320\] uint8"):
        lk.linear(torch.zeros(1, 64), torch.zeros(3, 68, dtype=torch.uint8), Q.Q8_0, 64)
    with pytest.raises(ValueError, match="inputs of 32 values for a weight with rows of 64"):
        lk.linear(torch.zeros(1, 32), torch.zeros(3, 320, dtype=torch.uint8), Q.Q8_0, 64)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F16], ids=lambda t: t.name)
def test_swiglu_is_silu_of_gate_times_up_in_one_launch(qtype):
    """`swiglu` over stacked gate and up rows against `F.silu(gate) * up` over `linear`'s outputs:
    the same bits for float16 inputs (both round the halves, silu and the product to float16), within
    float32's rounding of exp for float32 inputs; past GEMV_MAX_ROWS it is those ops. (bfloat16: the
    interpreter truncates float32 to bfloat16, a GPU rounds; natively only.)"""
    g = torch.Generator().manual_seed(80 + int(qtype))
    k, n = _k(qtype), 10
    w, values = weight(qtype, 2 * n, k, g)
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if NATIVE else (torch.float32, torch.float16)
    for dtype in dtypes:
        for rows in (1, 2, 5, lk.GEMV_MAX_ROWS + 1):
            x = (torch.randn(rows, k, generator=g) * 4).to(DEVICE, dtype)
            got = lk.swiglu(x, w, qtype, k)
            gate, up = lk.linear(x, w, qtype, k).split(n, dim=-1)
            want = F.silu(gate) * up
            assert got.shape == (rows, n) and got.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(got, want), (dtype, rows)
    with pytest.raises(ValueError, match="an even count"):
        lk.swiglu(x, w[:-1], qtype, k)


@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.F16)], ids=lambda t: "+".join(
    q.name for q in t))
def test_two_types_stacked_by_outputs_in_one_product(types, monkeypatch):
    """`linear_segments` (q and k of one type, v of another): the stacked outputs of both weights
    with their bias parts, against float64; one launch of the two-type kernel where the first
    weight's rows are whole tiles (K split too, its sums added in the kernel), each weight its own
    launch where they are not, the tiled kernel past GEMV_MAX_ROWS."""
    from mm3.backends.gpu import layout_triton

    g = torch.Generator().manual_seed(90 + int(types[1]))
    launches = []
    for name in ("gemv_kernel", "gemv_segments_kernel", "gemm_kernel"):
        real = getattr(layout_triton, name)
        monkeypatch.setattr(layout_triton, name, _Counted(real, name, launches))
    tile = lk.Config(block_n=4, block_c=8, num_warps=2)
    for first, second, config, rows, k, want_launches in (
            (8, 4, tile, 2, 256, ["gemv_segments_kernel"]), (8, 5, SPLIT, 3, 512, ["gemv_segments_kernel"]),
            (6, 4, tile, 1, 256, ["gemv_kernel", "gemv_kernel"]),
            (24, 4, lk.Config(block_n=16, block_c=8, num_warps=2), 2, 256, ["gemv_segments_kernel"]),  # tiles of 8
            (8, 4, None, lk.GEMV_MAX_ROWS + 2, 256, ["gemm_kernel", "gemm_kernel"])):
        (w1, v1), (w2, v2) = weight(types[0], first, k, g), weight(types[1], second, k, g)
        bias = torch.randn(first + second, generator=g)
        x = torch.randn(rows, k, generator=g)
        launches.clear()
        got = lk.linear_segments(x.to(DEVICE), [(w1, types[0]), (w2, types[1])], k, bias.to(DEVICE), config=config)
        want = F.linear(x.double(), torch.cat([v1, v2]).double(), bias.double())
        assert launches == want_launches, (first, rows)
        assert got.shape == (rows, first + second)
        assert ((got.cpu().double() - want).norm() / want.norm()).item() < 1e-6, (first, rows)
        if config is SPLIT:  # the tiles' counters were set back: the same bits again
            again = lk.linear_segments(x.to(DEVICE), [(w1, types[0]), (w2, types[1])], k, bias.to(DEVICE),
                                       config=config)
            assert torch.equal(got, again)
    x = torch.randn(2, k, generator=g).to(DEVICE)  # each part as it would be alone, bit for bit
    both = lk.linear_segments(x, [(w1, types[0]), (w2, types[1])], k, config=tile)
    assert torch.equal(both[:, :8], lk.linear(x, w1, types[0], k, config=tile))
    assert torch.equal(both[:, 8:], lk.linear(x, w2, types[1], k, config=tile))


class _Counted:
    """A kernel whose launches are recorded by name."""

    def __init__(self, kernel, name, launches):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F16], ids=lambda t: t.name)
def test_the_norm_before_and_the_residual_after_inside_one_launch(qtype, monkeypatch):
    """`norm` and `residual` inside the decode launch (one row, a split K, four rows; one type, two
    stacked types, the SwiGLU form) against the norm kernel, the product and torch's add apart: the
    same bits. The inputs are multiples of 1/4 below 2, so every sum of their squares is exact in
    any order (the kernels sum in different orders); past GEMV_MAX_ROWS torch's operations do it."""
    from mm3.backends.gpu import layout_triton
    from mm3.backends.gpu.norm_kernels import rms_norm

    launches = []
    for name in ("gemv_kernel", "gemv_segments_kernel"):
        monkeypatch.setattr(layout_triton, name, _Counted(getattr(layout_triton, name), name, launches))
    g = torch.Generator().manual_seed(100 + int(qtype))
    k, eps = _k(qtype), 1e-6
    w, _ = weight(qtype, 8, k, g)
    second = {Q.Q4_K: Q.Q6_K, Q.Q6_K: Q.Q8_0, Q.Q8_0: Q.F16, Q.F16: Q.Q8_0}[qtype]
    v, _ = weight(second, 4, k, g)
    for dtype in (torch.float32, torch.float16):
        nw = (torch.rand(k, generator=g) + 0.5).to(DEVICE, dtype)
        for rows, config in ((1, None), (2, SPLIT), (4, None), (lk.GEMV_MAX_ROWS + 1, None)):
            x = (torch.randint(-7, 8, (rows, k), generator=g) / 4).to(DEVICE, dtype)
            res = torch.randn(rows, 12, generator=g).to(DEVICE, dtype)
            normed = rms_norm(x, nw, eps) if rows <= lk.GEMV_MAX_ROWS else lk.torch_rms_norm(x, (nw, eps))
            segments = [(w, qtype), (v, second)]
            launches.clear()
            got = lk.linear_segments(x, segments, k, config=config, norm=(nw, eps), residual=res)
            assert len(launches) == (rows <= lk.GEMV_MAX_ROWS)
            assert torch.equal(got, res + lk.linear_segments(normed, segments, k, config=config)), (dtype, rows)
            got = lk.linear(x, w, qtype, k, config=config, norm=(nw, eps), residual=res[:, :8])
            assert torch.equal(got, res[:, :8] + lk.linear(normed, w, qtype, k, config=config)), (dtype, rows)
            assert torch.equal(lk.swiglu(x, w, qtype, k, norm=(nw, eps)), lk.swiglu(normed, w, qtype, k))
    assert lk.fused_works("norm", qtype, torch.float16, DEVICE)  # the self-check a whole layer asks first
    with pytest.raises(ValueError, match="a residual of 4 rows of 8"):
        lk.linear(x[:4], w, qtype, k, residual=res[:4, :7])
    with pytest.raises(ValueError, match=f"a norm weight of {k}"):
        lk.linear(x, w, qtype, k, norm=(nw[1:], eps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rows_added_to_the_stream_inside_the_launch(dtype, monkeypatch):
    """`add` (the depth decoder's position embeddings: row i of the inputs takes row i % p): inside
    the normed product (one type and two stacked, K split or not) the same bits as the product
    over torch's sum, and inside the residual's epilogue the same bits as torch's sum plus the
    product; no launch more. The sums round (random values), as torch rounds them."""
    from mm3.backends.gpu import layout_triton

    launches = []
    for name in ("gemv_kernel", "gemv_segments_kernel"):
        monkeypatch.setattr(layout_triton, name, _Counted(getattr(layout_triton, name), name, launches))
    g = torch.Generator().manual_seed(5)
    k, eps = 512, 1e-6
    w, _ = weight(Q.Q4_K, 8, k, g)
    v, _ = weight(Q.Q6_K, 4, k, g)
    nw = (torch.rand(k, generator=g) + 0.5).to(DEVICE, dtype)
    assert lk.decode_grid(4, 8, k, lk.REFERENCE_SMS, SPLIT)[4] == 2  # SPLIT: K over two programs
    for songs, positions, config in ((2, 2, None), (3, 1, SPLIT)):
        x = torch.randn(songs, positions, k, generator=g).to(DEVICE, dtype)
        pos = torch.randn(1, positions, k, generator=g).to(DEVICE, dtype)
        res = torch.randn(songs, positions, 8, generator=g).to(DEVICE, dtype)
        pos8 = torch.randn(1, positions, 8, generator=g).to(DEVICE, dtype)
        for segments in ([(w, Q.Q4_K)], [(w, Q.Q4_K), (v, Q.Q6_K)]):
            launches.clear()
            got = lk.linear_segments(x, segments, k, config=config, norm=(nw, eps), add=pos[0])
            assert len(launches) == 1
            want = lk.linear_segments(x + pos, segments, k, config=config, norm=(nw, eps))
            assert torch.equal(got, want), (dtype, songs, positions, len(segments))
        launches.clear()
        got = lk.linear(x, w, Q.Q4_K, k, config=config, residual=res, add=pos8)
        assert len(launches) == 1
        assert torch.equal(got, (res + pos8) + lk.linear(x, w, Q.Q4_K, k, config=config)), (dtype, songs, positions)
    with pytest.raises(ValueError, match="with a norm or with a residual"):
        lk.linear(x, w, Q.Q4_K, k, add=pos[0])
    with pytest.raises(ValueError, match="a count dividing 3"):
        lk.linear(x, w, Q.Q4_K, k, residual=res, add=torch.zeros(4, 8, dtype=dtype, device=DEVICE))


def test_the_norm_forms_check_reads_the_rows_added_to_the_stream(monkeypatch):
    """`fused_works("norm")`, asked before a whole layer serves, also runs the forms that add rows to
    the stream (the depth decoder's first block): a launch that misreads them is refused, with a
    warning naming the form."""
    monkeypatch.setattr(lk, "_WORKS", {})
    assert lk.fused_works("norm", Q.Q4_K, torch.float16, DEVICE)
    real = lk.linear

    def misread(*args, add=None, **kwargs):
        return real(*args, add=None if add is None else add.flip(0), **kwargs)
    monkeypatch.setattr(lk, "linear", misread)
    monkeypatch.setattr(lk, "_WORKS", {})
    with pytest.warns(UserWarning, match="Q4_K norm kernel computes wrongly .*the norm's inputs plus rows"):
        assert not lk.fused_works("norm", Q.Q4_K, torch.float16, DEVICE)
