"""Which kernels serve a quantized weight on an accelerator, by rule.

`family(qtype, n, k, device)`: "layout" (the weight is held in the device layout and multiplied by
`mm3.backends.gpu.layout_kernels`), "triton" (the GGUF blocks, by `mm3.backends.gpu.kernels`) or
None (torch's products). `MM3_KERNELS` (`kernels.configure`) names one, or "off" none; "auto" (the
default) takes, on an accelerator (CUDA, ROCm, XPU), the layout kernels wherever the layout serves
the weight's type and row length and they compute right there (`layout_kernels.works`, checked once
per type), the block kernels elsewhere (`rule`). A decode step reads every weight in turn, so a
product timed alone with its weight hot in the cache misleads: in whole frames the layout kernels
serve best wherever they read the type. Nothing is timed or kept on disk.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QT

from ...cache_dir import drop_old_records
from . import device_layout, kernels, layout_kernels

FAMILIES = ("layout", "triton")


def reads(name: str, qtype: QT, k: int) -> bool:
    """Whether family `name` reads weights of `qtype` with rows of `k` values. Float weights stay as
    they are in both (torch's product, or the block kernel for an input of another dtype)."""
    if qtype in layout_kernels.FLOATS:
        return False
    if name == "layout":
        return qtype in device_layout.LAYOUT_TYPES and layout_kernels.supports(qtype, k)
    return kernels.supports(qtype, k)


def rule(qtype: QT, k: int) -> str | None:
    """The family "auto" gives a weight of `qtype` with rows of `k` values on an accelerator, before
    the device's check: "layout" where it reads them, else "triton" where that does, else None."""
    return next((name for name in FAMILIES if reads(name, qtype, k)), None)


def family(qtype: QT, n: int, k: int, device: torch.device) -> str | None:
    """The kernel family for a [n, k] weight of `qtype` placed on `device` (see the module doc)."""
    device = torch.device(device)
    mode = kernels.mode()
    if mode == "off" or device.type == "meta" or not kernels.available(device.type):
        return None
    if mode in FAMILIES:  # named: wherever it reads the type, CPU tensors under the interpreter too
        return mode if reads(mode, qtype, k) else None
    if device.type == "cpu":  # auto: accelerators only
        return None
    drop_old_records()
    chosen = rule(qtype, k)
    if chosen == "layout" and not layout_kernels.works(qtype, compute_dtype(device), device):
        chosen = "triton" if reads("triton", qtype, k) else None
    return chosen


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the layout kernels are checked in: bfloat16 where the device has it."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16 if device.type != "cpu" else torch.float32
