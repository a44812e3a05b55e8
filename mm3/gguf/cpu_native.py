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

The C files (`native/`: the products and repacking, `integer_product.c`; a decode step's small
operations, `decode_steps.c`) are compiled once per machine into one library with the system's C
compiler (`CC`, else `cc`, `gcc` or `clang`; `-O3 -march=native`, with OpenMP where the compiler
has it) in the cache folder (`mm3.cache_dir`), keyed by the sources, the compiler and the
processor, and loaded with ctypes.
Where there is no compiler, the build fails or its product is wrong on a probe, `available()` is
False and the other forms serve. It is one candidate form (`native`) that `mm3.cpu_choice`
times in whole frames beside the others; `MM3_CPU_NATIVE=off` keeps it from being built. The same
library serves an AR step's other small operations that torch runs as many: the fast numerics'
RMSNorm (`rms_norm`), an embedding lookup's few quantized rows (`lookup`) and the depth decoder's
attention over its short cache (`attend`) and the depth decoder's guided top-k draws
(`top_k_draw`); and it repacks the common types' GGUF blocks into its
tiles (`LIBRARY_REPACKS`: about a gigabyte a second, several times the tensor operations).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ..cache_dir import cache_dir
from ..matmul import rows_out
from . import cpu_int4, quants

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("native") / name for name in ("integer_product.c", "decode_steps.c"))
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
BUILD_SECONDS = 120
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


def _machine() -> str:
    """What the compiled code depends on besides its source: the processor and its features."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _compiler() -> str | None:
    named = os.environ.get("CC", "").strip()
    if named:
        return shutil.which(named) or named
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_SECONDS)


FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")


def build(flags: tuple[str, ...] = FLAGS, openmp: bool = True) -> Path | None:
    """The compiled library in the cache folder, built now with `flags` (and OpenMP: without it
    the kernel runs on one thread) if it is not there; None where it cannot be (no compiler, not
    x86-64, a failed build), with one log line."""
    if platform.machine().lower() not in ("x86_64", "amd64") or os.name != "posix":
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found (set CC to name one): the CPU products use torch's kernels alone")
        return None
    try:
        version = _run([cc, "--version"]).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.info("the C compiler %s does not run (%s): the CPU products use torch's kernels alone", cc, e)
        return None
    flags = (*flags, "-fopenmp") if openmp else tuple(flags)
    digest = hashlib.sha256(b"\0".join([*(source.read_bytes() for source in SOURCES), version.encode(),
                                         " ".join(flags).encode(),
                                         _machine().encode()])).hexdigest()[:20]
    out = cache_dir() / "native" / f"integer_product-{digest}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".tmp", dir=out.parent)
    os.close(handle)
    try:
        done = _run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"])
        if done.returncode == 0:
            os.replace(tmp, out)
            log.info("built the CPU integer kernel with %s%s", Path(cc).name, "" if openmp else " (one thread)")
            return out
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    except (OSError, subprocess.SubprocessError) as e:
        why = str(e)
    finally:
        Path(tmp).unlink(missing_ok=True)
    log.info("cannot build the CPU integer kernel with %s%s (%s)", cc, "" if openmp else " without OpenMP", why)
    return None


def load(path: Path):
    """The library at `path` with its functions' signatures set (ctypes; OSError if it cannot load)."""
    lib = ctypes.CDLL(str(path))
    lib.mm3_integer_product.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 5
    lib.mm3_integer_product.restype = ctypes.c_int
    lib.mm3_integer_vector_bits.restype = ctypes.c_int
    lib.mm3_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_float]
    lib.mm3_rms_norm.restype = None
    lib.mm3_dequantize_rows.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 3 + [ctypes.c_void_p,
                                                                                                ctypes.c_int64,
                                                                                                ctypes.c_void_p]
    lib.mm3_dequantize_rows.restype = ctypes.c_int
    lib.mm3_integer_nibble_quads.restype = ctypes.c_int
    lib.mm3_attend.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + \
        [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_void_p]
    lib.mm3_attend.restype = ctypes.c_int
    lib.mm3_repack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_int]
    lib.mm3_repack.restype = ctypes.c_int
    lib.mm3_top_k_draw.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int64,
                                                                              ctypes.c_void_p, ctypes.c_int,
                                                                              ctypes.c_void_p, ctypes.c_int64,
                                                                              ctypes.c_void_p]
    lib.mm3_top_k_draw.restype = ctypes.c_int
    lib.mm3_decode_prepare.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + \
        [ctypes.c_void_p] * 2 + [ctypes.c_float] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_void_p]
    lib.mm3_decode_prepare.restype = ctypes.c_int
    return lib


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


