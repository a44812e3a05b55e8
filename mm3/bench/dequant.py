"""Dequantization throughput: our torch kernels against gguf-py's numpy reference, per GGML type.

    python -m mm3.bench.dequant [--mib 64] [--threads 1] [--device cpu] [--types Q8_0,Q4_K] [--json]

For each type it builds random blocks (finite f16 scales) whose float32 expansion is `--mib` MiB,
times `mm3.formats.gguf.quants.dequantize` (median of `--repeat` runs; allocating its output, and again
writing into a reused `out=` buffer) and gguf-py's `gguf.quants.dequantize` on the same bytes,
checks the two agree bit for bit, and reports GB/s of float32 output written ("speedup" compares
the allocating torch call with numpy, which also allocates). F32 is left out: it dequantizes to a
view of the input bytes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time

import gguf
import numpy as np
import torch

from ..backends.cpu.choice import processor
from ..formats.gguf.quants import SCALE_OFFSETS, SUPPORTED_TYPES, dequantize

QT = gguf.GGMLQuantizationType
ROW = 4096  # values per row of the benchmark tensors (a multiple of every block size)


def random_raw(qtype: QT, n_values: int, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes [rows, row_bytes] for n_values values of `qtype`, with finite f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == QT.F16:
        return rng.standard_normal(n_values, dtype=np.float32).astype(np.float16).view(np.uint8).reshape(-1, ROW * 2)
    if qtype == QT.BF16:
        top = rng.standard_normal(n_values, dtype=np.float32).view(np.uint32) >> 16
        return top.astype(np.uint16).view(np.uint8).reshape(-1, ROW * 2)
    raw = rng.integers(0, 256, size=(n_values // block, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        scale = rng.uniform(-0.01, 0.01, size=raw.shape[0]).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1, ROW // block * size)


def _median_seconds(fn, repeat: int, sync) -> float:
    fn()  # warm-up (allocator, lazy init)
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(qtype: QT, mib: float, repeat: int, device: torch.device, rng: np.random.Generator) -> dict:
    n_values = max(ROW, int(mib * 2**20 / 4) // ROW * ROW)
    raw = random_raw(qtype, n_values, rng)
    shape = (n_values // ROW, ROW)
    raw_t = torch.from_numpy(raw).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t_torch = _median_seconds(lambda: dequantize(raw_t, qtype, shape), repeat, sync)
    buf = torch.empty(shape, dtype=torch.float32, device=device)
    t_reuse = _median_seconds(lambda: dequantize(raw_t, qtype, shape, out=buf), repeat, sync)
    t_numpy = _median_seconds(lambda: gguf.quants.dequantize(raw, qtype), max(1, repeat // 2), lambda: None)
    ours = dequantize(raw_t, qtype, shape).cpu()
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))
    out_bytes = n_values * 4
    return {
        "type": qtype.name, "values": n_values, "raw_bytes": raw.nbytes, "out_bytes": out_bytes,
        "torch_ms": t_torch * 1e3, "torch_gbps": out_bytes / t_torch / 1e9,
        "torch_reused_out_ms": t_reuse * 1e3, "torch_reused_out_gbps": out_bytes / t_reuse / 1e9,
        "numpy_ms": t_numpy * 1e3, "numpy_gbps": out_bytes / t_numpy / 1e9,
        "speedup": t_numpy / t_torch, "bit_exact": bool(torch.equal(ours.view(torch.int32), ref.view(torch.int32))),
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mm3.bench.dequant", description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=64, help="float32 output size per type in MiB (default 64)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per type; the median is reported")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="device for the torch kernels (numpy always runs on CPU)")
    p.add_argument("--types", default=None, help="comma-separated GGML type names (default: all but F32)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    types = ([QT[name.strip()] for name in args.types.split(",")] if args.types
             else sorted((t for t in SUPPORTED_TYPES if t != QT.F32), key=lambda t: t.name))
    device = torch.device(args.device)
    rng = np.random.default_rng(0)
    env = {
        "device": str(device), "cpu": processor(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "numpy": np.__version__,
        "gguf": _version("gguf"),
        "date": time.strftime("%Y-%m-%d"), "mib": args.mib, "repeat": args.repeat,
    }
    rows = [bench(t, args.mib, args.repeat, device, rng) for t in types]
    if args.json:
        print(json.dumps({"env": env, "results": rows}, indent=2))
        return 0
    print(f"# {env['date']}  {env['cpu']}  ({env['cpu_count']} cores, torch {env['torch']} with "
          f"{env['torch_threads']} threads, numpy {env['numpy']}, gguf {env['gguf']})  device {env['device']}  "
          f"{args.mib:g} MiB float32 out")
    print(f"{'type':6s} {'raw MiB':>8s} {'torch ms':>9s} {'torch GB/s':>10s} {'reused-out GB/s':>15s} "
          f"{'numpy ms':>9s} {'numpy GB/s':>10s} {'speedup':>8s}  exact")
    for r in rows:
        print(f"{r['type']:6s} {r['raw_bytes'] / 2**20:8.1f} {r['torch_ms']:9.2f} {r['torch_gbps']:10.2f} "
              f"{r['torch_reused_out_gbps']:15.2f} {r['numpy_ms']:9.2f} {r['numpy_gbps']:10.2f} "
              f"{r['speedup']:7.1f}x  {'yes' if r['bit_exact'] else 'NO'}")
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
