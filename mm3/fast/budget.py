"""How many bytes of dequantized weight copies to keep, per device (the "cache dequantized weights"
switch of the ops layer and of the packed AR weights, in automatic mode)."""

from __future__ import annotations

import torch

RESERVE_BYTES = 1 << 30  # accelerator memory left free for activations and the allocator


def free_bytes(device: torch.device) -> int | None:
    """Free memory of `device`, None if unknown. CUDA (and ROCm): free VRAM; XPU: free device
    memory; MPS: the Metal working-set size the system recommends minus what the driver has
    allocated for this process (memory is shared with the CPU); CPU: the kernel's MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "xpu":
        xpu = torch.xpu
        if hasattr(xpu, "mem_get_info"):
            return int(xpu.mem_get_info(device)[0])
        total = xpu.get_device_properties(device).total_memory
        return max(0, int(total - xpu.memory_reserved(device)))
    if device.type == "mps":
        mps = torch.mps
        if not hasattr(mps, "recommended_max_memory"):  # Metal's recommendedMaxWorkingSetSize
            return None
        return max(0, int(mps.recommended_max_memory() - mps.driver_allocated_memory()))
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
    --quant Q8_0`). Accelerators (CUDA, XPU, MPS): what is free beyond RESERVE_BYTES; CPU: a quarter
    of the available memory; a device whose free memory is unknown: nothing. The most used weights (the depth decoder's) are kept first."""
    return _budget(torch.device(device))


def dit_weight_budget(device: torch.device) -> int:
    """Synthesis: every DiT weight is used 2 x steps times per window. Same rule as the AR stage."""
    return _budget(torch.device(device))


def _budget(device: torch.device) -> int:
    free = free_bytes(device)
    if free is None:
        return 0
    if device.type == "cpu":
        return free // 4
    return max(0, free - RESERVE_BYTES)
