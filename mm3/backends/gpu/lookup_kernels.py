"""Embedding rows gathered and dequantized in one Triton kernel each (imported only where Triton runs).

A table is held as the file has it (`mm3.backends.gpu.placement` gives embeddings no other form):
uint8 rows of GGUF blocks, or a float tensor. Each program expands a tile of one row with the
arithmetic of `mm3.formats.gguf.quants` (`triton_gguf._weights`: the same float32 products in the
same order) and rounds it once to the output dtype, so a row equals the torch dequantization cast
to that dtype bit for bit. Floating-point contraction is turned off at launch (`FP_FUSION`), so
`q * (d * s) - m` keeps its two roundings on a GPU too.

The row ids are read on the device: `lookup_rows_kernel` takes codes and adds an offset itself
(an AR frame's code -> table row), repeating each code for the rows of its song;
`lookup_feedback_kernel` makes a frame's whole LM input (`mm3.plan.replay.frame_feedback`): the
LM row of the semantic code plus the sum of the acoustic codes' rows, scaled, with torch's
roundings in torch's order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_gguf import _weights

FP_FUSION = False  # launch option: no fused multiply-adds, each product and sum rounded as torch's


@triton.jit
def _round(x, dt: tl.constexpr):
    """float32 x rounded to `dt` (to nearest, ties to even). bfloat16 by its bits: Triton's
    interpreter truncates where a GPU rounds, and these are the same bits on both."""
    if dt == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        r = tl.where(x != x, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dt)


@triton.jit
def _row(table_ptr, code, rows, cols, row_stride, QTYPE: tl.constexpr):
    """Float32 values at `cols` of table row `code` (clamped into the table: never a stray read)."""
    code = tl.minimum(tl.maximum(code.to(tl.int64), 0), rows - 1)
    return _weights(table_ptr, code, cols, row_stride, QTYPE)


@triton.jit
def lookup_rows_kernel(table_ptr, codes_ptr, out_ptr, K, rows, row_stride, code_stride, out_stride, add,
                       QTYPE: tl.constexpr, REPEAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Output row i = table row codes[i // REPEAT] + add, values [0, K), in the output's dtype."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = cols < K
    code = tl.load(codes_ptr + (i // REPEAT) * code_stride).to(tl.int64) + add
    w = _row(table_ptr, code, rows, tl.minimum(cols, K - 1), row_stride, QTYPE)
    tl.store(out_ptr + i.to(tl.int64) * out_stride + cols, _round(w, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def lookup_feedback_kernel(lm_ptr, audio_ptr, frame_ptr, out_ptr, K, lm_rows, audio_rows, lm_stride, audio_stride,
                           frame_stride, out_stride, code_offset, audio_vocab, scale,
                           LM_QTYPE: tl.constexpr, AUDIO_QTYPE: tl.constexpr, NCB: tl.constexpr,
                           REPEAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Output row i, of song i // REPEAT with codes frame[song, :NCB]: (lm[c0 + code_offset] +
    sum_j audio[c_j + (j - 1) * audio_vocab]) * scale, each row rounded to the output dtype first,
    the sum accumulated in float32 in j's order and rounded once, then the add and the product each
    rounded to the output dtype (torch's arithmetic for a half-precision or float32 tensor)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = cols < K
    at = tl.minimum(cols, K - 1)
    dt = out_ptr.dtype.element_ty
    codes = frame_ptr + (i // REPEAT) * frame_stride
    emb = _row(lm_ptr, tl.load(codes).to(tl.int64) + code_offset, lm_rows, at, lm_stride, LM_QTYPE)
    emb = _round(emb, dt)
    acc = _row(audio_ptr, tl.load(codes + 1).to(tl.int64), audio_rows, at, audio_stride, AUDIO_QTYPE)
    acc = _round(acc, dt).to(tl.float32)
    for j in tl.static_range(2, NCB):
        code = tl.load(codes + j).to(tl.int64) + (j - 1) * audio_vocab
        acc += _round(_row(audio_ptr, code, audio_rows, at, audio_stride, AUDIO_QTYPE), dt).to(tl.float32)
    y = _round(emb.to(tl.float32) + _round(acc, dt).to(tl.float32), dt).to(tl.float32) * scale
    tl.store(out_ptr + i.to(tl.int64) * out_stride + cols, _round(y, dt), mask=ok)


def _block_k(k: int) -> int:
    """Columns a lookup program expands: 256 (a row of the released 4096 over 16 programs)."""
    return min(256, 1 << (k - 1).bit_length())


def rows(table: torch.Tensor, kind: tuple[int, int], codes: torch.Tensor, k: int, dtype: torch.dtype,
         repeat: int = 1, add: int = 0) -> torch.Tensor:
    """`lookup_rows_kernel`: rows `codes[i // repeat] + add` of `table` (kind: its type code and row
    stride) -> [codes.numel() * repeat, k] `dtype`."""
    n = codes.numel() * repeat
    out = torch.empty(n, k, dtype=dtype, device=codes.device)
    if n:
        block = _block_k(k)
        lookup_rows_kernel[(n, triton.cdiv(k, block))](
            table, codes, out, k, table.shape[0], kind[1], codes.stride(0), out.stride(0), int(add),
            QTYPE=kind[0], REPEAT=int(repeat), BLOCK_K=block, num_warps=4, enable_fp_fusion=FP_FUSION)
    return out


def feedback(lm_table: torch.Tensor, lm_kind: tuple[int, int], audio_table: torch.Tensor,
             audio_kind: tuple[int, int], frame: torch.Tensor, code_offset: int, audio_vocab: int, k: int,
             dtype: torch.dtype, repeat: int = 1) -> torch.Tensor:
    """`lookup_feedback_kernel`: a frame's LM input from `frame` [songs, ncb] (each song's row
    `repeat` times) -> [songs * repeat, 1, k] `dtype`; the kinds: each table's type code and row stride."""
    ncb = frame.shape[1]
    n = frame.shape[0] * repeat
    out = torch.empty(n, 1, k, dtype=dtype, device=frame.device)
    if n:
        block = _block_k(k)
        lookup_feedback_kernel[(n, triton.cdiv(k, block))](
            lm_table, audio_table, frame, out, k, lm_table.shape[0], audio_table.shape[0], lm_kind[1], audio_kind[1],
            frame.stride(0), out.stride(0), int(code_offset), int(audio_vocab), ncb ** -0.5,
            LM_QTYPE=lm_kind[0], AUDIO_QTYPE=audio_kind[0], NCB=ncb, REPEAT=int(repeat), BLOCK_K=block,
            num_warps=4, enable_fp_fusion=FP_FUSION)
    return out
