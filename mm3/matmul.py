"""The forms of matrix products the engine picks on the CPU, and a reusable dequantization buffer.

Decode-shaped products (`decode_linear`): decoding multiplies a handful of rows (the CFG pair of
each song) by large weights, so its speed is the speed of reading the weights. On the CPU the same
product runs at very different speeds in its two forms, and which is faster depends on the
processor: on an AMD EPYC MKL ran `x @ w.T` with 2-4 rows (what `F.linear` calls) at ~10 GB/s of
weights and `w @ x.T` (weight-major) at 25-40 GB/s; on an Intel Xeon the opposite, `F.linear` 2x
faster (the medium bench config's fused gate/up weight: 47 against 19 GB/s). So the form is timed on the first product of each
shape (both forms, alternately, best of 3) and the faster one kept for the process;
`MM3_DECODE_FORM` = "linear" or "weight-major" names one instead. Accelerators keep `F.linear`.

`Scratch`: one flat buffer per dtype for per-call dequantization on the CPU, where a fresh
allocation of a large weight means page faults on every product.

Large float32 CPU matrix products through oneDNN instead of MKL, where that stays float32-accurate
(`onednn_matmul`):

torch runs float32 `F.linear` on the CPU with MKL's sgemm, which on the AMD EPYC we measured runs
about half as fast as oneDNN's kernels for the DiT's shapes (1378 x 2048 x 512 and alike). torch
sends float32 products to oneDNN when `torch.backends.mkldnn.matmul.fp32_precision` is "bf16";
oneDNN may then use bfloat16 arithmetic where the CPU has it. Whether the result is still float32
accurate depends on the CPU and oneDNN version, so `onednn_matmul` checks once per process, on
products of the DiT's depths against float64, and switches only when the error stays at float32
level (measured here: 4e-7 relative, against 2.4e-7 for MKL); otherwise it changes nothing. The
switch is set for the duration of a `with` block and restored after it.
"""

from __future__ import annotations

from contextlib import contextmanager

import math
import os
import threading
import time
import warnings

import torch
import torch.nn.functional as F

DECODE_MAX_ROWS = 16  # beyond this the weight-major form stops paying on the CPU (measured up to 16)


DECODE_FORMS = ("auto", "linear", "weight-major")
_WEIGHT_MAJOR: dict[tuple, bool] = {}  # (N, K, rows, dtype) -> whether w @ x.T is the faster form


def decode_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T (+ b) -> [..., N], in the fastest form for a few rows on x's device."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows > DECODE_MAX_ROWS:
        return F.linear(x, w, b)
    x2 = x.reshape(rows, x.shape[-1])
    if not _weight_major(x2, w):
        return F.linear(x, w, b)
    y = torch.mm(w, x2.T).T  # [rows, N]
    if b is not None:
        y = y + b
    return y.contiguous().view(*x.shape[:-1], w.shape[0])


def _weight_major(x2: torch.Tensor, w: torch.Tensor) -> bool:
    key = (w.shape[0], w.shape[1], x2.shape[0], w.dtype)
    answer = _WEIGHT_MAJOR.get(key)
    if answer is None:
        named = os.environ.get("MM3_DECODE_FORM", "auto").strip().lower() or "auto"
        if named not in DECODE_FORMS:
            warnings.warn(f"MM3_DECODE_FORM={named!r} is not one of {', '.join(DECODE_FORMS)}; timing both",
                          stacklevel=2)
        if named in ("linear", "weight-major"):
            answer = named == "weight-major"
        else:
            forms = {True: lambda: torch.mm(w, x2.T), False: lambda: F.linear(x2, w)}
            forms[False]()  # the first product touches the weight's pages: not timed
            best = {True: math.inf, False: math.inf}
            for _ in range(3):
                for form, run in forms.items():
                    start = time.perf_counter()
                    run()
                    best[form] = min(best[form], time.perf_counter() - start)
            answer = best[True] < best[False]
        _WEIGHT_MAJOR[key] = answer
    return answer


class Scratch(threading.local):
    """A reusable flat buffer per dtype (per thread) for dequantizing a weight that is used once."""

    def __init__(self):
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < n:
            buf = self.buffers[dtype] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)

    def clear(self):
        self.buffers.clear()


CPU_SCRATCH = Scratch()

MAX_REL_ERR = 4e-6  # float32-level; a bfloat16 product would be ~3e-3
# torch's CPU flash attention also follows the switch: faster for heads of 64 (the released DiT;
# 13.5 -> 10.9 ms for 8 heads x 690 tokens x 2), slower for heads of 16 (2.8 -> 3.8 ms), measured.
MIN_HEAD_DIM = 32
_PROBE: list[bool] = []  # cached result of _accurate()


def _flag():
    return getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)


def _accurate() -> bool:
    if not _PROBE:
        ok = False
        flags = _flag()
        if flags is not None and torch.backends.mkldnn.is_available():
            g = torch.Generator().manual_seed(0)
            old = flags.fp32_precision
            try:
                flags.fp32_precision = "bf16"
                ok = True
                for k in (64, 512, 2048):
                    x, w = torch.randn(256, k, generator=g), torch.randn(96, k, generator=g)
                    want = F.linear(x.double(), w.double())
                    err = ((F.linear(x, w).double() - want).norm() / want.norm()).item()
                    ok = ok and err < MAX_REL_ERR
            except (RuntimeError, ValueError, AttributeError):
                ok = False
            finally:
                flags.fp32_precision = old
        _PROBE.append(ok)
    return _PROBE[0]


@contextmanager
def onednn_matmul(device, enabled: bool = True):
    """Within the block, float32 CPU products go to oneDNN if `_accurate()`; a no-op elsewhere."""
    flags = _flag()
    if not enabled or torch.device(device).type != "cpu" or flags is None or not _accurate():
        yield False
        return
    old = flags.fp32_precision
    flags.fp32_precision = "bf16"
    try:
        yield True
    finally:
        flags.fp32_precision = old


def pays_for(dit) -> bool:
    """Whether the switch speeds up this DiT's forward as a whole (see MIN_HEAD_DIM)."""
    return int(getattr(dit, "hp", {}).get("attention_head_dim", 0)) >= MIN_HEAD_DIM
