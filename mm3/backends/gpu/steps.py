"""The GPU back end's whole decode steps: the answers `mm3.backends.steps` gets for tensors on the
GPU code path (`emulation.gpu_path`). Each returns its result, or None with nothing written where
it does not serve (a dtype, layout or shape its kernels do not take), and the model's torch
operations run instead. Every step reads positions from the device (the cache's `pos`), never
from the host, so a frame of them can be captured as one CUDA graph.
"""

from __future__ import annotations

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _serves(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the kernels take x and `others`: one float dtype of theirs and one device, rows of
    stride 1, outside tracing (torch.compile fuses the model's own operations)."""
    if torch.compiler.is_compiling() or x.dtype not in _DTYPES or x.dim() == 0 or x.stride(-1) != 1:
        return False
    return all(t.dtype == x.dtype and t.device == x.device and t.dim() > 0 and t.stride(-1) == 1 for t in others)


def _vector(w: torch.Tensor, n: int) -> bool:
    return w.is_contiguous() and w.numel() == n


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x's rows by `weight` in one kernel (`norm_kernels.rms_norm`), or None."""
    if not _serves(x, weight) or not _vector(weight, x.shape[-1]):
        return None
    from . import norm_kernels

    return norm_kernels.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, its RMSNorm by `weight`) in one kernel (`norm_kernels.add_rms_norm`), or None."""
    if not _serves(x, delta, weight) or x.shape != delta.shape or not _vector(weight, x.shape[-1]):
        return None
    from . import norm_kernels

    return norm_kernels.add_rms_norm(x, delta, weight, eps)


def lookup(table: torch.Tensor, qtype, ids: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows `ids` [n] of a quantized table gathered and dequantized in one kernel -> [n, k] `dtype`, or None."""
    return None


def top_k_draw(logits, rows_per_song: int, cfg: float, top_k: int, q, excluded=None, gate: bool = False):
    """A guided top-k draw in one kernel, or None."""
    return None


def rope_table(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """The rotation's (cos, sin) [1, 1, 1, D] of `dtype` for the device position `pos` ([1] int64)
    in one kernel (`attention_kernels.rope_table_kernel`), or None."""
    if torch.compiler.is_compiling() or dtype not in _DTYPES or pos.dtype != torch.int64 or pos.numel() != 1 or \
            inv_freq.dtype != torch.float32 or inv_freq.device != pos.device or not inv_freq.is_contiguous() or \
            not _pow2(inv_freq.numel()):
        return None
    from . import attention_kernels

    return attention_kernels.rope_table(pos, inv_freq, dtype)


def prepare_attention(q, k, v, q_norm, k_norm, eps: float, cos, sin, cache_k, cache_v, pos):
    """An LM decode step's q/k norms, rotation and cache write at the device position `pos` ([1]
    int64) in one kernel (`attention_kernels.attn_prep_kernel`) -> the rotated queries [B, heads,
    1, D], or None."""
    if not _serves(q, k, v, q_norm, k_norm, cos, sin, cache_k, cache_v) or q.dim() != 3 or cache_k.dim() != 4:
        return None
    b, s, width = q.shape
    rows, kv_heads, _, d = cache_k.shape
    if s != 1 or rows != b or k.shape != (b, 1, kv_heads * d) or v.shape != k.shape or cache_v.shape != cache_k.shape \
            or not (cache_k.is_contiguous() and cache_v.is_contiguous()) or width % d or not _pow2(d) \
            or not all(_vector(t, d) for t in (q_norm, k_norm, cos, sin)) \
            or pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != q.device:
        return None
    from . import attention_kernels

    return attention_kernels.prepare(q, k, v, q_norm, k_norm, eps, cos, sin, cache_k, cache_v, pos, width // d,
                                     kv_heads, d)


def decode_attention(q, cache_k, cache_v, pos, span: int, scale: float):
    """One query position's attention over the first pos + 1 keys of the cache (a launch sized for
    `span` keys) in two kernels (`attention_kernels.decode`) -> [B, heads, 1, D], or None."""
    if not _serves(q, cache_k, cache_v) or q.dim() != 4 or cache_k.dim() != 4 or not q.is_contiguous():
        return None
    b, heads, s, d = q.shape
    rows, kv_heads, cap, dk = cache_k.shape
    if s != 1 or rows != b or dk != d or not _pow2(d) or heads % kv_heads or cache_v.shape != cache_k.shape \
            or not (cache_k.is_contiguous() and cache_v.is_contiguous()) or not 0 < span <= cap \
            or pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != q.device:
        return None
    from . import attention_kernels

    return attention_kernels.decode(q, cache_k, cache_v, pos, span, scale)


def short_attention(q, k, v, cache_k, cache_v, at: int, scale: float):
    """The depth decoder's attention of new rows q, k, v [B, S, heads * D] over its short cache
    (written at `at`, a position the host knows: the cache restarts every frame) in one kernel
    (`attention_kernels.attention_short_kernel`) -> [B, S, heads * D], or None."""
    if not _serves(q, k, v, cache_k, cache_v) or q.dim() != 3 or cache_k.dim() != 4:
        return None
    b, s, width = q.shape
    rows, heads, cap, d = cache_k.shape
    if rows != b or width != heads * d or k.shape != q.shape or v.shape != q.shape or cache_v.shape != cache_k.shape \
            or not (cache_k.is_contiguous() and cache_v.is_contiguous()) or not _pow2(d) or not 0 <= at <= cap - s \
            or s > 16:
        return None
    from . import attention_kernels

    return attention_kernels.short(q, k, v, cache_k, cache_v, at, scale)
