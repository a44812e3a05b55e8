"""An LM decode step's attention in Triton (imported only where Triton runs): the rotation's
tables of the step's position (`rope_table_kernel`), the preparation of one position
(`attn_prep_kernel`: q/k RMSNorm, rotation, the cache write at the device position), the attention
of that position over the filled part of the cache (`attention_decode_kernel`, split over the keys,
the last split of each key head combining them), both in one launch from the fused q/k/v row
(`attention_step_kernel`), and the depth decoder's short attention (`attention_short_kernel`).
The LM's kernels also take an 8-bit cache (QUANT: int8 codes and a float32 scale a group of GROUP
values, `mm3.models.kv_cache`): the new position rounded as `kv_codes` rounds it, bit for bit, and
each key and value read back as its code times its scale in float32.

The preparation computes what `mm3.models.lm.Qwen3Attention` computes with torch, in the same
roundings (the norm as `norm_kernels`; `q * cos + rotate_half(q) * sin` with each product and the
sum rounded to the compute dtype; the tables' cos and sin are Triton's, which on a GPU are the
CUDA math library's as torch's are, and elsewhere may differ from torch's in the last float32
bit). The attention takes a block of keys in two products (`tl.dot`: the tensor cores, where the
compute dtype is 16-bit): the scores summed in float32, the softmax in float32, its weights rounded
to the compute dtype for the product with the values, as flash attention (torch's on a GPU) rounds
them; float32 caches multiply in exact float32 products. Positions are read from the device (the
cache's `pos`), so a captured step replays at any position; the key splits past the filled length
return at once, so a step costs what the filled keys cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import interpreted
from .layout_kernels import counters
from .norm_kernels import cast, largest, warps

INTERPRETED = tl.constexpr(interpreted())  # Triton's interpreter runs the kernels
SPLIT = 256  # keys per program of the decode attention
BLOCK_N = 64  # keys per iteration of a program (one product of each kind)
BLOCK_N_8BIT = 32  # over an 8-bit cache: its widened tiles take 116-128 registers at 32 keys, 167 at 64
DOT_ROWS = 16  # a key head's queries padded to a tensor-core product's rows (mma's m: 16)


@triton.jit
def rope_table_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, D: tl.constexpr):
    """The rotation's tables [D] (cos, sin of the angles pos * inv_freq, each half twice) for the
    position `pos_ptr` holds: float32 angles, as `Qwen3LM.rope` computes them, rounded to the
    tables' dtype."""
    cols = tl.arange(0, D)
    angle = tl.load(pos_ptr).to(tl.float32) * tl.load(inv_ptr + cols % (D // 2))
    tl.store(cos_ptr + cols, cast(tl.cos(angle), cos_ptr.dtype.element_ty))
    tl.store(sin_ptr + cols, cast(tl.sin(angle), sin_ptr.dtype.element_ty))


@triton.jit
def _rotated(src, heads, valid, w_ptr, cos_ptr, sin_ptr, eps, D: tl.constexpr):
    """Heads `heads` [R] of the row at `src` ([D] contiguous values each; `valid` [R]: the others
    read as zeros) RMS-normalized by w and rotated (RoPE with the tables cos, sin [D]), in the
    roundings of torch's ops in the row's dtype: [R, D] of that dtype."""
    cols = tl.arange(0, D)[None, :]
    half: tl.constexpr = D // 2
    partner = (cols + half) % D
    at = src + heads.to(tl.int64)[:, None] * D
    x = tl.load(at + cols, mask=valid[:, None], other=0.0)
    xp = tl.load(at + partner, mask=valid[:, None], other=0.0)
    var = tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1) / D
    r = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))[:, None]
    w = tl.load(w_ptr + cols).to(tl.float32)
    wp = tl.load(w_ptr + partner).to(tl.float32)
    normed = cast(w * cast(x.to(tl.float32) * r, x.dtype).to(tl.float32), x.dtype).to(tl.float32)
    other = cast(wp * cast(xp.to(tl.float32) * r, x.dtype).to(tl.float32), x.dtype).to(tl.float32)
    rot = tl.where(cols < half, -other, other)
    c = tl.load(cos_ptr + cols).to(tl.float32)
    s = tl.load(sin_ptr + cols).to(tl.float32)
    a = cast(normed * c, x.dtype).to(tl.float32)
    b = cast(rot * s, x.dtype).to(tl.float32)
    return cast(a + b, x.dtype)


