"""The AR stage against diffusers 0.42.1 on the small-vocabulary tiny model, CPU float32, 1 thread.

One reference run per song length is shared by the module (the reference import alone takes
seconds). 2.0 s = 50 frames (one denoise window); 8.4 s = 210 frames (two windows).
"""

import types

import pytest
import torch

from mm3.plan.ar import PlanSettings, ZeroFramesError, max_frames_for, plan
from mm3.plan.replay import replay
from mm3.constants import MAX_AUDIO_FRAMES
from mm3.plan.codes import AudioCodes, AudioCodesError, parse_audio_codes
from mm3.files.opener import open_component
from mm3.weights import layers as gguf_ops
from mm3.formats.gguf.reader import compressed_from_torch
from mm3.models.depth import RVQDepthDecoder
from mm3.models.lm import Qwen3LM, set_numerics
from mm3.progress import Cancelled, Progress
from mm3.plan.prompt import build_prompt
from mm3.plan.sampling import draw, exponential_draws, exponential_tail, make_generator, top_k_probs
from mm3.tokenizer import MM3Tokenizer

CAPTION = "a bright synth pop song with warm female vocals"
LYRICS = "[verse]\nhello world\n[chorus]\nsing with me"
DURATIONS = {"short": 2.0, "long": 8.4}
SEEDS = {"short": 0, "long": 1}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def ours(tiny):
    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    tok = MM3Tokenizer.from_component(lm_c)
    yield types.SimpleNamespace(lm=Qwen3LM.load(lm_c), depth=RVQDepthDecoder.load(d_c), tok=tok,
                                lm_ref=Qwen3LM.load(lm_c, numerics="reference"),
                                depth_ref=RVQDepthDecoder.load(d_c, numerics="reference"),
                                prompt=build_prompt(tok, CAPTION, LYRICS))
    lm_c.close()
    d_c.close()


@pytest.fixture(scope="module")
def ref(tiny, one_thread):
    ref_ar = pytest.importorskip("tests.helpers.reference_ar")
    r = ref_ar.load_reference(tiny.diffusers)
    ids = ref_ar.reference_text_ids(r, CAPTION, LYRICS)
    runs = {k: ref_ar.run_reference_ar(r, ids, DURATIONS[k], make_generator(SEEDS[k])) for k in DURATIONS}
    return types.SimpleNamespace(model=r, ids=ids, runs=runs)


def test_prompt_ids_equal_reference(ours, ref):
    assert torch.equal(ours.prompt.ids, ref.ids)


@pytest.mark.parametrize("song", list(DURATIONS))
def test_plan_reference_numerics_is_bit_exact(ours, ref, one_thread, song):
    rr, g = ref.runs[song], make_generator(SEEDS[song])
    (ac,) = plan(ours.lm_ref, ours.depth_ref, ours.prompt, PlanSettings(duration=DURATIONS[song]), generators=g)
    assert ac.frames == int(DURATIONS[song] * 25) == rr.frame_hiddens.shape[0]
    assert torch.equal(ac.codes, rr.codes)  # frame 0 included
    assert torch.equal(ac.frame_hiddens, rr.frame_hiddens)
    assert torch.equal(g.get_state(), rr.generator_state)  # the generator was consumed identically
    assert not ac.ended_naturally


@pytest.mark.parametrize("song", list(DURATIONS))
def test_plan_fast_path_matches_reference(ours, ref, one_thread, song):
    rr = ref.runs[song]
    (ac,) = plan(ours.lm, ours.depth, ours.prompt, PlanSettings(duration=DURATIONS[song], lm_seed=SEEDS[song]))
    assert ac.lm_seed == SEEDS[song]
    assert torch.equal(ac.codes, rr.codes)
    lm_hidden, depth_hidden = ac.frame_hiddens[:, 0], ac.frame_hiddens[:, 1:]
    assert rel(lm_hidden, rr.lm_last[1:, 0]) < 1e-5
    assert rel(depth_hidden, rr.depth_hidden[1:]) < 1e-5
    assert rel(ac.frame_hiddens, rr.frame_hiddens) < 1e-5


