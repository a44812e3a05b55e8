"""How many bytes of dequantized weight copies to keep, per device (the "cache dequantized weights"
switch of the ops layer and of the packed AR weights, in automatic mode)."""

from __future__ import annotations

import torch

RESERVE_BYTES = 1 << 30  # accelerator memory left free for activations and the allocator


def free_bytes(device: torch.device) -> int | None:
    """Free memory of `device` (CUDA: free VRAM; CPU: the kernel's MemAvailable), None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def ar_weight_budget(device: torch.device) -> int:
    """AR stage (weights read once per product, 7 depth passes per frame): dequantizing per product
    writes and reads the whole float weight, about twice the traffic of reading a kept copy
    (medium config, Q8_0, CPU: 88 ms/frame against 48.5 kept; `python -m mm3 bench --config medium
    --quant Q8_0`). CUDA: what is free beyond RESERVE_BYTES; CPU: a quarter of the available memory;
    elsewhere nothing. The most used weights (the depth decoder's) are kept first."""
    return _budget(torch.device(device))


def dit_weight_budget(device: torch.device) -> int:
    """Synthesis: every DiT weight is used 2 x steps times per window. Same rule as the AR stage."""
    return _budget(torch.device(device))


def _budget(device: torch.device) -> int:
    free = free_bytes(device)
    if free is None:
        return 0
    if device.type == "cuda":
        return max(0, free - RESERVE_BYTES)
    return free // 4
