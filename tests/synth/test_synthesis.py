"""Synthesis stage (condition encoder, flow DiT sampler, vocoder, stitch) against diffusers 0.42.1.

The oracle is the reference itself: its models loaded from the tiny diffusers folder and its own
denoise / decode blocks, recorded with hooks (tests/helpers/reference_synth.py). Ours runs from the tiny GGUF
files. CPU float32 with one thread, as exact comparisons need.
"""

import copy
import math

import numpy as np
import pytest
import torch

from mm3.synth.audio import decode_windows, encode_audio, stitch, stitched_length
from mm3.files.opener import open_component
from mm3.synth.flow import NonFiniteError, encode_conditions, flow_sigmas, sample_latents, window_bounds
from mm3.formats.gguf.errors import ComponentError
from mm3.weights.layers import load_tensors
from mm3.formats.gguf.reader import compressed_from_torch
from mm3.models.cond import ConditionEncoder
from mm3.models.dit import FlowDiT
from mm3.models.vocoder import Vocoder, channels_last
from mm3.progress import Cancelled, Progress

pytest.importorskip("diffusers")
from tests.helpers.reference_synth import load_reference, reference_decode, reference_denoise, rel_err

REL = 1e-5  # latents, velocities, conditions: relative to the largest reference value
CHANNELS_LAST_SLACK = 3  # channels-last against the reference's layout, errors from a float64 decode
ALPHA = 1e-5  # Snake alpha of the pass-through vocoder: x + sin(a x)^2 / a ~ x + a x^2
STEPS, NOISE_SEED, HIDDEN_SEED = 3, 5, 1234


def sample(cond, dit, fh, **kwargs):
    """The flow sampler on the per-window conditions of one song's frame hiddens fh ([1, F, W] or [F, W])."""
    return sample_latents(dit, encode_conditions(cond, fh.reshape(-1, fh.shape[-1])), **kwargs)


def decode(voc, windows, **kwargs):
    """Each window decoded, then stitched (hop 512)."""
    return stitch(decode_windows(voc, windows, **kwargs), 512)


@pytest.fixture(scope="module", autouse=True)
def _exact_threads(one_thread):
    """Bit-exact comparisons need the reference's thread count (CPU conv sums depend on it)."""


@pytest.fixture(scope="module")
def ours(tiny):
    return (ConditionEncoder.load(open_component(tiny.file("mm3-cond"), "cond")),
            FlowDiT.load(open_component(tiny.file("mm3-dit"), "dit")),
            Vocoder.load(open_component(tiny.file("mm3-vae"), "vae")))


@pytest.fixture(scope="module")
def ref(tiny):
    return load_reference(tiny.diffusers)


@pytest.fixture(scope="module", params=[200, 250], ids=["1window", "2windows"])
def case(request, ref):
    """A reference denoise + decode on fixed random frame hiddens with a fresh generator."""
    frames = request.param
    width = ref.condition_encoder.config.num_condition_layers * ref.condition_encoder.config.condition_hidden_dim
    fh = torch.randn(1, frames, width, generator=torch.Generator().manual_seed(HIDDEN_SEED))
    starts, chunks, rec = reference_denoise(ref, fh, STEPS, torch.Generator().manual_seed(NOISE_SEED))
    return dict(frames=frames, fh=fh, starts=starts, chunks=chunks, rec=rec, audio=reference_decode(ref, chunks))


@pytest.mark.parametrize("steps", [2, 3, 4, 7, 30, 50])
def test_sigmas_match_scheduler(ref, steps):
    ref.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps))
    sig = flow_sigmas(steps)
    assert sig.dtype == torch.float32
    assert torch.equal(sig, ref.scheduler.sigmas)
    assert torch.equal(sig[:-1], ref.scheduler.timesteps)


@pytest.mark.parametrize("steps", [1, 0, -3, 2.5])
def test_steps_below_two_rejected(steps):
    with pytest.raises(ValueError, match="steps must be at least 2"):
        flow_sigmas(steps)


