"""Compute device and dtype: chosen automatically, or named by the user."""

from __future__ import annotations

import torch


def pick_device(name: str | None = None) -> torch.device:
    """`name` ("cuda", "cuda:1", "xpu", "mps", "cpu") or the best available: CUDA (ROCm builds
    report as CUDA), XPU, MPS, then CPU."""
    if name and name != "auto":
        dev = torch.device(name)
        available = {
            "cuda": torch.cuda.is_available,
            "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
            "mps": lambda: torch.backends.mps.is_available(),
            "cpu": lambda: True,
        }
        check = available.get(dev.type)
        if check is None or not check():
            raise ValueError(f"device {name!r} is not available here (auto picks {pick_device().type})")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    if torch.backends.mps.is_available():
        return torch.device("mps")
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


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "xpu":
        torch.xpu.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()