def test_the_fast_plans_draws_are_the_kernel_librarys_and_torchs_alike(ours, one_thread, monkeypatch):
    """On the CPU the fast numerics draw each code in one call of the kernel library
    (`steps.top_k_draw`); with it refused, torch's operations give the same song."""
    from mm3.backends import steps
    from mm3.backends.cpu import native as cpu_native

    if not cpu_native.available():
        pytest.skip("the native kernel library cannot be built here")
    served = []
    real = steps.top_k_draw
    monkeypatch.setattr(steps, "top_k_draw", lambda *a, **kw: served.append(real(*a, **kw)) or served[-1])
    settings = PlanSettings(duration=2.0, lm_seed=3, songs=2)
    library = plan(ours.lm, ours.depth, ours.prompt, settings)
    assert served and all(code is not None for code in served)
    assert len(served) == 51 * ours.depth.num_codebooks  # a semantic and 7 acoustic draws a frame, frames 0-50
    monkeypatch.setattr(steps, "top_k_draw", lambda *a, **kw: None)
    for with_library, with_torch in zip(library, plan(ours.lm, ours.depth, ours.prompt, settings)):
        assert torch.equal(with_library.codes, with_torch.codes)


def test_replay_matches_sampled_hiddens(ours, ref, one_thread, monkeypatch):
    import mm3.plan.replay

    monkeypatch.setattr(mm3.plan.replay, "REPLAY_CHUNK", 64)  # several passes over this song's frames
    rr = ref.runs["long"]
    rp = replay(ours.lm, ours.depth, ours.prompt, rr.codes)
    assert rp.frames == rr.frame_hiddens.shape[0] and torch.equal(rp.codes, rr.codes)
    err = (rp.frame_hiddens - rr.frame_hiddens).pow(2).mean().sqrt() / rr.frame_hiddens.pow(2).mean().sqrt()
    assert err < 1e-2
    assert err < 1e-5  # float32: teacher forcing recomputes the same states (observed ~3e-7)


def test_batch_of_two_equals_songs_alone(ours, one_thread):
    batch = plan(ours.lm, ours.depth, ours.prompt, PlanSettings(duration=2.0, lm_seed=7, songs=2))
    for i, song in enumerate(batch):
        (alone,) = plan(ours.lm, ours.depth, ours.prompt, PlanSettings(duration=2.0, lm_seed=7 + i))
        assert song.lm_seed == alone.lm_seed == 7 + i
        assert torch.equal(song.codes, alone.codes)
        assert rel(song.frame_hiddens, alone.frame_hiddens) < 1e-5  # batch GEMMs round differently on CPU
    assert not torch.equal(batch[0].codes, batch[1].codes)


def test_progress_and_cancel_between_frames(ours):
    calls = []
    prog = Progress(on_progress=lambda *a: calls.append(a), should_stop=lambda: len(calls) >= 5)
    with pytest.raises(Cancelled, match="before frame 5"):
        plan(ours.lm, ours.depth, ours.prompt, PlanSettings(duration=2.0, lm_seed=0), progress=prog)
    assert [c[:3] for c in calls] == [("ar", n, 50) for n in range(5)]  # frame 0 emits nothing
    assert calls[-1][3]["frame"] == 4


def test_end_token_stops_the_song(ours, monkeypatch):
    lm, end = ours.lm_ref, ours.tok.special.audio_end
    real = lm.head

    def end_from(k):  # END becomes certain from the k-th sampled frame on
        count = [0]

        def logits(h):
            out = real(h)
            count[0] += 1
            if count[0] >= k:
                out[:, end] = 1e4
            return out
        return logits

    monkeypatch.setattr(lm, "head", end_from(4))
    (ac,) = plan(lm, ours.depth_ref, ours.prompt, PlanSettings(duration=2.0, lm_seed=3))
    assert ac.ended_naturally and ac.frames == 2 and ac.codes.shape == (3, 8)
    monkeypatch.setattr(lm, "head", end_from(2))  # END right after frame 0: nothing emitted
    with pytest.raises(ZeroFramesError, match=r"song 0 \(lm_seed 3\) generated zero audio frames"):
        plan(lm, ours.depth_ref, ours.prompt, PlanSettings(duration=2.0, lm_seed=3))


