"""An AR decode step's small operations in one call each of the CPU kernel library
(`mm3.backends.cpu.native`), where torch runs each as a dozen small operations: the fast numerics'
RMSNorm (`rms_norm`), an embedding lookup's few quantized rows (`lookup`), the depth decoder's
attention over its short cache (`attend`) and its whole blocks (`depth_layers`), an LM decode
step's q/k norms, rotation and cache write (`decode_prepare`), the guided top-k draws
(`top_k_draw`, `draw_from_raw`) and their random numbers (`raw_draws`, `exponentials`,
`skip_draws`). Each returns None (False) where it does not serve (no library, another dtype,
device or layout, tracing), checked before the library is looked up, and the caller's torch
operations run instead.
"""

from __future__ import annotations

import weakref

import torch
from gguf import GGMLQuantizationType as QT

from . import native as cpu_native


def _row_groups(x: torch.Tensor) -> tuple[int, int, int] | None:
    """How `mm3_rms_norm` reads x's rows: (groups, rows a group, floats between groups), for a
    contiguous x or one whose last two dimensions are (as a head view of a fused product's output:
    [B, S, heads, D] of a wider row); None for other layouts."""
    n = x.shape[-1]
    if x.is_contiguous():
        return x.numel() // max(n, 1), 1, n
    if x.dim() != 4 or x.stride(-1) != 1 or x.stride(-2) != n:
        return None
    b, s, inner = x.shape[0], x.shape[1], x.shape[2]
    if s == 1 or b == 1:
        return b * s, inner, x.stride(0) if s == 1 else x.stride(1)
    return (b * s, inner, x.stride(1)) if x.stride(0) == s * x.stride(1) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x's rows times `weight` in one call of the kernel library (float32 on the CPU;
    a float32 sum in another order than torch's, so not the reference's bit for bit), or None where
    it cannot serve: no library, another dtype or device, a row layout it does not read."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32 or \
            weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous() or \
            weight.numel() != x.shape[-1]:
        return None  # checked first: the library is built or loaded only where it can serve
    groups = _row_groups(x)
    lib = cpu_native.library()
    if groups is None or lib is None:
        return None
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.mm3_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), *groups, x.shape[-1], eps)
    return y


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
           at: int, scale: float) -> torch.Tensor | None:
    """Attention of the new positions q, k, v [B, S, heads * D] (views of one buffer: the same
    strides) over a short cache's positions before them and themselves, in one call of the kernel
    library: k and v written into `cache_k`, `cache_v` [B, kv_heads, capacity, D] at positions
    at .. at + S - 1 first -> [B, S, heads * D] float32. A decode step of the depth decoder is a
    dozen small torch operations for a few thousand multiply-adds. None where it does not serve
    (no library, another dtype, device or layout, tracing)."""
    f32 = torch.float32
    if torch.compiler.is_compiling() or not (q.is_cpu and k.is_cpu and v.is_cpu and cache_k.is_cpu and cache_v.is_cpu) \
            or not (q.dtype == k.dtype == v.dtype == cache_k.dtype == cache_v.dtype == f32) or q.dim() != 3:
        return None
    b, s, width = q.shape
    strides, rows_k = q.stride(), k.shape
    if rows_k != v.shape or rows_k[:2] != (b, s) or k.stride() != strides or v.stride() != strides or \
            strides[2] != 1 or cache_k.dim() != 4 or cache_k.shape != cache_v.shape or \
            not (cache_k.is_contiguous() and cache_v.is_contiguous()):
        return None
    rows, kv_heads, capacity, d = cache_k.shape
    if rows != b or rows_k[2] != kv_heads * d or width % d or (width // d) % kv_heads or not 0 <= at <= capacity - s:
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    out = torch.empty(b, s, width)
    if lib.mm3_attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), strides[0], strides[1], cache_k.data_ptr(),
                      cache_v.data_ptr(), b, s, width // d, kv_heads, capacity, at, d, scale, out.data_ptr()):
        raise MemoryError(f"the kernel library could not allocate the scores of {at + s} positions")
    return out


