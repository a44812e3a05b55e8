"""Which kernels serve a quantized weight on an accelerator, measured where they run.

`family(qtype, n, k, device)`: "layout" (the weight is held in the device layout and multiplied by
`mm3.backends.gpu.layout_kernels`), "triton" (the GGUF blocks, by `mm3.backends.gpu.kernels`) or None (torch's
products). `MM3_KERNELS` (`kernels.configure`) names one, or "off" none; "auto" (the default) takes,
on an accelerator, the faster of those that compute right there, timed once on a random weight of
that type and shape at its first placement and kept in `choices.json` of the cache folder
(`mm3.cache_dir`) under the device's name, its driver and the torch and Triton versions: every
later run on that machine takes the same kernels without timing, so it computes the same numbers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

from ...bounded import MAX_RECORD_BYTES, loads, read_bytes
from ...cache_dir import cache_dir, clear_stale, writable
from . import device_layout, kernels, layout_kernels
from ...formats.gguf.quants import random_blocks

FAMILIES = ("layout", "triton")
CHOICES_FILE = "choices.json"
STALE_SECONDS = 60  # a record's temporary older than this was left by a killed process
TIMED_ROWS = 2  # a decode product (the CFG pair): what the AR stage runs most


def family(qtype: QT, n: int, k: int, device: torch.device) -> str | None:
    """The kernel family for a [n, k] weight of `qtype` placed on `device` (see the module doc)."""
    device = torch.device(device)
    mode = kernels.mode()
    if mode == "off" or device.type == "meta" or not kernels.available(device.type):
        return None
    fits = [f for f in FAMILIES if _supports(f, qtype, k)]
    if mode in FAMILIES:
        return mode if mode in fits else None
    if device.type == "cpu" or not fits:  # auto: accelerators only
        return None
    key = f"{qtype.name}/{n}x{k}"
    record = _records(device)
    entry = record.get(key)
    known = entry.get("family") if isinstance(entry, dict) else None  # another value: a damaged entry, timed again
    if (isinstance(known, str) and known in fits) or (known is None and isinstance(entry, dict)):
        return known
    times = measure(qtype, n, k, device, fits)
    chosen = min(times, key=times.get) if times else None
    _remember(device, key, {"family": chosen, "ms": {f: round(t, 4) for f, t in times.items()}})
    return chosen


def _supports(name: str, qtype: QT, k: int) -> bool:
    if qtype in layout_kernels.FLOATS:
        return False  # float weights stay as they are: torch's product, or the block kernel for another dtype
    if name == "layout":
        return qtype in device_layout.LAYOUT_TYPES and layout_kernels.supports(qtype, k)
    return kernels.supports(qtype, k)


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype products are checked and timed in: bfloat16 where the device has it."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16 if device.type != "cpu" else torch.float32


def measure(qtype: QT, n: int, k: int, device: torch.device, names=FAMILIES, repeat: int = 20) -> dict[str, float]:
    """Milliseconds per decode product (TIMED_ROWS input rows) of each family that computes right
    on `device` (`works`), on a random [n, k] weight of `qtype`."""
    dtype = compute_dtype(device)
    blocks = random_blocks(qtype, n, k, device=device)
    x = torch.randn(TIMED_ROWS, k, device=device, dtype=dtype)
    runs = {}
    if "layout" in names and layout_kernels.works(qtype, dtype, device):
        planes = device_layout.to_planes(blocks, qtype, k)
        runs["layout"] = lambda: layout_kernels.linear(x, planes, qtype, k)
    if "triton" in names and kernels.works(qtype, dtype, device):
        runs["triton"] = lambda: kernels.fused_linear(x, blocks, qtype)
    return {name: _time(fn, device, repeat) for name, fn in runs.items()}


def _time(fn, device: torch.device, repeat: int) -> float:
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best * 1e3


# -- the record on disk ------------------------------------------------------------------------------
def machine_key(device: torch.device) -> str:
    """The device's name, driver, and the torch and Triton versions: what a choice holds for."""
    name, driver = device.type, "unknown"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        try:
            driver = str(torch._C._cuda_getDriverVersion())
        except Exception:
            pass
    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = "none"
    return f"{name} | driver {driver} | torch {torch.__version__} | triton {version}"


def choices_path() -> Path:
    return cache_dir() / CHOICES_FILE


def _load() -> dict:
    """The record of every machine's choices; one that cannot be read (damaged, nested past the
    bound, or not an object of objects) is taken as empty and rewritten by the next choice."""
    try:
        data = loads(read_bytes(choices_path(), MAX_RECORD_BYTES, "the kernel choices"), "the kernel choices")
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


_RECORDS: dict = {}  # machine key -> its choices, read once per process


def _records(device: torch.device) -> dict:
    key = machine_key(device)
    if key not in _RECORDS:
        _RECORDS[key] = dict(_load().get(key, {}))
    return _RECORDS[key]


def _remember(device: torch.device, key: str, value: dict) -> None:
    """Record a choice in memory and on disk (the file merged, then replaced in one step); a cache
    folder that cannot be written costs only the timing again next time."""
    machine = machine_key(device)
    _records(device)[key] = value
    if writable() is None:  # warned once
        return
    path = choices_path()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    clear_stale(path.parent, f"{path.name}.*.tmp", STALE_SECONDS)
    try:
        everything = _load()
        everything.setdefault(machine, {})[key] = value
        tmp.write_text(json.dumps(everything, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def forget() -> None:
    """Drop the choices read into this process (the file stays)."""
    _RECORDS.clear()
