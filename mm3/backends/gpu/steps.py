"""The GPU back end's whole decode steps: the answers `mm3.backends.steps` gets for tensors on the
GPU code path (`emulation.gpu_path`). Each returns its result, or None with nothing written where
it does not serve (a dtype, layout or shape its kernels do not take), and the model's torch
operations run instead. Every step reads positions from the device (the cache's `pos`), never
from the host, so a frame of them can be captured as one CUDA graph.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x's rows by `weight` in one kernel, or None."""
    return None


def lookup(table: torch.Tensor, qtype, ids: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows `ids` [n] of a quantized table gathered and dequantized in one kernel -> [n, k] `dtype`, or None."""
    return None


def top_k_draw(logits, rows_per_song: int, cfg: float, top_k: int, q, excluded=None, gate: bool = False):
    """A guided top-k draw in one kernel, or None."""
    return None
