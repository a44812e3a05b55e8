"""Quantized weights multiplied on the CPU by a kernel of this package, built on the machine that runs it.

torch's CPU int4 product reads a weight of up to 8 bits a value as two int4 planes (`cpu_int4`:
twice the values) and is bound by its arithmetic on few cores. `native/integer_product.c`
multiplies the values as stored, as integers: int8 (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) or 4-bit
(Q4_0, Q4_1, Q4_K), with a scale per 16 or 32 of them and an offset where the type has one
(`TYPES`; the scales as exact as the file's and nearly as small, `SCALE_FORMS`), by integer
multiply-adds over 16 rows at a time, the input rounded per group to int16 (about 1e-5
relative, far below the int4 product's bfloat16 rounding). So its products are
float32 products up to that rounding, and on a processor that multiplies int16 fast it reads a
weight about as fast as memory delivers it.

The C files are compiled once per machine into one library (`mm3.backends.cpu.build`), loaded
and probed once per process (`library`).
Where there is no compiler, the build fails or its product is wrong on a probe, `available()` is
False and the other forms serve. Where it is available, the rule of `mm3.backends.cpu.choice` gives
the AR stage its form (`native`); `MM3_CPU_NATIVE=off` keeps it from being built. The same
library serves an AR step's other small operations that torch runs as many: the fast numerics'
RMSNorm (`rms_norm`), an embedding lookup's few quantized rows (`lookup`) and the depth decoder's
attention over its short cache (`attend`) and the depth decoder's guided top-k draws
(`top_k_draw`); and it repacks the common types' GGUF blocks into its
tiles (`LIBRARY_REPACKS`: about a gigabyte a second, several times the tensor operations).
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ... import switches
from ...formats.gguf import quants
from . import build as cpu_build, int4 as cpu_int4
from .matmul import rows_out

log = logging.getLogger(__name__)

ENV_SWITCH = "MM3_CPU_NATIVE"


class Layout(NamedTuple):
    """How the kernel holds a type: values a scale (its sub-block), bits a value, whether an
    offset per group is taken away (w = scale q - offset)."""

    group: int
    bits: int
    offsets: bool


TYPES = {QT.Q8_0: Layout(32, 8, False), QT.Q5_0: Layout(32, 8, False), QT.Q6_K: Layout(16, 8, False),
         QT.Q5_1: Layout(32, 8, True), QT.Q5_K: Layout(32, 8, True),
         QT.Q4_0: Layout(32, 4, True), QT.Q4_1: Layout(32, 4, True), QT.Q4_K: Layout(32, 4, True)}
# How a tile holds its scales and offsets (`native/integer_product.c`, FORM_*): float32; float16
# (the legacy types' own, where every one is a float16 exactly); per super-block of 256 columns a
# float16 factor times an int8 per group (the K types' own d * scale: 4.6 bits a Q4_K value, 8.6 a
# Q6_K one, against 6 and 10 in float32).
SCALE_FORMS = {"f32": 0, "f16": 1, "super": 2}
SUPER_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
SUPER_COLUMNS = 256
TILE = 16  # rows the kernel multiplies together: a weight gets zero rows up to a multiple, cut off after
REPACK_ROWS = 1024  # rows repacked at a time (a multiple of TILE): bounds the temporaries
_LIBRARY: list = []  # [ctypes library or None], once per process
_LOCK = threading.Lock()


class Packing(NamedTuple):
    """A weight in the kernel's layout: `weight` [rows / 16, bytes a tile] int8 (each tile's values,
    then its scales and offsets in the form `scales`, a key of `SCALE_FORMS`), `in_features` K, the
    type's `Layout`, and for 4-bit values whether they lie in quads of columns (the layout of a
    build with VNNI) or pairs."""

    weight: torch.Tensor
    in_features: int
    layout: Layout
    quads: bool = False
    scales: str = "f32"

    def nbytes(self) -> int:
        return self.weight.numel()


def library():
    """The loaded kernel library, or None (built, loaded and probed once per process: with
    OpenMP, else without; published only once its probe passed, so once there it is read without
    the lock, as a frame's hundreds of calls do)."""
    if _LIBRARY:
        return _LIBRARY[0]
    with _LOCK:
        if not _LIBRARY:
            _LIBRARY.append(_first_that_works())
    return _LIBRARY[0]


def forget() -> None:
    """Drop this process's library: the next use builds (or finds), loads and probes it again, under
    the switches and compiler in force then."""
    with _LOCK:
        _LIBRARY.clear()


def _first_that_works():
    if not switches.on(ENV_SWITCH):
        return None
    for openmp in (True, False):
        lib = cpu_build.load_built(openmp)
        if lib is None:
            continue
        try:
            right = _probe(lib)
        except (RuntimeError, ValueError, MemoryError) as e:
            log.warning("the CPU integer kernel built here fails its probe (%s): it is not used", e)
            return None
        if not right:
            log.warning("the CPU integer kernel built here computes wrong products: it is not used")
            return None
        return lib
    log.info("the CPU products use torch's kernels alone")
    return None




def available() -> bool:
    """Whether the kernel is built, loaded and computes what it should here."""
    return library() is not None


def vector_bits() -> int:
    """The vector width the kernel was built for (512, 256; 0: plain C; -1: not available)."""
    lib = library()
    return -1 if lib is None else int(lib.mm3_integer_vector_bits())


def _probe(lib) -> bool:
    g = torch.Generator().manual_seed(0)
    n, k = 40, 512  # rows that are not whole tiles, two super-blocks
    x = torch.randn(3, k, generator=g)
    for layout, form in ((Layout(32, 8, False), "f16"), (Layout(16, 8, True), "f32"), (Layout(32, 4, True), "super"),
                         (Layout(16, 8, False), "super")):
        low, high = (-128, 128) if layout.bits == 8 else (0, 16)
        q = torch.randint(low, high, (n, k), dtype=torch.int8, generator=g)
        groups = k // layout.group
        if form == "super":  # per part a float16 factor per 256 columns times an int8 per group
            parts = 2 if layout.offsets else 1
            factors = [torch.rand(n, k // SUPER_COLUMNS, generator=g).half() for _ in range(parts)]
            steps = [torch.randint(-63, 64, (n, groups), dtype=torch.int8, generator=g) for _ in range(parts)]
            sections = factors + steps
            per_group = [f.float().repeat_interleave(groups // f.shape[1], dim=1) * m.float()
                         for f, m in zip(factors, steps)]
            s, o = per_group[0], per_group[1] if layout.offsets else None
        else:
            dtype = torch.float16 if form == "f16" else torch.float32
            s = (torch.rand(n, groups, generator=g) + 0.5).to(dtype)
            o = torch.randn(n, groups, generator=g).to(dtype) if layout.offsets else None
            sections = [t for t in (s, o) if t is not None]
            s, o = (None if t is None else t.float() for t in (s, o))
        w = q.double().view(n, -1, layout.group) * s.double()[..., None]
        if o is not None:
            w = w - o.double()[..., None]
        want = x.double() @ w.view(n, k).T
        quads = layout.bits == 4 and nibble_quads(lib)
        with torch.inference_mode():
            got = product(x, Packing(_tile(q, sections, layout.bits, quads), k, layout, quads, form), lib)[:, :n]
        if not ((got.double() - want).norm() / want.norm()) < 1e-4:
            return False
    return True


def serves(layer, qtype: QT | None, device: torch.device) -> bool:
    """Whether a decode-shaped product of this layer (`mm3.weights.layers.Linear`) on `device` can come
    here: a weight of one of `TYPES` in the LM or depth decoder in the fast numerics, on the CPU."""
    return (device.type == "cpu" and qtype in TYPES and layer.decode_products and layer.fused_kernels
            and available())


def nibble_quads(lib=None) -> bool:
    """Whether the kernel (`lib`, default this process's) holds 4-bit values in quads of columns."""
    lib = lib or library()
    return lib is not None and bool(lib.mm3_integer_nibble_quads())


def repack(raw: torch.Tensor, qtype: QT, out_features: int, in_features: int, quads: bool | None = None,
           scales: str | None = None) -> Packing:
    """GGUF block rows [N, row_bytes] of one of `TYPES` -> the kernel's tiles (see `Packing`;
    `quads`: the 4-bit layout, default the one this process's kernel reads; `scales`: a key of
    `SCALE_FORMS`, default the smallest exact one: "super" for the K types, else "f16" where every
    scale and offset is a float16, else "f32")."""
    if qtype not in TYPES:
        raise ValueError(f"the CPU integer kernel reads {', '.join(t.name for t in TYPES)}, not {qtype.name}")
    layout = TYPES[qtype]
    quads = layout.bits == 4 and (nibble_quads() if quads is None else quads)
    form = scales or ("super" if qtype in SUPER_TYPES else "f16")
    if form not in SCALE_FORMS or (form == "super" and qtype not in SUPER_TYPES):
        raise ValueError(f"{qtype.name} scales cannot be held as {form!r}")
    packed = _repacked_by_library(raw, qtype, out_features, in_features, quads, form)
    if packed is not None:
        return packed
    rows = raw.reshape(out_features, -1)
    parts = []
    for i in range(0, out_features, REPACK_ROWS):
        q, sections = _values(rows[i:i + REPACK_ROWS], qtype, in_features, form)
        if sections is None:  # a scale that is no float16: every chunk again in float32
            if scales is not None:
                raise ValueError(f"{qtype.name} scales are not all float16 values: they cannot be held as 'f16'")
            return repack(raw, qtype, out_features, in_features, quads, "f32")
        parts.append(_tile(q, sections, layout.bits, quads))
    return Packing(parts[0] if len(parts) == 1 else torch.cat(parts), in_features, layout, quads, form)


LIBRARY_REPACKS = {QT.Q8_0: "f16", QT.Q4_0: "f16", QT.Q4_K: "super", QT.Q5_K: "super", QT.Q6_K: "super"}


def _repacked_by_library(raw: torch.Tensor, qtype: QT, n: int, k: int, quads: bool, form: str) -> Packing | None:
    """`repack`'s packing made in one call of the kernel library (the same bytes, hundreds of times
    faster than the tensor operations below: a released-size weight set is gigabytes), where it
    makes this type in this form; else None."""
    if LIBRARY_REPACKS.get(qtype) != form or raw.dtype != torch.uint8 or raw.device.type != "cpu":
        return None
    lib = library()
    if lib is None:
        return None
    rows = raw.reshape(n, -1).contiguous()
    layout = TYPES[qtype]
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    if k % block_values or rows.shape[1] != k // block_values * block_bytes:
        raise ValueError(f"{qtype.name} rows of {rows.shape[1]} bytes do not hold {k} values")
    out = torch.empty((n + TILE - 1) // TILE, tile_bytes(k, layout, form), dtype=torch.int8)
    status = lib.mm3_repack(rows.data_ptr(), int(qtype), n, k, int(quads), out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError(f"the kernel library could not allocate a tile's values ({TILE} x {k})")
    return Packing(out, k, layout, quads, form) if status == 0 else None  # -4: an offset needs float32


def _values(raw: torch.Tensor, qtype: QT, k: int, form: str = "f32"):
    """Block rows -> the values q [n, k] (int8; 0..15 for 4-bit types) and the scale sections of
    `form` (`_tile`), w = s q - o with scales s and offsets o per group, each exact: "f32" or "f16"
    [s, o] (o only for the types with offsets; None for "f16" where a value is no float16),
    "super" [d, dmin, d's multiples, dmin's] as the K types store them (s = d x, o = dmin y). Q8_0's
    bytes as they are, the others from the planes `cpu_int4` reads them into."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    n = raw.shape[0]
    b = raw.reshape(-1, block_bytes).contiguous()
    if qtype == QT.Q8_0:
        b = b.view(n, -1, block_bytes)
        q = b[..., 2:].contiguous().view(torch.int8).view(n, k)
        s, o = b[..., :2].contiguous().view(torch.float16).view(n, -1).float(), None
    elif TYPES[qtype].bits == 4:
        q, s, o = cpu_int4.one_plane(b, qtype)
        q, s, o = q.to(torch.int8).view(n, k), s.reshape(n, -1), o.reshape(n, -1)
    else:
        high, low, scale, constant = cpu_int4.two_planes(b, qtype)  # w = S (16 (H - 8) + L) + c
        q = ((high.to(torch.int16) - 8) * 16 + low.to(torch.int16)).to(torch.int8).view(n, k)
        s, o = scale.float().reshape(n, -1), (-constant.float().reshape(n, -1) if TYPES[qtype].offsets else None)
    if form == "super":
        return q, _super_sections(b, qtype, n)
    sections = [t for t in (s, o) if t is not None]
    if form == "f16":
        halves = [t.half() for t in sections]
        if not all(torch.equal(h.float(), t) for h, t in zip(halves, sections)):
            return q, None
        sections = halves
    return q, sections


def _super_sections(b: torch.Tensor, qtype: QT, n: int) -> list[torch.Tensor]:
    """K-type blocks [n * blocks, bytes] -> [d [n, k / 256] float16, then dmin for Q4_K and Q5_K,
    the per-group multiples [n, groups] int8 of d, then of dmin]: s = d x, o = dmin y."""
    if qtype == QT.Q6_K:  # ql[128], qh[64], scales[16] int8, d
        d = b[:, 208:210].contiguous().view(torch.float16).view(n, -1)
        return [d, b[:, 192:208].view(torch.int8).reshape(n, -1)]
    d = b[:, :4].contiguous().view(torch.float16)  # [blocks, 2]: d, dmin
    steps = quants._k4_scale_min(b[:, 4:16]).to(torch.int8)  # [blocks, 2, 8]: 6-bit scales, mins
    return [d[:, 0].reshape(n, -1), d[:, 1].reshape(n, -1), steps[:, 0].reshape(n, -1), steps[:, 1].reshape(n, -1)]


def _tile(q: torch.Tensor, sections: list[torch.Tensor], bits: int, quads: bool = False) -> torch.Tensor:
    """Values q [n, k] (int8, or 0..15 for `bits` 4) and the scale sections (`_values`: each
    [n, columns] of any dtype) -> tiles [n / 16 (up), bytes] (the layouts of
    `native/integer_product.c`: each section [columns][16] after the values)."""
    n, k = q.shape
    pad = -n % TILE
    if pad:
        q = torch.cat((q, q.new_zeros(pad, k)))
        sections = [torch.cat((t, t.new_zeros(pad, t.shape[1]))) for t in sections]
    t = (n + pad) // TILE
    width = 4 if quads else 2  # columns a lane: a row's values side by side
    lanes = q.view(t, TILE, k // width, width).permute(0, 2, 1, 3).reshape(t, k // width, width * TILE)
    if bits == 4:  # two pairs (quads) a byte: the first in the low nibble
        lanes = lanes[:, 0::2] | (lanes[:, 1::2] << 4)
    parts = [lanes.reshape(t, -1)]
    for section in sections:
        parts.append(section.contiguous().view(t, TILE, -1).transpose(1, 2).contiguous().view(torch.int8).view(t, -1))
    return torch.cat(parts, dim=1)


def tile_bytes(k: int, layout: Layout, scales: str = "f32") -> int:
    """Bytes of one tile of 16 rows of K values (`_tile`) with scales in the form `scales`."""
    parts = 2 if layout.offsets else 1
    groups = k // layout.group
    if scales == "super":
        per_group = 2 * TILE * (k // SUPER_COLUMNS) + TILE * groups
    else:
        per_group = (2 if scales == "f16" else 4) * TILE * groups
    return TILE * k * layout.bits // 8 + per_group * parts


def _checked(packed: Packing, k: int, lib, rows: int | str = "..") -> tuple:
    """What the C call reads of `packed` for inputs of K = k, checked ((n, k, group, bits, offsets,
    scale form)): the packing's bytes and K, and its value layout against `lib`'s."""
    w = packed.weight
    if k != packed.in_features or w.dim() != 2 or w.shape[1] != tile_bytes(k, packed.layout, packed.scales) or \
            w.dtype != torch.int8 or not w.is_contiguous() or w.device.type != "cpu":
        raise ValueError(f"a [{rows}, {k}] input does not fit a packing of {packed.in_features} columns "
                         f"({tuple(w.shape)} {w.dtype} on {w.device}, {packed.layout})")
    group, bits, offsets = packed.layout
    if bits == 4 and packed.quads != bool(lib.mm3_integer_nibble_quads()):
        raise ValueError("4-bit values packed for another build of the CPU integer kernel")
    return w.shape[0] * TILE, k, group, bits, int(offsets), SCALE_FORMS[packed.scales]


def _multiply(lib, x: torch.Tensor, weight: torch.Tensor, args: tuple) -> torch.Tensor:
    """The C call: x [..., K] float32, contiguous, times the checked packing (`_checked`'s args)
    -> [..., N padded to whole tiles] float32."""
    n, k = args[0], args[1]
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    m = x.numel() // k
    if m and n:
        status = lib.mm3_integer_product(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, *args,
                                         torch.get_num_threads())
        if status == -1:
            raise MemoryError(f"the CPU integer kernel could not allocate the rounded rows of a [{m}, {k}] input")
        if status:
            raise ValueError(f"the CPU integer kernel takes 16 or 32 values a scale of 8 or 4 bits (whole "
                             f"super-blocks for the 'super' scales), not {args[2:]} of {k} columns")
    return y


def product(x2: torch.Tensor, packed: Packing, lib=None) -> torch.Tensor:
    """x2 [M, K] times the packed weight -> [M, rows padded to whole tiles] float32 (`lib`: another
    build of the kernel, `load`; default this process's). What the C code reads is checked first:
    K against the packing, the packing's bytes, contiguous float32 inputs."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError("the CPU integer kernel is not available")
    args = _checked(packed, x2.shape[1], lib, x2.shape[0])
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.to(torch.float32).contiguous()
    return _multiply(lib, x2, packed.weight, args)


class Bound:
    """`packed`'s product of `out_features` outputs with its packing checked once (`_checked`): a
    frame makes hundreds of these calls, each a few microseconds of Python around the C call.
    `bound(x, bias)` is `linear(x, packed, out_features, bias)`."""

    def __init__(self, packed: Packing, out_features: int):
        lib = library()
        if lib is None:
            raise RuntimeError("the CPU integer kernel is not available")
        self.packed, self.out_features, self.lib = packed, out_features, lib
        self.args = _checked(packed, packed.in_features, lib)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return linear(x, self.packed, self.out_features, bias)
        shape, k = x.shape, self.packed.in_features
        if shape[-1] != k:
            raise ValueError(f"a [.., {shape[-1]}] input does not fit a packing of {k} columns")
        if x.dtype != torch.float32 or not x.is_contiguous():  # else its rows as they lie
            return rows_out(_multiply(self.lib, x.reshape(-1, k).to(torch.float32).contiguous(),
                                      self.packed.weight, self.args), x, self.out_features, bias)
        y = _multiply(self.lib, x, self.packed.weight, self.args)
        if y.shape[-1] != self.out_features:
            y = y[..., :self.out_features]
        return y if bias is None else y + bias


def bind(packed: Packing, out_features: int) -> Bound:
    """`linear` over `packed` with its packing checked now, once (`Bound`)."""
    return Bound(packed, out_features)


@torch.library.custom_op("mm3::native_integer", mutates_args=())
def _traced(x2: torch.Tensor, weight: torch.Tensor, k: int, group: int, bits: int, offsets: bool,
            quads: bool, scales: str) -> torch.Tensor:
    return product(x2, Packing(weight, k, Layout(group, bits, offsets), quads, scales))


@_traced.register_fake
def _(x2, weight, k, group, bits, offsets, quads, scales):
    return x2.new_empty((x2.shape[0], weight.shape[0] * TILE))


def linear(x: torch.Tensor, packed: Packing, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype, W in the kernel's packing (a custom op
    while torch.compile traces, `torch.ops.mm3.native_integer`: a call into a C library is opaque to it)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.to(torch.float32).contiguous()
    if torch.compiler.is_compiling():
        y = torch.ops.mm3.native_integer(x2, packed.weight, packed.in_features, *packed.layout, packed.quads,
                                         packed.scales)
    else:
        y = product(x2, packed)
    return rows_out(y, x, out_features, bias)
