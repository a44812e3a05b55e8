"""The decode products with 8-bit inputs (`MM3_GPU_INT8_INPUTS`, `mm3.backends.gpu.layout_int8`): each
block of 32 inputs rounded to int8 by its largest magnitude / 127, then multiplied in integers. They
equal the float64 product of the weight with those rounded inputs (every type the loop reads, every
form a frame launches), stay within the rounding's own bound of the exact product, and leave the
other types as they were. On a machine with CUDA natively (PTX's dp4a); elsewhere through Triton's
interpreter (the same integers from the bytes)."""

import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mm3.backends.gpu import layout_kernels as lk

from .test_layout_kernels import DEVICE, NATIVE, _k, switched_tile, weight

triton = pytest.importorskip("triton", reason="this torch installation has no Triton")

Q = gguf.GGMLQuantizationType
INT8_QUANTS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
TILE = lk.Config(block_n=4, block_c=8, num_warps=2, int8_inputs=True)
WIDE = lk.Config(block_n=8, block_c=8, num_warps=2, int8_inputs=True)
SPLIT8 = lk.Config(block_n=4, block_c=1, num_warps=2, int8_inputs=True)  # one chunk a tile: K split


@pytest.fixture(scope="module", autouse=True)
def runnable():
    if not NATIVE and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the kernels cannot run here")
    if NATIVE and torch.version.hip is not None:
        pytest.skip("the 8-bit input loop is PTX: ROCm keeps the float loop")


def rounded_inputs(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(the inputs as the kernels multiply them: each block of 32 rounded to int8 steps of its largest
    magnitude / 127, in float64; that step per value): the arithmetic of `layout_int8`, in numpy."""
    x = x.double().cpu().numpy()
    k = x.shape[-1]
    padded = np.zeros(x.shape[:-1] + (-(-k // 32) * 32,))
    padded[..., :k] = x
    blocks = padded.reshape(x.shape[:-1] + (-1, 32))
    top = np.maximum(np.abs(blocks).max(-1, keepdims=True), 1e-30).astype(np.float32)
    inv = (np.float32(127) / top).astype(np.float32)
    step = (top * np.float32(1.0 / 127.0)).astype(np.float32).astype(np.float64)
    codes = np.rint(blocks * inv.astype(np.float64))
    assert np.abs(codes).max() <= 127
    shape = x.shape[:-1] + (-1,)
    return ((codes * step).reshape(shape)[..., :k],
            np.broadcast_to(step, blocks.shape).reshape(shape)[..., :k])


@pytest.mark.parametrize("qtype", INT8_QUANTS, ids=lambda t: t.name)
def test_products_are_the_weight_times_the_rounded_inputs(qtype):
    """Against float64 over the rounded inputs: to float32's rounding, with 1 to 5 rows, K split over
    programs, a bias, 8-row tiles; and within the rounding's bound of the exact product (half a step
    of each input, times the weight's magnitude)."""
    g = torch.Generator().manual_seed(200 + int(qtype))
    k, n = _k(qtype), 9
    w, values = weight(qtype, n, k, g)
    bias = torch.randn(n, generator=g)
    v = values.double().numpy()
    for rows, config in ((1, TILE), (2, TILE), (3, SPLIT8), (5, TILE), (2, WIDE)):
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g) * 3
        got = lk.linear(x.to(DEVICE), w, qtype, k, bias.to(DEVICE), config=config).cpu().double().numpy()
        xq, step = rounded_inputs(x)
        want = xq @ v.T + bias.double().numpy()
        assert (np.abs(got - want) <= 1e-6 * (np.abs(xq) @ np.abs(v).T) + 1e-12).all(), (rows, config)
        exact = x.double().numpy() @ v.T + bias.double().numpy()
        bound = (step / 2) @ np.abs(v).T
        assert (np.abs(got - exact) <= bound * (1 + 1e-5) + 1e-6 * np.abs(x.double().numpy()) @ np.abs(v).T).all(), \
            (rows, config)
        assert np.abs(got - exact).max() > 100 * np.abs(got - want).max()  # the inputs were rounded


