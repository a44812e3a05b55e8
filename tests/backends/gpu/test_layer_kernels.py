"""The decoder layers' small kernels on the GPU code path (`mm3.backends.gpu.norm_kernels`,
`attention_kernels`), natively on a CUDA device (`.ci/gpu`) or else run by Triton's interpreter
over CPU tensors (`emulated()`), through the
seam (`mm3.backends.steps`) and checked against the models' torch operations: RMSNorm (also on a
head view of a fused product), the residual add with the norm after it, an LM decode step's
preparation (the rotation's tables, norms, rotation, cache write at the device position), its attention over the filled
keys (positions near the end of a bucket, garbage past them), and the depth decoder's short
attention. Bit for bit in bfloat16 where the arithmetic is the same; the float32 sums of squares
and the attention's softmax are summed in another order than torch's: within a few float32 ulps;
the LM's decode attention rounds its softmax weights to bfloat16 for the product with the values,
as flash attention does: within that rounding."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mm3.backends import steps
from mm3.backends.gpu import attention_kernels
from mm3.backends.gpu.emulation import on_gpu_path
from mm3.models.lm import one_query_attention, rms_norm, rotate_half

pytest.importorskip("triton", reason="this torch installation has no Triton")
NATIVE = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
pytestmark = pytest.mark.skipif(not NATIVE and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a CUDA device or Triton's interpreter")
DEVICE = torch.device("cuda" if NATIVE else "cpu")  # natively on a CUDA device (`.ci/gpu`), else emulated

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance of a and b in units of their dtype's last place (bfloat16)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude -> ordered integers
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


def _same(got: torch.Tensor, want: torch.Tensor, ulps: int = 0, rtol: float = 2e-6):
    """bfloat16: within `ulps` units in the last place; float32: within rtol (the sum's order)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.bfloat16:
        assert _ulps(got, want) <= ulps
    else:
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)


