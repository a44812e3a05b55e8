"""The LM's 8-bit KV cache (`MM3_GPU_INT8_KV_CACHE`, `mm3.models.kv_cache`): its rounding in torch
(`kv_codes`, `KVCache`), the GPU attention kernels writing and reading it (natively on a CUDA device
in `.ci/gpu`, else through Triton's interpreter over CPU tensors), and the models choosing it only on
the GPU code path with the switch on."""

import os

import pytest
import torch

from mm3.backends import steps
from mm3.backends.gpu import attention_kernels
from mm3.backends.gpu.emulation import emulated, on_gpu_path
from mm3.models.kv_cache import KVCache, kv_codes, kv_values, value_bytes
from mm3.models.lm import activation_bytes
from tests.backends.gpu.test_layer_kernels import within_weight_rounding

pytest.importorskip("triton", reason="this torch installation has no Triton")
NATIVE = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if NATIVE else "cpu")
kernels_run = pytest.mark.skipif(not NATIVE and not INTERPRETED, reason="needs a CUDA device or Triton's interpreter")
EPS = 1e-6


def _rand(g, *shape, dtype=torch.bfloat16, low=None):
    t = torch.randn(*shape, generator=g) if low is None else torch.rand(*shape, generator=g) + low
    return t.to(DEVICE, dtype)


def _at(position: int) -> torch.Tensor:
    return torch.tensor([position], device=DEVICE)


def _rope(position: int, d: int, dtype):
    inv = 1.0 / (1000000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = torch.cat([inv, inv]) * position
    return angle.cos().to(DEVICE, dtype)[None, None, None], angle.sin().to(DEVICE, dtype)[None, None, None]


def _step_rows(g, position: int, b: int = 2, heads: int = 8, kv_heads: int = 2, d: int = 128):
    """A decode step's fused q/k/v rows [B, 1, .] (and q, k, v, their pieces), the q and k norms'
    weights and the rotation's tables at `position`, bfloat16."""
    fused = _rand(g, b, 1, (heads + 2 * kv_heads) * d)
    q, k, v = fused.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return fused, (q, k, v), (_rand(g, d, low=0.5), _rand(g, d, low=0.5)), _rope(position, d, torch.bfloat16)


def _quantized(k: torch.Tensor, v: torch.Tensor):
    """An 8-bit copy of 16-bit caches [B, kv_heads, cap, D]: (codes k, codes v, (scales k, scales v))."""
    (ck, sk), (cv, sv) = kv_codes(k), kv_codes(v)
    return ck, cv, (sk, sv)


def test_codes_round_each_group_to_its_largest_value():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 128, generator=g, dtype=torch.float32) * torch.logspace(-3, 3, 5)[None, :, None]
    x[0, 0, 32:64] = 0.0  # a group of zeros
    codes, scales = kv_codes(x.to(torch.bfloat16))
    assert codes.dtype == torch.int8 and codes.shape == x.shape and scales.shape == (3, 5, 4)
    blocks = x.to(torch.bfloat16).float().unflatten(-1, (4, 32))
    assert torch.equal(scales, blocks.abs().amax(-1) / 127)
    assert scales[0, 0, 1] == 0 and not codes[0, 0, 32:64].any()
    assert int(codes.abs().max()) == 127 and int(codes.min()) >= -127
    back = kv_values(codes, scales, torch.float32)
    # each value within half a step of its group's scale (and the product's own float32 rounding)
    error = (back - blocks.flatten(-2)).abs().unflatten(-1, (4, 32))
    assert (error <= scales[..., None] / 2 + back.abs().unflatten(-1, (4, 32)) * 2 ** -23).all()
    assert torch.equal(back.unflatten(-1, (4, 32)).abs().amax(-1), scales * 127)
    # halves go to even, as torch.round does
    half = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5] + [0.0] * 26)
    c, s = kv_codes(half)
    assert s.item() == 1.0 and c[:6].tolist() == [127, 0, 2, 2, 0, -2]


