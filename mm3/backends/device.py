"""Compute device and dtype: chosen automatically, or named by the user."""

from __future__ import annotations

import os

import torch


def pick_device(name: str | torch.device | None = None) -> torch.device:
    """`name` ("cuda", "cuda:1", "xpu", "mps", "cpu", or a torch.device) or the best available: CUDA (ROCm builds
    report as CUDA), XPU, MPS, then CPU; an accelerator with its index ("cuda" is the current
    one, "cuda:0"), as its tensors report it."""
    from .gpu.kernels import indexed_device

    if name and name != "auto":
        dev = torch.device(name)
        available = {
            "cuda": torch.cuda.is_available,
            "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
            "mps": lambda: torch.backends.mps.is_available(),
            "cpu": lambda: True,
        }
        check = available.get(dev.type)
        if check is None and isinstance(name, torch.device):  # a device type this engine does not list
            return indexed_device(dev)
        if check is None or not check():
            raise ValueError(f"device {str(dev)!r} is not available here (auto picks {pick_device().type})")
        return indexed_device(dev)
    if torch.cuda.is_available():
        return indexed_device("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return indexed_device("xpu")
    if torch.backends.mps.is_available():
        return indexed_device("mps")
    return torch.device("cpu")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_dtype(device: torch.device, name: str | None = None) -> torch.dtype:
    """`name` or the device's default: bfloat16 where the device computes it natively (CUDA with
    bf16 support, XPU), float32 elsewhere (CPU for exactness, MPS where fp16 overflows)."""
    if name and name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device.type == "xpu":
        return torch.bfloat16
    return torch.float32


def total_bytes(device: torch.device) -> int | None:
    """The memory a model file chosen for `device` may take: an accelerator's memory (MPS: the
    working set Metal recommends), None on the CPU (no limit: the most precise file is chosen)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "xpu":
        return int(torch.xpu.get_device_properties(device).total_memory)
    if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
        return int(torch.mps.recommended_max_memory())
    return None


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's first weight lives: the compute device when the caller names none."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "xpu":
        torch.xpu.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


# -- memory: how many bytes of dequantized weight copies a stage may keep ---------------------------
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


def keeps_ar_copies(device: torch.device) -> bool:
    """Whether the AR stage keeps float copies of LM/depth weights on `device` (within its budget):
    where no fused kernel reads the blocks (CPU, MPS, no Triton), or where `MM3_KEEP_COPIES=1` asks
    for it (memory to spare; float products may then be faster). Where the kernels run, copies
    would spend the memory the quantization saved."""
    from .gpu import kernels

    return os.environ.get("MM3_KEEP_COPIES", "0") == "1" or not kernels.available(torch.device(device).type)


def ar_weight_budget(device: torch.device) -> int:
    """AR stage (weights read once per product, 7 depth passes per frame): dequantizing per product
    writes and reads the whole float weight, about twice the traffic of reading a kept copy.
    Accelerators (CUDA, XPU, MPS): what is free beyond RESERVE_BYTES; CPU: a quarter
    of the available memory; a device whose free memory is unknown: nothing. The most used weights
    (the depth decoder's) are kept first. `mm3.plan.ar.plan` keeps none where the fused kernels read the
    blocks (`keeps_ar_copies`)."""
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