def within_weight_rounding(got: torch.Tensor, q, keys, values, scale: float):
    """bfloat16 attention output `got` [B, heads, 1, D] within what the kernels' roundings allow of
    the exact attention of q over keys, values [B, kv_heads, n, D] (float64, GQA): the softmax's
    weights rounded to bfloat16 for the product with the values (flash attention's rounding: at most
    2^-9 of the weighted mean of |values|) and the output rounded once (2^-9 of it)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (t.double().repeat_interleave(group, 1) for t in (keys, values))
    want = one_query_attention(q.double(), keys, values, None, scale)
    spread = one_query_attention(q.double(), keys, values.abs(), None, scale)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    bound = 2 ** -9 * (spread + want.abs()) * 1.01 + 1e-30
    assert ((got.double() - want).abs() <= bound).all(), float(((got.double() - want).abs() / bound).max())


def _rand(g, *shape, dtype=torch.float32, low=None):
    t = torch.randn(*shape, generator=g) if low is None else torch.rand(*shape, generator=g) + low
    return t.to(DEVICE, dtype)


def _at(position: int) -> torch.Tensor:
    """A device position ([1] int64 where the kernels read it)."""
    return torch.tensor([position], device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_of_rows_and_of_a_head_view(dtype):
    g = torch.Generator().manual_seed(1)
    x, w = _rand(g, 2, 3, 64, dtype=dtype), _rand(g, 64, dtype=dtype, low=0.5)
    fused = _rand(g, 2, 3, (4 + 2 + 2) * 16, dtype=dtype)  # a q/k/v product's output: heads are views of it
    q = fused[..., :64].view(2, 3, 4, 16)
    with on_gpu_path(DEVICE):
        rows = steps.rms_norm(x, w, EPS)
        heads = steps.rms_norm(q, w[:16].contiguous(), EPS)
    _same(rows, rms_norm(x, w, EPS), ulps=1)
    _same(heads, rms_norm(q, w[:16], EPS), ulps=1)
    assert heads.is_contiguous() and not q.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_add_with_the_norm_after_it(dtype):
    g = torch.Generator().manual_seed(2)
    x, delta, w = _rand(g, 2, 1, 64, dtype=dtype), _rand(g, 2, 1, 64, dtype=dtype), _rand(g, 64, dtype=dtype, low=0.5)
    with on_gpu_path(DEVICE):
        total, normed = steps.add_rms_norm(x, delta, w, EPS)
    assert torch.equal(total, x + delta)  # the same addition, bit for bit
    _same(normed, rms_norm(x + delta, w, EPS), ulps=1)
    shared = delta[:1].expand_as(x)  # one row added to every row (the depth decoder's position embedding)
    with on_gpu_path(DEVICE):
        total, normed = steps.add_rms_norm(x, shared, w, EPS)
    assert torch.equal(total, x + delta[:1])
    _same(normed, rms_norm(x + delta[:1], w, EPS), ulps=1)
    if not NATIVE:
        assert steps.add_rms_norm(x, delta, w, EPS) is None  # a CPU tensor outside emulation: the CPU's to serve


def _rope(position: int, d: int, dtype):
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = torch.tensor([position]).float()[:, None] * inv  # on the CPU, then moved
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE, dtype)[None, None], emb.sin().to(DEVICE, dtype)[None, None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_tables_of_the_device_position(dtype):
    """The tables `Qwen3LM.rope` makes for one position, from the position on the device: the same
    float32 angles; cos and sin may differ from torch's CPU ones in the last float32 bit."""
    d = 128
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    for position in (0, 5, 9000):
        with on_gpu_path(DEVICE):
            cos, sin = steps.rope_table(_at(position), inv.to(DEVICE), dtype)
        want_cos, want_sin = _rope(position, d, dtype)
        _same(cos, want_cos, ulps=1, rtol=3e-7)
        _same(sin, want_sin, ulps=1, rtol=3e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("position", [0, 5, 31])
def test_decode_preparation_writes_the_device_position(dtype, position):
    """q/k norms and rotation as `Qwen3Attention` computes them; k and v written at `pos` only."""
    g = torch.Generator().manual_seed(3 + position)
    b, heads, kv_heads, d, cap = 2, 4, 2, 16, 32
    fused = _rand(g, b, 1, (heads + 2 * kv_heads) * d, dtype=dtype)
    q, k, v = fused.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    qn, kn = _rand(g, d, dtype=dtype, low=0.5), _rand(g, d, dtype=dtype, low=0.5)
    cos, sin = _rope(position, d, dtype)
    ck, cv = _rand(g, b, kv_heads, cap, d, dtype=dtype), _rand(g, b, kv_heads, cap, d, dtype=dtype)
    want_k, want_v = ck.clone(), cv.clone()
    with on_gpu_path(DEVICE):
        got = steps.prepare_attention(q, k, v, qn, kn, EPS, cos, sin, ck, cv, None, _at(position))
    wq = rms_norm(q.view(b, 1, heads, d), qn, EPS).transpose(1, 2)
    wk = rms_norm(k.view(b, 1, kv_heads, d), kn, EPS).transpose(1, 2)
    want_k[:, :, position] = (wk * cos + rotate_half(wk) * sin)[:, :, 0]
    want_v[:, :, position] = v.view(b, kv_heads, d)
    _same(got, wq * cos + rotate_half(wq) * sin, ulps=1, rtol=1e-5)
    _same(ck, want_k, ulps=1, rtol=1e-5)
    assert torch.equal(cv, want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [attention_kernels.SPLIT, 16])
def test_decode_attention_reads_only_the_filled_keys(dtype, split, monkeypatch):
    """Over a bucket of 48 keys (one split, or three of 16) at positions 0, 15, 16, 46, 47: the
    filled keys' attention (keys past the position are NaN: never read), GQA 2 query heads a key head."""
    monkeypatch.setattr(attention_kernels, "SPLIT", split)
    g = torch.Generator().manual_seed(4)
    b, heads, kv_heads, d, bucket = 2, 4, 2, 16, 48
    q = _rand(g, b, heads, 1, d, dtype=dtype)
    ck, cv = _rand(g, b, kv_heads, bucket + 8, d, dtype=dtype), _rand(g, b, kv_heads, bucket + 8, d, dtype=dtype)
    for position in (0, 15, 16, 46, 47):
        k, v = ck.clone(), cv.clone()
        k[:, :, position + 1:] = float("nan")
        v[:, :, position + 1:] = float("nan")
        with on_gpu_path(DEVICE):
            got = steps.decode_attention(q, k, v, _at(position), bucket, d ** -0.5)
        if dtype == torch.bfloat16:
            within_weight_rounding(got, q, k[:, :, :position + 1], v[:, :, :position + 1], d ** -0.5)
        else:  # exact float32 products: torch's float32 attention up to the order of the sums
            want = one_query_attention(q, k[:, :, :position + 1], v[:, :, :position + 1], None, d ** -0.5)
            assert got.shape == q.shape and got.dtype == dtype
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_decode_attention_in_one_launch_is_the_two_launches_bit_for_bit(monkeypatch):
    """The last split of each key head combines the splits in the combining kernel's order: the
    same bits as the two launches, at positions that fill one, two and all three splits of 16; the
    counters are back at zero after each launch (a replayed graph finds them so)."""
    from mm3.backends.gpu.frame_count import KernelCounter
    from mm3.backends.gpu.layout_kernels import counters

    monkeypatch.setattr(attention_kernels, "SPLIT", 16)
    g = torch.Generator().manual_seed(5)
    b, heads, kv_heads, d, bucket = 2, 8, 2, 16, 48
    q = _rand(g, b, heads, 1, d, dtype=torch.bfloat16)
    ck = _rand(g, b, kv_heads, bucket, d, dtype=torch.bfloat16)
    cv = _rand(g, b, kv_heads, bucket, d, dtype=torch.bfloat16)
    launches = []
    for position in (3, 16, 31, 47):
        pos = _at(position)
        with KernelCounter() as one:
            fused = attention_kernels.decode(q, ck, cv, pos, bucket, d ** -0.5)
        with KernelCounter() as two:
            split = attention_kernels.decode(q, ck, cv, pos, bucket, d ** -0.5, two_launches=True)
        assert torch.equal(fused, split), position
        assert not counters(q.device, b * kv_heads)[:b * kv_heads].any()
        launches.append(tuple(sum(launch.source == "triton" for launch in c.launches) for c in (one, two)))
    assert launches == [(1, 2)] * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [16, 256])