def test_frame_limits():
    assert max_frames_for(2.0, 100, 10240) == 50
    assert max_frames_for(1000.0, 100, 100000) == MAX_AUDIO_FRAMES
    assert max_frames_for(1000.0, 5000, 10240) == 10240 - 5000 - 1
    with pytest.raises(ValueError, match="shorter than one frame"):
        max_frames_for(0.01, 10, 10240)
    with pytest.raises(ValueError, match="positive"):
        max_frames_for(0.0, 10, 10240)


def test_lm_and_depth_modules_match_reference(ours, ref, one_thread):
    """Single forwards: prefill + decode steps of the LM (both CFG rows), and the depth decoder
    whole-sequence and with its incremental cache."""
    emb = ref.model.language_model.model.embed_tokens(ref.ids)
    out = ref.model.language_model.model(inputs_embeds=emb, use_cache=True)
    lm = ours.lm_ref
    cache = lm.new_cache(2, ref.ids.shape[1] + 3, torch.float32, "cpu")
    assert torch.equal(lm(lm.embed(ref.ids, torch.float32), cache), out.last_hidden_state)
    past = out.past_key_values
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(2, 1, lm.hidden_size, generator=g)
        out = ref.model.language_model.model(inputs_embeds=x, past_key_values=past, use_cache=True)
        past = out.past_key_values
        assert torch.equal(lm(x, cache), out.last_hidden_state)
    assert torch.equal(lm.head(out.last_hidden_state[:, -1]),
                       ref.model.language_model.lm_head(out.last_hidden_state[:, -1]))

    seq = torch.randn(2, 8, ours.depth.hidden_size, generator=g)
    full = ours.depth_ref(seq)
    assert torch.equal(full, ref.model.rvq_depth_decoder(seq))
    dc = ours.depth.new_cache(2, torch.float32, "cpu")
    steps = [ours.depth(seq[:, :2], dc)] + [ours.depth(seq[:, j:j + 1], dc) for j in range(2, 8)]
    assert rel(torch.cat(steps, 1), full) < 1e-6


def test_ops_seam_and_head_rows(ours):
    """Models are built through the `ops` namespace; a row range of the LM head equals those rows."""
    seen = []

    class CountingLinear(gguf_ops.Linear):
        def forward(self, x):
            seen.append(self.out_features)
            return super().forward(x)

    ops = types.SimpleNamespace(**{k: getattr(gguf_ops, k) for k in ("Embedding", "Vector", "Linear")})
    ops.Linear = CountingLinear
    lm_src = ours.lm_ref
    tensors = {n: compressed_from_torch(n, b) for n, b in _float_state(lm_src).items()}
    lm = Qwen3LM(lm_src.cfg, ops)
    gguf_ops.load_tensors(lm, tensors, source="test")
    h = torch.randn(2, lm.hidden_size, generator=torch.Generator().manual_seed(0))
    cs = ours.prompt.codes
    full = lm.head(h)
    lo, hi = min(cs.end_id, cs.code_offset), cs.code_offset + 5
    lm.keep_head_rows(lo, hi)
    assert lm.head_ids == (lo, hi) and isinstance(lm.lm_head, CountingLinear)
    assert torch.allclose(lm.head(h), full[:, lo:hi], atol=1e-6, rtol=1e-5)
    assert seen == [lm.vocab_size, hi - lo]


def _float_state(module):
    out = {}
    for path, sub in module.named_modules():
        if isinstance(sub, gguf_ops.WeightSlots):
            for slot in sub.slot_shapes:
                out[f"{path}.{slot}" if path else slot] = sub.get(slot, torch.float32)
    return out


