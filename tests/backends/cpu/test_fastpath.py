"""The fast numerics against the reference numerics, CPU float32: fused and decode-shaped products,
the head rows of the candidates, the one AR decode path (codes, hiddens and generator states equal
for models loaded either way, END read one frame late), the cheap skip of the semantic draw, and
dequantized-weight caches of the ops layer.

The reference numerics are themselves checked against diffusers in test_ar.py; here the fast models
must give the same codes on the tiny model and hiddens within float rounding (their products are
shaped differently), and consume every generator exactly as the reference does."""

import types

import gguf
import pytest
import torch
import torch.nn.functional as F

from mm3.plan import ar
from mm3.backends import device as budget
from mm3.plan.ar import PlanSettings, ZeroFramesError, plan
from mm3.files.opener import open_component
from mm3.synth.flow import encode_conditions, sample_latents
from mm3.backends.cpu import native as cpu_native, steps as cpu_steps
from mm3.weights import layers as gguf_ops
from mm3.weights import copies as weight_copies
from mm3.formats.gguf.encode import quantize
from mm3.formats.gguf.reader import CompressedTensor, compressed_from_torch
from mm3.backends.cpu.matmul import weight_major_linear
from mm3.models.depth import RVQDepthDecoder
from mm3.models.dit import FlowDiT
from mm3.models.lm import Qwen3LM, set_numerics
from mm3.progress import Cancelled, Progress
from mm3.plan.prompt import build_prompt
from mm3.plan.sampling import exponential_draws, exponential_tail, make_generator
from mm3.tokenizer import MM3Tokenizer