def top_k_draw(logits: torch.Tensor, rows_per_song: int, cfg: float, top_k: int, q: torch.Tensor,
               excluded: torch.Tensor | None = None, gate: bool = False) -> torch.Tensor | None:
    """The reference's guided top-k draw (`mm3.plan.sampling`: `guide`, `top_k_probs`, `draw`) in one
    call of the kernel library: logits [songs * rows_per_song, N] (each song's conditional row,
    then with 2 rows its unconditional one), q [songs, N] its Exponential(1) draws, float32, or
    int64 the generator's raw draws (`raw_draws`: made Exponential only where they count) ->
    [songs] int64. `excluded` [N] bool: columns -inf first; `gate`: only columns where the conditional
    logit is among its top_k largest are guided (the LM's semantic draw). The same index as torch's
    operations except where two candidates' ratios lie within a few float32 roundings (its
    exponentials and sums round differently); a dozen small operations otherwise, several a frame.
    None where it does not serve (another dtype, device or layout, tracing, no library, a NaN
    logit under `gate`)."""
    if torch.compiler.is_compiling() or not (logits.is_cpu and q.is_cpu) or logits.dtype != torch.float32 or \
            q.dtype not in (torch.float32, torch.int64) or logits.dim() != 2 or q.dim() != 2 or \
            rows_per_song not in (1, 2):
        return None
    rows, n = logits.shape
    songs = rows // rows_per_song
    if not logits.is_contiguous() or rows != songs * rows_per_song or q.shape != (songs, n) or q.stride(1) != 1 or \
            not 1 <= top_k or not n:
        return None
    if excluded is not None and (not excluded.is_cpu or excluded.dtype != torch.bool or excluded.shape != (n,) or
                                 not excluded.is_contiguous()):
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    out = torch.empty(songs, dtype=torch.int64)
    status = lib.mm3_top_k_draw(logits.data_ptr(), songs, rows_per_song, n, cfg, top_k,
                                None if excluded is None else excluded.data_ptr(), int(gate),
                                *((q.data_ptr(), None) if q.dtype == torch.float32 else (None, q.data_ptr())),
                                q.stride(0), out.data_ptr())
    if status == -1:
        raise MemoryError(f"the kernel library could not allocate the scratch of a draw over {n} logits")
    return None if status else out


def decode_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                   eps: float, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                   at: int) -> torch.Tensor | None:
    """One decode position of the LM's attention up to the attention itself, in one call of the
    kernel library: q [B, 1, heads * D], k and v [B, 1, kv_heads * D] (a product's output) get their
    heads RMS-normalized (`q_norm`, `k_norm` [D]) and rotated (`cos`, `sin`: the position's D
    angles); k and v are written into `cache_k`, `cache_v` [B, kv_heads, capacity, D] at position
    `at`; returns the query heads [B, heads, 1, D] float32 (two dozen small torch operations
    otherwise; the attention over the cache stays torch's batched products, fast on long songs).
    None where it does not serve (no library, another dtype, device or layout, tracing)."""
    small = (q_norm, k_norm, cos, sin)
    if torch.compiler.is_compiling() or not (q.is_cpu and k.is_cpu and v.is_cpu and cache_k.is_cpu and
                                             cache_v.is_cpu and all(t.is_cpu for t in small)):
        return None
    f32 = torch.float32
    if not (q.dtype == k.dtype == v.dtype == cache_k.dtype == cache_v.dtype == f32) or \
            any(t.dtype != f32 or not t.is_contiguous() for t in small) or q.dim() != 3 or k.dim() != 3:
        return None
    b, s, width = q.shape
    if cache_k.dim() != 4 or cache_k.shape != cache_v.shape or not (cache_k.is_contiguous() and cache_v.is_contiguous()):
        return None
    rows, kv_heads, capacity, d = cache_k.shape
    kv_strides = k.stride()
    if s != 1 or rows != b or k.shape != (b, 1, kv_heads * d) or v.shape != k.shape or v.stride() != kv_strides or \
            q.stride(2) != 1 or kv_strides[2] != 1 or width % d or (width // d) % kv_heads or \
            any(t.numel() != d for t in small) or not 0 <= at < capacity:
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    heads = width // d
    out = torch.empty(b, heads, 1, d)
    status = lib.mm3_decode_prepare(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), kv_strides[0],
                                    q_norm.data_ptr(), k_norm.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(),
                                    cache_k.data_ptr(), cache_v.data_ptr(), b, heads, kv_heads, capacity, at, d,
                                    out.data_ptr())
    return None if status else out


