"""The fast paths against the plain ones, CPU float32: packed decode products, the one-function AR
frame step (codes, hiddens and generator states equal to the plain loop's, END read one frame late),
the cheap skip of the semantic draw, and dequantized-weight caches of the ops layer.

The plain AR loop is itself checked against diffusers in test_ar.py; here the fast engine must give
the same codes on the tiny model and hiddens within float rounding (its products are shaped
differently), and consume every generator exactly as the plain loop (hence as the reference)."""

import types

import gguf
import pytest
import torch
import torch.nn.functional as F

from mm3.ar import ZeroFramesError, plan
from mm3.components import open_component
from mm3.fast.frame import supports
from mm3.fast.linear import decode_linear, pack_linears, pack_rows
from mm3.flow import sample_latents
from mm3.gguf import ops as gguf_ops
from mm3.gguf.encode import quantize
from mm3.gguf.reader import CompressedTensor, compressed_from_torch
from mm3.models.depth import RVQDepthDecoder
from mm3.models.dit import FlowDiT
from mm3.models.lm import Qwen3LM
from mm3.progress import Cancelled, Progress
from mm3.prompt import build_prompt
from mm3.sampling import exponential_draws, exponential_tail, make_generator
from mm3.tokenizer import MM3Tokenizer

Q = gguf.GGMLQuantizationType


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def tiny_ar(tiny, one_thread):
    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    tok = MM3Tokenizer.from_component(lm_c)
    yield types.SimpleNamespace(lm_c=lm_c, d_c=d_c, tok=tok, lm=Qwen3LM.load(lm_c), depth=RVQDepthDecoder.load(d_c),
                                prompt=build_prompt(tok, "warm synth pop", "[verse]\nhello there"))
    lm_c.close()
    d_c.close()


def _quantized(t: torch.Tensor, qtype) -> CompressedTensor:
    blocks = quantize(t.numpy(), qtype)  # gguf-py has no K-quant encoder
    return CompressedTensor("w", qtype, tuple(t.shape), torch.from_numpy(blocks.copy()).reshape(-1))


def _linear(k, n, qtype, g):
    layer = gguf_ops.Linear(k, n, bias=False)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    layer.fill("weight", compressed_from_torch("w", w) if qtype == Q.F32 else _quantized(w, qtype))
    return layer


# -- products and packed weights ---------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2, 4, 16, 40])
def test_decode_linear_equals_linear(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 1, 96, generator=g), torch.randn(200, 96, generator=g)
    y = decode_linear(x, w)
    assert y.shape == (rows, 1, 200) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtypes", [(Q.F32,) * 3, (Q.Q8_0,) * 3, (Q.Q8_0, Q.Q6_K, Q.Q8_0)])
def test_pack_linears_is_the_stacked_product_and_rebinds_in_place(qtypes):
    g = torch.Generator().manual_seed(0)
    layers = [_linear(256, n, t, g) for n, t in zip((64, 32, 32), qtypes)]
    x = torch.randn(2, 256, generator=g)
    before = [layer(x) for layer in layers]
    packed = pack_linears(layers)
    assert len(packed.segments) == (1 if len(set(qtypes)) == 1 else 3)
    after = [layer(x) for layer in layers]  # the plain forward on the rebound views: the same bytes
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    y = packed.linear(x, torch.float32)
    torch.testing.assert_close(y, torch.cat(before, dim=-1), rtol=1e-5, atol=1e-5)
    if len(set(qtypes)) == 1:  # one buffer; packing again finds the views adjacent and copies nothing
        again = pack_linears(layers)
        assert again.segments[0].data.data_ptr() == packed.segments[0].data.data_ptr()
    kept = packed.cache(torch.float32)
    assert kept == (0 if qtypes[0] == Q.F32 and len(set(qtypes)) == 1 else 128 * 256 * 4)
    assert torch.equal(packed.linear(x, torch.float32), y)  # a kept copy is the same dequantization


def test_pack_rows_of_a_quantized_head():
    g = torch.Generator().manual_seed(1)
    head = _linear(64, 300, Q.Q8_0, g)
    h = torch.randn(2, 64, generator=g)
    ranges = [(7, 8), (100, 300)]
    full = head(h)
    torch.testing.assert_close(pack_rows(head, ranges).linear(h, torch.float32),
                               torch.cat([full[:, 7:8], full[:, 100:300]], dim=-1), rtol=1e-5, atol=1e-5)


def test_exponential_tail_skips_exactly():
    for n, start in ((330, 261), (151739, 151670), (1000, 1)):
        a, b = make_generator(n), make_generator(n)
        for _ in range(3):
            assert torch.equal(exponential_draws(n, a)[:, start:], exponential_tail(n, start, b))
        assert torch.equal(a.get_state(), b.get_state())


