"""How a render computes: the fast numerics or the reference's, chosen once and passed to every stage.

"fast": the LM and depth decoder with fused products, both CFG branches of a DiT step in one
batch, the DiT's forward in `compute_dtype` (None: the sampler's rule, `mm3.backends.cpu.bf16.dit_dtype`),
the vocoder on channels-last images. "reference": the reference's op shapes everywhere (separate
products, two CFG calls, the DiT in the latents' dtype, the reference's convolutions) and its
schedule at the automatic shift, so that with its random stream (`rng="reference"`) the audio is
the reference's bit for bit on a CPU in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import RNG_MODES
from ..backends.cpu.bf16 import many_rows_bf16
from ..synth.flow import AUTO_SHIFT, schedule_shift

MODES = ("fast", "reference")


@dataclass(frozen=True)
class Numerics:
    mode: str = "fast"
    compute_dtype: torch.dtype | None = None  # of the DiT's forward; None: the sampler's rule

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"numerics must be one of {', '.join(MODES)}, got {self.mode!r}")

    @classmethod
    def for_rng(cls, rng: str, *, dtype: torch.dtype | None = None,
                fast_dtype: torch.dtype | None = None) -> "Numerics":
        """The numerics of a random-stream mode: "reference" -> the reference's, computing the DiT
        in `dtype`; "independent" -> the fast ones, computing it in `fast_dtype`."""
        if rng not in RNG_MODES:
            raise ValueError(f"rng must be one of {', '.join(RNG_MODES)}, got {rng!r}")
        return cls("reference", dtype) if rng == "reference" else cls("fast", fast_dtype)

    @property
    def reference(self) -> bool:
        return self.mode == "reference"

    @property
    def models(self) -> str:
        """The LM and depth decoder's numerics (`mm3.models.lm.set_numerics`)."""
        return self.mode

    @property
    def cfg_batch(self) -> bool:
        """Both CFG branches of a DiT step as one batch; the reference makes two calls."""
        return not self.reference

    @property
    def exact(self) -> bool:
        """The vocoder's convolutions in the reference's layout (`Vocoder.decode_sides`)."""
        return self.reference

    def many_rows_bf16(self, device, dtype: torch.dtype) -> bool:
        """Whether the AR stage's products over many rows (prefill, replay) multiply in bfloat16:
        in the fast numerics, where the DiT's forward does (`mm3.backends.cpu.bf16.many_rows_bf16`)."""
        return not self.reference and many_rows_bf16(device, dtype, self.compute_dtype)

    def shift(self, steps: int, dit_shift: float = AUTO_SHIFT) -> float:
        """The flow schedule's shift for `dit_shift` (AUTO_SHIFT: `mm3.synth.flow.schedule_shift`'s rule;
        the reference's schedule, 1, in the reference numerics)."""
        if self.reference and dit_shift == AUTO_SHIFT:
            return 1.0
        return schedule_shift(steps, dit_shift)

    def sampler(self, steps: int, dit_shift: float = AUTO_SHIFT) -> dict:
        """The keywords of `mm3.synth.flow.sample_latents` this choice sets."""
        return dict(cfg_batch=self.cfg_batch, compute_dtype=self.compute_dtype, shift=self.shift(steps, dit_shift))


FAST = Numerics()
