"""Adapters (LoRA) attached to one linear layer: low-rank terms its product adds beside the weight,
or merges into a float copy of it (as PEFT merges an adapter)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class LowRank:
    """Adapters attached to one layer: `terms` ((down A [r, in], up B [out, r], scale s), ...) add
    `sum s B (A x)` to its output (tensors of any dtype, on any device; `merge`: into a float copy
    of the weight instead, `merged`)."""

    terms: tuple
    merge: bool = False

    def side(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(down [R, in], up [out, R]) of every term together, in `dtype` on `device`, the scales in
        `up` (scaled in float32): one product pair serves any number of adapters."""
        down = torch.cat([d.to(device=device, dtype=dtype) for d, _, _ in self.terms])
        up = torch.cat([(u.to(device=device, dtype=torch.float32) * s).to(dtype) for _, u, s in self.terms], dim=1)
        return down, up

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` plus every term, term by term as PEFT merges one (W += (B @ A) * s, in float32),
        in the weight's dtype."""
        out = weight.to(torch.float32, copy=True)
        for d, u, s in self.terms:
            out += (u.to(out.device, torch.float32) @ d.to(out.device, torch.float32)) * s
        return out.to(weight.dtype)