# -- the AR engine ----------------------------------------------------------------------------------

def _both(t, **kw):
    """Plain and fast engines on the same generators; returns (plain, fast, plain gens, fast gens)."""
    n = kw.pop("lm_batch_size", 1)
    seeds = [kw.pop("lm_seed", 0) + i for i in range(n)]
    out = []
    for engine in ("plain", "fast"):
        gens = [make_generator(s) for s in seeds]
        songs = plan(t.lm, t.depth, t.prompt, lm_batch_size=n, generators=gens, engine=engine, **kw)
        out.append((songs, gens))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def _assert_same(plain, fast, gp, gf):
    for a, b in zip(plain, fast):
        assert torch.equal(a.codes, b.codes)
        assert a.ended_naturally == b.ended_naturally
        assert a.frame_hiddens.shape == b.frame_hiddens.shape
        assert rel(b.frame_hiddens, a.frame_hiddens) < 1e-5
    for a, b in zip(gp, gf):
        assert torch.equal(a.get_state(), b.get_state())


@pytest.mark.parametrize("songs", [1, 3])
def test_fast_engine_equals_plain(tiny_ar, songs):
    _assert_same(*_both(tiny_ar, duration=2.0, lm_seed=5, lm_batch_size=songs))


def test_static_shapes_step_equals_plain(tiny_ar):
    """The masked, bucketed attention a compiled step uses, run eagerly."""
    from mm3.fast import plan as fast_plan

    t = tiny_ar
    (ref,) = plan(t.lm, t.depth, t.prompt, duration=1.0, lm_seed=2, engine="plain")
    prompt = t.prompt
    cache = t.lm.new_cache(2, prompt.num_tokens + 26, torch.float32)
    last = t.lm(t.lm.embed(prompt.ids, torch.float32), cache)[:, -1]
    ((codes, hiddens, ended),) = fast_plan.sample_frames(
        t.lm, t.depth, prompt.codes, cache, last, [make_generator(2)], max_frames=25, lm_cfg=1.5, top_k=50,
        dtype=torch.float32, progress=Progress(), static_shapes=True)
    assert torch.equal(codes, ref.codes) and rel(hiddens, ref.frame_hiddens) < 1e-5


@pytest.fixture()
def ending_lm(tiny_ar):
    """The tiny LM with its END head row set to a multiple of one code's row: END then comes when
    that code would, at different frames for different seeds."""
    lm = Qwen3LM.load(tiny_ar.lm_c)
    cs = tiny_ar.prompt.codes
    w = lm.lm_head.get("weight", torch.float32).clone()
    w[cs.end_id] = w[cs.code_offset + 10]  # seeds 0..3: END after 25 and 3 frames, two songs run to the cap
    lm.lm_head.set_float("weight", w)
    return types.SimpleNamespace(**{**vars(tiny_ar), "lm": lm})


def test_end_one_frame_late_equals_plain(ending_lm):
    plain, fast, gp, gf = _both(ending_lm, duration=2.0, lm_seed=0, lm_batch_size=4)
    ended = [s.ended_naturally for s in plain]
    assert any(ended) and not all(ended)  # a song stopped early while the batch went on
    _assert_same(plain, fast, gp, gf)


def test_end_at_once_is_zero_frames(ending_lm):
    lm, prompt = ending_lm.lm, ending_lm.prompt
    cache = lm.new_cache(2, prompt.num_tokens, torch.float32)
    last = lm(lm.embed(prompt.ids, torch.float32), cache)[0, -1]  # the conditional hidden of frame 0
    w = lm.lm_head.get("weight", torch.float32).clone()
    w[prompt.codes.end_id] = 100 * last / last.norm()  # END wins the first draw
    lm.lm_head.set_float("weight", w)
    states = []
    for engine in ("plain", "fast"):
        g = make_generator(1)
        with pytest.raises(ZeroFramesError, match="song 0"):
            plan(ending_lm.lm, ending_lm.depth, ending_lm.prompt, duration=1.0, generators=g, engine=engine)
        states.append(g.get_state())
    assert torch.equal(*states)  # one semantic draw consumed, as the reference


def test_fast_progress_and_cancel(tiny_ar):
    calls = []
    prog = Progress(on_progress=lambda *a: calls.append(a), should_stop=lambda: len(calls) >= 5)
    with pytest.raises(Cancelled, match="before frame 5"):
        plan(tiny_ar.lm, tiny_ar.depth, tiny_ar.prompt, duration=2.0, lm_seed=0, progress=prog, engine="fast")
    assert [c[:3] for c in calls] == [("ar", n, 50) for n in range(5)]


