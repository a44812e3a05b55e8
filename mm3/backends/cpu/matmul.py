"""The forms of matrix products the engine picks on the CPU, and a reusable dequantization buffer.

`weight_major_linear`: a decode step multiplies a few rows by large weights, so its speed is the
speed of reading them. On the CPU `x @ w.T` (`F.linear`) and `w @ x.T` (weight-major) read them at
very different speeds; `mm3.backends.cpu.forms` names the form each layer takes (`mm3.backends.cpu.choice`
gives it by rule, or as `MM3_CPU_PRODUCT` names).

`onednn_matmul`: large float32 CPU products through oneDNN instead of MKL, which can be much
faster for the DiT's shapes. oneDNN may use bfloat16 arithmetic where the CPU has it, so the
switch is taken only after a once-per-process check against float64 shows float32-level error,
and only for the duration of a `with` block.
"""

from __future__ import annotations

from contextlib import contextmanager


import torch
import torch.nn.functional as F

DECODE_MAX_ROWS = 16  # beyond this the weight-major form stops paying on the CPU


def rows_out(y: torch.Tensor, x: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A CPU kernel's output for x's rows ([rows, N padded to its tile]) as x's [..., N] in x's
    dtype, `bias` added."""
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)


def weight_major_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T (+ b) -> [..., N], as `w @ x.T` for a few rows on the CPU (else `F.linear`)."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows > DECODE_MAX_ROWS:
        return F.linear(x, w, b)
    y = torch.mm(w, x.reshape(rows, x.shape[-1]).T).T  # [rows, N]
    if b is not None:
        y = y + b
    return y.contiguous().view(*x.shape[:-1], w.shape[0])


MAX_REL_ERR = 4e-6  # float32-level; a bfloat16 product would be ~3e-3
PROBE_DEPTHS = (64, 512, 2048)  # inner lengths the accuracy probe multiplies over: short to long dot products
# torch's CPU flash attention also follows the switch: it pays for wide heads (the released DiT's
# 64) and costs for narrow ones, hence the floor on the head size.
MIN_HEAD_DIM = 32
_PROBE: list[bool] = []  # cached result of accurate()


def _flag():
    return getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)


def accurate() -> bool:
    """Whether oneDNN's float32 products are float32-exact here (checked once against float64)."""
    if not _PROBE:
        ok = False
        flags = _flag()
        if flags is not None and torch.backends.mkldnn.is_available():
            g = torch.Generator().manual_seed(0)
            old = flags.fp32_precision
            try:
                flags.fp32_precision = "bf16"
                ok = True
                for k in PROBE_DEPTHS:
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
    """Within the block, float32 CPU products go to oneDNN if `accurate()`; a no-op elsewhere."""
    flags = _flag()
    if not enabled or torch.device(device).type != "cpu" or flags is None or not accurate():
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
