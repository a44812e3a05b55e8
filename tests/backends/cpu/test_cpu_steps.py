"""An AR decode step's small operations in the kernel library (`mm3.backends.cpu.steps`): each against
torch's operations (bit for bit where the library promises it, else up to rounding), in the layers
that use them, and left to torch where the library cannot serve (no library looked up)."""

import gguf
import pytest
import torch
import torch.nn.functional as F

from mm3.bench.random_models import random_tensor
from mm3.backends import steps
from mm3.backends.cpu import native as cpu_native
from mm3.backends.cpu import steps as cpu_steps
from mm3.weights import layers as gguf_ops

Q = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(not cpu_native.available(),
                                  reason="the native integer kernel cannot be built here (no C compiler, or not x86-64)")


@needs_kernel
def test_the_kernels_rms_norm_is_torchs_up_to_rounding():
    """Rows contiguous or the heads of a wider row (q and k of the fused q/k/v product), one row a
    position or many; a layout it does not read is left to torch (None)."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 5, 1536, generator=g) * 7
    w = torch.randn(128, generator=g)
    cases = [torch.randn(2, 1, 1024, generator=g), torch.randn(2, 173, 1000, generator=g),
             wide[:, :, :1024].view(3, 5, 8, 128), wide[:1, :, 256:512].view(1, 5, 2, 128),
             wide[:, :1, 1024:].reshape(3, 1, 512)[:, :, :256].view(3, 1, 2, 128)]
    for x in cases:
        weight = torch.randn(x.shape[-1], generator=g)
        want = F.rms_norm(x, (x.shape[-1],), weight, 1e-6)
        got = cpu_steps.rms_norm(x, weight, 1e-6)
        assert got.shape == x.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert cpu_steps.rms_norm(wide.transpose(0, 1)[..., :1024].reshape(5, 3, 8, 128)[:, :, ::2], w, 1e-6) is None
    assert cpu_steps.rms_norm(torch.randn(2, 128, dtype=torch.bfloat16), w, 1e-6) is None



@needs_kernel
@pytest.mark.parametrize("qtype", cpu_steps.ROW_TYPES, ids=lambda t: t.name)
def test_an_embedding_lookup_is_gguf_pys_dequantization_bit_for_bit(qtype):
    n, k = 60, 512
    raw = torch.from_numpy(random_tensor("w", (n, k), qtype, torch.Generator().manual_seed(3))).reshape(n, -1)
    values = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).reshape(n, k))
    ids = torch.tensor([[59, 0, 17], [17, 3, 41]])
    assert torch.equal(cpu_steps.lookup(raw, qtype, ids, k), values[ids.reshape(-1)])
    layer = gguf_ops.Embedding(n, k)
    layer.set_stored("weight", qtype, raw)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(layer.lookup(ids, dtype), values[ids].to(dtype))
    with pytest.raises(IndexError, match="outside the table's 60 rows"):
        layer.lookup(torch.tensor([60]), torch.float32)


def test_an_embedding_of_a_type_the_library_does_not_read_is_dequantized_by_torch():
    n, k = 20, 256
    raw = torch.from_numpy(random_tensor("w", (n, k), Q.Q3_K, torch.Generator().manual_seed(4))).reshape(n, -1)
    assert cpu_steps.lookup(raw, Q.Q3_K, torch.tensor([1]), k) is None
    layer = gguf_ops.Embedding(n, k)
    layer.set_stored("weight", Q.Q3_K, raw)
    values = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q.Q3_K).reshape(n, k))
    ids = torch.tensor([[2, 19]])
    assert torch.equal(layer.lookup(ids, torch.float32), values[ids])


def test_the_library_is_not_loaded_for_what_it_cannot_serve(monkeypatch):
    """A norm or lookup on another device, or traced by torch.compile, is torch's: the library is
    neither built nor loaded for it (its lock would break a compiled graph)."""
    monkeypatch.setattr(cpu_native, "library", lambda: pytest.fail("the library was looked up"))
    x, w = torch.empty(2, 1, 64, device="meta"), torch.empty(64, device="meta")
    assert cpu_steps.rms_norm(x, w, 1e-6) is None
    assert cpu_steps.lookup(torch.empty(4, 34, dtype=torch.uint8, device="meta"), Q.Q8_0, torch.tensor([1]), 32) is None
    assert cpu_steps.lookup(torch.zeros(4, 34, dtype=torch.uint8), Q.Q8_0, torch.tensor([1.0]), 32) is None
    assert cpu_steps.attend(x, x, x, torch.empty(2, 1, 4, 64, device="meta"), torch.empty(2, 1, 4, 64, device="meta"),
                             0, 0.125) is None

    from mm3.models.lm import rms_norm

    torch._dynamo.reset()
    try:
        cpu = torch.randn(2, 1, 64), torch.randn(64)
        compiled = torch.compile(lambda a, b: rms_norm(a, b, 1e-6, True), backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(*cpu), F.rms_norm(cpu[0], (64,), cpu[1], 1e-6))
    finally:
        torch._dynamo.reset()


def _attention_reference(q, k, v, cache_k, cache_v, at):
    """torch's: the new keys and values written into copies of the caches, then SDPA with each new
    position seeing the cached ones and itself (query head h reads key head h // group)."""
    b, s, width = q.shape
    kv_heads, d = cache_k.shape[1], cache_k.shape[3]
    keys, values = cache_k.clone(), cache_v.clone()
    keys[:, :, at:at + s] = k.reshape(b, s, kv_heads, d).transpose(1, 2)
    values[:, :, at:at + s] = v.reshape(b, s, kv_heads, d).transpose(1, 2)
    mask = torch.arange(at + s)[None] <= torch.arange(at, at + s)[:, None]
    out = F.scaled_dot_product_attention(q.reshape(b, s, -1, d).transpose(1, 2), keys[:, :, :at + s],
                                         values[:, :, :at + s], attn_mask=mask, enable_gqa=width // d != kv_heads)
    return out.transpose(1, 2).reshape(b, s, width), keys, values


@needs_kernel
@pytest.mark.parametrize("b,s,heads,kv_heads,d,capacity,at", [(2, 1, 4, 4, 256, 16, 0), (2, 1, 4, 4, 256, 16, 7),
                                                              (2, 2, 4, 4, 256, 16, 0), (3, 3, 8, 2, 40, 12, 5),
                                                              (1, 1, 8, 2, 64, 300, 299)])
def test_the_kernels_attention_is_torchs_up_to_rounding(b, s, heads, kv_heads, d, capacity, at):
    """The new positions' keys and values land in the caches exactly; each new position attends
    over the cached ones and itself (the fused q/k/v product's output views, as the depth decoder
    has them)."""
    g = torch.Generator().manual_seed(at)
    fused = torch.randn(b, s, (heads + 2 * kv_heads) * d, generator=g)
    q, k, v = fused.split_with_sizes([heads * d, kv_heads * d, kv_heads * d], -1)
    cache_k, cache_v = (torch.randn(b, kv_heads, capacity, d, generator=g) for _ in range(2))
    want, keys, values = _attention_reference(q, k, v, cache_k, cache_v, at)
    got = cpu_steps.attend(q, k, v, cache_k, cache_v, at, d ** -0.5)
    assert torch.equal(cache_k, keys) and torch.equal(cache_v, values)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_attention_the_kernel_cannot_take_is_left_to_torch():
    q = k = v = torch.randn(2, 1, 64)
    cache = torch.zeros(2, 1, 8, 64)
    assert cpu_steps.attend(q, k, v, cache, cache.clone(), 8, 0.125) is None  # past the cache's end
    assert cpu_steps.attend(q.double(), k.double(), v.double(), cache.double(), cache.double(), 0, 0.125) is None
    assert cpu_steps.attend(q, k, v, cache.transpose(2, 3), cache.clone(), 0, 0.125) is None  # not contiguous
    assert cpu_steps.attend(q, k, v, torch.zeros(3, 1, 8, 64), torch.zeros(3, 1, 8, 64), 0, 0.125) is None  # rows
    wide = torch.randn(2, 1, 128)
    assert cpu_steps.attend(q, wide[..., :64], wide[..., 64:], cache, cache.clone(), 0, 0.125) is None  # strides
    assert torch.equal(cache, torch.zeros(2, 1, 8, 64))  # nothing written


@needs_kernel
def test_the_depth_decoders_fast_attention_matches_its_reference_step_by_step(monkeypatch):
    from mm3.models.depth import DepthAttention, DepthCache

    served = []
    real = cpu_steps.attend
    monkeypatch.setattr(cpu_steps, "attend", lambda *a: served.append(real(*a)) or served[-1])
    torch.manual_seed(0)
    ops = gguf_ops
    attention = DepthAttention(64, 4, ops)
    for layer in (attention.to_q, attention.to_k, attention.to_v, attention.to_out):
        layer.set_stored("weight", Q.F32, torch.randn(64, 64) / 8)
    caches = [DepthCache(2, 2, 4, 8, 16, torch.float32, torch.device("cpu")) for _ in range(2)]
    for s in (2, 1, 1, 1):
        x = torch.randn(2, s, 64)
        outs = []
        for fast, cache in zip((False, True), caches):
            attention.fast_numerics = fast
            outs.append(attention(x, cache, 1))
            cache.length += s
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert len(served) == 4 and all(out is not None for out in served)  # each fast step was the library's




def _served_natively(model, types: dict, component: str, seed: int):
    """`model` with random weights, each product's in types[its name] (Q8_0 by default) and served
    by the native kernel, its norms and tables float32, in the fast numerics."""
    from mm3.backends.cpu.forms import FORMS, Serving
    from mm3.models.lm import set_numerics

    g = torch.Generator().manual_seed(seed)
    for name, sub in model.named_modules():
        if isinstance(sub, gguf_ops.Linear):
            qtype = types.get(name.rsplit(".", 1)[-1], Q.Q8_0)
            raw = random_tensor("w", (sub.out_features, sub.in_features), qtype, g)
            sub.set_stored("weight", qtype, torch.from_numpy(raw))
            sub.cpu_form = Serving(FORMS["native"], component)
        elif isinstance(sub, gguf_ops.Vector):
            sub.set_stored("weight", Q.F32, torch.rand(*sub.slot_shapes["weight"], generator=g) + 0.5)
        elif isinstance(sub, gguf_ops.Embedding):
            sub.set_stored("weight", Q.F32, torch.randn(*sub.slot_shapes["weight"], generator=g))
    set_numerics(model, "fast")
    return model


def _native_depth(types: dict, seed: int = 0):
    """A depth decoder of two blocks (dim 256, 4 heads, intermediate 512), `_served_natively`."""
    from mm3.models.depth import RVQDepthDecoder

    hp = dict(hidden_size=256, num_attention_heads=4, audio_vocab_size=64, num_codebooks=8,
              max_position_embeddings=16, num_layers=2, intermediate_size=512)
    return _served_natively(RVQDepthDecoder(hp), types, "depth", seed)


Q4_K_M = {"to_q": Q.Q4_K, "to_k": Q.Q4_K, "to_v": Q.Q6_K, "to_out": Q.Q4_K, "gate_proj": Q.Q4_K, "up_proj": Q.Q4_K,
          "down_proj": Q.Q6_K}


@needs_kernel
@pytest.mark.parametrize("types", [{}, Q4_K_M], ids=["Q8_0", "Q4_K_M"])
def test_the_depth_decoders_blocks_in_one_call_match_its_blocks_step_by_step(monkeypatch, types):
    """A frame's depth steps (two positions, then one at a time) through the kernel library's one
    call against the same blocks' own products and torch operations; the caches agree too. With
    Q4_K_M the q/k/v product is three parts (v in Q6_K), gate/up one stacked packing."""
    model = _native_depth(types)
    served = []
    real = cpu_steps.depth_layers
    monkeypatch.setattr(cpu_steps, "depth_layers", lambda *a: served.append(real(*a)) or served[-1])
    caches = [model.new_cache(2, torch.float32, torch.device("cpu")) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    for s in (2, 1, 1, 1, 1, 1, 1):
        x = torch.randn(2, s, 256, generator=g)
        whole = model(x, caches[1])
        with monkeypatch.context() as apart:
            apart.setattr(cpu_steps, "depth_layers", lambda *a: None)
            blocks = model(x, caches[0])
        torch.testing.assert_close(whole, blocks, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-5, atol=1e-5)
    assert len(served) == 7 and all(out is not None for out in served)
    assert int(steps.held_parts(model).counts[0]) == (3 if types else 1)  # q/k/v: parts apart, or stacked



@needs_kernel
def test_packings_dropped_are_freed_and_the_blocks_parts_made_again():
    """The blocks' parts hold the packings weakly: a form switch or a move that drops them frees
    them at once, and the next step finds the parts made again (never the old addresses)."""
    import gc
    import weakref

    model = _native_depth({})
    cache = model.new_cache(2, torch.float32, torch.device("cpu"))
    x = torch.randn(2, 2, 256)
    first = model(x, cache)
    held = steps.held_parts(model)
    down = model.layers[0].down_proj
    old = weakref.ref(down.packings()["native"].weight)
    for block in model.layers:
        for product in block.products():
            product.drop_packing()
    gc.collect()
    assert old() is None and not held.alive()
    cache.reset()
    again = model(x, cache)
    assert steps.held_parts(model) is not held and steps.held_parts(model).alive()
    assert torch.equal(again, first)

@needs_kernel
def test_depth_blocks_with_an_adapter_run_block_by_block(monkeypatch):
    """An adapter beside a product (not the kernel's alone): every block runs itself."""
    from mm3.backends.products import LowRank

    model = _native_depth({})
    served = []
    monkeypatch.setattr(cpu_steps, "depth_layers", lambda *a: served.append(a))
    layer = model.layers[1].up_proj
    layer.set_low_rank(LowRank(((torch.randn(4, 256) / 16, torch.randn(512, 4) / 16, 1.0),)))
    cache = model.new_cache(2, torch.float32, torch.device("cpu"))
    out = model(torch.randn(2, 2, 256), cache)
    assert served == [] and out.shape == (2, 2, 256) and cache.length == 2


@needs_kernel
def test_depth_blocks_the_library_cannot_take_are_left_to_torch():
    model = _native_depth({})
    cache = model.new_cache(2, torch.float32, torch.device("cpu"))
    model(torch.randn(2, 2, 256), cache)  # the products chosen and their parts made
    parts = steps.held_parts(model)
    norms = [torch.ones(256)] * 4
    x = torch.randn(2, 1, 256)
    assert cpu_steps.depth_layers(x, norms, 1e-6, parts, cache.k, cache.v, 16, 0.125) is None  # past the end
    assert cpu_steps.depth_layers(x, norms[:2], 1e-6, parts, cache.k, cache.v, 2, 0.125) is None  # one block's norms
    assert cpu_steps.depth_layers(x.double(), norms, 1e-6, parts, cache.k, cache.v, 2, 0.125) is None
    assert cpu_steps.depth_layers(torch.randn(3, 1, 256), norms, 1e-6, parts, cache.k, cache.v, 2, 0.125) is None
    assert cpu_steps.depth_layers(x, norms, 1e-6, parts, cache.k[:1], cache.v[:1], 2, 0.125) is None

def _semantic_draw(logits, r, cfg, k, q, excluded):
    """FrameSampler's semantic draw by torch's operations (no shaping)."""
    from mm3.plan.sampling import draw, guide, kth_largest, top_k_probs

    c, u = (logits[0::2], logits[1::2]) if r == 2 else (logits, logits)
    if excluded is not None:
        c, u = c.masked_fill(excluded, -float("inf")), u.masked_fill(excluded, -float("inf"))
    guided = (guide(c, u, cfg) if r == 2 else c).masked_fill(c < kth_largest(c, k), -float("inf"))
    if excluded is not None:
        guided = guided.masked_fill(excluded, -float("inf"))
    return draw(top_k_probs(guided, k), q)


@needs_kernel
@pytest.mark.parametrize("gate", [False, True], ids=["acoustic", "semantic"])
def test_the_librarys_draws_are_torchs(gate):
    """Guided or not, one song or several, top-k below or above the width, many ties (rounded
    logits), infinite and NaN logits, excluded columns: the same index as torch's operations."""
    from mm3.plan.sampling import draw, guide, top_k_probs

    g = torch.Generator().manual_seed(int(gate))
    for trial in range(400):
        songs, r = 1 + trial % 3, 1 + (trial // 3) % 2
        n, k = (1024, 300, 7, 50)[trial % 4], (50, 1, 5, 2000)[(trial // 7) % 4]
        logits = torch.randn(songs * r, n, generator=g) * (1, 5, 30)[trial % 3]
        if trial % 11 == 0:
            logits = logits.round()
        if trial % 13 == 0:
            logits[0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0 if gate else float("nan")])
        excluded = None if not gate or trial % 4 == 0 else torch.rand(n, generator=g) < 0.3
        raw = cpu_steps.raw_draws(g, (songs, n))
        if trial % 17 == 0:  # zero draws: 0 / 0 is NaN where the probability is zero, and torch's argmax takes it
            raw[0, trial % n] = 1 << 60
            raw[-1, -1] = 0
        q = cpu_steps.exponentials(raw)
        if gate:
            want = _semantic_draw(logits, r, 1.7, k, q, excluded)
        else:
            want = draw(top_k_probs(guide(logits[0::2], logits[1::2], 1.7) if r == 2 else logits, k), q)
        assert torch.equal(cpu_steps.top_k_draw(logits, r, 1.7, k, q, excluded, gate), want), trial
        assert torch.equal(cpu_steps.top_k_draw(logits, r, 1.7, k, raw, excluded, gate), want), trial


@needs_kernel
def test_a_draw_from_raw_draws_is_torchs_draw():
    """Shaped probabilities' draw (the semantic code's with shaping) from raw draws: the same index
    as torch's over the Exponential values, zero draws and NaN probabilities included."""
    from mm3.plan.sampling import draw, make_generator

    g = make_generator(9)
    for trial in range(300):
        rows, n = 1 + trial % 3, (2000, 64, 5)[trial % 3]
        probs = torch.softmax(torch.randn(rows, n, generator=g) * 3, -1)
        probs = probs.masked_fill(probs < probs.topk(min(n, 40), -1).values[:, -1:], 0.0)
        raw = cpu_steps.raw_draws(g, (rows, n))
        if trial % 7 == 0:
            raw[0, trial % n] = 0  # a zero draw: 0 / 0 where the probability is zero
        if trial % 11 == 0:
            probs[-1, n // 2] = float("nan")
        want = draw(probs, cpu_steps.exponentials(raw))
        assert torch.equal(cpu_steps.draw_from_raw(probs, raw), want), trial
    assert cpu_steps.draw_from_raw(torch.rand(2, 8).double(), torch.zeros(2, 8, dtype=torch.int64)) is None
    assert cpu_steps.draw_from_raw(torch.rand(2, 8), torch.zeros(2, 9, dtype=torch.int64)) is None


@needs_kernel
def test_raw_draws_are_torchs_exponential_draws_bit_for_bit():
    """The library's draws from the generator's raw 64-bit values: each the Exponential(1) value
    torch makes of it, the generator consumed alike."""
    from mm3.plan.sampling import make_generator

    assert cpu_steps.raw_draws_exact()
    a, b = make_generator(5), make_generator(5)
    for shape in ((1, 1), (3, 1000), (7, 1024), (1, 16411)):
        want = torch.empty(shape).exponential_(generator=a)
        got = cpu_steps.exponentials(cpu_steps.raw_draws(b, shape))
        assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(a.get_state(), b.get_state())


@needs_kernel
@pytest.mark.parametrize("count", [1, 2, 311, 312, 313, 623, 624, 625, 10_000, 183_600])
def test_a_skip_leaves_the_generator_where_as_many_draws_leave_it(count):
    from mm3.plan.sampling import make_generator

    for lead in (0, 1, 155, 311):  # the generator partway through its words
        a, b = make_generator(count + lead), make_generator(count + lead)
        for gen in (a, b):
            torch.empty(lead, dtype=torch.int64).random_(generator=gen)
        torch.empty(count).exponential_(generator=a)
        assert cpu_steps.skip_draws(b, count)
        assert torch.equal(a.get_state(), b.get_state()), lead
        assert torch.equal(torch.empty(50).exponential_(generator=a), torch.empty(50).exponential_(generator=b))


def test_without_the_librarys_draw_arithmetic_the_draws_are_torchs(monkeypatch):
    """Where the check fails (another torch's generator), nothing is skipped by the library and the
    semantic draw's tail is still exact."""
    from mm3.plan.sampling import exponential_draws, exponential_tail, make_generator

    monkeypatch.setattr(cpu_steps, "raw_draws_exact", lambda: False)
    g = make_generator(1)
    state = g.get_state()
    assert not cpu_steps.skip_draws(g, 10) and torch.equal(g.get_state(), state)
    a, b = make_generator(2), make_generator(2)
    assert torch.equal(exponential_draws(5000, a)[:, 4000:], exponential_tail(5000, 4000, b))
    assert torch.equal(a.get_state(), b.get_state())


@needs_kernel
def test_draws_the_library_does_not_take_are_left_to_torch():
    logits, q = torch.randn(4, 64), torch.rand(2, 64) + 0.1
    assert cpu_steps.top_k_draw(logits.double(), 2, 1.5, 5, q) is None
    assert cpu_steps.top_k_draw(logits.T.contiguous().T, 2, 1.5, 5, q) is None  # rows not contiguous
    assert cpu_steps.top_k_draw(logits, 2, 1.5, 5, torch.rand(3, 64)) is None  # draws of other songs
    assert cpu_steps.top_k_draw(logits, 3, 1.5, 5, q) is None
    assert cpu_steps.top_k_draw(logits, 2, 1.5, 5, q, torch.zeros(63, dtype=torch.bool)) is None
    nan = logits.clone()
    nan[0, 3] = float("nan")
    assert cpu_steps.top_k_draw(nan, 2, 1.5, 5, q, gate=True) is None  # torch's order of NaNs is its own


@needs_kernel
def test_the_lms_decode_step_matches_its_torch_path_step_by_step(monkeypatch):
    """A prefill, then decode steps through the kernel library's one call (norms, rotation, cache
    write) and torch's attention, against the same layer's torch operations; the caches agree too."""
    from mm3.models.lm import KVCache, Qwen3Attention

    served = []
    real = cpu_steps.decode_prepare
    monkeypatch.setattr(cpu_steps, "decode_prepare", lambda *a: served.append(real(*a)) or served[-1])
    torch.manual_seed(0)
    cfg = {"hidden_size": 64, "head_dim": 16, "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-6}
    attention = Qwen3Attention(cfg, gguf_ops)
    for layer in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
        layer.set_stored("weight", Q.F32, torch.randn(layer.out_features, layer.in_features) / 8)
    for norm in (attention.q_norm, attention.k_norm):
        norm.set_stored("weight", Q.F32, torch.rand(16) + 0.5)
    caches = [KVCache.empty(2, 3, 2, 12, 16, torch.float32, torch.device("cpu")) for _ in range(2)]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    for s in (4, 1, 1, 1):
        x = torch.randn(3, s, 64)
        angles = (caches[0].length + torch.arange(s))[:, None].float() * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        outs = []
        for fast, cache in zip((False, True), caches):
            attention.fast_numerics = fast
            outs.append(attention(x, cos, sin, cache, 1))
            cache.advance(s)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-6)
        assert torch.equal(caches[1].v, caches[0].v)
    assert len(served) == 3 and all(out is not None for out in served)  # the decode steps were the library's



def _native_lm_layer(types: dict, seed: int = 0):
    """An LM layer (hidden 256, 4 heads of 64 over 2 key heads, intermediate 512), `_served_natively`."""
    from mm3.models.lm import Qwen3DecoderLayer

    cfg = {"hidden_size": 256, "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 512, "rms_norm_eps": 1e-6}
    return _served_natively(Qwen3DecoderLayer(cfg, gguf_ops), types, "lm", seed)


@needs_kernel
@pytest.mark.parametrize("types", [{}, {"v_proj": Q.Q6_K, "down_proj": Q.Q6_K, "q_proj": Q.Q4_K, "k_proj": Q.Q4_K,
                                        "o_proj": Q.Q4_K, "gate_proj": Q.Q4_K, "up_proj": Q.Q4_K}],
                         ids=["Q8_0", "Q4_K_M"])
def test_the_lms_decode_step_in_two_library_calls_matches_its_layer_step_by_step(monkeypatch, types):
    """A prefill, then decode steps through the kernel library's two calls around torch's attention
    against the same layer's own products and operations; the caches agree too."""
    from mm3.models.lm import KVCache

    layer = _native_lm_layer(types)
    served = []
    real = cpu_steps.lm_leave
    monkeypatch.setattr(cpu_steps, "lm_leave", lambda *a: served.append(real(*a)) or served[-1])
    caches = [KVCache.empty(2, 3, 2, 12, 64, torch.float32, torch.device("cpu")) for _ in range(2)]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    g = torch.Generator().manual_seed(2)
    for s in (4, 1, 1, 1):
        x = torch.randn(3, s, 256, generator=g)
        angles = (caches[0].length + torch.arange(s))[:, None].float() * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        whole = layer(x, cos, sin, caches[1], 1)
        with monkeypatch.context() as apart:
            apart.setattr(cpu_steps, "lm_enter", lambda *a: None)
            own = layer(x, cos, sin, caches[0], 1)
        for cache in caches:
            cache.advance(s)
        torch.testing.assert_close(whole, own, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-5, atol=1e-6)
    assert len(served) == 3 and all(out is not None for out in served)  # the decode steps were the library's
    assert int(steps.held_parts(layer).counts[0]) == (3 if types else 1)  # each part apart (v in Q6_K), or stacked


@needs_kernel
def test_an_lm_step_whose_layer_does_not_fit_writes_nothing():
    """lm_enter checks the whole layer's products (the second half's too) before it writes the
    cache, so a step it takes is one lm_leave finishes."""
    from mm3.backends import products
    from mm3.models.lm import KVCache

    layer = _native_lm_layer({})
    cpu = torch.device("cpu")
    qkv, out, gate_up, down = (products.native_parts(p.product_for(torch.float32, cpu), torch.float32, cpu)
                               for p in layer.products())
    swapped = cpu_steps.BlockParts([[qkv, out, down, gate_up]])  # the MLP's products in the wrong order
    cache = KVCache.empty(2, 3, 2, 12, 64, torch.float32, cpu)
    w, angles = torch.ones(64), torch.zeros(64)
    q = cpu_steps.lm_enter(torch.randn(3, 1, 256), torch.ones(256), 1e-6, swapped, w, w, 1e-6, angles, angles,
                           cache.k[1], cache.v[1], 0)
    assert q is None and not cache.k.any() and not cache.v.any()

@needs_kernel
def test_decode_steps_the_library_cannot_take_are_left_to_torch():
    q, kv = torch.randn(2, 1, 64), torch.randn(2, 1, 32)
    w, angles = torch.ones(16), torch.zeros(16)
    cache = torch.zeros(2, 2, 4, 16)
    args = (w, w, 1e-6, angles, angles)
    assert cpu_steps.decode_prepare(q, kv, kv, *args, cache, cache.clone(), 4) is None  # past the end
    assert cpu_steps.decode_prepare(torch.randn(2, 2, 64), torch.randn(2, 2, 32), torch.randn(2, 2, 32), *args, cache,
                                     cache.clone(), 0) is None  # two positions: not a decode step
    assert cpu_steps.decode_prepare(q, kv, kv, w, w, 1e-6, torch.zeros(8), angles, cache, cache.clone(),
                                     0) is None  # angles of another width
    assert cpu_steps.decode_prepare(q.double(), kv, kv, *args, cache, cache.clone(), 0) is None
    assert torch.equal(cache, torch.zeros(2, 2, 4, 16))


def test_a_shape_whose_skip_is_not_exact_is_drawn_whole(monkeypatch):
    """The library's twists skip only where this shape's skip was found exact: a torch whose
    Exponential draws of some size consume its generator otherwise draws them all."""
    from mm3.plan import sampling

    monkeypatch.setattr(sampling, "skip_is_exact", lambda n, start: False)
    g = sampling.make_generator(1)
    state = g.get_state()
    assert not sampling.skip_draws(5000, 4000, g) and torch.equal(g.get_state(), state)


def test_the_draw_arithmetic_is_checked_per_size(monkeypatch):
    """Once a size: the check asks for the library (and runs it) the first time only; another size
    is checked on its own. Sizes no other test draws, so neither was checked before."""
    asked = []
    real = cpu_native.library
    monkeypatch.setattr(cpu_native, "library", lambda: asked.append(1) or real())
    first = cpu_steps.raw_draws_exact(977)
    assert len(asked) == 1
    assert cpu_steps.raw_draws_exact(977) == first and len(asked) == 1
    assert cpu_steps.raw_draws_exact(1013) == first and len(asked) == 2