def test_sampling_draw_equals_multinomial():
    g = torch.Generator().manual_seed(11)
    for n in (7, 64, 330, 200000):
        probs = torch.softmax(torch.randn(1, n, generator=g) * 3, -1)
        a, b = make_generator(n), make_generator(n)
        for _ in range(5):
            assert torch.equal(draw(probs, exponential_draws(n, a)), torch.multinomial(probs, 1, generator=b).squeeze(-1))
        assert torch.equal(a.get_state(), b.get_state())
    # the head rows [lo, hi) only, as the fast LM holds them: the same index and the same generator
    # use as over the whole space (ids outside the candidates are -inf in both)
    logits = torch.full((1, 330), -float("inf"))
    cols = torch.tensor([261] + list(range(266, 330)))
    logits[0, cols] = torch.randn(len(cols), generator=g)
    lo, hi = 261, 330
    a, b = make_generator(1), make_generator(1)
    for _ in range(20):
        full = draw(top_k_probs(logits, 50), exponential_draws(330, a))
        part = draw(top_k_probs(logits[:, lo:hi], 50), exponential_tail(330, lo, b)[:, :hi - lo])
        assert torch.equal(full, part + lo)
    assert torch.equal(a.get_state(), b.get_state())


def test_audio_codes_text_roundtrip(ours, ref):
    rr = ref.runs["short"]
    ac = AudioCodes(rr.codes, rr.frame_hiddens, ours.prompt, 0, False)
    text = ac.to_request_codes()
    assert text.split(",")[:8] == [str(int(c)) for c in rr.codes[0]]
    assert len(text.split(",")) == 8 * (ac.frames + 1)
    assert torch.equal(parse_audio_codes(text, 64, 64), rr.codes)
    assert torch.equal(parse_audio_codes(" 1, 2,3,4,5,6,7,8,\n9,10,11,12,13,14,15,16,", 64, 64),
                       torch.arange(1, 17).view(2, 8))


@pytest.mark.parametrize("text,message", [
    ("1,2,x", "Invalid audio_codes"), ("1.5," * 16, "Invalid audio_codes"), ("1,,2" + ",0" * 14, "Invalid audio_codes"),
    ("1-2" + ",0" * 15, "Invalid audio_codes"),
    (",".join(["0"] * 8), "audio_codes needs 8 codes per frame, at least 2 frames"),
    (",".join(["0"] * 17), "audio_codes needs 8 codes per frame, at least 2 frames"),
    (",".join(["0"] * 8 + ["64"] + ["0"] * 7), "frame 1 position 0: semantic code c0 64 is out of range 0..63"),
    (",".join(["0"] * 8 + ["0", "0", "0", "-1"] + ["0"] * 4), "frame 1 position 3: acoustic code c3 -1"),
    (",".join(["0"] * 15 + ["1024"]), "frame 1 position 7: acoustic code c7 1024 is out of range 0..1023"),
])
def test_parse_audio_codes_errors(text, message):
    with pytest.raises(AudioCodesError, match=message):
        parse_audio_codes(text, 64 if "c0" in message else 16384, 1024)


def test_real_id_layout_matches_reference(tiny_real_ids, one_thread):
    """Released id layout (END 151670 below the code offset 151675, no patched constants): the
    semantic draw runs over 151739 categories and the fast path maps candidates back to ids."""
    ref_ar = pytest.importorskip("tests.helpers.reference_ar")
    r = ref_ar.load_reference(tiny_real_ids.diffusers)
    ids = ref_ar.reference_text_ids(r, CAPTION, LYRICS)
    rr = ref_ar.run_reference_ar(r, ids, 1.0, make_generator(4))
    lm_c = open_component(tiny_real_ids.file("mm3-lm"), expect="lm")
    d_c = open_component(tiny_real_ids.file("mm3-depth"), expect="depth")
    try:
        lm, depth = Qwen3LM.load(lm_c), RVQDepthDecoder.load(d_c)
        prompt = build_prompt(MM3Tokenizer.from_component(lm_c), CAPTION, LYRICS)
        assert torch.equal(prompt.ids, ids) and prompt.codes.end_id == 151670
        lm_ref, depth_ref = Qwen3LM.load(lm_c, numerics="reference"), RVQDepthDecoder.load(d_c, numerics="reference")
        (exact,) = plan(lm_ref, depth_ref, prompt, PlanSettings(duration=1.0, lm_seed=4))
        (fast,) = plan(lm, depth, prompt, PlanSettings(duration=1.0, lm_seed=4))
        assert torch.equal(exact.codes, rr.codes) and torch.equal(exact.frame_hiddens, rr.frame_hiddens)
        assert torch.equal(fast.codes, rr.codes) and rel(fast.frame_hiddens, rr.frame_hiddens) < 1e-5
    finally:
        lm_c.close()
        d_c.close()


