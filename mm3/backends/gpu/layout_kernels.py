"""Products over the device layout: `linear(x, planes, qtype, k, bias)` = x @ W.T (+ bias), W held
as `mm3.backends.gpu.device_layout` planes (or, for F16/BF16/F32 weights, as the float tensor itself).

Decode-shaped inputs (up to `GEMV_MAX_ROWS` rows) go to `layout_triton.gemv_kernel`: groups of up
to 4 input rows, `Config.block_n` weight rows and `Config.block_c` chunks (256 values) per program,
K split over programs until the grid has `TARGET_WAVES` programs per multiprocessor (partial sums
then added in a fixed order by each tile's last program, so results do not depend on timing). Two
weights of different types stacked by their outputs (`linear_segments`: q and k of one type, v of
another) take one launch too, and `swiglu` gives `silu(gate) * up` of stacked gate and up rows from
one. Wider inputs (a prefill, the DiT) go to `layout_triton.gemm_kernel`. `MM3_KERNELS` and the
product choice live in `mm3.backends.products`; `works` checks a kernel once per (type, dtype,
device) before a layer uses it.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from . import device_layout as dl
from ... import switches
from .interpreter import interpreted
from .kernels import CODES, FLOAT_DTYPES as FLOATS  # the kernels' type codes, shared
from ...weights.binding import indexed_device

GEMV_MAX_ROWS = 16  # beyond: the tiled GEMM
TARGET_WAVES = 4  # decode programs per multiprocessor the K split aims for
REFERENCE_SMS = 132  # the grid's target when the device cannot say (an H100 / H200)


@dataclass(frozen=True)
class Config:
    """A kernel's tiles: weight rows and chunks per program, warps, and for the GEMM input rows."""

    block_n: int
    block_c: int
    num_warps: int
    block_m: int = 0
    num_stages: int = 3
    int8_inputs: bool = False  # decode: quantized weights multiplied with 8-bit inputs (`layout_int8`)


# Tiles chosen from the static report (`python -m mm3 kernels --report`): no spills, no layout
# conversions (a decode tile of 4 rows x 8 chunks over 2 warps puts 4 words of every plane in each
# thread), 16-byte loads of every weight byte.
DECODE = Config(block_n=4, block_c=8, num_warps=2)
# 8 weight rows a thread: each input value (and its norm inside) serves twice as many weights, at
# about twice the registers (docs/KERNELS.md); `MM3_GPU_DECODE_ROWS=8` picks it, for a GPU to time.
DECODE_WIDE = Config(block_n=8, block_c=8, num_warps=2)
PREFILL = Config(block_n=64, block_c=1, num_warps=4, block_m=64)
PREFILL_F32 = Config(block_n=32, block_c=1, num_warps=4, block_m=32)  # float32 inputs: FMA products
# Under Triton's interpreter (tests on the CPU) a program costs the same whatever its tile: wide
# tiles, few programs. The arithmetic of each output is the same.
INTERPRETED = (Config(block_n=64, block_c=8, num_warps=2), Config(block_n=64, block_c=1, num_warps=4, block_m=64))


@functools.cache  # asked at every product: the switches are read once a process (`cache_clear` reads them again)
def decode_config() -> Config:
    """The decode tile in force on a GPU: DECODE, or DECODE_WIDE under `MM3_GPU_DECODE_ROWS=8`; with
    8-bit inputs under `MM3_GPU_INT8_INPUTS` (where the device runs them: `int8_inputs`)."""
    config = DECODE_WIDE if switches.value("MM3_GPU_DECODE_ROWS") == "8" else DECODE
    return dataclasses.replace(config, int8_inputs=switches.on("MM3_GPU_INT8_INPUTS"))


def default_decode_config() -> Config:
    """The decode tile of a launch that names none: `decode_config()`, or under the interpreter its
    wide tile (`INTERPRETED`) with the inputs `decode_config()` asks for."""
    if interpreted():
        return dataclasses.replace(INTERPRETED[0], int8_inputs=decode_config().int8_inputs)
    return decode_config()


def int8_inputs(config: Config, device: torch.device) -> bool:
    """Whether a decode launch on `device` reads its inputs as int8 (`layout_int8`): where `config`
    asks and the kernel's PTX runs (CUDA, not ROCm), or under the interpreter (its emulation)."""
    return config.int8_inputs and (interpreted() or (device.type == "cuda" and torch.version.hip is None))