ROW_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)  # what `lookup` dequantizes


def lookup(table: torch.Tensor, qtype: QT, ids: torch.Tensor, k: int) -> torch.Tensor | None:
    """Rows `ids` of a table of GGUF block rows [rows, row bytes] (uint8, on the CPU) as float32
    [ids.numel(), k], in one call of the kernel library: bit for bit `mm3.formats.gguf.quants`'
    dequantization, which takes a hundred microseconds of small operations for the few rows of an
    AR step's lookup. None where it does not serve (no library, another type or layout, tracing);
    an id outside the table is an IndexError, as indexing would raise."""
    if torch.compiler.is_compiling() or qtype not in ROW_TYPES or table.dtype != torch.uint8 or table.dim() != 2 or \
            table.device.type != "cpu" or not table.is_contiguous() or ids.is_floating_point() or ids.is_complex():
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    at = ids.reshape(-1)
    if at.dtype != torch.int64 or not at.is_contiguous() or at.device.type != "cpu":
        at = at.to(device="cpu", dtype=torch.int64).contiguous()
    y = torch.empty(at.numel(), k)
    status = lib.mm3_dequantize_rows(table.data_ptr(), int(qtype), table.shape[0], table.shape[1], k,
                                     at.data_ptr(), at.numel(), y.data_ptr())
    if status == -3:
        raise IndexError(f"an embedding id is outside the table's {table.shape[0]} rows")
    return None if status else y


class BlockParts:
    """Blocks' products as the kernel library reads them (`depth_layers`, `lm_enter`, `lm_leave`):
    each part's packed weight and shape, as `cpu_native.Bound` checked them, and how many parts each
    of a block's four products has. It holds the bound products weakly, so a packing dropped (a form
    switched, the model moved) is freed at once; `alive()` says whether every one is still there,
    else the addresses are not to be read."""

    def __init__(self, blocks: list[list[list[cpu_native.Bound]]]):
        bound = [p for block in blocks for product in block for p in product]
        self.layers = len(blocks)
        self._bound = [weakref.ref(p) for p in bound]
        self.fields = torch.tensor([(p.packed.weight.data_ptr(), *p.args, p.out_features) for p in bound],
                                   dtype=torch.int64)
        self.counts = torch.tensor([len(product) for block in blocks for product in block], dtype=torch.int64)
        self.first_width = sum(p.out_features for p in blocks[0][0])  # the first block's q/k/v product's

    def alive(self) -> bool:
        return all(ref() is not None for ref in self._bound)


def depth_layers(x: torch.Tensor, norms: list[torch.Tensor], eps: float, parts: BlockParts, cache_k: torch.Tensor,
                 cache_v: torch.Tensor, at: int, scale: float) -> torch.Tensor | None:
    """The depth decoder's blocks over the new positions x [B, S, dim] in one call of the kernel
    library (`mm3_depth_layers`), each block: RMSNorm, the q/k/v product, attention over the cache (k
    and v written at `at`, as `attend`), the out product added to x, RMSNorm, the gate/up product,
    silu(gate) * up and the down product added -> [B, S, dim] float32. `norms`: each block's two
    RMSNorm weights in turn; `parts`: the blocks' products (q/k/v and gate/up one stacked packing,
    or one a part); the caches [layers, B, heads, capacity, D]. The fast numerics' torch operations
    up to the rounding of silu's exponential; a dozen small operations and five products a block
    otherwise, 28 block steps a frame. None where it does not serve (tracing, another dtype, device
    or layout, parts that do not fit the blocks)."""
    f32 = torch.float32
    layers = parts.layers
    if torch.compiler.is_compiling() or not (x.is_cpu and cache_k.is_cpu and cache_v.is_cpu) or x.dim() != 3 or \
            not (x.dtype == cache_k.dtype == cache_v.dtype == f32) or not x.is_contiguous() or \
            len(norms) != 2 * layers or cache_k.dim() != 5 or cache_k.shape != cache_v.shape or \
            cache_k.shape[0] != layers or not (cache_k.is_contiguous() and cache_v.is_contiguous()):
        return None
    b, s, dim = x.shape
    _, rows, heads, capacity, d = cache_k.shape
    if rows != b or heads * d != dim or not 0 <= at <= capacity - s or \
            any(w.dtype != f32 or not w.is_cpu or not w.is_contiguous() or w.numel() != dim for w in norms):
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    addresses = torch.tensor([w.data_ptr() for w in norms], dtype=torch.int64)
    y = torch.empty(b, s, dim)
    status = lib.mm3_depth_layers(x.data_ptr(), b, s, dim, layers, addresses.data_ptr(), eps, parts.fields.data_ptr(),
                                  parts.counts.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), heads, capacity, at,
                                  scale, torch.get_num_threads(), y.data_ptr())
    if status == -1:
        raise MemoryError(f"the kernel library could not allocate the scratch of the depth blocks over {b * s} rows")
    return None if status else y


