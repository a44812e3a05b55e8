"""Measuring: the machine a report names, peak memory over a block, device sync, best-of timing."""

from __future__ import annotations

import os
import platform
import time

import torch

from ..backends.cpu.choice import processor

MIB = 1 << 20


def machine(device: torch.device) -> dict:
    info = {"cpu": processor(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "device": str(device),
            "os": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)}
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:
        info["diffusers"] = None
    return info


class PeakMemory:
    """Peak process RSS (Linux: VmHWM, reset through /proc/self/clear_refs) and, on CUDA, peak
    allocated VRAM, over a `with` block, with the RSS at its start (the bench holds both sides'
    models in one process: the difference is what the run itself added). MiB; None where the
    platform cannot say."""

    def __init__(self, device: torch.device):
        self.device, self.rss_mib, self.vram_mib, self.start_mib = device, None, None, None

    @staticmethod
    def _status(key: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def __enter__(self):
        rss = self._status("VmRSS")
        self.start_mib = None if rss is None else round(rss / MIB, 1)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        hwm = self._status("VmHWM")
        self.rss_mib = None if hwm is None else round(hwm / MIB, 1)
        if self.device.type == "cuda":
            self.vram_mib = round(torch.cuda.max_memory_allocated(self.device) / MIB, 1)
        return False

    def as_dict(self) -> dict:
        d = {"peak_rss_mib": self.rss_mib, "rss_before_mib": self.start_mib}
        if self.vram_mib is not None:
            d["peak_vram_mib"] = self.vram_mib
        return d


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ratio(reference: float | None, ours: float | None) -> float | None:
    """How many times faster ours is (reference time / our time)."""
    if not reference or not ours:
        return None
    return round(reference / ours, 2)


def best_of(fns: dict, repeat: int, device: torch.device) -> dict:
    """Best wall time of each callable, run in turns (load from other processes hits all alike)."""
    for fn in fns.values():
        fn()  # warm-up
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """GB/s a device-to-device copy moves (bytes read + written), best of 5: the bandwidth a
    bandwidth-bound stage can reach. None off CUDA."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return _copy_gb_per_s(device, min(nbytes, free // 4))


def host_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s a copy in the machine's memory moves (bytes read + written), best of 5: what the AR's
    weight reads on the CPU are held against."""
    return _copy_gb_per_s(torch.device("cpu"), nbytes)


def _copy_gb_per_s(device: torch.device, nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # pages touched before the timing
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):  # the first copy also touches dst's pages
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return round(2 * nbytes / best / 1e9, 1)


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float | None:
    """Tera floating-point operations per second of one large square product in `dtype`, best of
    5: the compute a compute-bound stage can reach. None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del a, b
    return round(2 * n ** 3 / best / 1e12, 1)


def read_bytes(module: torch.nn.Module) -> int:
    """Bytes of weights one forward of `module` reads: each slot's kept float copy where one is
    kept (`mm3.weights.copies`), else the slot as held (blocks or device layout)."""
    from ..weights.layers import WeightSlots

    total = 0
    for sub in module.modules():
        if not isinstance(sub, WeightSlots):
            continue
        for name in sub._slot_types:
            t = sub._dequantized.get(name)
            t = sub._parameters.get(name) if t is None else t
            if t is not None:
                total += t.numel() * t.element_size()
    return total