def test_quantized_weights_equal_their_dequantized_floats(tiny, ours, one_thread, monkeypatch):
    """Q8_0 LM and depth weights (embedding rows and LM-head row ranges dequantized on demand) give
    the same plan as F32 models holding gguf-py's dequantization of the same blocks. (The CPU int4
    product of the fast numerics rounds inputs to bfloat16: off here, tested in test_cpu_int4.)"""
    import gguf

    from mm3.backends.cpu import int4 as cpu_int4

    monkeypatch.setattr(cpu_int4, "serves", lambda *a: False)

    from mm3.formats.gguf.reader import CompressedTensor

    q8 = gguf.GGMLQuantizationType.Q8_0
    models = {}
    for arch, kind, cls in (("mm3-lm", "lm", Qwen3LM), ("mm3-depth", "depth", RVQDepthDecoder)):
        comp = open_component(tiny.file(arch), expect=kind)
        quant, floats = {}, {}
        for name, t in comp.tensors.items():
            values = t.raw.view(torch.float32).view(t.shape).numpy()
            if len(t.shape) == 2:  # every matrix (embeddings included), as the released Q8_0 files
                blocks = gguf.quants.quantize(values, q8)
                quant[name] = CompressedTensor(name, q8, t.shape, torch.from_numpy(blocks.copy()).reshape(-1))
                values = gguf.quants.dequantize(blocks, q8).reshape(t.shape)
            else:
                quant[name] = compressed_from_torch(name, torch.from_numpy(values.copy()))
            floats[name] = compressed_from_torch(name, torch.from_numpy(values.copy()))
        pair = []
        for tensors in (quant, floats):
            m = cls(comp.hparams)
            gguf_ops.load_tensors(m, tensors, source=f"{kind} Q8_0")
            pair.append(m.eval())
        comp.close()
        models[kind] = pair
    assert models["lm"][0].lm_head.qtype("weight") == q8
    for numerics in ("fast", "reference"):
        for m in models["lm"] + models["depth"]:
            set_numerics(m, numerics)
        (a,) = plan(models["lm"][0], models["depth"][0], ours.prompt, PlanSettings(duration=1.0, lm_seed=2))
        (b,) = plan(models["lm"][1], models["depth"][1], ours.prompt, PlanSettings(duration=1.0, lm_seed=2))
        assert torch.equal(a.codes, b.codes) and torch.equal(a.frame_hiddens, b.frame_hiddens)


def test_bfloat16_compute_is_float32_within_its_rounding(ours):
    """A bfloat16 plan's hiddens are those of its codes' float32 replay within a few bfloat16
    epsilons (2**-8; measured 8.0e-3 relative), and its bfloat16 replay is the sampled hiddens
    within two (measured 3.3e-3: the batch shape's rounding, as `plan_and_replay` promises)."""
    eps = 2.0 ** -8
    (ac,) = plan(ours.lm, ours.depth, ours.prompt, PlanSettings(duration=0.4, lm_seed=0), dtype=torch.bfloat16)
    assert ac.frame_hiddens.dtype == torch.bfloat16 and ac.frame_hiddens.shape == (10, 8, ours.lm.hidden_size)
    rp = replay(ours.lm, ours.depth, ours.prompt, ac.codes, dtype=torch.bfloat16)
    f32 = replay(ours.lm, ours.depth, ours.prompt, ac.codes, dtype=torch.float32).frame_hiddens

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    assert rel(ac.frame_hiddens, f32) < 4 * eps and rel(rp.frame_hiddens, f32) < 4 * eps
    assert rel(rp.frame_hiddens, ac.frame_hiddens.float()) < 2 * eps