def lm_enter(x: torch.Tensor, norm_in: torch.Tensor, eps: float, parts: BlockParts, q_norm: torch.Tensor,
             k_norm: torch.Tensor, head_eps: float, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor,
             cache_v: torch.Tensor, at: int) -> torch.Tensor | None:
    """An LM decode step's layer up to its attention in one call of the kernel library: RMSNorm of
    x [B, 1, dim], the q/k/v product (`parts`: the layer's, `BlockParts` of one block), the heads'
    norms and rotation with k and v written into the layer's caches [B, kv_heads, capacity, D] at
    `at` (as `decode_prepare`) -> the queries [B, heads, 1, D] float32. None where it does not serve
    (tracing, another dtype, device or layout, parts that do not fit), before anything is written."""
    f32 = torch.float32
    small = (norm_in, q_norm, k_norm, cos, sin)
    if torch.compiler.is_compiling() or not (x.is_cpu and cache_k.is_cpu and cache_v.is_cpu) or x.dim() != 3 or \
            x.shape[1] != 1 or not x.is_contiguous() or x.dtype != f32 or cache_k.dtype != f32 or \
            cache_v.dtype != f32 or cache_k.dim() != 4 or cache_k.shape != cache_v.shape or \
            not (cache_k.is_contiguous() and cache_v.is_contiguous()) or parts.layers != 1 or \
            any(t.dtype != f32 or not t.is_cpu or not t.is_contiguous() for t in small):
        return None
    b, _, dim = x.shape
    rows, kv_heads, capacity, d = cache_k.shape
    width = parts.first_width
    heads = width // d - 2 * kv_heads
    if rows != b or heads <= 0 or heads % kv_heads or norm_in.numel() != dim or q_norm.numel() != d or \
            k_norm.numel() != d or cos.numel() != d or sin.numel() != d or not 0 <= at < capacity:
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    q = torch.empty(b, heads, 1, d)
    status = lib.mm3_lm_enter(x.data_ptr(), b, dim, norm_in.data_ptr(), eps, parts.fields.data_ptr(),
                              parts.counts.data_ptr(), q_norm.data_ptr(), k_norm.data_ptr(), head_eps, cos.data_ptr(),
                              sin.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), heads, kv_heads, capacity, at, d,
                              torch.get_num_threads(), q.data_ptr())
    if status == -1:
        raise MemoryError("the kernel library could not allocate the scratch of an LM decode step")
    return None if status else q


def lm_leave(x: torch.Tensor, attended: torch.Tensor, norm_post: torch.Tensor, eps: float,
             parts: BlockParts) -> torch.Tensor | None:
    """An LM decode step's layer after its attention in one call of the kernel library: x [B, 1,
    dim] plus the out product of the attention's output `attended` [B, 1, dim], then plus the MLP
    (RMSNorm, gate/up, silu(gate) * up, down) of that -> [B, 1, dim] float32, the fast numerics'
    operations up to the rounding of silu's exponential. None where it does not serve."""
    f32 = torch.float32
    if torch.compiler.is_compiling() or not (x.is_cpu and attended.is_cpu and norm_post.is_cpu) or \
            x.dtype != f32 or attended.dtype != f32 or norm_post.dtype != f32 or x.dim() != 3 or \
            attended.shape != x.shape or not (x.is_contiguous() and attended.is_contiguous() and
                                              norm_post.is_contiguous()) or norm_post.numel() != x.shape[2] or \
            parts.layers != 1:
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    b, s, dim = x.shape
    y = torch.empty(b, s, dim)
    status = lib.mm3_lm_leave(x.data_ptr(), attended.data_ptr(), b * s, dim, norm_post.data_ptr(), eps,
                              parts.fields.data_ptr(), parts.counts.data_ptr(), torch.get_num_threads(),
                              y.data_ptr())
    if status == -1:
        raise MemoryError("the kernel library could not allocate the scratch of an LM decode step")
    return None if status else y