def test_short_attention_over_a_frame_of_depth_steps(dtype, d):
    """The depth decoder's 7 steps of a frame (2 positions, then 1 at a time) as `DepthAttention`
    computes them with torch: the cache written at each step's positions, causal attention."""
    g = torch.Generator().manual_seed(5)
    b, heads, cap = 2, 2, 9
    ck, cv = (torch.zeros(b, heads, cap, d, dtype=dtype, device=DEVICE) for _ in range(2))
    wk, wv = ck.clone(), cv.clone()
    at = 0
    for s in (2, 1, 1, 1, 1, 1, 1):
        fused = _rand(g, b, s, 3 * heads * d, dtype=dtype)
        q, k, v = fused.split(heads * d, dim=-1)
        with on_gpu_path(DEVICE):
            got = steps.short_attention(q, k, v, ck, cv, at, d ** -0.5)
        split = [t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v)]
        wk[:, :, at:at + s], wv[:, :, at:at + s] = split[1], split[2]
        want = F.scaled_dot_product_attention(split[0].float(), wk[:, :, :at + s].float(), wv[:, :, :at + s].float(),
                                              is_causal=at == 0 and s > 1).transpose(1, 2).flatten(2, 3)
        assert torch.equal(ck, wk) and torch.equal(cv, wv)
        if dtype == torch.bfloat16:
            assert _ulps(got, want.to(dtype)) <= 1
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        at += s


def test_shapes_the_kernels_do_not_take_are_refused():
    g = torch.Generator().manual_seed(6)
    x = _rand(g, 2, 64, dtype=torch.float64)
    q = _rand(g, 2, 4, 1, 12)  # head_dim 12: not a power of two
    ck = _rand(g, 2, 2, 8, 12)
    with on_gpu_path(DEVICE):
        assert steps.rms_norm(x, torch.ones(64, dtype=torch.float64, device=DEVICE), EPS) is None
        assert steps.decode_attention(q, ck, ck.clone(), _at(3), 8, 0.3) is None
        assert steps.decode_attention(_rand(g, 2, 4, 1, 16), _rand(g, 2, 2, 8, 16), _rand(g, 2, 2, 8, 16),
                                      _at(3), 9, 0.3) is None  # a span past the cache