def test_quantized_fast_engine_and_weight_cache(tiny_ar):
    """Q8_0 depth: kept dequantized copies give the very same numbers as per-product dequantization."""
    tensors = {}
    for name, t in tiny_ar.d_c.tensors.items():
        values = t.raw.view(torch.float32).view(t.shape).clone()
        tensors[name] = _quantized(values, Q.Q8_0) if len(t.shape) == 2 else compressed_from_torch(name, values)
    depth = RVQDepthDecoder(tiny_ar.d_c.hparams)
    gguf_ops.load_tensors(depth, tensors, source="q8")
    runs = [plan(tiny_ar.lm, depth, tiny_ar.prompt, duration=1.0, lm_seed=4, engine="fast", cache_budget=b)[0]
            for b in (0, 1 << 40)]
    assert torch.equal(runs[0].codes, runs[1].codes) and torch.equal(runs[0].frame_hiddens, runs[1].frame_hiddens)


def test_other_ops_layers_fall_back_to_plain(tiny_ar):
    class Counting(gguf_ops.Linear):
        pass

    ops = types.SimpleNamespace(Linear=Counting, Embedding=gguf_ops.Embedding, Vector=gguf_ops.Vector)
    depth = RVQDepthDecoder(tiny_ar.d_c.hparams, ops)
    gguf_ops.load_tensors(depth, tiny_ar.d_c.tensors, source="test")
    assert "Counting" in supports(tiny_ar.lm, depth)
    with pytest.raises(ValueError, match="engine 'fast' cannot run"):
        plan(tiny_ar.lm, depth, tiny_ar.prompt, duration=0.4, lm_seed=0, engine="fast")
    (song,) = plan(tiny_ar.lm, depth, tiny_ar.prompt, duration=0.4, lm_seed=0)  # auto: the plain loop
    assert song.frames == 10


# -- dequantized-weight cache of the ops layer -------------------------------------------------------

def test_dit_weight_cache_keeps_numbers(tiny):
    comp = open_component(tiny.file("mm3-dit"), expect="dit")
    cond_c = open_component(tiny.file("mm3-cond"), expect="cond")
    try:
        from mm3.models.cond import ConditionEncoder

        tensors = {}
        for name, t in comp.tensors.items():
            values = t.raw.view(torch.float32).view(t.shape).clone()
            big = len(t.shape) == 2 and t.shape[-1] % 32 == 0
            tensors[name] = _quantized(values, Q.Q8_0) if big else compressed_from_torch(name, values)
        dit = FlowDiT(comp.hparams)
        gguf_ops.load_tensors(dit, tensors, source="q8")
        cond = ConditionEncoder.load(cond_c)
        fh = torch.randn(1, 30, cond.num_layers * cond.hidden_dim, generator=torch.Generator().manual_seed(0))
        plain = sample_latents(cond, dit, fh, steps=3, seed=1, weight_cache=0)
        kept = sample_latents(cond, dit, fh, steps=3, seed=1, weight_cache=1 << 40)
        assert all(torch.equal(a, b) for a, b in zip(plain, kept))
        assert gguf_ops.dequantized_nbytes(dit) == 0  # released after the call
        used = gguf_ops.cache_dequantized(dit, torch.float32, budget_bytes=40_000)
        assert 0 < used <= 40_000 and gguf_ops.dequantized_nbytes(dit) == used
        assert gguf_ops.release_dequantized(dit) == used
    finally:
        comp.close()
        cond_c.close()


def test_weight_budget_on_mps_and_xpu(monkeypatch):
    """Apple silicon and Intel GPUs get a budget from their own memory APIs (with none, every AR
    product would dequantize its whole weight again)."""
    from mm3.fast import budget

    gib = 1 << 30
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 * gib, raising=False)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 5 * gib, raising=False)
    assert budget.free_bytes(torch.device("mps")) == 11 * gib
    assert budget.ar_weight_budget(torch.device("mps")) == 11 * gib - budget.RESERVE_BYTES
    monkeypatch.setattr(torch.xpu, "mem_get_info", lambda device=None: (6 * gib, 8 * gib), raising=False)
    assert budget.free_bytes(torch.device("xpu")) == 6 * gib
    assert budget.dit_weight_budget(torch.device("xpu")) == 5 * gib
    monkeypatch.delattr(torch.mps, "recommended_max_memory")
    assert budget.free_bytes(torch.device("mps")) is None and budget.ar_weight_budget(torch.device("mps")) == 0
