"""The windowed flow-matching sampler: frame hiddens -> one latent per window.

Windows of 200 frames every 100, each conditioned on its own frames, take `steps` Euler steps
from noise with classifier-free guidance; consecutive windows share 172 latents, pulled towards
the previous window's result at every step. Follows diffusers 0.42.1 number for number. Noise is
drawn on the CPU, one generator per variation in window order, so a seed gives the same song on
every device and the AR stage's generator reproduces the reference run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..constants import DEFAULT_DIT_CFG, DEFAULT_STEPS, MAX_VARIATIONS
from ..errors import RunError
from ..backends.cpu.bf16 import dit_dtype, onednn_pays
from ..backends.device import dit_weight_budget, model_device
from ..weights.copies import cache_dequantized, dequantized_nbytes, release_dequantized
from ..backends.cpu.matmul import onednn_matmul, pays_for
from ..weights.scratch import CPU_SCRATCH
from ..progress import Cancelled, Progress
from .settings import AUTO_SHIFT, MAX_SHIFT, check_shift  # noqa: F401 (MAX_SHIFT: importable here too)

WINDOW_FRAMES = 200  # before_denoise.py: 200-frame windows ...
WINDOW_HOP = 100  # ... every 100 frames
OVERLAP_LATENTS = 172  # denoise.py _OVERLAP_LATENT_LENGTH: latents shared with the previous window
BLEND_SIGMA_MIN = 1e-6  # denoise.py: x[:ov] = (1 - (1 - 1e-6) t) noise + t prev


class NonFiniteError(RunError):
    """The DiT produced NaN/Inf: the run fails rather than decoding noise."""


def window_bounds(num_frames: int) -> list[tuple[int, int]]:
    """[start, end) frames of each window: [0, F) if F <= 200, else starts 0, 100, ... below F - 100."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}")
    starts = [0] if num_frames <= WINDOW_FRAMES else list(range(0, num_frames - WINDOW_HOP, WINDOW_HOP))
    return [(s, min(s + WINDOW_FRAMES, num_frames)) for s in starts]