def chunks_of(k: int) -> int:
    return -(-k // dl.CHUNK)


def decode_tiles(k: int, config: Config | None = None) -> int:
    """Chunks per decode tile: the configured count or the largest power of two below it that
    divides the row's chunks (a tile never runs past a row, so no chunk needs a mask)."""
    chunks, c = chunks_of(k), (config or decode_config()).block_c
    while chunks % c:
        c //= 2
    return c


def decode_grid(m: int, n: int, k: int, sms: int, config: Config | None = None) -> tuple[int, int, int, int, int]:
    """(block_m, block_c, row groups, weight-row tiles, K splits) of a decode product: K is split
    (in whole tiles) until the grid holds TARGET_WAVES programs per multiprocessor or every split
    has one tile."""
    config = config or decode_config()
    block_m = 1 if m == 1 else 2 if m == 2 else 4
    block_c = decode_tiles(k, config)
    groups, tiles = -(-m // block_m), -(-n // config.block_n)
    k_tiles = chunks_of(k) // block_c
    splits = 1
    while groups * tiles * splits < TARGET_WAVES * sms and splits * 2 <= k_tiles:
        splits *= 2
    return block_m, block_c, groups, tiles, splits


_SMS: dict = {}


def multiprocessors(device: torch.device) -> int:
    if device not in _SMS:
        try:
            _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
        except Exception:  # the interpreter, or a device torch cannot describe
            _SMS[device] = REFERENCE_SMS
    return _SMS[device]


def planes(weight: torch.Tensor, qtype: QT, k: int) -> tuple:
    """(q, qh, s, s2) kernel arguments: the layout's planes as int32 [rows, words] views (unused
    ones repeat q), or the float weight itself."""
    if qtype in FLOATS:
        return weight, weight, weight, weight
    lay = dl.layout_of(qtype, k)
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != lay.row_bytes:
        raise ValueError(f"a {qtype.name} layout of rows of {k} values is [n, {lay.row_bytes}] uint8, got "
                         f"{weight.dtype} {list(weight.shape)}")
    q = lay.plane(weight, "q")
    get = lambda name: lay.plane(weight, name) if name in lay.offsets else q  # noqa: E731
    if qtype == QT.Q6_K:
        return q, get("qh"), get("sc"), get("d")
    if qtype in (QT.Q4_K, QT.Q5_K):
        return q, get("qh"), get("hdr"), q
    return q, get("qh"), get("d"), get("m")


def linear(x: torch.Tensor, weight: torch.Tensor, qtype: QT, k: int, bias: torch.Tensor | None = None,
           config: Config | None = None, *, norm: tuple | None = None, residual: torch.Tensor | None = None,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] @ W.T (+ bias) -> [..., n] in x's dtype; W as the layout [n, row_bytes] uint8
    (a float tensor [n, k] for F16/BF16/F32) on x's device. `norm` (weight [k], eps): x
    RMS-normalized first; `residual` (x's leading shape, [..., n]): added to the product; `add`
    (with one of them: rows [..., p, k] with `norm`, [..., p, n] with `residual`): added first, as
    torch adds it, to the rows normalized or to the residual, row i taking add's row i % p (the
    depth decoder's position embeddings); decode-shaped inputs do all inside the one launch (`Fusion`)."""
    return linear_segments(x, [(weight, qtype)], k, bias, config, norm=norm, residual=residual, add=add)


@dataclass(frozen=True)
class Fusion:
    """What a decode launch does around its product: the inputs' RMSNorm (`norm_weight`, `eps`) on
    the way in, a residual added on the way out (`residual`, rows of the output's width), and rows
    added to the stream the norm reads or the residual holds (`add` [p, width]: row i of the
    stream takes row i % p)."""

    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    residual: torch.Tensor | None = None
    add: torch.Tensor | None = None

    def args(self, y: torch.Tensor) -> tuple:
        """(norm weight, residual, its row stride, added rows, their count and row stride, eps) as
        the kernels take them (y where unused)."""
        res, add = self.residual, self.add
        return (y if self.norm_weight is None else self.norm_weight, y if res is None else res,
                0 if res is None else res.stride(0), y if add is None else add, 1 if add is None else add.shape[0],
                0 if add is None else add.stride(0), float(self.eps))

    def flags(self) -> dict:
        return dict(NORM=self.norm_weight is not None, RESIDUAL=self.residual is not None, ADD=self.add is not None)

    def column_slice(self, at: int, size: int) -> Fusion:
        """This fusion for the output columns [at, at + size) (the residual's and its added rows')."""
        res, add = self.residual, self.add
        return dataclasses.replace(self, residual=None if res is None else res[:, at:at + size],
                                   add=None if add is None or res is None else add[:, at:at + size])


def _fused(x2: torch.Tensor, n: int, norm: tuple | None, residual: torch.Tensor | None,
           add: torch.Tensor | None = None) -> Fusion:
    """The `Fusion` of a launch over rows x2 [m, k] with n outputs, its tensors checked."""
    weight, eps = norm if norm is not None else (None, 0.0)
    if weight is not None and (weight.shape != (x2.shape[1],) or weight.dtype != x2.dtype or
                               weight.device != x2.device or not weight.is_contiguous()):
        raise ValueError(f"a norm weight of {x2.shape[1]} {x2.dtype} values on {x2.device}, got {weight.dtype} "
                         f"{list(weight.shape)}")
    if residual is not None:
        residual = residual.reshape(-1, residual.shape[-1])
        if residual.shape != (x2.shape[0], n) or residual.dtype != x2.dtype or residual.stride(-1) != 1:
            raise ValueError(f"a residual of {x2.shape[0]} rows of {n} {x2.dtype} values, got {residual.dtype} "
                             f"{list(residual.shape)}")
    if add is not None:
        if (weight is None) == (residual is None):
            raise ValueError("rows to add go with a norm or with a residual, one of them")
        width = x2.shape[1] if residual is None else n
        add = add.reshape(-1, add.shape[-1])
        if add.shape[1] != width or add.shape[0] < 1 or x2.shape[0] % add.shape[0] or add.dtype != x2.dtype or \
                add.device != x2.device or add.stride(-1) != 1:
            raise ValueError(f"rows to add of {width} {x2.dtype} values, a count dividing {x2.shape[0]}, got "
                             f"{add.dtype} {list(add.shape)}")
    return Fusion(weight, eps, residual, add)


def plus_rows(rows: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
    """rows [m, w] plus add [p, w] (row i taking add's row i % p; p divides m) with torch's add:
    what `Fusion.add` computes inside a launch."""
    if add is None:
        return rows
    return (rows.view(-1, add.shape[0], rows.shape[-1]) + add).view(rows.shape)


def torch_rms_norm(x: torch.Tensor, norm: tuple | None) -> torch.Tensor:
    """x RMS-normalized by `norm` (weight, eps) with torch's operations, in `mm3.models.lm.rms_norm`'s
    arithmetic (x itself where `norm` is None): what a wide launch leaves to torch."""
    if norm is None:
        return x
    weight, eps = norm
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def linear_segments(x: torch.Tensor, segments: list, k: int, bias: torch.Tensor | None = None,
                    config: Config | None = None, *, norm: tuple | None = None,
                    residual: torch.Tensor | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` of weights stacked by their outputs, each (weight, qtype) in its own type (one or
    two): y = [x @ W1.T, x @ W2.T] (+ bias). Decode-shaped inputs take one launch (two types:
    `gemv_segments_kernel`, where the first weight's rows are whole decode tiles). `norm`,
    `residual` and `add` as `linear`'s."""
    import triton

    from .layout_triton import gemm_kernel

    if x.shape[-1] != k:
        raise ValueError(f"inputs of {x.shape[-1]} values for a weight with rows of {k}")
    if not 1 <= len(segments) <= 2:
        raise ValueError(f"one or two weights stacked, got {len(segments)}")
    sizes = [w.shape[0] for w, _ in segments]
    n = sum(sizes)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    fused = _fused(x2, n, norm, residual, add)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    parts = [(planes(w, qtype, k), CODES[qtype]) for w, qtype in segments]
    if not (m and n):
        return y.view(*x.shape[:-1], n)
    if m <= GEMV_MAX_ROWS:
        config = config or default_decode_config()
        if len(parts) == 2 and sizes[0] % config.block_n:  # the tile the first weight's rows fill, 4 rows or more
            block_n = config.block_n
            while block_n > 4 and sizes[0] % block_n:
                block_n //= 2
            config = dataclasses.replace(config, block_n=block_n)
        if len(parts) == 1 or sizes[0] % config.block_n == 0:
            _decode(x2, parts, sizes, k, bias, y, config, fused)
        else:  # the first weight ends inside a tile: each its own launch
            for (p, b, at), size in zip(_bounds(parts, sizes, bias), sizes):
                _decode(x2, [p], [size], k, b, y[:, at:at + size], config, fused.column_slice(at, size))
        return y.view(*x.shape[:-1], n)
    x2 = torch_rms_norm(x2 if norm is None else plus_rows(x2, fused.add), norm)
    config = config or (INTERPRETED[1] if interpreted() else PREFILL_F32 if x.dtype == torch.float32 else PREFILL)
    for ((q, qh, s, s2), code), b, at in _bounds(parts, sizes, bias):
        size = q.shape[0]
        out = y[:, at:at + size]
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(size, config.block_n))
        gemm_kernel[grid](x2, q, qh, s, s2, b if b is not None else out, out, m, size, k, x2.stride(0), out.stride(0),
                          q.stride(0), qh.stride(0), s.stride(0), s2.stride(0), chunks_of(k), QTYPE=code,
                          HAS_BIAS=b is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                          BLOCK_C=config.block_c, num_warps=config.num_warps, num_stages=config.num_stages)
    y = y if fused.residual is None else plus_rows(fused.residual, fused.add) + y
    return y.view(*x.shape[:-1], n)


def _bounds(parts: list, sizes: list[int], bias: torch.Tensor | None) -> list:
    """(part, its bias or None, its first output column) per stacked weight."""
    out, at = [], 0
    for part, size in zip(parts, sizes):
        out.append((part, None if bias is None else bias[at:at + size], at))
        at += size
    return out


def _decode(x2: torch.Tensor, parts: list, sizes: list[int], k: int, bias: torch.Tensor | None, y: torch.Tensor,
            config: Config, fused: Fusion = Fusion()) -> None:
    """One decode launch writing y [m, sum(sizes)] (a view with unit column stride): `gemv_kernel`,
    or `gemv_segments_kernel` for two weights; K split where the grid is small, the partial sums
    added by the tile's last program; the norm and residual of `fused` inside it."""
    from .layout_triton import gemv_kernel, gemv_segments_kernel

    m, n = x2.shape[0], sum(sizes)
    block_m, block_c, groups, tiles, splits = decode_grid(m, n, k, multiprocessors(x2.device), config)
    chunks = chunks_of(k)
    split_chunks = -(-chunks // (splits * block_c)) * block_c
    splits = -(-chunks // split_chunks)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x2.device) if splits > 1 else y
    counts = counters(x2.device, groups * tiles) if splits > 1 else y
    b = bias if bias is not None else y
    consts = dict(HAS_BIAS=bias is not None, PARTIAL=splits > 1, BLOCK_M=block_m, BLOCK_N=config.block_n,
                  BLOCK_C=block_c, num_warps=config.num_warps, PRECISE=not interpreted(),
                  INT8=int8_inputs(config, x2.device), **fused.flags())
    extra = fused.args(y)
    (q, qh, s, s2), code = parts[0]
    if len(parts) == 1:
        gemv_kernel[(groups, tiles, splits)](
            x2, q, qh, s, s2, b, y, part, counts, m, n, k, x2.stride(0), y.stride(0), q.stride(0), qh.stride(0),
            s.stride(0), s2.stride(0), chunks, split_chunks, *extra, QTYPE=code, **consts)
        return
    (q2, qh2, s3, s4), code2 = parts[1]
    gemv_segments_kernel[(groups, tiles, splits)](
        x2, q, qh, s, s2, q2, qh2, s3, s4, b, y, part, counts, m, n, sizes[0], k, x2.stride(0), y.stride(0),
        q.stride(0), qh.stride(0), s.stride(0), s2.stride(0), q2.stride(0), qh2.stride(0), s3.stride(0),
        s4.stride(0), chunks, split_chunks, *extra, QTYPE=code, QTYPE2=code2, **consts)


_COUNTS: dict = {}


def counters(device: torch.device, size: int) -> torch.Tensor:
    """At least `size` int32 counters on `device` for the current stream, zero between launches
    (each kernel's last program of a group sets its own back; kernels on one stream run one after
    another, so they share them): made once, so a captured graph reads
    the same buffer every replay."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    held = _COUNTS.get((device, stream))
    if held is None or held.numel() < size:
        held = _COUNTS[(device, stream)] = torch.zeros(max(size, 1 << 14), dtype=torch.int32, device=device)
    return held


def swiglu(x: torch.Tensor, weight: torch.Tensor, qtype: QT, k: int, config: Config | None = None, *,
           norm: tuple | None = None) -> torch.Tensor:
    """silu(gate) * up in x's dtype, W [2 n, k] (as `linear`'s) holding the gate rows then the up
    rows: for decode-shaped inputs one launch of `gemv_kernel` (SWIGLU: each program computes
    matching gate and up rows and stores the product, never the halves; the same arithmetic as
    `F.silu(gate) * up` over `linear`'s outputs), else `linear` and torch's ops. `norm` as `linear`'s."""
    from .layout_triton import gemv_kernel

    if x.shape[-1] != k:
        raise ValueError(f"inputs of {x.shape[-1]} values for a weight with rows of {k}")
    if weight.shape[0] % 2:
        raise ValueError(f"gate and up rows stacked: an even count, got {weight.shape[0]}")
    n = weight.shape[0] // 2
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > GEMV_MAX_ROWS or not n:
        gate, up = linear(torch_rms_norm(x, norm), weight, qtype, k, config=config).split(n, dim=-1)
        return F.silu(gate) * up
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, qh, s, s2 = planes(weight, qtype, k)
    fused = _fused(x2, n, norm, None)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return y.view(*x.shape[:-1], n)
    config = config or default_decode_config()
    block_m, block_c = (1 if m == 1 else 2 if m == 2 else 4), decode_tiles(k, config)
    chunks = chunks_of(k)
    gemv_kernel[(-(-m // block_m), -(-n // (config.block_n // 2)), 1)](
        x2, q, qh, s, s2, y, y, y, y, m, n, k, x2.stride(0), y.stride(0), q.stride(0), qh.stride(0), s.stride(0),
        s2.stride(0), chunks, chunks, *fused.args(y), QTYPE=CODES[qtype], HAS_BIAS=False, PARTIAL=False,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_C=block_c, SWIGLU=True, PRECISE=not interpreted(),
        INT8=int8_inputs(config, x2.device), num_warps=config.num_warps, **fused.flags())
    return y.view(*x.shape[:-1], n)


def supports(qtype: QT, in_features: int) -> bool:
    """Whether these kernels read weights of `qtype` with rows of `in_features` values."""
    if qtype in FLOATS:
        return True
    if qtype not in dl.LAYOUT_TYPES:
        return False
    try:
        dl.layout_of(qtype, in_features)
    except ValueError:
        return False
    return True


_WORKS: dict[tuple, bool] = {}


def works(qtype: QT, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the layout kernels for this type and input dtype compile on `device` and agree with
    the torch dequantization on a small product (decode and prefill shapes), checked once per
    process; a kernel that fails is left out with a warning."""
    device = indexed_device(device)
    key = (qtype, dtype, device)
    if key not in _WORKS:
        _WORKS[key] = _check(qtype, dtype, device)
    return _WORKS[key]


def fused_works(form: str, qtype: QT, dtype: torch.dtype, device: torch.device, second: QT | None = None) -> bool:
    """`works` for a fused decode form: "swiglu" (`swiglu` over `qtype`), "segments"
    (`linear_segments` over `qtype` then `second`) or "norm" (`linear` with the inputs' RMSNorm
    inside and a residual added: the prologue and epilogue every decode form shares; and each with
    rows added to the stream it reads, the depth decoder's positions), checked once per process
    against torch."""
    device = indexed_device(device)
    key = (form, qtype, second, dtype, device)
    if key not in _WORKS:
        _WORKS[key] = works(qtype, dtype, device) and (second is None or works(second, dtype, device)) and \
            _check(qtype, dtype, device, form, second)
    return _WORKS[key]


def _check(qtype: QT, dtype: torch.dtype, device: torch.device, form: str = "linear",
           second: QT | None = None) -> bool:
    g = torch.Generator().manual_seed(0)
    k = 512
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    name = qtype.name if second is None else f"{qtype.name}+{second.name}"
    try:
        if form == "segments":
            (w1, v1), (w2, v2) = _sample(qtype, 24, k, g), _sample(second, 16, k, g)
            weights, values = [(w1.to(device), qtype), (w2.to(device), second)], torch.cat([v1, v2])
        else:
            weight, values = _sample(qtype, 40 if form == "linear" else 80, k, g)
            weight = weight.to(device)
        for rows in (2,) if form in ("swiglu", "norm") else (2, GEMV_MAX_ROWS + 1):
            x = torch.randn(rows, k, generator=g)
            xd = x.to(device, dtype)
            norm = (torch.rand(k, generator=g) + 0.5).to(dtype)
            if form == "norm":  # the inputs normalized first: torch's arithmetic, as the norm kernels'
                x = torch_rms_norm(x.to(dtype), (norm, 1e-6)).float()
            want = x.to(dtype).double() @ values.to(dtype).double().T
            if form == "segments":
                got = linear_segments(xd, weights, k)
            elif form == "swiglu":
                got = swiglu(xd, weight, qtype, k)
                gate, up = want.split(want.shape[1] // 2, dim=-1)
                want = F.silu(gate) * up
            elif form == "norm":  # the prologue every decode form shares, and the residual's epilogue
                residual = torch.randn(rows, weight.shape[0], generator=g).to(dtype)
                got = linear(xd, weight, qtype, k, norm=(norm.to(device), 1e-6), residual=residual.to(device))
                want = want + residual.double()
            else:
                got = linear(xd, weight, qtype, k)
            pairs = [(got, want, f"{rows} rows")]
            if form == "norm":  # the depth decoder's first block: its position rows added where the stream is read
                pairs += _added_rows(xd, weight, qtype, k, values, norm, residual, dtype, device, g)
            for got, want, what in pairs:
                error = float((got.double().cpu() - want).norm() / want.norm())
                if not error < tolerance:
                    warnings.warn(f"the layout {name} {form} kernel computes wrongly on {device} for {dtype} inputs "
                                  f"({what}: relative error {error:.1e}); using another product", stacklevel=3)
                    return False
    except Exception as e:  # a compiler or driver that cannot build it
        warnings.warn(f"the layout {name} {form} kernel cannot run on {device} ({type(e).__name__}: {e}); "
                      "using another product", stacklevel=3)
        return False
    return True


def _added_rows(xd, weight, qtype, k, values, norm, residual, dtype, device, g) -> list:
    """(got, want, what) of the two forms that add rows to the stream as they read it: the norm's
    inputs plus rows (`add` with `norm`) and the residual plus rows (`add` with `residual`), each
    row taking the added rows' row i % 2, rounded as torch adds them."""
    rows, n = xd.shape[0], weight.shape[0]
    positions, to_residual = torch.randn(2, k, generator=g).to(dtype), torch.randn(2, n, generator=g).to(dtype)
    x = xd.cpu()
    repeat = [i % 2 for i in range(rows)]
    normed = torch_rms_norm(x + positions[repeat], (norm, 1e-6))
    w = values.to(dtype).double().T
    return [(linear(xd, weight, qtype, k, norm=(norm.to(device), 1e-6), add=positions.to(device)),
             normed.double() @ w, "the norm's inputs plus rows"),
            (linear(xd, weight, qtype, k, residual=residual.to(device), add=to_residual.to(device)),
             (residual + to_residual[repeat]).double() + x.double() @ w, "the residual plus rows")]


def _sample(qtype: QT, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight of `qtype` [n, k] as the kernels read it (the layout, or floats), and its values."""
    from ...formats.gguf.quants import dequantize, random_blocks

    if qtype in FLOATS:
        weight = torch.randn(n, k, generator=g).to(FLOATS[qtype])
        return weight, weight.float()
    raw = random_blocks(qtype, n, k, generator=g)
    return dl.to_planes(raw, qtype, k), dequantize(raw, qtype, (n, k))