def test_a_non_finite_value_makes_its_group_read_as_nan():
    x = torch.ones(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    codes, scales = kv_codes(x)
    back = kv_values(codes, scales, torch.float32)
    assert back[0, :32].isnan().all() and back[1, 32:].isnan().all()
    assert torch.equal(back[0, 32:], x[0, 32:]) and torch.equal(back[1, :32], x[1, :32])
    assert not codes[0, :32].any() and not codes[1, 32:].any()  # no undefined cast of a NaN


def test_a_head_of_fewer_values_than_a_group_takes_one_scale():
    codes, scales = kv_codes(torch.arange(16, dtype=torch.float32)[None])
    assert scales.shape == (1, 1) and scales.item() == torch.tensor(15 / 127, dtype=torch.float32).item()
    assert value_bytes(8, 16, 2) == 1 + 4 / 16 and value_bytes(8, 128, 2) == 1.125 and value_bytes(16, 128, 2) == 2


def test_the_8_bit_cache_writes_and_reads_as_the_16_bit_one_rounded():
    """KVCache's torch path: a prompt of 3 then steps at the device position, in 8 bits, reads back the
    16-bit cache's values rounded by `kv_codes`, in the compute dtype; repeat and nbytes follow."""
    g = torch.Generator().manual_seed(1)
    full = KVCache.empty(2, 2, 2, 8, 64, torch.bfloat16, "cpu")
    small = KVCache.empty(2, 2, 2, 8, 64, torch.bfloat16, "cpu", bits=8)
    assert small.quantized and not full.quantized and small.k.dtype == torch.int8
    assert small.nbytes() == 2 * (2 * 2 * 2 * 8 * 64 + 4 * 2 * 2 * 2 * 8 * 2)
    assert full.nbytes() == 2 * (2 * 2 * 2 * 8 * 64) * 2
    for s in (3, 1, 1):
        for layer in range(2):
            k, v = (torch.randn(2, 2, s, 64, generator=g).to(torch.bfloat16) for _ in range(2))
            full.write(layer, k, v)
            small.write(layer, k, v)
        full.advance(s)
        small.advance(s)
    for layer in range(2):
        keys, values, _, _ = small.attended(layer, 1)
        want_k, want_v, _, _ = full.attended(layer, 1)
        assert keys.dtype == torch.bfloat16 and keys.shape == want_k.shape == (2, 2, 6, 64)
        assert torch.equal(keys, kv_values(*kv_codes(want_k), torch.bfloat16))
        assert torch.equal(values, kv_values(*kv_codes(want_v), torch.bfloat16))
        assert torch.equal(small.scales(layer)[0][:, :, :5], kv_codes(want_k[:, :, :5])[1])
    copies = small.repeat(2)
    assert copies.quantized and copies.rows == 4 and torch.equal(copies.k_scales[:, 2:], small.k_scales)
    assert copies.dtype == torch.bfloat16


def test_the_estimate_counts_the_8_bit_cache():
    cfg = {"num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
           "hidden_size": 4096}
    full = activation_bytes(cfg, 0, 8999, 2, 2)
    small = activation_bytes(cfg, 0, 8999, 2, 2, kv_bits=8)
    values = 2 * 8 * 9000 * 128  # a layer's keys, both rows
    assert full == 36 * 2 * values * 2
    assert small == 36 * 2 * values * 1.125 + 2 * values * (4 + 2)  # and one layer read back by torch's path


def test_the_switch_chooses_8_bits_on_the_gpu_code_path_only(monkeypatch):
    monkeypatch.setenv("MM3_GPU_INT8_KV_CACHE", "on")
    assert steps.kv_cache_bits("cpu", 128) == 16  # the CPU back end's path reads 16-bit caches
    assert steps.kv_cache_bits("meta", 128) == 16
    if INTERPRETED:
        with emulated():
            assert steps.kv_cache_bits("cpu", 128) == 8 and steps.kv_cache_bits("cpu", 16) == 8
            assert steps.kv_cache_bits("cpu", 96) == 16 and steps.kv_cache_bits("cpu", 8) == 16  # kernels refuse
    monkeypatch.setenv("MM3_GPU_INT8_KV_CACHE", "off")
    assert steps.kv_cache_bits(DEVICE, 128) == 16
    if INTERPRETED:
        with emulated():
            assert steps.kv_cache_bits("cpu", 128) == 16


@kernels_run
@pytest.mark.parametrize("position", [0, 17])
def test_the_preparation_writes_the_codes_torch_rounds(position):
    """`attention_kernels.prepare` into an 8-bit cache: the queries it returns and the codes and
    scales `kv_codes` makes of what it writes into a 16-bit cache, bit for bit; nothing else moves."""
    g = torch.Generator().manual_seed(2)
    b, heads, kv_heads, d, cap = 2, 8, 2, 128, 24
    _, (q, k, v), (qn, kn), (cos, sin) = _step_rows(g, position)
    k16, v16 = torch.zeros(b, kv_heads, cap, d, dtype=torch.bfloat16, device=DEVICE), \
        torch.zeros(b, kv_heads, cap, d, dtype=torch.bfloat16, device=DEVICE)
    k8, v8, scales = _quantized(_rand(g, b, kv_heads, cap, d), _rand(g, b, kv_heads, cap, d))
    before = [t.clone() for t in (k8, v8, *scales)]
    want_q = attention_kernels.prepare(q, k, v, qn, kn, EPS, cos, sin, k16, v16, _at(position), heads, kv_heads, d)
    with on_gpu_path(DEVICE):
        got_q = steps.prepare_attention(q, k, v, qn, kn, EPS, cos, sin, k8, v8, None, _at(position), scales)
    assert torch.equal(got_q, want_q)
    wk, wsk = kv_codes(k16[:, :, position])
    wv, wsv = kv_codes(v16[:, :, position])
    for got, want in ((k8[:, :, position], wk), (v8[:, :, position], wv), (scales[0][:, :, position], wsk),
                      (scales[1][:, :, position], wsv)):
        assert torch.equal(got, want), position
    others = torch.arange(cap, device=DEVICE) != position
    for got, was in zip((k8, v8, *scales), before):
        assert torch.equal(got[:, :, others], was[:, :, others])


@kernels_run
@pytest.mark.parametrize("split", [attention_kernels.SPLIT, 16])
def test_the_decode_attention_reads_each_code_times_its_scale(split, monkeypatch):
    """Over an 8-bit cache: the attention over the values it stands for (`kv_values`, each rounded to
    the compute dtype for the products) within the kernels' roundings; the scales past the filled
    keys are NaN (never read)."""
    monkeypatch.setattr(attention_kernels, "SPLIT", split)
    g = torch.Generator().manual_seed(3)
    b, heads, kv_heads, d, bucket = 2, 8, 2, 128, 48
    q = _rand(g, b, heads, 1, d)
    k8, v8, (sk, sv) = _quantized(_rand(g, b, kv_heads, bucket + 8, d), _rand(g, b, kv_heads, bucket + 8, d) * 4)
    for position in (0, 15, 16, 47):
        ks, vs = sk.clone(), sv.clone()
        ks[:, :, position + 1:] = float("nan")
        vs[:, :, position + 1:] = float("nan")
        with on_gpu_path(DEVICE):
            got = steps.decode_attention(q, k8, v8, _at(position), bucket, d ** -0.5, (ks, vs))
        keys = kv_values(k8[:, :, :position + 1], sk[:, :, :position + 1], torch.bfloat16)
        values = kv_values(v8[:, :, :position + 1], sv[:, :, :position + 1], torch.bfloat16)
        within_weight_rounding(got, q, keys, values, d ** -0.5)


@kernels_run
@pytest.mark.parametrize("position", [0, 15, 16, 47])
def test_the_attention_step_is_the_preparation_then_the_decode(position, monkeypatch):
    """`attention_kernels.step` over an 8-bit cache: the same bits as `prepare` then `decode` over it
    (the codes and scales written included; on a GPU, within the norms' float32 contraction)."""
    monkeypatch.setattr(attention_kernels, "SPLIT", 16)
    g = torch.Generator().manual_seed(4)
    b, heads, kv_heads, d, cap = 2, 8, 2, 128, 48
    fused, (q, k, v), (qn, kn), (cos, sin) = _step_rows(g, position)
    k8, v8, (sk, sv) = _quantized(_rand(g, b, kv_heads, cap, d), _rand(g, b, kv_heads, cap, d))
    one = [t.clone() for t in (k8, v8, sk, sv)]
    two = [t.clone() for t in (k8, v8, sk, sv)]
    pos = _at(position)
    rotated = attention_kernels.prepare(q, k, v, qn, kn, EPS, cos, sin, two[0], two[1], pos, heads, kv_heads, d,
                                        scales=(two[2], two[3]))
    want = attention_kernels.decode(rotated, two[0], two[1], pos, cap, d ** -0.5, scales=(two[2], two[3]))
    got = attention_kernels.step(fused.view(b, -1), qn, kn, EPS, cos, sin, one[0], one[1], pos, cap, d ** -0.5, heads,
                                 scales=(one[2], one[3]))
    if NATIVE:  # a GPU may contract the norm's float32 sums differently in the two kernels: a key a step apart
        for a, w in zip(one, two):
            if a.dtype == torch.int8:
                assert int((a.int() - w.int()).abs().max()) <= 1, position
            else:
                torch.testing.assert_close(a, w, rtol=1e-2, atol=1e-6)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    else:
        for a, w in zip(one, two):
            assert torch.equal(a, w), position
        assert torch.equal(got, want)


@kernels_run
def test_caches_the_kernels_do_not_take_are_refused():
    g = torch.Generator().manual_seed(5)
    q = _rand(g, 2, 4, 1, 64)
    k8, v8, (sk, sv) = _quantized(_rand(g, 2, 2, 8, 64), _rand(g, 2, 2, 8, 64))
    with on_gpu_path(DEVICE):
        assert steps.decode_attention(q, k8, v8, _at(3), 8, 0.1, (sk, sv)) is not None
        assert steps.decode_attention(q, k8, v8, _at(3), 8, 0.1) is None  # int8 without scales
        assert steps.decode_attention(q, k8, v8, _at(3), 8, 0.1, (sk.double(), sv)) is None
        assert steps.decode_attention(q, k8, v8, _at(3), 8, 0.1, (sk[..., :1].contiguous(), sv)) is None
        three = torch.zeros(2, 2, 8, 3, device=DEVICE)  # 64 values in 3 groups
        assert steps.decode_attention(q, k8, v8, _at(3), 8, 0.1, (three, three.clone())) is None
        small = _rand(g, 2, 4, 1, 8)  # heads of 8: under the tensor-core products' 16
        k8s, v8s, (sks, svs) = _quantized(_rand(g, 2, 2, 8, 8), _rand(g, 2, 2, 8, 8))
        assert steps.decode_attention(small, k8s, v8s, _at(3), 8, 0.1, (sks, svs)) is None
        assert steps.decode_attention(q, k8.float(), v8.float(), _at(3), 8, 0.1, (sk, sv)) is None


@pytest.mark.skipif(not INTERPRETED, reason="the emulated GPU code path (a GPU runs it in test_frame_graphs)")
def test_a_plan_runs_over_the_8_bit_cache(tiny, monkeypatch):
    """A whole AR plan on the emulated GPU code path with the switch on: its LM cache is 8-bit (the
    prompt written by torch's path, the frames by the kernels), and the tiny model draws the codes it
    draws over the 16-bit cache."""
    from mm3.files.opener import open_component
    from mm3.models.depth import RVQDepthDecoder
    from mm3.models.lm import Qwen3LM
    from mm3.plan.ar import PlanSettings, plan
    from mm3.plan.prompt import build_prompt
    from mm3.tokenizer import MM3Tokenizer
    from tests.backends.gpu.test_kernels import _Requantized

    made, empty = [], KVCache.empty  # whether each cache made is 8-bit

    def recording(*args, **kwargs):
        made.append(empty(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(KVCache, "empty", recording)
    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    codes = {}
    try:
        for flag in ("off", "on"):
            monkeypatch.setenv("MM3_GPU_INT8_KV_CACHE", flag)
            with emulated(), torch.inference_mode():
                lm, depth = Qwen3LM.load(_Requantized(lm_c)), RVQDepthDecoder.load(_Requantized(d_c))
                prompt = build_prompt(MM3Tokenizer.from_component(lm_c), "warm synth pop", "[verse]\nhello")
                codes[flag] = plan(lm, depth, prompt, PlanSettings(duration=0.12, lm_seed=5), weight_budget=0)[0].codes
    finally:
        lm_c.close()
        d_c.close()
    assert [cache.quantized for cache in made] == [False, True]
    assert made[1].k.dtype == torch.int8 and made[1].k_scales.abs().sum() > 0
    assert codes["on"].shape[0] >= 3 and torch.equal(codes["on"], codes["off"])