def settled_windows(frames: int, final: bool) -> int:
    """How many leading windows of a song with `frames` frames planned so far are settled: their
    bounds (`window_bounds`) and whether each is the song's last can no longer change. A complete
    song (`final`): all of them. One still being planned: window k, frames [100k, 100k + 200),
    once more than 100k + 200 frames are planned, for then every frame of it is there and the
    song goes on past it (window k + 1 exists, so the stitch crops k's end as it will)."""
    if final:
        return len(window_bounds(frames)) if frames >= 1 else 0
    return max(0, -(-(frames - WINDOW_FRAMES) // WINDOW_HOP))


def flow_sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """[steps + 1] float32 flow times: 1 - float32(linspace(1, 1/N, N)) computed in float32, then 1.0.

    The DiT is fed sigma_i and the Euler step uses sigma_{i+1} - sigma_i (the reference scheduler
    with num_train_timesteps 1, invert_sigmas). `shift` > 1 keeps the noise levels high for
    longer: s -> shift * s / (1 + (shift - 1) * s) before the inversion, in float32 as the
    scheduler computes it; the reference's schedule is shift 1."""
    if int(steps) != steps or steps < 2:
        raise ValueError(f"steps must be at least 2, got {steps}")
    shift = check_shift(shift)
    s = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
    if shift != 1.0:
        s = shift * s / (1 + (shift - 1) * s)
    return torch.cat([1.0 - torch.from_numpy(s), torch.ones(1)])


def schedule_shift(steps: int, shift: float = AUTO_SHIFT) -> float:
    """The shift a render uses: `shift` itself, or for AUTO_SHIFT 29 / (steps - 1) below 30 steps
    (few steps sound thin and phasey without one) and 1 from 30 steps on, so default renders keep
    the reference's schedule."""
    if shift == AUTO_SHIFT:
        return (DEFAULT_STEPS - 1) / (steps - 1) if 2 <= steps < DEFAULT_STEPS else 1.0
    return check_shift(shift)


def window_offsets(latent_lengths: list[int]) -> list[int]:
    """Where each window's latent 0 sits on the song's latent timeline: window k starts where the
    previous window's carried part began (its latents L - 344 .. L - 172 become window k's first)."""
    offsets = [0]
    for length in latent_lengths[:-1]:
        offsets.append(offsets[-1] + max(0, length - 2 * OVERLAP_LATENTS))
    return offsets


def timeline_length(latent_lengths: list[int]) -> int:
    """Latents on the song's timeline (what the stitch keeps, in latents)."""
    return window_offsets(latent_lengths)[-1] + latent_lengths[-1]


@dataclass
class Keep:
    """What a repaint keeps: per window the original latents [1 or V, C, L_k] and a mask [L_k]
    float32 (1 keeps the original, 0 samples anew, between them a crossfade)."""

    latents: list[torch.Tensor]
    masks: list[torch.Tensor]

    @classmethod
    def range(cls, original: list[torch.Tensor], start: int, end: int, fade: int = 0,
              covered: int | None = None) -> "Keep":
        """Keep everything but timeline latents [start, end) of the windows `original`, with a
        linear crossfade of `fade` latents inside each edge of the range; latents from `covered`
        on (past the end of a shorter recording) are sampled anew too."""
        lengths = [x.shape[-1] for x in original]
        total = timeline_length(lengths)
        if not 0 <= start < end <= total:
            raise ValueError(f"repaint range [{start}, {end}) latents is not inside the song's 0..{total}")
        mask = torch.ones(total)
        mask[start:end] = 0.0
        if covered is not None:
            mask[covered:] = 0.0
        fade = max(0, min(int(fade), (end - start) // 2))
        if fade:
            ramp = torch.linspace(1.0, 0.0, fade + 2)[1:-1]
            if start > 0:
                mask[start:start + fade] = ramp
            if end < total:
                mask[end - fade:end] = ramp.flip(0)
        return cls(list(original), split_timeline(mask, lengths))

    @classmethod
    def seconds(cls, original: list[torch.Tensor], start: float, end: float, fade: float, latent_rate: float,
                covered: int | None = None) -> "Keep":
        """`range` in seconds of the song (`latent_rate` latents per second); an end past the song
        is its end."""
        total = timeline_length([x.shape[-1] for x in original])
        a, b = int(round(start * latent_rate)), min(total, int(round(end * latent_rate)))
        if a >= total:
            raise ValueError(f"repaint_start {start:g} s is at or after the end of the song ({total / latent_rate:.2f} s)")
        return cls.range(original, a, max(b, a + 1), int(round(fade * latent_rate)), covered)

    def check(self, conditions: list[torch.Tensor], channels: int):
        if len(self.latents) != len(conditions):
            raise ValueError(f"the latents to keep have {len(self.latents)} windows, the conditions {len(conditions)}")
        for k, (x, c) in enumerate(zip(self.latents, conditions)):
            if x.dim() != 3 or x.shape[1] != channels or x.shape[-1] != c.shape[1]:
                raise ValueError(f"window {k}: latents to keep are {list(x.shape)}, expected [1 or V, {channels}, "
                                 f"{c.shape[1]}] (made from the same codes)")


def repaint_keep(conditions: list[torch.Tensor], original: list[torch.Tensor], start: float, end: float, fade: float,
                 sample_rate: float, hop: int, covered: int | None = None) -> Keep:
    """What a repaint of seconds [start, end) keeps: elsewhere the first variation of `original`
    (latents of the windows of `conditions`, made from the same codes), crossfaded over `fade`
    seconds inside each edge. `sample_rate` / `hop`: the condition encoder's output rate and hop."""
    if [c.shape[1] for c in conditions] != [x.shape[-1] for x in original]:
        raise ValueError(f"the latents to keep ({[x.shape[-1] for x in original]} per window) were not made for this "
                         f"song's windows ({[c.shape[1] for c in conditions]}): use latents of the same codes, or "
                         "source codes with as many frames")
    return Keep.seconds([x[:1] for x in original], start, end, fade, sample_rate / hop, covered)


def split_timeline(timeline: torch.Tensor, latent_lengths: list[int]) -> list[torch.Tensor]:
    """A song's latents on its timeline [..., T] -> one [..., L_k] per window (`window_offsets`).
    The timeline must cover the windows; `pad_timeline` extends a shorter one."""
    need = timeline_length(latent_lengths)
    if timeline.shape[-1] < need:
        raise ValueError(f"the timeline has {timeline.shape[-1]} latents, the windows need {need}")
    return [timeline[..., o:o + n] for o, n in zip(window_offsets(latent_lengths), latent_lengths)]


def windows_from_timeline(timeline: torch.Tensor, latent_lengths: list[int]) -> tuple[list[torch.Tensor], int]:
    """Encoded audio [B, C, T] -> the windows of a song of these latent lengths, and how many
    timeline latents the audio covers (a shorter recording is padded with zeros there: a repaint
    samples that part anew, `Keep.range(covered=...)`); a longer one is cut."""
    need = timeline_length(latent_lengths)
    covered = min(timeline.shape[-1], need)
    if timeline.shape[-1] < need:
        timeline = torch.nn.functional.pad(timeline, (0, need - timeline.shape[-1]))
    return split_timeline(timeline[..., :need], latent_lengths), covered


def seed_generators(seed: int, variations: int = 1) -> list[torch.Generator]:
    """One CPU generator per variation j, seeded seed + j."""
    if seed < 0 or seed + variations - 1 >= 2**64:
        raise ValueError(f"seed must be in 0..2**64-1 (for every variation), got {seed}")
    return [torch.Generator("cpu").manual_seed(seed + j) for j in range(variations)]


def _check_args(steps, dit_cfg, seed, generator, variations):
    if not 1 <= variations <= MAX_VARIATIONS:
        raise ValueError(f"synth_batch_size must be between 1 and {MAX_VARIATIONS}, got {variations}")
    if not np.isfinite(dit_cfg):
        raise ValueError(f"dit_cfg must be a finite number, got {dit_cfg}")
    if (seed is None) == (generator is None):
        raise ValueError("pass exactly one of seed (int) or generator (CPU torch.Generator, or one per variation)")
    if seed is not None:
        return seed_generators(int(seed), variations)
    gens = list(generator) if isinstance(generator, (list, tuple)) else [generator]
    if len(gens) != variations:
        raise ValueError(f"got {len(gens)} generator(s) for {variations} variation(s): pass one per variation")
    for g in gens:
        if not isinstance(g, torch.Generator) or g.device.type != "cpu":
            raise ValueError(f"noise generators must be CPU torch.Generator objects, got {g!r}")
    return gens


@torch.inference_mode()
def encode_conditions(cond_encoder, frame_hiddens: torch.Tensor, *, device=None, dtype: torch.dtype = torch.float32,
                      progress: Progress | None = None) -> list[torch.Tensor]:
    """The DiT condition of every window: [1, L_k, D] in `dtype` on `device` (default: where the
    encoder's first weight lives), window k from the frame hiddens of window k alone (the encoder's
    k=3 conv sees the window's edges). frame_hiddens: one song's [F, layers, hidden] (as
    `AudioCodes.frame_hiddens`) or [F, layers * hidden], layer-major. Cancel check before every window."""
    progress = progress or Progress()
    device = model_device(cond_encoder) if device is None else torch.device(device)
    if frame_hiddens.dim() not in (2, 3):
        raise ValueError(f"frame_hiddens must be [F, layers, hidden] or [F, layers * hidden], got "
                         f"{list(frame_hiddens.shape)}")
    bounds = window_bounds(frame_hiddens.shape[0])
    out = []
    for k, (s, e) in enumerate(bounds):
        if progress.should_stop():
            raise Cancelled(f"condition encoding cancelled at window {k + 1}/{len(bounds)}")
        out.append(encode_window(cond_encoder, frame_hiddens[s:e], device=device, dtype=dtype))
        progress.on_progress("cond", k + 1, len(bounds), {"window": k, "windows": len(bounds)})
    return out


def encode_window(cond_encoder, frame_hiddens: torch.Tensor, *, device, dtype: torch.dtype) -> torch.Tensor:
    """One window's condition [1, L, D] in `dtype` on `device` from its frames' hiddens alone
    ([e - s, layers, hidden] or [e - s, layers * hidden])."""
    fh = frame_hiddens.reshape(frame_hiddens.shape[0], -1).unsqueeze(0)  # [1, e - s, layers * hidden]
    return cond_encoder(fh.to(device=device, dtype=dtype)).to(dtype)


@dataclass
class _Run:
    """What every window of one `sample_latents` call shares."""

    dit: torch.nn.Module
    sigmas: torch.Tensor  # [steps + 1] on the device
    dit_cfg: float
    cfg_batch: bool
    group: int  # variations per DiT call
    device: torch.device
    dtype: torch.dtype  # of the latents and the Euler steps
    compute_dtype: torch.dtype  # of the DiT's forward
    progress: Progress
    windows: int
    total: int  # progress units: windows x groups x steps
    keep: "Keep | None" = None

    @property
    def steps(self) -> int:
        return self.sigmas.shape[0] - 1


@torch.inference_mode()
def sample_latents(dit, conditions: list[torch.Tensor], *, steps: int = DEFAULT_STEPS,
                   dit_cfg: float = DEFAULT_DIT_CFG, seed: int | None = None, generator=None,
                   variations: int = 1, variation_batch: int = 1, cfg_batch: bool = True, device=None,
                   dtype: torch.dtype = torch.float32, progress: Progress | None = None,
                   weight_cache: int | None = None, fast_matmul: bool | None = None,
                   shift: float = 1.0, keep: Keep | None = None, compute_dtype: torch.dtype | None = None,
                   on_window: Callable[[int, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
    """Denoise every window; returns one latent [variations, C, L_k] per window (uncropped).

    Variation j's noise comes from a CPU generator seeded `seed + j`, or from `generator` (the
    reference's stream). `variation_batch` > 1 batches variations (rounding then differs from a
    lone run); `cfg_batch` False makes the reference's two CFG calls (bit-exact on a CPU in
    float32). `weight_cache`: bytes of dequantized DiT weights kept for the call (None: automatic).
    `fast_matmul`: oneDNN float32 products on a CPU (None: where they time faster, `onednn_pays`). `shift`:
    of the schedule (`flow_sigmas`). `keep`: a repaint's kept part (`Keep`). `compute_dtype`: of
    the DiT's forward (None: `mm3.backends.cpu.bf16.dit_dtype`'s rule). `on_window(k, latent)`: called as
    each window is done, outside the sampler's settings. Cancel check before every step.
    """
    if not conditions:
        raise ValueError("no window conditions to sample (encode_conditions returns one per window)")
    if keep is not None:
        keep.check(conditions, dit.in_channels)
    sampler = WindowSampler(dit, windows=len(conditions), steps=steps, dit_cfg=dit_cfg, seed=seed, generator=generator,
                            variations=variations, variation_batch=variation_batch, cfg_batch=cfg_batch,
                            device=device, dtype=dtype, progress=progress, weight_cache=weight_cache,
                            fast_matmul=fast_matmul, shift=shift, keep=keep, compute_dtype=compute_dtype)
    out = []
    with sampler:
        for k, given in enumerate(conditions):
            out.append(sampler.window(k, given))
            if on_window is not None:
                on_window(k, out[-1])
    return out


class WindowSampler:
    """`sample_latents` one window at a time, in order: `window(k, condition)` denoises window k and
    carries its overlap to window k + 1, so the windows of a song still being planned can follow
    as their frames come, with the numbers `sample_latents` gives. Used as a context manager (the
    DiT's weight copies live inside it); `windows`: the expected count, for progress reports."""

    def __init__(self, dit, *, windows: int, steps: int = DEFAULT_STEPS, dit_cfg: float = DEFAULT_DIT_CFG,
                 seed: int | None = None, generator=None, variations: int = 1, variation_batch: int = 1,
                 cfg_batch: bool = True, device=None, dtype: torch.dtype = torch.float32,
                 progress: Progress | None = None, weight_cache: int | None = None, fast_matmul: bool | None = None,
                 shift: float = 1.0, keep: Keep | None = None, compute_dtype: torch.dtype | None = None):
        self.gens = _check_args(steps, dit_cfg, seed, generator, variations)
        device = model_device(dit) if device is None else torch.device(device)
        group = max(1, min(int(variation_batch), variations))
        self.n_groups = -(-variations // group)
        if compute_dtype is None:
            compute_dtype = dit_dtype(device, dtype, dit) if cfg_batch else dtype
        self.run = _Run(dit, flow_sigmas(steps, shift).to(device), float(dit_cfg), cfg_batch, group, device, dtype,
                        compute_dtype, progress or Progress(), windows, windows * self.n_groups * steps, keep)
        self.budget = dit_weight_budget(device) if weight_cache is None else int(weight_cache)
        if fast_matmul is None:  # oneDNN's float32 where the DiT's heads are wide and its products time faster
            fast_matmul = cfg_batch and pays_for(dit) and onednn_pays(device, compute_dtype, dit)
        self.fast = fast_matmul
        self.own = False
        self.prev_lat = self.prev_cond = None

    def __enter__(self):
        dit, run = self.run.dit, self.run
        self.own = self.budget > 0 and dequantized_nbytes(dit) == 0  # copies someone else keeps are left alone
        if self.own:
            cache_dequantized(dit, run.compute_dtype, self.budget, run.device)
        return self

    def __exit__(self, *exc):
        if self.own:
            release_dequantized(self.run.dit)
        CPU_SCRATCH.clear()
        return False

    def window(self, k: int, given: torch.Tensor) -> torch.Tensor:
        """Window k's latents [variations, C, L_k] from its condition [1, L_k, D] (not modified)."""
        run, gens = self.run, self.gens
        variations, channels, n_groups = len(gens), run.dit.in_channels, self.n_groups
        with onednn_matmul(run.device, self.fast):
            cond = given.to(device=run.device, dtype=run.dtype, copy=True)  # [1, L, D]; the carry writes into it
            length = cond.shape[1]
            ov = 0
            if self.prev_lat is not None:
                ov = min(self.prev_lat.shape[-1], length)
                cond[:, :ov] = self.prev_cond[:, :ov]
            noise = torch.cat([torch.randn((1, channels, length), generator=g) for g in gens])  # CPU, float32
            noise = noise.to(device=run.device, dtype=run.dtype)
            kept = None
            if run.keep is not None:
                orig = run.keep.latents[k].to(device=run.device, dtype=run.dtype).expand(variations, -1, -1)
                kept = (orig, run.keep.masks[k].to(device=run.device, dtype=run.dtype))
            lat = []
            for gi in range(n_groups):
                sl = slice(gi * run.group, min((gi + 1) * run.group, variations))
                ctx = dict(window=k, windows=max(run.windows, k + 1), variations=(sl.start, sl.stop))
                prev = None if self.prev_lat is None else self.prev_lat[sl]
                lat.append(_denoise_window(run, noise[sl], cond, prev, ov, ctx, (k * n_groups + gi) * run.steps,
                                           None if kept is None else (kept[0][sl], kept[1])))
            x = torch.cat(lat)
            a = max(0, length - 2 * OVERLAP_LATENTS)
            b = max(a, length - OVERLAP_LATENTS)
            self.prev_lat, self.prev_cond = x[..., a:b], cond[:, a:b]  # carried to the next window
        return x


def _denoise_window(run: _Run, x, cond, prev, ov, ctx, done0, kept=None):
    """Euler steps of one window for a group of variations x [V, C, L] sharing `cond` [1, L, D];
    `kept`: (original [V, C, L], mask [L]) of a repaint."""
    dit, sig, dit_cfg, steps = run.dit, run.sigmas, run.dit_cfg, run.steps
    v_n = x.shape[0]
    if kept is not None and bool((kept[1] == 1).all()):  # nothing to repaint in this window
        for i in range(steps):
            if run.progress.should_stop():
                raise Cancelled(f"cancelled at window {ctx['window'] + 1}/{ctx['windows']}, step {i + 1}/{steps}")
            run.progress.on_progress("dit", done0 + i + 1, run.total, dict(ctx, step=i + 1, steps=steps))
        return kept[0].clone()
    noise_prompt = x[..., :ov].clone()
    noise = x.clone() if kept is not None else None
    # A guidance scale of 1 is the conditional prediction alone: the reference guider then skips the
    # unconditional call, and so do we.
    guided = not math.isclose(dit_cfg, 1.0)
    cd, latent_dtype = run.compute_dtype, x.dtype

    def velocity(x_in, t_in, c_in):  # the DiT in its compute dtype; the velocity in the latents'
        return dit(x_in.to(cd), t_in.to(cd), c_in).to(latent_dtype)

    cond_in = cond.expand(v_n, -1, -1).to(cd)
    uncond = torch.zeros_like(cond_in)
    pair = torch.cat([cond_in, uncond]) if guided and run.cfg_batch else None
    for i in range(steps):
        if run.progress.should_stop():
            raise Cancelled(f"cancelled at window {ctx['window'] + 1}/{ctx['windows']}, step {i + 1}/{steps}")
        t = sig[i]
        if ov > 0:
            tv = t.to(x.dtype)
            x[..., :ov] = (1.0 - (1.0 - BLEND_SIGMA_MIN) * tv) * noise_prompt + tv * prev[..., :ov]
        if kept is not None:
            tv = t.to(x.dtype)
            x = torch.lerp(x, (1.0 - (1.0 - BLEND_SIGMA_MIN) * tv) * noise + tv * kept[0], kept[1])
        tt = t.expand(v_n).to(x.dtype)
        if not guided:
            v = velocity(x, tt, cond_in)
        else:
            if pair is not None:  # both CFG branches in one batch: rows [cond x V, zeros x V], same latents
                v2 = velocity(torch.cat([x, x]), t.expand(2 * v_n).to(x.dtype), pair)
                v_c, v_u = v2[:v_n], v2[v_n:]
            else:
                v_c, v_u = velocity(x, tt, cond_in), velocity(x, tt, uncond)
            v = v_u + dit_cfg * (v_c - v_u)
        x = (x.to(torch.float32) + (sig[i + 1] - sig[i]) * v).to(v.dtype)  # the scheduler's Euler step
        if not bool(torch.isfinite(v).all() & torch.isfinite(x).all()):
            what = "velocity" if not torch.isfinite(v).all() else "latent"
            raise NonFiniteError(
                f"non-finite DiT {what} at window {ctx['window'] + 1}/{ctx['windows']}, step {i + 1}/{steps} "
                f"(variations {ctx['variations'][0]}..{ctx['variations'][1] - 1})")
        run.progress.on_progress("dit", done0 + i + 1, run.total, dict(ctx, step=i + 1, steps=steps))
    if kept is not None:
        x = torch.lerp(x, kept[0], kept[1])
    if ov > 0:
        x[..., :ov] = prev[..., :ov]
    return x
