"""One reusable flat buffer per dtype (per thread) for dequantizing a weight on the CPU that is used
once: a fresh allocation of a large weight at every product means page faults on every product."""

from __future__ import annotations

import math
import threading

import torch


class Scratch(threading.local):
    """A reusable flat buffer per dtype (per thread) for dequantizing a weight that is used once."""

    def __init__(self):
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < n or (buf.is_inference() and not torch.is_inference_mode_enabled()):
            # (a buffer made inside inference mode cannot be written outside it)
            buf = self.buffers[dtype] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)

    def clear(self):
        self.buffers.clear()


CPU_SCRATCH = Scratch()