_RAW_EXACT: dict[int, bool] = {}  # draws of a size -> whether torch makes them as `raw_draws` assumes


def raw_draws_exact(n: int = 4099) -> bool:
    """Whether the library's draw arithmetic is torch's on this machine for n draws at a time,
    checked once per size on scratch generators: an Exponential(1) draw is one 64-bit value (an
    int64 `random_` one) turned into -log1p(-u) (`exponentials`), and `skip_draws` leaves a
    generator where that many draws leave it. Where it is not (another torch's draws, or no
    library), the callers draw with torch alone."""
    if n not in _RAW_EXACT:
        _RAW_EXACT[n] = _check_raw_draws(n)
    return _RAW_EXACT[n]


def _check_raw_draws(n: int) -> bool:
    lib = cpu_native.library()
    if lib is None:
        return False
    a, b = torch.Generator("cpu").manual_seed(20261204), torch.Generator("cpu").manual_seed(20261204)
    want = torch.empty(n).exponential_(generator=a)
    raw = torch.empty(n, dtype=torch.int64).random_(generator=b)
    got = torch.empty(n)
    lib.mm3_exponentials(raw.data_ptr(), raw.numel(), got.data_ptr())
    if not torch.equal(want.view(torch.int32), got.view(torch.int32)) or not torch.equal(a.get_state(), b.get_state()):
        return False
    for count in (1, 311, 312, 623, 1000, 183_597):  # across twists, from several offsets
        state = a.get_state()
        torch.empty(count, dtype=torch.int64).random_(generator=a)
        if state.numel() < 24 + 624 * 8:
            return False
        lib.mm3_generator_skip(state.data_ptr(), count)
        if not torch.equal(state, a.get_state()):
            return False
    return True


def raw_draws(generator: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """`shape` raw 64-bit draws (int64) that consume the CPU generator as as many Exponential(1)
    draws do; `exponentials` makes those of them (and `top_k_draw` those it needs). Only where
    `raw_draws_exact()`."""
    return torch.empty(shape, dtype=torch.int64).random_(generator=generator)


def exponentials(raw: torch.Tensor) -> torch.Tensor:
    """The Exponential(1) float32 draws torch would have made from `raw_draws`' values, bit for bit
    (`raw_draws_exact`)."""
    raw = raw.contiguous()
    out = torch.empty(raw.shape)
    cpu_native.library().mm3_exponentials(raw.data_ptr(), raw.numel(), out.data_ptr())
    return out


def draw_from_raw(probs: torch.Tensor, raw: torch.Tensor) -> torch.Tensor | None:
    """`mm3.plan.sampling.draw(probs, exponentials(raw))` -> [rows] int64, the Exponential values made
    only where they count (a nonzero probability, a zero draw); probs [rows, N] float32 and raw
    [rows, N] int64 on the CPU, rows contiguous. None where it does not serve."""
    if torch.compiler.is_compiling() or not (probs.is_cpu and raw.is_cpu) or probs.dtype != torch.float32 or \
            raw.dtype != torch.int64 or probs.dim() != 2 or raw.shape != probs.shape or probs.stride(1) != 1 or \
            raw.stride(1) != 1:
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    lib.mm3_draw_from_raw(probs.data_ptr(), raw.data_ptr(), probs.shape[0], probs.shape[1], probs.stride(0),
                          raw.stride(0), out.data_ptr())
    return out


def skip_draws(generator: torch.Generator, count: int) -> bool:
    """Moves a CPU generator past `count` 64-bit draws without making them (a few twists of its
    state, not 2 * count outputs: the LM's semantic draw skips 180 000 a frame); False, untouched,
    where `raw_draws_exact()` does not hold or it is not a CPU generator."""
    if count <= 0 or generator.device.type != "cpu" or not raw_draws_exact():
        return count <= 0
    state = generator.get_state()
    cpu_native.library().mm3_generator_skip(state.data_ptr(), count)
    generator.set_state(state)
    return True