def _released():
    """Each kernel with the constexprs and warps its launcher gives it at the released sizes (LM
    4096 wide, 32 / 8 heads of 128; depth 16 heads of 256, bfloat16)."""
    from mm3.backends.gpu import norm_kernels as nk
    from mm3.backends.gpu.step_specs import attention_specs

    bf, f32, i64 = "*bf16", "*fp32", "*i64"
    per, block = nk.tile(128)
    norm = {"x_ptr": bf, "w_ptr": bf, "y_ptr": bf, "eps": "fp32"}
    add_norm = {"x_ptr": bf, "d_ptr": bf, "w_ptr": bf, "s_ptr": bf, "y_ptr": bf, "eps": "fp32"}
    rope = {"pos_ptr": i64, "inv_ptr": f32, "cos_ptr": bf, "sin_ptr": bf}
    prep = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "qw_ptr": bf, "kw_ptr": bf, "cos_ptr": bf, "sin_ptr": bf,
            "pos_ptr": i64, "out_ptr": bf, "eps": "fp32", "ks_ptr": f32, "vs_ptr": f32}
    combine = {"m_ptr": f32, "l_ptr": f32, "acc_ptr": f32, "pos_ptr": i64, "out_ptr": bf}
    short = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "ck_ptr": bf, "cv_ptr": bf, "out_ptr": bf, "scale": "fp32"}
    split = {"SPLIT": attention_kernels.SPLIT}
    lm_kernels = []
    for cache, quant in ((bf, {"QUANT": False, "GROUP": 32}), ("*i8", {"QUANT": True, "GROUP": 32})):
        lm_kernels.append((attention_kernels.attn_prep_kernel, {**prep, "ck_ptr": cache, "cv_ptr": cache},
                           {"HEADS": 32, "KV_HEADS": 8, "D": 128, **quant}, nk.warps(128)))
    lm_kernels += [(spec.fn, spec.signature, spec.constexprs, spec.num_warps) for spec in attention_specs()]
    return [
        (nk.norm_rms_kernel, norm, {"ROWS": 1, "BLOCK": 4096}, nk.warps(4096)),
        (nk.norm_rms_kernel, norm, {"ROWS": per, "BLOCK": block}, nk.warps(per * block)),
        (nk.norm_add_rms_kernel, add_norm, {"ROWS": 1, "BLOCK": 4096}, nk.warps(4096)),
        (attention_kernels.rope_table_kernel, rope, {"D": 128}, nk.warps(128)),
        *lm_kernels,
        (attention_kernels.attention_combine_kernel, combine,
         {"G": 4, "GP": attention_kernels.DOT_ROWS, "D": 128, **split}, nk.warps(128)),
        (attention_kernels.attention_short_kernel, short, {"HEADS": 16, "D": 256, "SP": 2, "CP": 16}, 4),
    ]


def compiled_facts(arch: int = 90) -> list[tuple[str, int, int]]:
    """(kernel, registers, spilled bytes) of each kernel at its released constexprs, compiled by
    Triton's own compiler and ptxas for sm_<arch> (in a process where Triton does not interpret)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from mm3.backends.gpu.kernel_report import ptxas_facts

    out = []
    for fn, types, consts, num_warps in _released():
        signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        kernel = compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                         target=GPUTarget("cuda", arch, 32),
                         options={"num_warps": num_warps, "enable_fp_fusion": False})
        facts = ptxas_facts(kernel.asm["ptx"], arch)
        out.append((fn.__name__, facts.registers, facts.spill_store_bytes + facts.spill_load_bytes))
    return out


def test_the_kernels_compile_for_sm90_without_spills():
    """Every kernel at its released constexprs compiles for sm_90 (no GPU needed), within the
    register file, spilling nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    code = ("import json; from tests.backends.gpu.test_layer_kernels import compiled_facts; "
            "print(json.dumps(compiled_facts(90)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          check=False, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(facts) == len(_released())
    for name, registers, spilled in facts:
        assert 0 < registers <= 255 and spilled == 0, (name, registers, spilled)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_attention_step_prepares_and_attends_in_one_launch(dtype, monkeypatch):
    """`attention_kernels.step` from the fused q/k/v row: the same bits as the preparation kernel
    then the decode attention (the queries, the cache written at the position, the output), at
    positions at the start, inside and at the end of splits of 16 (GQA: 4 query heads a key head)."""
    from mm3.backends.gpu.frame_count import KernelCounter

    monkeypatch.setattr(attention_kernels, "SPLIT", 16)
    g = torch.Generator().manual_seed(7)
    b, heads, kv_heads, d, cap = 2, 8, 2, 16, 48
    fused = _rand(g, b, 1, (heads + 2 * kv_heads) * d, dtype=dtype)
    q, k, v = fused.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    qn, kn = _rand(g, d, dtype=dtype, low=0.5), _rand(g, d, dtype=dtype, low=0.5)
    ck, cv = _rand(g, b, kv_heads, cap, d, dtype=dtype), _rand(g, b, kv_heads, cap, d, dtype=dtype)
    for position in (0, 15, 16, 30, 47):
        pos = _at(position)
        cos, sin = _rope(position, d, dtype)
        k1, v1, k2, v2 = ck.clone(), cv.clone(), ck.clone(), cv.clone()
        rotated = attention_kernels.prepare(q, k, v, qn, kn, EPS, cos, sin, k1, v1, pos, heads, kv_heads, d)
        want = attention_kernels.decode(rotated, k1, v1, pos, cap, d ** -0.5)
        with KernelCounter() as counted:
            got = attention_kernels.step(fused.view(b, -1), qn, kn, EPS, cos, sin, k2, v2, pos, cap, d ** -0.5, heads)
        assert [launch.name for launch in counted.launches if launch.source == "triton"] == ["attention_step_kernel"]
        assert torch.equal(v2, v1), position
        if NATIVE and dtype == torch.float32:  # a GPU may fuse the float32 sums of squares into FMAs here
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want) and torch.equal(k2, k1), position
