"""The GPU back end's whole decode steps: the answers `mm3.backends.steps` gets for tensors on the
GPU code path (`emulation.gpu_path`). Each returns its result, or None with nothing written where
it does not serve (a dtype, layout or shape its kernels do not take, or a kernel that failed its
first-use check on the device: `step_checks`), and the model's torch operations run instead. Every
step reads positions from the device (the cache's `pos`), never from the host, so a frame of them
can be captured as one CUDA graph.
"""

from __future__ import annotations

import torch

from . import step_checks
from .kernels import CODES, FLOAT_DTYPES

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes the kernels read and write
_INTEGERS = (torch.int64, torch.int32)
_DOT_K = 16  # the fewest values a head the decode attention's tensor-core products take


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


def attends_heads_of(d: int) -> bool:
    """Whether the LM's decode attention kernels take heads of d values: a power of two, at least
    the tensor-core products' 16."""
    return _pow2(d) and d >= _DOT_K


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x's rows by `weight` in one kernel (`norm_kernels.rms_norm`), or None."""
    if not _serves(x, weight) or not _vector(weight, x.shape[-1]) or \
            not step_checks.serves("norms", x.device, x.dtype, x.shape[-1]):
        return None
    from . import norm_kernels

    return norm_kernels.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, its RMSNorm by `weight`) in one kernel (`norm_kernels.add_rms_norm`), or None."""
    if not _serves(x, delta, weight) or x.shape != delta.shape or not _vector(weight, x.shape[-1]) or \
            not step_checks.serves("norms", x.device, x.dtype, x.shape[-1]):
        return None
    from . import norm_kernels

    return norm_kernels.add_rms_norm(x, delta, weight, eps)


def _table(table: torch.Tensor, qtype, k: int, device: torch.device):
    """(kernel type code, row stride) of a table the lookup kernels read, or None: GGUF block rows
    [rows, row bytes] uint8, or a float table [rows, k] of the file's dtype, rows dense, on `device`."""
    code = CODES.get(qtype)
    if code is None or table.device != device or table.dim() != 2 or table.stride(1) != 1 or k < 1:
        return None
    if code == 0:
        return (0, table.stride(0)) if table.dtype == FLOAT_DTYPES[qtype] and table.shape[1] == k else None
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    if table.dtype != torch.uint8 or k % block or table.shape[1] != k // block * size:
        return None
    return code, table.stride(0)


def code_rows(table: torch.Tensor, qtype, codes: torch.Tensor, k: int, dtype: torch.dtype, repeat: int = 1,
              add: int = 0) -> torch.Tensor | None:
    """Rows `codes[i // repeat] + add` of a table (GGUF block rows or floats) gathered and dequantized
    in one kernel -> [codes.numel() * repeat, k] `dtype`, or None."""
    if torch.compiler.is_compiling() or dtype not in _DTYPES or codes.dtype not in _INTEGERS or \
            codes.dim() != 1 or codes.device != table.device or repeat < 1:
        return None
    kind = _table(table, qtype, k, codes.device)
    if kind is None:
        return None
    if not step_checks.serves("lookup", codes.device, dtype, qtype.name, k, int(repeat), codes.dtype):
        return None
    from . import lookup_kernels

    return lookup_kernels.rows(table, kind, codes, k, dtype, repeat, add)