@triton.jit
def _store_head(c_ptr, s_ptr, slot, x, D: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr):
    """One head's values x [1, D] into a cache at position `slot` (of all its rows' positions): as
    they are, or with QUANT as `mm3.models.kv_cache.kv_codes` rounds them (each group's largest
    magnitude / 127 its scale, into s_ptr; round(x / scale), half to even, its codes; a group of
    zeros, or one whose scale is not finite, codes 0)."""
    cols = tl.arange(0, D)[None, :]
    if QUANT:
        g = tl.reshape(x.to(tl.float32), (D // GROUP, GROUP))
        scales = tl.div_rn(tl.reduce(tl.abs(g), 1, largest), 127.0)
        y = tl.div_rn(g, scales[:, None])
        code = (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000  # round to even: 1.5 * 2^23 added
        code = tl.where((scales[:, None] > 0) & (y == y), tl.minimum(tl.maximum(code, -127), 127), 0)
        tl.store(c_ptr + slot * D + cols, tl.reshape(code.to(tl.int8), (1, D)))
        tl.store(s_ptr + slot * (D // GROUP) + tl.arange(0, D // GROUP), scales)
    else:
        tl.store(c_ptr + slot * D + cols, x)


@triton.jit
def _write_position(k_src, v_src, kh, kw_ptr, cos_ptr, sin_ptr, ck_ptr, cv_ptr, ks_ptr, vs_ptr, slot, eps,
                    D: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr):
    """Key head kh of a row's keys (at k_src + kh * D) normalized, rotated and written with its
    value head (v_src + kh * D) into the caches at position `slot` (`_store_head`)."""
    cols = tl.arange(0, D)[None, :]
    one = tl.full((1,), 0, tl.int32) + kh
    _store_head(ck_ptr, ks_ptr, slot, _rotated(k_src, one, one >= 0, kw_ptr, cos_ptr, sin_ptr, eps, D), D, QUANT,
                GROUP)
    _store_head(cv_ptr, vs_ptr, slot, tl.load(v_src + one.to(tl.int64)[:, None] * D + cols), D, QUANT, GROUP)


@triton.jit
def attn_prep_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, ck_ptr, cv_ptr, ks_ptr, vs_ptr, pos_ptr,
                     out_ptr, sq, sk, sv, cap, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                     QUANT: tl.constexpr = False, GROUP: tl.constexpr = 32):
    """Program (row b, head h): a query head (h < HEADS) normalized and rotated into out [B, HEADS,
    1, D]; else key head h - HEADS normalized, rotated and written with its value head into the
    cache [B, KV_HEADS, cap, D] at the position `pos_ptr` holds (with QUANT in 8 bits, the scales
    into ks, vs [B, KV_HEADS, cap, D / GROUP])."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, D)[None, :]
    if h < HEADS:
        one = tl.full((1,), 0, tl.int32) + h
        y = _rotated(q_ptr + b * sq, one, one >= 0, qw_ptr, cos_ptr, sin_ptr, eps, D)
        tl.store(out_ptr + (b * HEADS + h) * D + cols, y)
    else:
        kh = h - HEADS
        slot = (b * KV_HEADS + kh) * cap + tl.load(pos_ptr)
        _write_position(k_ptr + b * sk, v_ptr + b * sv, kh, kw_ptr, cos_ptr, sin_ptr, ck_ptr, cv_ptr, ks_ptr, vs_ptr,
                        slot, eps, D, QUANT, GROUP)


@triton.jit
def _read_heads(c_ptr, s_ptr, slots, valid, dtype: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr,
                GROUP: tl.constexpr):
    """A cache's heads at positions `slots` [N] (of all its rows' positions; `valid` [N]: the others
    read as zeros) in `dtype` [N, D]: as stored, or with QUANT each code times its group's scale in
    float32, rounded to `dtype`."""
    cols = tl.arange(0, D)[None, :]
    x = tl.load(c_ptr + slots[:, None] * D + cols, mask=valid[:, None], other=0)
    if QUANT:  # each group's scale read once, not once a value
        groups = tl.arange(0, D // GROUP)[None, :]
        scales = tl.load(s_ptr + slots[:, None] * (D // GROUP) + groups, mask=valid[:, None], other=0.0)
        x = tl.reshape(tl.reshape(x.to(tl.float32), (x.shape[0], D // GROUP, GROUP)) * scales[:, :, None],
                       (x.shape[0], D))
        x = _rounded(x, dtype)
    return x


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x (float32) rounded to `dtype`, ties to even: the GPU's own conversion (one instruction), or
    under the interpreter, which would truncate, `cast`'s."""
    if INTERPRETED:
        return cast(x, dtype)
    else:
        return x.to(dtype)


@triton.jit
def _dot(a, b):
    """a @ b summed in float32: on the tensor cores for 16-bit operands, in exact float32 products
    for float32 ones (as torch's float32 attention). Triton's interpreter, whose 16-bit products are
    wrong, takes the 16-bit operands widened: the same exact products, summed in float32."""
    if a.dtype == tl.float32 or INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _partials(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bh, start, end, cap, scale, GP: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr):
    """The running maximum, softmax sum and weighted values (float32) of the queries q [GP, D] (the
    compute dtype; GP >= 16, the rows past a key head's queries zeros) of key head bh over the
    cache's keys [start, end): scores and weighted values as two products a block of BLOCK_N keys
    (`tl.dot`), the softmax's weights rounded to the compute dtype for the second, as flash
    attention rounds them."""
    keys = tl.arange(0, BLOCK_N)
    m = tl.full((GP,), float("-inf"), tl.float32)
    den = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for first in range(start, end, BLOCK_N):
        n = first + keys
        valid = n < end
        slots = bh * cap + n.to(tl.int64)
        k = _read_heads(k_ptr, ks_ptr, slots, valid, q.dtype, D, QUANT, GROUP)
        v = _read_heads(v_ptr, vs_ptr, slots, valid, q.dtype, D, QUANT, GROUP)
        s = _dot(q, tl.trans(k)) * scale  # [GP, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(_rounded(p, q.dtype), v)
        m = m_new
    return m, den, acc


@triton.jit
def _finish(m, den, acc, m_ptr, l_ptr, acc_ptr, count_ptr, out_ptr, bh, split, n_splits, filled,
            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, COMBINE: tl.constexpr):
    """A split's partials into m, l [BH, n_splits, GP] and acc [BH, n_splits, GP, D]; with COMBINE,
    the last of key head bh's splits to finish (counted in count_ptr[bh], which it sets back to
    zero) combines them into out [B, heads, 1, D] as `attention_combine_kernel` does, in the same
    order."""
    g = tl.arange(0, GP)
    cols = tl.arange(0, D)
    row = (bh * n_splits + split) * GP + g
    mine = g < G  # the key head's query heads (the rows past them pad the products)
    tl.store(m_ptr + row, m, mask=mine)
    tl.store(l_ptr + row, den, mask=mine)
    tl.store(acc_ptr + row[:, None] * D + cols[None, :], acc, mask=mine[:, None])
    if COMBINE:
        tl.debug_barrier()  # every thread's partials are written before the count says so
        used = (filled + SPLIT - 1) // SPLIT  # the splits holding a filled key
        done = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if done == used - 1:  # the last of them: the splits in their order, the same bits whatever the timing
            tl.debug_barrier()
            row = bh * n_splits * GP + g
            m = tl.load(m_ptr + row, mask=mine, other=0.0, volatile=True)
            den = tl.load(l_ptr + row, mask=mine, other=1.0, volatile=True)
            acc = tl.load(acc_ptr + row[:, None] * D + cols[None, :], mask=mine[:, None], other=0.0, volatile=True)
            for other in range(1, used):
                row = (bh * n_splits + other) * GP + g
                ms = tl.load(m_ptr + row, mask=mine, other=0.0, volatile=True)
                m_new = tl.maximum(m, ms)
                alpha = tl.exp(m - m_new)
                beta = tl.exp(ms - m_new)
                den = den * alpha + tl.load(l_ptr + row, mask=mine, other=1.0, volatile=True) * beta
                acc = acc * alpha[:, None] + tl.load(acc_ptr + row[:, None] * D + cols[None, :], mask=mine[:, None],
                                                     other=0.0, volatile=True) * beta[:, None]
                m = m_new
            heads = bh * G + g
            tl.store(out_ptr + heads[:, None] * D + cols[None, :], cast(acc / den[:, None], out_ptr.dtype.element_ty),
                     mask=mine[:, None])
            tl.atomic_xchg(count_ptr + bh, 0, sem="relaxed", scope="gpu")


@triton.jit
def attention_decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, count_ptr, out_ptr,
                            cap, scale, n_splits, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                            SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, COMBINE: tl.constexpr,
                            QUANT: tl.constexpr = False, GROUP: tl.constexpr = 32):
    """Program (row and key head bh, split): the G query heads of key head bh over keys
    [split * SPLIT, (split + 1) * SPLIT) of the filled ones (pos + 1) (`_partials`); a split past
    the filled keys returns at once; the partials stored, and with COMBINE combined by the last
    split (`_finish`): one launch."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    filled = tl.load(pos_ptr) + 1
    start = split * SPLIT
    if start >= filled:
        return
    g = tl.arange(0, GP)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + (bh * G + g)[:, None] * D + cols[None, :], mask=(g < G)[:, None], other=0.0)
    m, den, acc = _partials(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bh, start, tl.minimum(start + SPLIT, filled), cap, scale,
                            GP, D, BLOCK_N, QUANT, GROUP)
    _finish(m, den, acc, m_ptr, l_ptr, acc_ptr, count_ptr, out_ptr, bh, split, n_splits, filled, G, GP, D, SPLIT,
            COMBINE)


@triton.jit
def attention_step_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, m_ptr,
                          l_ptr, acc_ptr, count_ptr, out_ptr, sq, cap, eps, scale, n_splits, HEADS: tl.constexpr,
                          KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                          SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr = False,
                          GROUP: tl.constexpr = 32):
    """An LM decode step's attention from its fused q/k/v row (qkv [B, (HEADS + 2 KV_HEADS) D], row
    stride sq) in one launch: as `attn_prep_kernel` then `attention_decode_kernel`. Each program
    normalizes and rotates its G query heads itself (`_rotated`); the program whose split holds
    the position `pos_ptr` holds writes the new key and value into the cache first, so its own
    threads read them after a barrier (no other program reads that position)."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    pos = tl.load(pos_ptr)
    start = split * SPLIT
    if start > pos:
        return
    b = bh // KV_HEADS
    kh = bh % KV_HEADS
    row = qkv_ptr + b * sq
    g = tl.arange(0, GP)
    if pos < start + SPLIT:  # this split holds the new position: write it, then read it with the rest
        _write_position(row + HEADS * D, row + (HEADS + KV_HEADS) * D, kh, kw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr,
                        ks_ptr, vs_ptr, bh * cap + pos, eps, D, QUANT, GROUP)
        tl.debug_barrier()
    q = _rotated(row, kh * G + g, g < G, qw_ptr, cos_ptr, sin_ptr, eps, D)
    m, den, acc = _partials(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bh, start, tl.minimum(start + SPLIT, pos + 1), cap,
                            scale, GP, D, BLOCK_N, QUANT, GROUP)
    _finish(m, den, acc, m_ptr, l_ptr, acc_ptr, count_ptr, out_ptr, bh, split, n_splits, pos + 1, G, GP, D, SPLIT,
            True)


@triton.jit
def attention_combine_kernel(m_ptr, l_ptr, acc_ptr, pos_ptr, out_ptr, n_splits, G: tl.constexpr, GP: tl.constexpr,
                             D: tl.constexpr, SPLIT: tl.constexpr):
    """Program (row and query head): the splits that saw filled keys combined (by their maxima)
    into the head's attention output, out [B, heads, 1, D] in out's dtype."""
    bq = tl.program_id(0).to(tl.int64)
    bh = bq // G
    g = bq % G
    used = (tl.load(pos_ptr) + SPLIT) // SPLIT  # splits holding a filled key: ceil((pos + 1) / SPLIT)
    cols = tl.arange(0, D)
    row = bh * n_splits * GP + g  # split 0 holds key 0: always filled
    m = tl.load(m_ptr + row)
    den = tl.load(l_ptr + row)
    acc = tl.load(acc_ptr + row * D + cols)
    for split in range(1, used):
        row = (bh * n_splits + split) * GP + g
        ms = tl.load(m_ptr + row)
        m_new = tl.maximum(m, ms)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(ms - m_new)
        den = den * alpha + tl.load(l_ptr + row) * beta
        acc = acc * alpha + tl.load(acc_ptr + row * D + cols) * beta
        m = m_new
    tl.store(out_ptr + bq * D + cols, cast(acc / den, out_ptr.dtype.element_ty))


@triton.jit
def attention_short_kernel(q_ptr, k_ptr, v_ptr, ck_ptr, cv_ptr, out_ptr, at, s_len, cap, scale,
                           sq0, sq1, sk0, sk1, sv0, sv1, HEADS: tl.constexpr, D: tl.constexpr,
                           SP: tl.constexpr, CP: tl.constexpr):
    """Program (row b, head h): the s_len new positions' keys and values written into the cache
    [B, HEADS, cap, D] at at .. at + s_len - 1, then their queries' causal attention over the
    cache's positions up to each one's own -> out [B, s_len, HEADS * D]."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, D)[None, :]
    new = tl.arange(0, SP)[:, None]
    fresh = new < s_len
    base = (b * HEADS + h) * cap * D
    written = base + (at + new) * D + cols
    tl.store(ck_ptr + written, tl.load(k_ptr + b * sk0 + new * sk1 + h * D + cols, mask=fresh), mask=fresh)
    tl.store(cv_ptr + written, tl.load(v_ptr + b * sv0 + new * sv1 + h * D + cols, mask=fresh), mask=fresh)
    tl.debug_barrier()  # the program's threads read what the others wrote
    q = tl.load(q_ptr + b * sq0 + new * sq1 + h * D + cols, mask=fresh, other=0.0)
    keys = tl.arange(0, CP)[:, None]
    filled = keys < at + s_len
    kc = tl.load(ck_ptr + base + keys * D + cols, mask=filled, other=0.0).to(tl.float32)
    vc = tl.load(cv_ptr + base + keys * D + cols, mask=filled, other=0.0).to(tl.float32)
    scores = tl.sum(q.to(tl.float32)[:, None, :] * kc[None, :, :], axis=2) * scale  # [SP, CP]
    scores = tl.where(tl.arange(0, CP)[None, :] <= at + new, scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, axis=1)[:, None])
    o = tl.sum(p[:, :, None] * vc[None, :, :], axis=1) / tl.sum(p, axis=1)[:, None]
    tl.store(out_ptr + (b * s_len + new) * (HEADS * D) + h * D + cols, cast(o, q.dtype), mask=fresh)


def rope_table(pos, inv_freq, dtype):
    """`rope_table_kernel` -> (cos, sin) [1, 1, 1, D] of `dtype`."""
    d = 2 * inv_freq.numel()
    cos = torch.empty(1, 1, 1, d, dtype=dtype, device=pos.device)
    sin = torch.empty_like(cos)
    rope_table_kernel[(1,)](pos, inv_freq, cos, sin, D=d, num_warps=warps(d))
    return cos, sin


def _scales(cache_k, cache_v, scales) -> tuple:
    """(key scales, value scales, QUANT, GROUP, BLOCK_N) a launch passes: an 8-bit cache's `scales`
    (ks, vs [B, kv_heads, cap, D / GROUP]), or the caches themselves (read by nothing) for a 16-bit
    one."""
    if scales is None:
        return cache_k, cache_v, False, 32, BLOCK_N
    return scales[0], scales[1], True, cache_k.shape[-1] // scales[0].shape[-1], BLOCK_N_8BIT


def prepare(q, k, v, q_norm, k_norm, eps, cos, sin, cache_k, cache_v, pos, heads: int, kv_heads: int, d: int,
            scales=None):
    """`attn_prep_kernel` over rows [B] -> the rotated queries [B, heads, 1, D]; `scales`: an 8-bit
    cache's (key, value) scales."""
    b = q.shape[0]
    out = torch.empty(b, heads, 1, d, dtype=q.dtype, device=q.device)
    ks, vs, quant, group, _ = _scales(cache_k, cache_v, scales)
    attn_prep_kernel[(b, heads + kv_heads)](q, k, v, q_norm, k_norm, cos, sin, cache_k, cache_v, ks, vs, pos, out,
                                            q.stride(0), k.stride(0), v.stride(0), cache_k.shape[2], eps,
                                            HEADS=heads, KV_HEADS=kv_heads, D=d, QUANT=quant, GROUP=group,
                                            num_warps=warps(d), enable_fp_fusion=False)
    return out


def _splits(b: int, heads: int, kv_heads: int, d: int, span: int, device) -> tuple:
    """(query heads a key head, that padded to a power of two, key splits of a launch over `span`
    keys, the splits' partials m, l [B kv_heads, splits, GP] and acc [.., D] in float32)."""
    g = heads // kv_heads
    gp = max(DOT_ROWS, triton.next_power_of_2(g))
    n_splits = triton.cdiv(span, SPLIT)
    m = torch.empty(b * kv_heads, n_splits, gp, dtype=torch.float32, device=device)
    acc = torch.empty(b * kv_heads, n_splits, gp, d, dtype=torch.float32, device=device)
    return g, gp, n_splits, (m, torch.empty_like(m), acc)


def decode(q, cache_k, cache_v, pos, span: int, scale: float, two_launches: bool = False, scales=None):
    """The attention of q [B, heads, 1, D] over the first pos + 1 keys of cache_k, cache_v [B,
    kv_heads, cap, D] (span: the keys a launch covers, >= pos + 1; `scales`: an 8-bit cache's) ->
    [B, heads, 1, D], in one launch (the last split of each key head combines them), or with
    `two_launches` the splits combined by `attention_combine_kernel` (the same bits)."""
    b, heads, _, d = q.shape
    kv_heads, cap = cache_k.shape[1], cache_k.shape[2]
    g, gp, n_splits, (m, den, acc) = _splits(b, heads, kv_heads, d, span, q.device)
    out = torch.empty_like(q)
    combine = not two_launches
    counts = counters(q.device, b * kv_heads) if combine else m
    ks, vs, quant, group, block = _scales(cache_k, cache_v, scales)
    attention_decode_kernel[(b * kv_heads, n_splits)](q, cache_k, cache_v, ks, vs, pos, m, den, acc, counts, out, cap,
                                                      scale, n_splits, G=g, GP=gp, D=d, SPLIT=SPLIT, BLOCK_N=block,
                                                      COMBINE=combine, QUANT=quant, GROUP=group, num_warps=4)
    if not combine:
        attention_combine_kernel[(b * heads,)](m, den, acc, pos, out, n_splits, G=g, GP=gp, D=d, SPLIT=SPLIT,
                                               num_warps=warps(d))
    return out


def step(qkv, q_norm, k_norm, eps, cos, sin, cache_k, cache_v, pos, span: int, scale: float, heads: int,
         scales=None):
    """`attention_step_kernel`: the attention of an LM decode step from its fused q/k/v rows qkv
    [B, 1, (heads + 2 kv_heads) D], the new key and value written into cache_k, cache_v [B,
    kv_heads, cap, D] at `pos` (span: the keys a launch covers, >= pos + 1; `scales`: an 8-bit
    cache's) -> [B, heads, 1, D]."""
    b, kv_heads, cap, d = cache_k.shape
    g, gp, n_splits, (m, den, acc) = _splits(b, heads, kv_heads, d, span, qkv.device)
    out = torch.empty(b, heads, 1, d, dtype=qkv.dtype, device=qkv.device)
    ks, vs, quant, group, block = _scales(cache_k, cache_v, scales)
    attention_step_kernel[(b * kv_heads, n_splits)](
        qkv, q_norm, k_norm, cos, sin, cache_k, cache_v, ks, vs, pos, m, den, acc, counters(qkv.device, b * kv_heads),
        out, qkv.stride(0), cap, eps, scale, n_splits, HEADS=heads, KV_HEADS=kv_heads, G=g, GP=gp, D=d, SPLIT=SPLIT,
        BLOCK_N=block, QUANT=quant, GROUP=group, num_warps=4)
    return out


def short(q, k, v, cache_k, cache_v, at: int, scale: float):
    """`attention_short_kernel` over rows [B] and heads -> [B, S, heads * D]."""
    b, s, width = q.shape
    heads, cap, d = cache_k.shape[1], cache_k.shape[2], cache_k.shape[3]
    out = torch.empty(b, s, width, dtype=q.dtype, device=q.device)
    attention_short_kernel[(b, heads)](q, k, v, cache_k, cache_v, out, at, s, cap, scale, q.stride(0), q.stride(1),
                                       k.stride(0), k.stride(1), v.stride(0), v.stride(1), HEADS=heads, D=d,
                                       SP=triton.next_power_of_2(s), CP=triton.next_power_of_2(cap), num_warps=4)
    return out