def test_windows_and_lengths_match_reference(ref, ours):
    from diffusers.modular_pipelines.minimax_music3.before_denoise import MiniMaxMusic3PrepareChunksStep

    block = MiniMaxMusic3PrepareChunksStep().init_pipeline()
    cond = ours[0]
    for frames in (1, 2, 3, 7, 99, 100, 101, 150, 199, 200, 201, 250, 299, 300, 301, 1000):
        starts = block(frame_hiddens=torch.zeros(1, frames, 1), output="chunk_starts")
        assert [s for s, _ in window_bounds(frames)] == starts
        assert all(e == min(s + 200, frames) for s, e in window_bounds(frames))
        width = cond.num_layers * cond.hidden_dim
        assert cond.latent_length(frames) == ref.condition_encoder(torch.zeros(1, frames, width)).shape[1]
    assert [cond.latent_length(f) for f in (200, 150, 100)] == [689, 516, 344]


def test_song_length_is_the_references_not_the_requested_duration(ref, ours):
    """A 60 s request (1500 frames) gives 2649088 samples, 60.07 s, as the reference pipeline: it
    never trims to the duration. Each 200-frame window holds int(200 * 3.4453) = 689 latents and
    neighbours share 344, so a window adds 345 latents per 100 frames where 344.53 would be exact;
    250 frames (10 s) come out 168 samples short for the same reason."""
    from diffusers.modular_pipelines.minimax_music3 import decoders

    width = ref.condition_encoder.config.num_condition_layers * ref.condition_encoder.config.condition_hidden_dim
    hop = ref.condition_encoder.config.output_hop_length
    for frames, samples in ((1500, 2649088), (250, 440832)):
        bounds = window_bounds(frames)
        theirs = [ref.condition_encoder(torch.zeros(1, e - s, width)).shape[1] for s, e in bounds]
        n = len(theirs)  # the reference's decode step: crops of its own constants, then concatenation
        kept = sum(L - (k > 0) * decoders._CROP_LEFT_LATENT - (k < n - 1) * decoders._CROP_RIGHT_LATENT
                   for k, L in enumerate(theirs))
        assert hop * kept == samples
        assert stitched_length([ours[0].latent_length(e - s) for s, e in bounds], hop) == samples
    assert 2649088 - 60 * 44100 == 3088


def test_condition_per_window(case, ours):
    cond = ours[0]
    assert len(case["rec"].cond_calls) == len(case["starts"])
    for (s, e), (frames, want) in zip(window_bounds(case["frames"]), case["rec"].cond_calls):
        assert torch.equal(frames, case["fh"][:, s:e])
        assert torch.equal(cond(frames), want)  # the reference's order of operations: bit for bit


def test_every_dit_velocity_batched_cfg(case, ours):
    """Each (cond, uncond) pair of reference batch-1 calls against one batch-of-2 call of ours."""
    dit = ours[1]
    calls = case["rec"].dit_calls
    assert len(calls) == 2 * STEPS * len(case["starts"])
    with torch.no_grad():
        for n in range(0, len(calls), 2):
            (x, t, c, v_c), (x_u, t_u, c_u, v_u) = calls[n], calls[n + 1]
            assert torch.equal(x, x_u) and torch.equal(t, t_u) and not c_u.any()
            got = dit(torch.cat([x, x]), t.expand(2), torch.cat([c, c_u]))
            assert rel_err(got[:1], v_c) < REL and rel_err(got[1:], v_u) < REL
            assert rel_err(dit(x, t, c), v_c) < REL  # and batch 1, as the reference calls it


def test_latents_per_window(case, ours):
    cond, dit, _ = ours
    events = []
    got = sample(cond, dit, case["fh"], steps=STEPS, generator=torch.Generator().manual_seed(NOISE_SEED),
                         progress=Progress(on_progress=lambda *a: events.append(a)))
    assert len(got) == len(case["chunks"])
    for a, b in zip(got, case["chunks"]):
        assert a.shape == b.shape and rel_err(a, b) < REL
    # the overlap carry: window k starts with exactly window k-1's latents [L-344, L-172)
    for prev, nxt in zip(got, got[1:]):
        length = prev.shape[-1]
        assert torch.equal(nxt[..., :172], prev[..., length - 344:length - 172])
    total = STEPS * len(got)
    assert [(e[0], e[1], e[2]) for e in events] == [("dit", i + 1, total) for i in range(total)]
    assert events[-1][3]["step"] == STEPS and events[-1][3]["window"] == len(got) - 1
    # the same noise comes from a seed: a fresh generator seeded the same
    again = sample(cond, dit, case["fh"], steps=STEPS, seed=NOISE_SEED)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    # two batch-1 CFG calls, as the reference makes them: bit for bit, and so is the audio
    exact = sample(cond, dit, case["fh"], steps=STEPS, seed=NOISE_SEED, cfg_batch=False)
    assert all(torch.equal(a, b) for a, b in zip(exact, case["chunks"]))
    assert torch.equal(decode(ours[2], exact, exact=True), case["audio"])