def lookup(table: torch.Tensor, qtype, ids: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows `ids` [n] of a quantized table gathered and dequantized in one kernel -> [n, k] `dtype`, or None."""
    return code_rows(table, qtype, ids, k, dtype)


def frame_feedback(lm_table: torch.Tensor, lm_qtype, audio_table: torch.Tensor, audio_qtype, frame: torch.Tensor,
                   code_offset: int, audio_vocab: int, k: int, dtype: torch.dtype,
                   repeat: int = 1) -> torch.Tensor | None:
    """A frame's LM input (`mm3.plan.replay.frame_feedback` of `frame` [songs, ncb] with each song's
    row repeated `repeat` times) in one kernel -> [songs * repeat, 1, k] `dtype`, or None."""
    if torch.compiler.is_compiling() or dtype not in _DTYPES or frame.dtype not in _INTEGERS or \
            frame.dim() != 2 or frame.shape[1] < 2 or frame.stride(1) != 1 or repeat < 1:
        return None
    device = frame.device
    lm, audio = _table(lm_table, lm_qtype, k, device), _table(audio_table, audio_qtype, k, device)
    if lm is None or audio is None:
        return None
    if not step_checks.serves("feedback", device, dtype, lm_qtype.name, audio_qtype.name, k, frame.shape[1],
                              int(repeat), frame.dtype):
        return None
    from . import lookup_kernels

    return lookup_kernels.feedback(lm_table, lm, audio_table, audio, frame, code_offset, audio_vocab, k, dtype, repeat)


def _draw(logits, rows_per_song, cfg, top_k, q, excluded, gate, coded):
    """Launch `draw_kernels.draw_top_k_kernel` (checks as `top_k_draw`); `coded`: (start, code
    offset, END id) -> (codes, end flags), else the indices."""
    if torch.compiler.is_compiling() or logits.dtype not in _DTYPES or logits.dim() != 2 or \
            q.dtype != torch.float32 or q.dim() != 2 or rows_per_song not in (1, 2) or top_k < 1:
        return None
    rows, n = logits.shape
    songs = rows // rows_per_song
    device = logits.device
    if rows != songs * rows_per_song or not n or logits.stride(1) != 1 or q.shape != (songs, n) or \
            q.stride(1) != 1 or q.device != device:
        return None
    if excluded is not None and (excluded.device != device or excluded.dtype != torch.bool or
                                 excluded.shape != (n,) or not excluded.is_contiguous()):
        return None
    if not step_checks.serves("draw", device, logits.dtype, n, rows_per_song, bool(gate), bool(coded),
                              excluded is not None):
        return None
    from . import draw_kernels

    return draw_kernels.draw(logits, rows_per_song, cfg, top_k, q, excluded, gate, coded)


def top_k_draw(logits, rows_per_song: int, cfg: float, top_k: int, q, excluded=None, gate: bool = False):
    """A guided top-k draw in one kernel (`mm3.backends.cpu.steps.top_k_draw`'s contract; logits in
    any float dtype, read as float32) -> [songs] int64, or None."""
    return _draw(logits, rows_per_song, cfg, top_k, q, excluded, gate, None)


def semantic_draw(logits, rows_per_song: int, cfg: float, top_k: int, q, excluded, start: int, code_offset: int,
                  end_id: int):
    """The LM's gated draw over head rows from id `start` in one kernel -> (codes [songs]: the id
    minus `code_offset`, at least 0; end [songs]: the id is `end_id`), or None."""
    return _draw(logits, rows_per_song, cfg, top_k, q, excluded, True, (start, code_offset, end_id))


def rope_table(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """The rotation's (cos, sin) [1, 1, 1, D] of `dtype` for the device position `pos` ([1] int64)
    in one kernel (`attention_kernels.rope_table_kernel`), or None."""
    if torch.compiler.is_compiling() or dtype not in _DTYPES or pos.dtype != torch.int64 or pos.numel() != 1 or \
            inv_freq.dtype != torch.float32 or inv_freq.device != pos.device or not inv_freq.is_contiguous() or \
            not _pow2(inv_freq.numel()) or not step_checks.serves("rope", pos.device, dtype, 2 * inv_freq.numel()):
        return None
    from . import attention_kernels

    return attention_kernels.rope_table(pos, inv_freq, dtype)


def _caches(cache_k, cache_v, scales, dtype: torch.dtype) -> bool:
    """Whether the attention kernels take these caches ([B, kv_heads, cap, D], contiguous, one shape):
    in `dtype`, or with `scales` (key, value) 8-bit (`mm3.models.kv_cache`): int8 codes and float32
    scales [B, kv_heads, cap, D / group] of a power-of-two group, on the caches' device."""
    if cache_k.dim() != 4 or cache_v.shape != cache_k.shape or cache_v.device != cache_k.device or \
            not (cache_k.is_contiguous() and cache_v.is_contiguous()):
        return False
    if scales is None:
        return cache_k.dtype == cache_v.dtype == dtype
    groups = scales[0].shape[-1]
    return cache_k.dtype == cache_v.dtype == torch.int8 and len(scales) == 2 and groups > 0 and \
        cache_k.shape[3] % groups == 0 and _pow2(cache_k.shape[3] // groups) and \
        all(t.dtype == torch.float32 and t.shape == (*cache_k.shape[:3], groups) and t.is_contiguous() and
            t.device == cache_k.device for t in scales)


def _attention_checked(dtype: torch.dtype, heads: int, cache_k: torch.Tensor, scales) -> bool:
    """Whether the LM attention kernels passed their check (`step_checks`) for these heads and cache:
    the preparation's, and where the attention kernels take the heads theirs too."""
    kv_heads, d = cache_k.shape[1], cache_k.shape[3]
    group = 0 if scales is None else d // scales[0].shape[-1]
    attends = attends_heads_of(d) and heads % kv_heads == 0
    return step_checks.serves("attention", cache_k.device, dtype, heads, kv_heads, d, group, attends)


def prepare_attention(q, k, v, q_norm, k_norm, eps: float, cos, sin, cache_k, cache_v, pos, scales=None):
    """An LM decode step's q/k norms, rotation and cache write at the device position `pos` ([1]
    int64) in one kernel (`attention_kernels.attn_prep_kernel`) -> the rotated queries [B, heads,
    1, D], or None. `scales`: an 8-bit cache's (key, value) scales."""
    if not _serves(q, k, v, q_norm, k_norm, cos, sin) or q.dim() != 3 or \
            not _caches(cache_k, cache_v, scales, q.dtype) or cache_k.device != q.device:
        return None
    b, s, width = q.shape
    rows, kv_heads, _, d = cache_k.shape
    if s != 1 or rows != b or k.shape != (b, 1, kv_heads * d) or v.shape != k.shape or width % d or not _pow2(d) \
            or not all(_vector(t, d) for t in (q_norm, k_norm, cos, sin)) \
            or pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != q.device or \
            not _attention_checked(q.dtype, width // d, cache_k, scales):
        return None
    from . import attention_kernels

    return attention_kernels.prepare(q, k, v, q_norm, k_norm, eps, cos, sin, cache_k, cache_v, pos, width // d,
                                     kv_heads, d, scales)


def decode_attention(q, cache_k, cache_v, pos, span: int, scale: float, scales=None):
    """One query position's attention over the first pos + 1 keys of the cache (a launch sized for
    `span` keys; `scales`: an 8-bit cache's) in two kernels (`attention_kernels.decode`) -> [B,
    heads, 1, D], or None."""
    if not _serves(q) or q.dim() != 4 or not q.is_contiguous() or not _caches(cache_k, cache_v, scales, q.dtype) \
            or cache_k.device != q.device:
        return None
    b, heads, s, d = q.shape
    rows, kv_heads, cap, dk = cache_k.shape
    if s != 1 or rows != b or dk != d or not attends_heads_of(d) or heads % kv_heads or not 0 < span <= cap \
            or pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != q.device or \
            not _attention_checked(q.dtype, heads, cache_k, scales):
        return None
    from . import attention_kernels

    return attention_kernels.decode(q, cache_k, cache_v, pos, span, scale, scales=scales)


def _attends(b: int, heads: int, cache_k, cache_v, scales, dtype, vectors, span: int, pos) -> bool:
    """Whether the one-launch attention step takes b rows of `heads` query heads of `dtype` over these
    caches (`_caches`), the head vectors (q/k norms, cos, sin) of D values, a launch of `span` keys
    and the device position `pos`."""
    if not _caches(cache_k, cache_v, scales, dtype):
        return False
    rows, kv_heads, cap, d = cache_k.shape
    return rows == b and attends_heads_of(d) and heads % kv_heads == 0 and \
        all(_vector(t, d) for t in vectors) and 0 < span <= cap and pos.dtype == torch.int64 and \
        pos.numel() == 1 and pos.device == cache_k.device and _attention_checked(dtype, heads, cache_k, scales)


def attention_step(q, k, v, q_norm, k_norm, eps: float, cos, sin, cache_k, cache_v, pos, span: int, scale: float,
                   scales=None):
    """An LM decode step's q/k norms, rotation, cache write at the device position `pos` and its
    attention over the filled keys (a launch sized for `span` keys; `scales`: an 8-bit cache's) in
    one kernel (`attention_kernels.step`) -> [B, heads, 1, D], or None (nothing written). q, k, v
    [B, 1, .]: adjacent pieces of each row of one q/k/v product's output, as its split gives them."""
    if not _serves(q, k, v, q_norm, k_norm, cos, sin) or q.dim() != 3 or cache_k.dim() != 4 or \
            cache_k.device != q.device:
        return None
    b, s, width = q.shape
    kv_width, size = cache_k.shape[1] * cache_k.shape[3], q.element_size()
    if s != 1 or width % cache_k.shape[3] or k.shape != (b, 1, kv_width) or v.shape != k.shape or \
            not _attends(b, width // cache_k.shape[3], cache_k, cache_v, scales, q.dtype, (q_norm, k_norm, cos, sin),
                         span, pos) or \
            k.data_ptr() != q.data_ptr() + width * size or v.data_ptr() != k.data_ptr() + kv_width * size or \
            not q.stride(0) == k.stride(0) == v.stride(0) >= width + 2 * kv_width:
        return None
    from . import attention_kernels

    return attention_kernels.step(q[:, 0], q_norm, k_norm, eps, cos, sin, cache_k, cache_v, pos, span, scale,
                                  width // cache_k.shape[3], scales)


def lm_layer(parts: tuple, x, norms: tuple, eps: float, head_norms: tuple, head_eps: float, cos, sin, cache_k,
             cache_v, pos, span: int, heads: int, scale: float, scales=None):
    """An LM layer's whole decode step in five launches, x [B, 1, dim] -> the layer's output:
    q/k/v with the input norm inside, the attention with the q/k norms, rotation and cache write
    inside (`attention_kernels.step`), out with the residual add, gate/up with the second norm and
    SwiGLU, down with the residual add. `parts`: `mm3.backends.products.layout_block`'s; `norms`:
    the layer's two norm weights, `head_norms` the q and k norms'; `scales`: an 8-bit cache's. None
    (nothing written) where the kernels do not take these shapes."""
    from .layout_kernels import GEMV_MAX_ROWS

    if torch.compiler.is_compiling() or not _serves(x, *norms, *head_norms, cos, sin) or x.dim() != 3 or \
            not x.is_contiguous() or cache_k.device != x.device:
        return None
    b, s, dim = x.shape
    if s != 1 or b > GEMV_MAX_ROWS or not all(_vector(w, dim) for w in norms) or \
            not _attends(b, heads, cache_k, cache_v, scales, x.dtype, (*head_norms, cos, sin), span, pos):
        return None
    kv_heads, d = cache_k.shape[1], cache_k.shape[3]
    from . import attention_kernels

    qkv_product, out, swiglu, down = parts
    qkv = qkv_product.fused(x, norm=(norms[0], eps))
    if qkv.shape[-1] != (heads + 2 * kv_heads) * d:
        raise ValueError(f"a q/k/v product of {qkv.shape[-1]} outputs for {heads} query and {kv_heads} key heads "
                         f"of {d}")
    attended = attention_kernels.step(qkv.view(b, -1), *head_norms, head_eps, cos, sin, cache_k, cache_v, pos, span,
                                      scale, heads, scales)
    x = out.fused(attended.view(b, 1, heads * d), residual=x)
    return down.fused(swiglu.fused(x, norm=(norms[1], eps)), residual=x)


def depth_blocks(parts: list, x, positions, norms: list, eps: float, cache_k, cache_v, at: int, scale: float):
    """The depth decoder's blocks over x [B, S, dim] plus its position embeddings `positions`
    [1, S, dim] and its cache (written at `at`, a host position) -> the last block's output, five
    launches a block: q/k/v with the input norm inside, the short attention, out with the residual
    add, gate/up with the second norm and SwiGLU, down with the residual add; the first block's q/k/v
    and out add the positions where they read x (no launch of their own). `parts`: each block's
    `layout_block`; `norms`: each block's two norm weights. None (nothing written) where the
    kernels do not take these shapes."""
    from .layout_kernels import GEMV_MAX_ROWS

    if torch.compiler.is_compiling() or not _serves(x, positions, cache_k, cache_v,
                                                    *(w for pair in norms for w in pair)) or \
            x.dim() != 3 or not x.is_contiguous() or cache_k.dim() != 5 or len(parts) != cache_k.shape[0]:
        return None
    b, s, dim = x.shape
    _, rows, heads, cap, d = cache_k.shape
    if rows != b or b * s > GEMV_MAX_ROWS or s > 16 or dim != heads * d or cache_v.shape != cache_k.shape or \
            not (cache_k.is_contiguous() and cache_v.is_contiguous()) or not _pow2(d) or not 0 <= at <= cap - s or \
            not all(_vector(w, dim) for pair in norms for w in pair) or positions.shape != (1, s, dim) or \
            not positions.is_contiguous() or not step_checks.serves("short", x.device, x.dtype, heads, d, s, cap):
        return None
    from . import attention_kernels

    add = positions[0]  # [S, dim]: row i of x's B * S rows takes position i % S
    for (qkv_product, out, swiglu, down), (first, second), ck, cv in zip(parts, norms, cache_k, cache_v):
        q, k, v = qkv_product.fused(x, norm=(first, eps), add=add).split(dim, dim=-1)
        x = out.fused(attention_kernels.short(q, k, v, ck, cv, at, scale), residual=x, add=add)
        x = down.fused(swiglu.fused(x, norm=(second, eps)), residual=x)
        add = None
    return x


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
            or s > 16 or not step_checks.serves("short", q.device, q.dtype, heads, d, s, cap):
        return None
    from . import attention_kernels

    return attention_kernels.short(q, k, v, cache_k, cache_v, at, scale)