Q = gguf.GGMLQuantizationType


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def tiny_ar(tiny, one_thread):
    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    tok = MM3Tokenizer.from_component(lm_c)
    yield types.SimpleNamespace(lm_c=lm_c, d_c=d_c, tok=tok, lm=Qwen3LM.load(lm_c), depth=RVQDepthDecoder.load(d_c),
                                lm_ref=Qwen3LM.load(lm_c, numerics="reference"),
                                depth_ref=RVQDepthDecoder.load(d_c, numerics="reference"),
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


# -- products and fused weights ----------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2, 4, 16, 40])
def test_weight_major_linear_equals_linear(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 1, 96, generator=g), torch.randn(200, 96, generator=g)
    y = weight_major_linear(x, w)
    assert y.shape == (rows, 1, 200) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    if rows <= 16:  # a few rows: w @ x.T itself
        assert torch.equal(y.view(rows, 200), torch.mm(w, x.view(rows, 96).T).T)


@pytest.mark.parametrize("qtypes", [(Q.F32,) * 3, (Q.Q8_0,) * 3, (Q.Q8_0, Q.Q6_K, Q.Q8_0)])
def test_fused_is_the_stacked_product_and_restacks_in_place(qtypes):
    g = torch.Generator().manual_seed(0)
    layers = [_linear(256, n, t, g) for n, t in zip((64, 32, 32), qtypes)]
    x = torch.randn(2, 256, generator=g)
    before = [layer(x) for layer in layers]
    fused = gguf_ops.Fused(layers)
    y = torch.cat(fused(x), dim=-1)
    after = [layer(x) for layer in layers]  # each part on its own, after the fused product: the same bytes
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    torch.testing.assert_close(y, torch.cat(before, dim=-1), rtol=1e-5, atol=1e-5)
    w = fused.stacked_weight(torch.float32, "cpu")
    if qtypes[0] == Q.F32:  # float parts became views of one stack; stacking again copies nothing
        assert fused.stacked_weight(torch.float32, "cpu").data_ptr() == w.data_ptr() == \
            layers[0].stored("weight").data_ptr()
    kept = fused.keep_dequantized(torch.float32)
    assert kept == (0 if qtypes[0] == Q.F32 else 128 * 256 * 4)
    assert torch.equal(torch.cat(fused(x), dim=-1), y)  # a kept copy is the same dequantization
    fused.fuse = False  # the reference's separate products
    assert all(torch.equal(a, b) for a, b in zip(fused(x), before))


def test_fused_parts_not_resident_give_the_same_product():
    """Parts that cannot serve as a resident stack (another dtype here; another device under a
    memory manager) are written into one buffer per use: the very product of the stacked floats."""
    g = torch.Generator().manual_seed(3)
    layers = []
    for n in (32, 64):
        layer = gguf_ops.Linear(128, n, bias=False)
        layer.set_float("weight", (torch.randn(n, 128, generator=g) / 8).half())
        layers.append(layer)
    x = torch.randn(2, 128, generator=g)
    y = torch.cat(gguf_ops.Fused(layers)(x), dim=-1)
    assert torch.equal(y, F.linear(x, torch.cat([layer.stored("weight").float() for layer in layers])))
    assert all(layer.stored("weight").dtype == torch.float16 for layer in layers)  # nothing re-stacked


def test_head_rows_of_a_quantized_head():
    g = torch.Generator().manual_seed(1)
    head = _linear(64, 300, Q.Q8_0, g)
    h = torch.randn(2, 64, generator=g)
    full = head(h)
    rows = head.rows(100, 300)
    assert rows.stored("weight").data_ptr() == head.stored("weight")[100].data_ptr()  # a view: nothing copied
    torch.testing.assert_close(rows(h), full[:, 100:300], rtol=1e-5, atol=1e-5)


def test_exponential_tail_skips_exactly():
    for n, start in ((330, 261), (151739, 151670), (1000, 1)):
        a, b = make_generator(n), make_generator(n)
        for _ in range(3):
            assert torch.equal(exponential_draws(n, a)[:, start:], exponential_tail(n, start, b))
        assert torch.equal(a.get_state(), b.get_state())


def test_raw_frame_draws_are_the_exponential_ones():
    """A frame's draws as raw 64-bit values (the kernel library's draws): torch's Exponential ones
    once made, the generators consumed alike, an ended song's rows placeholders of either kind."""
    from mm3.backends.cpu import steps as cpu_steps

    if not cpu_steps.raw_draws_exact():
        pytest.skip("no kernel library on this machine (no C compiler): the frame's draws are torch's")
    kinds = [ar.FrameDraws([make_generator(s) for s in (3, 4)], 330, (200, 264), 8, 64, raw) for raw in (False, True)]
    for active in ([True, True], [True, False], [False, True]):
        (sem, dep), (raw_sem, raw_dep) = (k.frame(active) for k in kinds)
        assert raw_sem.dtype == raw_dep.dtype == torch.int64 and sem.shape == raw_sem.shape == (2, 64)
        for i, on in enumerate(active):
            if on:
                assert torch.equal(cpu_steps.exponentials(raw_sem[i]), sem[i])
                assert torch.equal(cpu_steps.exponentials(raw_dep[i]), dep[i])
    for a, b in zip(*(k.generators for k in kinds)):
        assert torch.equal(a.get_state(), b.get_state())


# -- the AR decode path -----------------------------------------------------------------------------

def _both(t, duration, lm_seed=0, songs=1, lm=None, lm_ref=None):
    """Reference and fast numerics on the same generators; returns (ref, fast, ref gens, fast gens)."""
    seeds = [lm_seed + i for i in range(songs)]
    out = []
    for lm_, depth in ((lm_ref or t.lm_ref, t.depth_ref), (lm or t.lm, t.depth)):
        gens = [make_generator(s) for s in seeds]
        out.append((plan(lm_, depth, t.prompt, PlanSettings(duration=duration, songs=songs), generators=gens), gens))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def _assert_same(ref, fast, gr, gf):
    for a, b in zip(ref, fast):
        assert torch.equal(a.codes, b.codes)
        assert a.ended_naturally == b.ended_naturally
        assert a.frame_hiddens.shape == b.frame_hiddens.shape
        assert rel(b.frame_hiddens, a.frame_hiddens) < 1e-5
    for a, b in zip(gr, gf):
        assert torch.equal(a.get_state(), b.get_state())


@pytest.mark.parametrize("songs", [1, 3])
def test_fast_numerics_equal_reference_numerics(tiny_ar, songs):
    _assert_same(*_both(tiny_ar, 2.0, lm_seed=5, songs=songs))


def test_fast_lm_keeps_only_the_candidate_head_rows(tiny_ar):
    cs, lm = tiny_ar.prompt.codes, tiny_ar.lm
    lo, hi = lm.head_ids
    assert (lo, hi) == (min(cs.end_id, cs.code_offset), max(cs.end_id + 1, cs.code_offset + cs.num_semantic))
    assert lm.lm_head.out_features == hi - lo < lm.vocab_size
    assert tiny_ar.lm_ref.head_ids == (0, lm.vocab_size)


def test_static_shapes_step_equals_reference(tiny_ar):
    """The masked, bucketed attention a compiled step uses, run eagerly."""
    t = tiny_ar
    (ref,) = plan(t.lm_ref, t.depth_ref, t.prompt, PlanSettings(duration=1.0, lm_seed=2))
    prompt = t.prompt
    cache = t.lm.new_cache(2, prompt.num_tokens + 26, torch.float32, "cpu")
    last = t.lm(t.lm.embed(prompt.ids, torch.float32), cache)[:, -1]
    sampler = ar.FrameSampler(t.lm, t.depth, prompt.codes, cache, PlanSettings(duration=1.0), torch.float32,
                              torch.device("cpu"))
    sampler.last = last
    draws = ar.FrameDraws([make_generator(2)], t.lm.vocab_size, t.lm.head_ids, 8, t.depth.audio_vocab)
    ((codes, hiddens, ended),) = ar.sample_frames(sampler, draws, max_frames=25, device=torch.device("cpu"),
                                                   progress=Progress(), static_shapes=True)
    assert torch.equal(codes, ref.codes) and rel(hiddens, ref.frame_hiddens) < 1e-5


def _set_head_row(lm: Qwen3LM, token: int, row: torch.Tensor):
    """Set the LM-head row of vocabulary id `token` (the head may hold only a range of rows)."""
    w = lm.lm_head.get("weight", torch.float32).clone()
    w[token - lm.head_ids[0]] = row
    lm.lm_head.set_float("weight", w)


def _head_row(lm: Qwen3LM, token: int) -> torch.Tensor:
    return lm.lm_head.get("weight", torch.float32)[token - lm.head_ids[0]]


@pytest.fixture()
def ending_lms(tiny_ar):
    """The tiny LM (both numerics) with its END head row set to one code's row: END then comes when
    that code would, at different frames for different seeds."""
    cs = tiny_ar.prompt.codes
    lms = [Qwen3LM.load(tiny_ar.lm_c, numerics=n) for n in ("reference", "fast")]
    for lm in lms:
        _set_head_row(lm, cs.end_id, _head_row(lm, cs.code_offset + 10).clone())  # seeds 0..3: two songs end
    return lms


def test_end_one_frame_late_equals_reference(tiny_ar, ending_lms):
    lm_ref, lm = ending_lms
    ref, fast, gr, gf = _both(tiny_ar, 2.0, lm_seed=0, songs=4, lm=lm, lm_ref=lm_ref)
    ended = [s.ended_naturally for s in ref]
    assert any(ended) and not all(ended)  # a song stopped early while the batch went on
    _assert_same(ref, fast, gr, gf)


def test_end_at_once_is_zero_frames(tiny_ar, ending_lms):
    prompt = tiny_ar.prompt
    states = []
    for lm, depth in zip(ending_lms, (tiny_ar.depth_ref, tiny_ar.depth)):
        cache = lm.new_cache(2, prompt.num_tokens, torch.float32, "cpu")
        last = lm(lm.embed(prompt.ids, torch.float32), cache)[0, -1]  # the conditional hidden of frame 0
        _set_head_row(lm, prompt.codes.end_id, 100 * last / last.norm())  # END wins the first draw
        g = make_generator(1)
        with pytest.raises(ZeroFramesError, match="song 0"):
            plan(lm, depth, prompt, PlanSettings(duration=1.0), generators=g)
        states.append(g.get_state())
    assert torch.equal(*states)  # one semantic draw consumed, as the reference


def test_reference_numerics_progress_and_cancel(tiny_ar):
    calls = []
    prog = Progress(on_progress=lambda *a: calls.append(a), should_stop=lambda: len(calls) >= 5)
    with pytest.raises(Cancelled, match="before frame 5"):
        plan(tiny_ar.lm_ref, tiny_ar.depth_ref, tiny_ar.prompt, PlanSettings(duration=2.0, lm_seed=0), progress=prog)
    assert [c[:3] for c in calls] == [("ar", n, 50) for n in range(5)]


def test_quantized_weights_and_weight_cache(tiny_ar):
    """Q8_0 depth: kept dequantized copies give the very same numbers as per-product dequantization."""
    tensors = {}
    for name, t in tiny_ar.d_c.tensors.items():
        values = t.raw.view(torch.float32).view(t.shape).clone()
        tensors[name] = _quantized(values, Q.Q8_0) if len(t.shape) == 2 else compressed_from_torch(name, values)
    depth = RVQDepthDecoder(tiny_ar.d_c.hparams)
    gguf_ops.load_tensors(depth, tensors, source="q8")
    set_numerics(depth, "fast")
    runs = [plan(tiny_ar.lm, depth, tiny_ar.prompt, PlanSettings(duration=1.0, lm_seed=4), weight_budget=b)[0]
            for b in (0, 1 << 40)]
    assert torch.equal(runs[0].codes, runs[1].codes) and torch.equal(runs[0].frame_hiddens, runs[1].frame_hiddens)
    assert weight_copies.dequantized_nbytes(depth) == 0  # released after the call


def test_other_ops_layers_run_the_same_decode_path(tiny_ar, monkeypatch):
    """Another `ops` implementation (a ComfyUI cast layer, a fused kernel) is a subclass: the same
    frame step runs over it and gives the same codes."""
    calls = []

    class Counting(gguf_ops.Linear):
        def forward(self, x):
            calls.append(self.out_features)
            return super().forward(x)

    ops = types.SimpleNamespace(Linear=Counting, Embedding=gguf_ops.Embedding, Vector=gguf_ops.Vector)
    depth = RVQDepthDecoder(tiny_ar.d_c.hparams, ops)
    gguf_ops.load_tensors(depth, tiny_ar.d_c.tensors, source="test")
    set_numerics(depth, "fast")
    steps = []
    real_step = ar.FrameSampler.step
    monkeypatch.setattr(ar.FrameSampler, "step", lambda self, *a: steps.append(1) or real_step(self, *a))
    settings = PlanSettings(duration=0.4, lm_seed=0)
    (song,) = plan(tiny_ar.lm, depth, tiny_ar.prompt, settings)
    (same,) = plan(tiny_ar.lm, tiny_ar.depth, tiny_ar.prompt, settings)
    assert song.frames == 10 and torch.equal(song.codes, same.codes)
    assert len(steps) == 2 * 11 and calls  # frames 0..10 of each run, all through FrameSampler.step


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
        fh = torch.randn(30, cond.num_layers * cond.hidden_dim, generator=torch.Generator().manual_seed(0))
        conditions = encode_conditions(cond, fh)
        plain = sample_latents(dit, conditions, steps=3, seed=1, weight_cache=0)
        kept = sample_latents(dit, conditions, steps=3, seed=1, weight_cache=1 << 40)
        assert all(torch.equal(a, b) for a, b in zip(plain, kept))
        assert weight_copies.dequantized_nbytes(dit) == 0  # released after the call
        used = weight_copies.cache_dequantized(dit, torch.float32, budget_bytes=40_000)
        assert 0 < used <= 40_000 and weight_copies.dequantized_nbytes(dit) == used
        assert weight_copies.release_dequantized(dit) == used
    finally:
        comp.close()
        cond_c.close()


def test_weight_budget_on_mps_and_xpu(monkeypatch):
    """Apple silicon and Intel GPUs get a budget from their own memory APIs (with none, every AR
    product would dequantize its whole weight again)."""
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


def test_ar_memory_estimate_counts_the_rows_a_song_takes():
    """What ComfyUI's loader keeps free for the AR stage follows `rows_per_song`: guidance exactly 1
    on an accelerator takes one LM row per song, half the KV cache and prefill of two rows."""
    from nodes.handles import ar_memory

    hp = {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
          "hidden_size": 256}
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    two = ar.activation_bytes(hp, 100, 500, 3, 1.5, gpu, 2)
    assert two == 2 * 4 * 6 * 2 * 601 * 64 * 2 + 3 * 6 * 100 * 512 * 4  # K and V of 6 rows; the prefill's MLP
    assert ar_memory(hp, 100, 500, 3, 1.0, gpu, 2) * 2 == two
    assert ar_memory(hp, 100, 500, 3, 1.0, cpu, 2) == two == ar.activation_bytes(hp, 100, 500, 3, 1.0, gpu, 2,
                                                                                  numerics="reference")


def test_guidance_one_runs_one_row_per_song(tiny_ar, monkeypatch):
    """With lm_cfg exactly 1 the fast numerics on an accelerator run the conditional row only (the
    unconditional one is work thrown away): the codes of the two-row run, hiddens within float
    rounding (a batch of half the rows), a cache of one row per song. Reference numerics and the CPU
    (where one row is slower) keep both rows."""
    t = tiny_ar
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert ar.rows_per_song("fast", 1.0, gpu) == 1 and ar.rows_per_song("fast", 1.5, gpu) == 2
    assert ar.rows_per_song("reference", 1.0, gpu) == 2 and ar.rows_per_song("fast", 1.0, cpu) == 2
    settings = PlanSettings(duration=1.2, lm_seed=4, lm_cfg=1.0, songs=2)
    caches = []
    real_new_cache = type(t.lm).new_cache
    monkeypatch.setattr(type(t.lm), "new_cache", lambda self, rows, *a, **k: caches.append(rows) or
                        real_new_cache(self, rows, *a, **k))
    monkeypatch.setattr(ar, "rows_per_song", lambda lm, cfg, device: 1)  # as on an accelerator
    one = plan(t.lm, t.depth, t.prompt, settings)
    monkeypatch.setattr(ar, "rows_per_song", lambda lm, cfg, device: 2)
    two = plan(t.lm, t.depth, t.prompt, settings)
    assert caches == [1, 2]
    for a, b in zip(one, two):
        assert torch.equal(a.codes, b.codes)
        assert rel(a.frame_hiddens, b.frame_hiddens) < 1e-5


def test_rms_norm_is_the_references_arithmetic_bit_for_bit():
    """On the CPU in float32 `rms_norm` is torch's fused call; it must give the reference's
    composite (variance in float32, rsqrt, scale) to the last bit, or the reference numerics drift."""
    from mm3.models.lm import rms_norm

    g = torch.Generator().manual_seed(0)
    for shape in ((2, 1, 1024), (2, 1, 8, 128), (2, 173, 8, 128), (3, 7, 64)):
        for scale in (1e-3, 1.0, 30.0):
            x, w = torch.randn(*shape, generator=g) * scale, torch.randn(shape[-1], generator=g)
            want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
            assert torch.equal(rms_norm(x, w, 1e-6), want), (shape, scale)


def test_scratch_made_in_inference_mode_is_replaced_outside_it():
    """The stages run in inference mode; a dequantization into the scratch buffer after them,
    outside it, must get a buffer it can write."""
    from mm3.weights.scratch import Scratch

    scratch = Scratch()
    with torch.inference_mode():
        scratch.take((4, 8), torch.float32).fill_(1.0)
    with torch.no_grad():
        scratch.take((4, 8), torch.float32).fill_(2.0)  # would raise on the inference tensor
    with torch.inference_mode():
        assert scratch.take((2, 8), torch.float32).sum().item() == 32.0  # its buffer kept inside


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("keys", [1, 37, 300])
def test_one_query_attention_is_torchs_attention(heads, kv_heads, keys):
    """The decode step's attention as two products: torch's fused attention up to float rounding,
    grouped heads and the bucket mask of a compiled step included."""
    from mm3.models.lm import one_query_attention

    g = torch.Generator().manual_seed(keys)
    q = torch.randn(2, heads, 1, 64, generator=g)
    k, v = torch.randn(2, kv_heads, keys, 64, generator=g) * 3, torch.randn(2, kv_heads, keys, 64, generator=g)
    mask = (torch.arange(keys) <= keys // 2)[None, None, None]
    for m in (None, mask):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.125, enable_gqa=heads != kv_heads)
        got = one_query_attention(q, k, v, m, 0.125)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if keys > 1:  # the masked keys take no part
        k2 = k.clone()
        k2[:, :, keys // 2 + 1:] = 1e4
        torch.testing.assert_close(one_query_attention(q, k2, v, mask, 0.125),
                                   one_query_attention(q, k, v, mask, 0.125))


def test_the_fast_lm_steps_attend_by_products_on_the_cpu(tiny_ar, monkeypatch):
    """Fast numerics: a decode step's attention is `one_query_attention`, a prompt's is torch's;
    the reference numerics keep torch's everywhere."""
    from mm3.models import lm as lm_module

    calls = []
    real = lm_module.one_query_attention
    monkeypatch.setattr(lm_module, "one_query_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    for model, expected in ((tiny_ar.lm, 1), (tiny_ar.lm_ref, 0)):
        calls.clear()
        cache = model.new_cache(2, tiny_ar.prompt.num_tokens + 2, torch.float32, "cpu")
        model(model.embed(tiny_ar.prompt.ids, torch.float32), cache)
        assert calls == []
        model(torch.randn(2, 1, model.hidden_size), cache)
        assert len(calls) == expected * len(model.model.layers)


@pytest.mark.skipif(not cpu_native.available(), reason="the native kernel library cannot be built here")
def test_the_fast_models_norm_through_the_kernel_library(tiny_ar, monkeypatch):
    """Every RMSNorm of the LM and depth decoder in the fast numerics on the CPU is one call of the
    kernel library; the reference numerics keep torch's."""
    calls = []
    real = cpu_steps.rms_norm
    monkeypatch.setattr(cpu_steps, "rms_norm", lambda *a: calls.append(a[0].shape) or real(*a))
    for lm, depth, expected in ((tiny_ar.lm, tiny_ar.depth, True), (tiny_ar.lm_ref, tiny_ar.depth_ref, False)):
        calls.clear()
        lm(torch.randn(2, 3, lm.hidden_size), lm.new_cache(2, 8, torch.float32, "cpu"))
        depth(torch.randn(2, 3, depth.hidden_size))
        norms = len(lm.model.layers) * 4 + 1 + len(depth.layers) * 2 + 1
        assert len(calls) == (norms if expected else 0)