def normed_reference(x: torch.Tensor, nw: torch.Tensor, eps: float, values: torch.Tensor) -> np.ndarray:
    """The products the 8-bit loop computes with the norm inside: the codes of x * w (float32, one
    rounding), each block's step times the row's 1/rms (float32, the kernels' formula)."""
    xw = (x.float() * nw.float()).numpy().astype(np.float32)
    r = np.float32(1) / np.sqrt(np.float32((x.double() ** 2).mean(-1).numpy() + eps).astype(np.float32))
    xq, _ = rounded_inputs(torch.from_numpy(xw))
    return (xq * r.astype(np.float64)[:, None]) @ values.double().numpy().T


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_the_fused_forms_read_the_rounded_inputs(qtype):
    """The residual after, SwiGLU, two stacked types (the K mixes' q/k/v: v in Q6_K): bit for bit
    what the plain 8-bit product gives, with torch's add and silu around it. The norm inside: the
    inputs times the norm's weight rounded to int8, 1/rms in the blocks' scales (one rounding where
    the float loop rounds twice), against float64 over those codes."""
    g = torch.Generator().manual_seed(300 + int(qtype))
    k, eps = 512, 1e-6
    w, values = weight(qtype, 8, k, g)
    v, v_values = weight(Q.Q6_K, 4, k, g)
    segments = [(w, qtype), (v, Q.Q6_K)]
    for rows, config, dtype in ((2, TILE, torch.float16), (3, SPLIT8, torch.float32), (4, WIDE, torch.float16)):
        x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
        res = torch.randn(rows, 12, generator=g).to(DEVICE, dtype)
        both = lk.linear_segments(x, segments, k, config=config)
        got = lk.linear_segments(x, segments, k, config=config, residual=res)
        assert torch.equal(got, res + both), (dtype, rows)
        part = lk.linear(x, w, qtype, k, config=config)
        assert torch.equal(both[:, :8], part)
        if config is not SPLIT8:  # SwiGLU never splits K
            gate, up = part.split(4, dim=-1)
            assert torch.equal(lk.swiglu(x, w, qtype, k, config=config), F.silu(gate) * up), (dtype, rows)
    for rows, config in ((1, TILE), (2, SPLIT8), (2, WIDE)):
        x = torch.randn(rows, k, generator=g) * 3
        nw = torch.rand(k, generator=g) + 0.5
        want = normed_reference(x, nw, eps, torch.cat([values, v_values]))
        got = lk.linear_segments(x.to(DEVICE), segments, k, config=config, norm=(nw.to(DEVICE), eps)).cpu().numpy()
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 2e-6 * scale, rows
        exact = lk.torch_rms_norm(x, (nw, eps)).double().numpy() @ torch.cat([values, v_values]).double().numpy().T
        assert np.abs(got - exact).max() <= 0.05 * scale  # what the inputs' rounding moves, at most
        pos = torch.randn(1, k, generator=g)  # rows added to the stream the norm reads: as added before
        got = lk.linear_segments(x.to(DEVICE), segments, k, config=config, norm=(nw.to(DEVICE), eps),
                                 add=pos.to(DEVICE))
        assert torch.equal(got, lk.linear_segments((x + pos).to(DEVICE), segments, k, config=config,
                                                   norm=(nw.to(DEVICE), eps)))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_non_finite_input_is_not_rounded_away(qtype):
    """A NaN input makes its row's products NaN, as the float loop's do (the song's checks look for it);
    an infinite one makes them non-finite."""
    g = torch.Generator().manual_seed(500 + int(qtype))
    k = 512
    w, _ = weight(qtype, 8, k, g)
    x = torch.randn(3, k, generator=g)
    x[0, 37], x[1, 300] = float("nan"), float("inf")
    got = lk.linear(x.to(DEVICE), w, qtype, k, config=TILE).cpu()
    assert got[0].isnan().all() and not got[1].isfinite().any() and got[2].isfinite().all()


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_float_weights_keep_the_float_loop(qtype):
    """Float weights (no integer fields) are multiplied as without the switch, bit for bit."""
    g = torch.Generator().manual_seed(400 + int(qtype))
    k = _k(qtype)
    w, _ = weight(qtype, 6, k, g)
    x = torch.randn(2, k, generator=g).to(DEVICE)
    plain = lk.Config(block_n=4, block_c=8, num_warps=2)
    assert torch.equal(lk.linear(x, w, qtype, k, config=TILE), lk.linear(x, w, qtype, k, config=plain))


def test_the_switch_asks_for_it_where_the_device_runs_it(monkeypatch):
    """`MM3_GPU_INT8_INPUTS`, read once a process, sets the decode tile's `int8_inputs` (the one a launch
    that names none takes, under the interpreter too); a launch takes the 8-bit loop on CUDA (not
    ROCm: the loop's PTX) and under the interpreter, not elsewhere."""
    def config_with(value):
        return switched_tile(monkeypatch, "MM3_GPU_INT8_INPUTS", value)

    try:
        assert not config_with(None).int8_inputs and config_with(None).block_n == 4
        assert config_with("on").int8_inputs and config_with("1") == lk.Config(4, 8, 2, int8_inputs=True)
        monkeypatch.setenv("MM3_GPU_DECODE_ROWS", "8")
        assert config_with("on") == WIDE
        if not NATIVE:  # a launch that names no tile: the interpreter's wide one, the inputs as switched
            assert lk.default_decode_config() == lk.dataclasses.replace(lk.INTERPRETED[0], int8_inputs=True)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert lk.int8_inputs(TILE, torch.device("cuda", 0)) == (torch.version.hip is None)
        assert not lk.int8_inputs(TILE, torch.device("cpu"))
        assert not lk.int8_inputs(lk.DECODE, torch.device("cuda", 0))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert lk.int8_inputs(TILE, torch.device("cpu"))
        monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not lk.int8_inputs(TILE, torch.device("cuda", 0))
    finally:
        monkeypatch.undo()
        lk.decode_config.cache_clear()
