"""4-bit weights multiplied on the CPU without a float copy, through torch's int4 matrix product.

torch's CPU kernel (`torch._weight_int4pack_mm_for_cpu`) multiplies bfloat16 rows by 4-bit weights
that carry a scale and an offset per group of 32 values along a row, w = (q - 8) * scale + offset.
Q4_0 (w = (q - 8) d), Q4_1 (w = q d + m) and Q4_K (w = d sc q - dmin mn per 32 values) all have that
form, so their blocks are repacked once into the kernel's layout, which takes about the bytes of the
blocks themselves (4 bits a weight plus two bfloat16 per 32). The inputs, scales and offsets are
rounded to bfloat16, so products differ from the float32 product of the dequantized weight by
about 0.3 % (the 4-bit weights themselves are ~10 % off the weights they were made from); used
for decode-shaped products of the LM and depth decoder in the fast numerics only.

Measured (2-core AMD EPYC, torch 2.14.1, 1 thread, 2 rows, Q4_K at the released LM's attention
and MLP shapes): 9.4 ms against 11.0 for the float32 product of a kept float copy and 69.8 for
dequantizing per product (attention), 18.9 / 28.5 / 197 ms (MLP).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ..matmul import DECODE_MAX_ROWS
from .quants import _halves, _k4_scale_min

INT4_TYPES = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K})
GROUP = 32
_PROBE: list[bool] = []


def available() -> bool:
    """Whether this torch has the CPU int4 product and it computes what this module expects."""
    if not _PROBE:
        ok = False
        if hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
            try:
                g = torch.Generator().manual_seed(0)
                q = torch.randint(0, 16, (24, 64), dtype=torch.int32, generator=g)
                scale, offset = torch.rand(24, 2, generator=g) + 0.5, torch.randn(24, 2, generator=g)
                x = torch.randn(2, 64, generator=g)
                w = ((q - 8).view(24, 2, GROUP) * scale[..., None] + offset[..., None]).view(24, 64)
                got = _product(x, pack(q, scale, offset))[:, :24]
                want = x.bfloat16().float() @ w.bfloat16().float().T
                ok = bool(((got - want).norm() / want.norm()) < 2e-2)
            except (RuntimeError, TypeError, AttributeError):
                ok = False
        _PROBE.append(ok)
    return _PROBE[0]


ROWS_MULTIPLE = 16  # the packing takes whole groups of 16 rows: others get zero rows, cut off after


def serves(layer, qtype: QT | None, device: torch.device) -> bool:
    """Whether a decode-shaped product of this layer (`mm3.gguf.ops.Linear`) on `device` comes here:
    a 4-bit weight of the LM or depth decoder in the fast numerics, on the CPU, with the kernel."""
    return (device.type == "cpu" and qtype in INT4_TYPES and layer.decode_products and layer.fused_kernels
            and available())


def reads(layer, qtype: QT | None, x: torch.Tensor) -> bool:
    """`serves`, for a decode-shaped x, with no kept float copy and the weight on the CPU."""
    if not serves(layer, qtype, x.device) or x.numel() > DECODE_MAX_ROWS * x.shape[-1]:
        return False
    return not layer.keeps_copy_for(x) and layer.stored("weight").device.type == "cpu"


def pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int32 in 0..15, scale and offset [N, K/32] -> (packed weight, scales and offsets)."""
    pad = -q.shape[0] % ROWS_MULTIPLE
    if pad:
        q = torch.cat((q, q.new_full((pad, q.shape[1]), 8)))
        scale, offset = (torch.cat((t, t.new_zeros(pad, t.shape[1]))) for t in (scale, offset))
    packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    pairs = torch.stack((scale, offset), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/32, N, 2]
    return packed, pairs


def _product(x2: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), packed[0], GROUP, packed[1]).float()


def repack(raw: torch.Tensor, qtype: QT, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF block rows [N, row_bytes] of a 4-bit type -> the kernel's (packed weight, scales and offsets)."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = raw.reshape(-1, size).contiguous()
    n_blocks = b.shape[0]
    if qtype == QT.Q4_K:  # d, dmin, scales[12], qs[128]; byte k of chunk c: values 64c + k, 64c + 32 + k
        qs = b[:, 16:].reshape(n_blocks, 4, 1, 32)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n_blocks, 256)
        dm = _halves(b, 0, 2)
        sm = _k4_scale_min(b[:, 4:16]).float()  # [n, 2, 8]
        scale = dm[:, :1] * sm[:, 0]  # [n, 8]
        offset = 8 * scale - dm[:, 1:] * sm[:, 1]
    else:  # Q4_0: d, qs[16]; Q4_1: d, m, qs[16] (value j low nibble of byte j, 16 + j high)
        start = 2 if qtype == QT.Q4_0 else 4
        qs = b[:, start:start + 16]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=1)
        scale = _halves(b, 0)
        offset = torch.zeros_like(scale) if qtype == QT.Q4_0 else 8 * scale + _halves(b, 2)
    groups = in_features // GROUP
    q = q.to(torch.int32).reshape(out_features, in_features)
    return pack(q, scale.reshape(out_features, groups), offset.reshape(out_features, groups))


def linear(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32) @ W.T (+ bias) -> [..., N] float32, W in the kernel's packing."""
    x2 = x.reshape(-1, x.shape[-1])
    y = _product(x2, packed)[:, :out_features].to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], out_features)
