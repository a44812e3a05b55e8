"""The GPU code path over CPU tensors, through Triton's interpreter: how the tests check the GPU
back end's kernels against torch, and how `python -m mm3 kernels --frame` counts a GPU frame's
launches, on a machine without a GPU.

Inside `emulated()` the CPU back end steps aside (`cpu_path` is False for every tensor) and the GPU
back end serves CPU tensors as it serves CUDA ones (`gpu_path`); the products take the device
layout's kernels. It needs `TRITON_INTERPRET=1` in the environment before Triton is imported.
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager

import torch

from .interpreter import interpreted

_ON = [False]


def active() -> bool:
    """Whether the GPU code path is being emulated over CPU tensors."""
    return _ON[0]


@contextmanager
def emulated(kernel_mode: str = "layout"):
    """Run the GPU code path over CPU tensors until the block ends (products by `kernel_mode`'s
    kernels, interpreted). Layers choose their products when loaded or moved: load them inside."""
    if not interpreted():
        raise RuntimeError("emulating the GPU code path needs TRITON_INTERPRET=1 set before Triton is imported")
    from . import kernels

    before, was = kernels.mode(), _ON[0]
    kernels.configure(kernel_mode)
    _ON[0] = True
    try:
        yield
    finally:
        _ON[0] = was
        kernels.configure(before)


def on_gpu_path(device):
    """The GPU code path for tensors on `device`: as they are on a device Triton runs (nothing to
    do), emulated for CPU tensors (`emulated`)."""
    return emulated() if torch.device(device).type == "cpu" else contextlib.nullcontext()


def gpu_device(device) -> bool:
    """Whether tensors on `device` take the GPU back end's whole steps: a device Triton runs, or the
    CPU while emulating."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu" and not _ON[0]:
        return False
    from . import kernels

    return kernels.available(kind)


def gpu_path(t: torch.Tensor) -> bool:
    """Whether `t` takes the GPU back end's whole steps (`gpu_device` of its device)."""
    return gpu_device(t.device)


def cpu_path(t: torch.Tensor) -> bool:
    """Whether `t` takes the CPU back end's whole steps: a CPU tensor, outside emulation."""
    return t.device.type == "cpu" and not _ON[0]