@pytest.mark.parametrize("cfg", [1.0, 2.5])
def test_other_guidance_scales(ours, ref, cfg):
    """dit_cfg 1 skips the unconditional branch, as the reference guider does."""
    fh = torch.randn(1, 60, 512, generator=torch.Generator().manual_seed(4))
    _, chunks, rec = reference_denoise(ref, fh, 2, torch.Generator().manual_seed(9), guidance=cfg)
    assert len(rec.dit_calls) == (2 if cfg == 1.0 else 4)
    got = sample(ours[0], ours[1], fh, steps=2, dit_cfg=cfg, seed=9)
    assert rel_err(got[0], chunks[0]) < REL


def test_decode_and_stitch(case, ours):
    voc = ours[2]
    exact = decode(voc, case["chunks"], hop=512, exact=True)
    want = case["audio"]
    expected = {200: 352768, 250: 440832}[case["frames"]]
    assert exact.shape == want.shape == (1, 2, expected)
    assert stitched_length([c.shape[-1] for c in case["chunks"]], 512) == expected
    assert torch.equal(exact, want)  # the reference's convolutions: its samples
    # By default the CPU runs the convolutions channels-last, which sum in another order: float32
    # rounding as the reference's, measured against a float64 decode (the random tiny vocoder's
    # layers grow both to ~1e-4).
    got = decode(voc, case["chunks"], hop=512)
    truth = decode(voc, case["chunks"], hop=512, exact=True, dtype=torch.float64).double()
    assert channels_last("cpu") == (not torch.equal(got, want))
    assert rel_err(got.double(), truth) < CHANNELS_LAST_SLACK * rel_err(want.double(), truth)
    assert got.abs().max() <= 1.0
    # one mono row per vocoder call: the same rows in the same order (the random tiny vocoder grows
    # batch-size-dependent conv rounding to ~1e-3, so this compares against per-row decoding)
    rows = [voc.decode_sides(c.reshape(2, c.shape[1] // 2, -1)[r:r + 1]) for c in case["chunks"] for r in (0, 1)]
    by_row = [torch.cat(rows[2 * k:2 * k + 2]).reshape(1, 2, -1) for k in range(len(case["chunks"]))]
    assert torch.equal(decode(voc, case["chunks"], max_rows=1), stitch(by_row, 512))
    # variations decode as they would alone
    pair = [torch.cat([c, c.flip(-1)]) for c in case["chunks"]]
    both = decode(voc, pair)
    assert torch.equal(both[:1], got)
    assert torch.equal(both[1:], decode(voc, [c.flip(-1) for c in case["chunks"]]))


def test_snakes_in_place_give_the_same_samples(case, ours):
    """The Snakes' reused output tensor and in-place arithmetic (CPU) change no sample, leave their
    input alone and hold no memory after a decode; with gradients on, the plain formula runs."""
    from mm3.models.vocoder import Snake

    voc = ours[2]
    lat = case["chunks"][0]
    keep = lat.clone()
    with torch.no_grad():
        fast = voc.decode(lat)
        assert voc.slot.tensor is None and torch.equal(lat, keep)
        snakes = [m for m in voc.modules() if isinstance(m, Snake)]
        try:
            for m in snakes:
                m.slot = None
            plain = voc.decode(lat)
        finally:
            for m in snakes:
                m.slot = voc.slot
    assert torch.equal(fast, plain)
    snake, width = snakes[-1], snakes[-1].slot_shapes["alpha"][0]
    x = torch.randn(2, width, 50)
    with torch.no_grad():
        twice = snake(snake(x))  # the second one reads the slot's tensor: it must not write over it
        snake.slot = None
        plain_twice = snake(snake(x))
        snake.slot = voc.slot
        voc.slot.clear()
    assert torch.equal(twice, plain_twice)
    clone = copy.deepcopy(voc)  # a copy's Snakes share a slot of its own
    assert clone.slot is not voc.slot and all(m.slot is clone.slot for m in clone.modules() if isinstance(m, Snake))
    x = torch.randn(2, width, 50, requires_grad=True)
    y = snakes[-1](x)
    y.sum().backward()
    assert x.grad is not None and voc.slot.tensor is None


def test_variations_use_seed_plus_j(ours, ref):
    cond, dit, _ = ours
    fh = torch.randn(230, 512, generator=torch.Generator().manual_seed(7))
    batch = sample(cond, dit, fh, steps=2, seed=11, variations=3)
    wide = sample(cond, dit, fh, steps=2, seed=11, variations=3, variation_batch=3)
    for j in range(3):
        alone = sample(cond, dit, fh, steps=2, seed=11 + j)
        for a, b, w in zip(batch, alone, wide):
            assert torch.equal(a[j:j + 1], b)  # identical alone or among variations
            assert rel_err(w[j:j + 1], b) < REL  # one DiT batch of 6: same within rounding
    assert not torch.equal(batch[0][0], batch[0][1])


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed=1, variations=0), "synth_batch_size must be between 1 and 9"),
    (dict(seed=1, variations=10), "synth_batch_size must be between 1 and 9"),
    (dict(seed=1, generator=torch.Generator()), "exactly one of seed"),
    (dict(), "exactly one of seed"),
    (dict(generator=torch.Generator(), variations=2), "one per variation"),
    (dict(seed=-1), "seed must be"),
    (dict(seed=1, steps=1), "steps must be at least 2"),
])
def test_sampler_argument_errors(ours, kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample(ours[0], ours[1], torch.zeros(10, 512), **kwargs)


def test_cancel_between_steps(ours):
    calls = []
    progress = Progress(on_progress=lambda *a: calls.append(a), should_stop=lambda: len(calls) >= 2)
    with pytest.raises(Cancelled, match="step 3/3"):
        sample(ours[0], ours[1], torch.zeros(50, 512), steps=3, seed=0, progress=progress)
    assert len(calls) == 2


class _NaNAt(torch.nn.Module):
    """Wraps the DiT and poisons the velocity of one call (0-based call index)."""

    def __init__(self, dit, call):
        super().__init__()
        self.dit, self.call, self.n, self.in_channels = dit, call, 0, dit.in_channels

    def forward(self, x, t, c):
        v = self.dit(x, t, c)
        self.n += 1
        return v * float("nan") if self.n - 1 == self.call else v


def test_non_finite_velocity_names_window_and_step(ours):
    fh = torch.randn(250, 512, generator=torch.Generator().manual_seed(3))
    with pytest.raises(NonFiniteError, match="velocity at window 2/2, step 2/3"):
        sample(ours[0], _NaNAt(ours[1], 4), fh, steps=3, seed=0)  # calls: 3 in window 1, then 2nd


# ------------------------------------------------------------------------------------------------
# Vocoder encoder.


def _snake(x, alpha):
    a = alpha.reshape(1, -1, 1)
    return x + (a + 1e-9).reciprocal() * torch.sin(a * x).pow(2)


def _plain_encoder(sd: dict, strides: list[int], mono: torch.Tensor) -> torch.Tensor:
    """The DAC encoder written directly from the training checkpoint's own names (weight norm applied
    here with torch._weight_norm, alphas [1, C, 1]): an independent path to the same numbers."""
    def wn(p):
        return torch._weight_norm(sd[p + ".weight_v"], sd[p + ".weight_g"], 0)

    x = torch.nn.functional.conv1d(mono, wn("encoder.block.0"), sd["encoder.block.0.bias"], padding=3)
    for k, s in enumerate(strides, start=1):
        p = f"encoder.block.{k}.block."
        for r, d in enumerate((1, 3, 9)):
            u = f"{p}{r}.block."
            y = torch.nn.functional.conv1d(_snake(x, sd[u + "0.alpha"]), wn(u + "1"), sd[u + "1.bias"],
                                           padding=3 * d, dilation=d)
            x = x + torch.nn.functional.conv1d(_snake(y, sd[u + "2.alpha"]), wn(u + "3"), sd[u + "3.bias"])
        x = torch.nn.functional.conv1d(_snake(x, sd[p + "3.alpha"]), wn(p + "4"), sd[p + "4.bias"], stride=s,
                                       padding=math.ceil(s / 2))
    n = len(strides)
    x = torch.nn.functional.conv1d(_snake(x, sd[f"encoder.block.{n + 1}.alpha"]), wn(f"encoder.block.{n + 2}"),
                                   sd[f"encoder.block.{n + 2}.bias"], padding=1)
    return torch.nn.functional.conv1d(x, sd["mean_proj.weight"], sd["mean_proj.bias"])


def test_encoder_matches_plain_torch_from_dav(tiny, ours, ref):
    voc = ours[2]
    sd = torch.load(tiny.diffusers / "dav.pth", map_location="cpu", weights_only=True)
    strides = list(reversed(ref.vocoder.config.upsampling_ratios))
    t = torch.arange(3 * 512 * 5) / 44100.0
    tone = torch.stack([0.5 * torch.sin(2 * math.pi * 440 * t), 0.3 * torch.sin(2 * math.pi * 1000 * t)])
    noise = 0.2 * torch.randn(2, t.numel(), generator=torch.Generator().manual_seed(0))
    audio = torch.stack([tone, noise])  # [B=2, 2, T]
    z = encode_audio(voc, audio, 44100)
    assert z.shape == (2, voc.latent_channels, t.numel() // 512)
    half = voc.latent_channels // 2
    with torch.no_grad():
        for b in range(2):
            for side in range(2):
                want = _plain_encoder(sd, strides, audio[b, side].reshape(1, 1, -1))[0]
                assert rel_err(z[b, side * half:(side + 1) * half], want) < REL  # left -> channels 0..C/2-1
    assert torch.equal(encode_audio(voc, tone, 44100), z[:1])  # [2, T] is a batch of one
    wav = voc.decode(z)
    assert wav.shape == (2, 2, t.numel()) and wav.abs().max() <= 1.0


def test_encoder_resamples_and_pads(ours):
    torchaudio = pytest.importorskip("torchaudio")
    voc = ours[2]
    x = 0.2 * torch.randn(2, 4000, generator=torch.Generator().manual_seed(2))
    z = encode_audio(voc, x, 48000)  # any rate and length: to 44.1 kHz, then padded to whole latents
    y = torchaudio.functional.resample(x, 48000, 44100)
    assert y.shape[-1] == math.ceil(4000 * 44100 / 48000)
    want = voc.encode(torch.nn.functional.pad(y, (0, -y.shape[-1] % 512)).unsqueeze(0))
    assert z.shape == (1, voc.latent_channels, math.ceil(y.shape[-1] / 512)) and torch.equal(z, want)


def test_vocoder_without_encoder(tiny):
    comp = open_component(tiny.file("mm3-vae"), "vae")
    voc = Vocoder.load(comp, with_encoder=False)
    assert voc.encoder is None
    with pytest.raises(ComponentError, match="encoder"):
        voc.encode(torch.zeros(1, 2, 512))


def _passthrough_vocoder() -> Vocoder:
    """A hop-2 vocoder whose weights make encode -> decode a near-identity (tanh aside).

    Random tiny weights cannot carry a tone through (nor could any weights at the released
    hop 512 with 64 channels per side, too few to hold the samples). With hop 2 and two latent
    channels per side the encoder's strided conv can split a side into its even and odd samples
    and the decoder's transposed conv can interleave them back; residual units get zero output
    convs (identity), Snakes a tiny alpha (x + ~1e-5 x^2), every other conv a centred identity.
    Frequency, length and side order then depend only on our plumbing: resampling, padding,
    side stacking and reshapes.
    """
    hp = {"latent_channels": 4, "sampling_rate": 44100, "upsampling_ratios": [2]}
    t = {}

    def conv(name, c_out, c_in, k, weight=None):
        w = torch.zeros(c_out, c_in, k)
        if weight is None:  # centred identity
            for i in range(min(c_out, c_in)):
                w[i, i, k // 2] = 1.0
        else:
            w = weight
        t[name + ".weight"], t[name + ".bias"] = w, torch.zeros(w.shape[0] if "conv_t" not in name else w.shape[1])

    def units(prefix, c):
        for r in (1, 2, 3):
            t[f"{prefix}.res_unit{r}.snake1.alpha"] = t[f"{prefix}.res_unit{r}.snake2.alpha"] = torch.full((c,), ALPHA)
            conv(f"{prefix}.res_unit{r}.conv1", c, c, 7)
            conv(f"{prefix}.res_unit{r}.conv2", c, c, 1, torch.zeros(c, c, 1))  # residual branch off

    conv("encoder.conv_in", 1, 1, 7)
    units("encoder.blocks.0", 1)
    t["encoder.blocks.0.snake1.alpha"] = torch.full((1,), ALPHA)
    split = torch.zeros(2, 1, 4)
    split[0, 0, 1] = split[1, 0, 2] = 1.0  # k=4, stride 2, pad 1: tap 1 -> x[2n], tap 2 -> x[2n+1]
    conv("encoder.blocks.0.conv1", 2, 1, 4, split)
    t["encoder.snake_out.alpha"] = torch.full((2,), ALPHA)
    conv("encoder.conv_out", 2, 2, 3)
    conv("encoder.mean_proj", 2, 2, 1)
    conv("dec_in_proj", 2, 2, 1)
    conv("conv_in", 2, 2, 7)
    t["blocks.0.snake1.alpha"] = torch.full((2,), ALPHA)
    merge = torch.zeros(2, 1, 4)
    merge[0, 0, 1] = merge[1, 0, 2] = 1.0  # transposed: channel 0 -> sample 2n, channel 1 -> 2n+1
    conv("blocks.0.conv_t1", 2, 1, 4, merge)
    units("blocks.0", 1)
    t["snake_out.alpha"] = torch.full((1,), ALPHA)
    conv("conv_out", 1, 1, 7)
    tensors = {k: compressed_from_torch(k, v.float()) for k, v in t.items()}
    voc = Vocoder(hp, {k: v.shape for k, v in tensors.items()})
    load_tensors(voc, tensors, source="passthrough")
    return voc


def _peak_hz(x: torch.Tensor, rate: int) -> float:
    spec = torch.fft.rfft(x.double() * torch.hann_window(x.numel(), dtype=torch.float64)).abs()
    return float(spec.argmax()) * rate / x.numel()


@pytest.mark.parametrize("rate", [44100, 48000, 22050])
def test_passthrough_roundtrip_keeps_frequency_length_and_sides(rate):
    if rate != 44100:
        pytest.importorskip("torchaudio")
    voc = _passthrough_vocoder()
    n = rate  # one second
    t = torch.arange(n) / rate
    left, right = 0.3 * torch.sin(2 * math.pi * 440 * t), 0.3 * torch.sin(2 * math.pi * 660 * t)
    z = encode_audio(voc, torch.stack([left, right]), rate)
    out_n = math.ceil(n * 44100 / rate)
    assert z.shape == (1, 4, math.ceil(out_n / 2))
    wav = voc.decode(z)[0]
    assert wav.shape == (2, 2 * z.shape[-1])
    assert abs(_peak_hz(wav[0, :out_n], 44100) - 440) <= 1.0  # left stays left, at 440 Hz
    assert abs(_peak_hz(wav[1, :out_n], 44100) - 660) <= 1.0
    if rate == 44100:  # no resampling: sample for sample tanh(x), up to the Snakes' ~1e-5 x^2 each
        assert (wav[:, :n] - torch.tanh(torch.stack([left, right]))).abs().max() < 1e-4
        assert torch.allclose(z[0, 0], left[0::2], atol=1e-4) and torch.allclose(z[0, 3], right[1::2], atol=1e-4)


def test_passthrough_roundtrip_noise():
    voc = _passthrough_vocoder()
    x = 0.2 * torch.randn(2, 44100 + 7, generator=torch.Generator().manual_seed(1))
    wav = voc.decode(encode_audio(voc, x, 44100))[0]
    assert wav.shape == (2, 44100 + 8)  # padded to a whole latent
    assert (wav[:, :x.shape[1]] - torch.tanh(x)).abs().max() < 1e-4
    assert wav[:, -1].abs().max() < 1e-6  # the padding is silence