def _first_that_works():
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("off", "0", "no", "false"):
        return None
    for openmp in (True, False):
        path = build(openmp=openmp)
        if path is None:
            continue
        try:
            lib = load(path)
        except OSError as e:
            log.info("cannot load the CPU integer kernel %s (%s)", path.name, e)
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
    """Whether a decode-shaped product of this layer (`mm3.gguf.ops.Linear`) on `device` can come
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


def _multiply(lib, x2: torch.Tensor, weight: torch.Tensor, args: tuple) -> torch.Tensor:
    """The C call: x2 [M, K] float32, contiguous, times the checked packing (`_checked`'s args)."""
    m = x2.shape[0]
    n, k = args[0], args[1]
    y = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        status = lib.mm3_integer_product(x2.data_ptr(), weight.data_ptr(), y.data_ptr(), m, *args,
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
        n = self.args[0]
        y = torch.empty(*shape[:-1], n, dtype=torch.float32)
        m = x.numel() // k
        if m and n:
            status = self.lib.mm3_integer_product(x.data_ptr(), self.packed.weight.data_ptr(), y.data_ptr(), m,
                                                  *self.args, torch.get_num_threads())
            if status:
                raise (MemoryError if status == -1 else ValueError)(f"the CPU integer kernel failed ({status}) "
                                                                     f"on a [{m}, {k}] input")
        if n != self.out_features:
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
    lib = library()
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
    lib = library()
    if lib is None:
        return None
    out = torch.empty(b, s, width)
    if lib.mm3_attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), strides[0], strides[1], cache_k.data_ptr(),
                      cache_v.data_ptr(), b, s, width // d, kv_heads, capacity, at, d, scale, out.data_ptr()):
        raise MemoryError(f"the kernel library could not allocate the scores of {at + s} positions")
    return out


def top_k_draw(logits: torch.Tensor, rows_per_song: int, cfg: float, top_k: int, q: torch.Tensor,
               excluded: torch.Tensor | None = None, gate: bool = False) -> torch.Tensor | None:
    """The reference's guided top-k draw (`mm3.sampling`: `guide`, `top_k_probs`, `draw`) in one
    call of the kernel library: logits [songs * rows_per_song, N] (each song's conditional row,
    then with 2 rows its unconditional one), q [songs, N] its Exponential(1) draws -> [songs]
    int64. `excluded` [N] bool: columns -inf first; `gate`: only columns where the conditional
    logit is among its top_k largest are guided (the LM's semantic draw). The same index as torch's
    operations except where two candidates' ratios lie within a few float32 roundings (its
    exponentials and sums round differently); a dozen small operations otherwise, several a frame.
    None where it does not serve (another dtype, device or layout, tracing, no library, a NaN
    logit under `gate`)."""
    if torch.compiler.is_compiling() or not (logits.is_cpu and q.is_cpu) or logits.dtype != torch.float32 or \
            q.dtype != torch.float32 or logits.dim() != 2 or q.dim() != 2 or rows_per_song not in (1, 2):
        return None
    rows, n = logits.shape
    songs = rows // rows_per_song
    if not logits.is_contiguous() or rows != songs * rows_per_song or q.shape != (songs, n) or q.stride(1) != 1 or \
            not 1 <= top_k or not n:
        return None
    if excluded is not None and (not excluded.is_cpu or excluded.dtype != torch.bool or excluded.shape != (n,) or
                                 not excluded.is_contiguous()):
        return None
    lib = library()
    if lib is None:
        return None
    out = torch.empty(songs, dtype=torch.int64)
    status = lib.mm3_top_k_draw(logits.data_ptr(), songs, rows_per_song, n, cfg, top_k,
                                None if excluded is None else excluded.data_ptr(), int(gate), q.data_ptr(),
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
    lib = library()
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
    [ids.numel(), k], in one call of the kernel library: bit for bit `mm3.gguf.quants`'
    dequantization, which takes a hundred microseconds of small operations for the few rows of an
    AR step's lookup. None where it does not serve (no library, another type or layout, tracing);
    an id outside the table is an IndexError, as indexing would raise."""
    if torch.compiler.is_compiling() or qtype not in ROW_TYPES or table.dtype != torch.uint8 or table.dim() != 2 or \
            table.device.type != "cpu" or not table.is_contiguous() or ids.is_floating_point() or ids.is_complex():
        return None
    lib = library()
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
