"""Fused dequantize-and-multiply through Triton: `y = x @ W.T (+ b)` read straight from GGUF blocks.

The weight never exists in float form in device memory: each program loads a tile of block bytes,
expands it to float32 in registers (the same arithmetic as `mm3.formats.gguf.quants`, type by type) and
multiplies it into its output tile with `tl.dot` (float32 inputs at IEEE precision, so no TF32;
half-precision inputs multiply in their own type with float32 accumulation). One kernel serves
both shapes the engine has: decode (the CFG pair of each song, 1-32 rows: the smallest row tile
and narrow column tiles, so the weight is read once by many programs) and prefill / the DiT (wide
tiles). Float weights of another dtype than the input (BF16 or F16 files under float32 compute)
go through the same kernel instead of a cast copy.

Used where Triton runs the device (CUDA, ROCm, XPU); `TRITON_INTERPRET=1` runs the same kernels on
CPU tensors, which is how they are tested without a GPU. `MM3_KERNELS` picks: "auto" (default:
on accelerators with Triton, those over the device layout wherever they read the weight, these
elsewhere: `mm3.backends.gpu.kernel_choice`), "off", "triton" (these; also CPU tensors with the
interpreter) or "layout" (`mm3.backends.gpu.layout_kernels`; also CPU tensors with the interpreter).
"""

from __future__ import annotations

import warnings

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ... import switches
from ...weights.binding import indexed_device
from .interpreter import interpreted

# Kernel type codes (constexpr in the kernel) for the types it reads.
CODES = {QT.F32: 0, QT.F16: 0, QT.BF16: 0, QT.Q8_0: 1, QT.Q4_0: 2, QT.Q4_1: 3, QT.Q5_0: 4, QT.Q5_1: 5,
          QT.Q4_K: 6, QT.Q5_K: 7, QT.Q6_K: 8}
KERNEL_TYPES: frozenset[QT] = frozenset(CODES)
_FLOATS = {QT.F32, QT.F16, QT.BF16}
FLOAT_DTYPES = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}


MODES = ("auto", "off", "triton", "layout")


def _setting() -> str:
    return switches.value("MM3_KERNELS")


_SETTING = [_setting()]
_AVAILABLE: dict[str, bool] = {}  # device type -> answer, for the current setting


def configure(setting: str | None = None) -> None:
    """Set the kernel mode (one of MODES; None: read MM3_KERNELS again). A layer keeps
    the product it chose (`mm3.backends.products`) until its weights or numerics are set again."""
    if setting is not None and setting not in MODES:
        raise ValueError(f"kernel mode {setting!r}: expected one of {', '.join(MODES)}")
    _SETTING[0] = _setting() if setting is None else setting
    _AVAILABLE.clear()


def mode() -> str:
    """The kernel mode in force (`configure`)."""
    return _SETTING[0]


def available(device: torch.device | str) -> bool:
    """Whether Triton kernels run on tensors of `device` in this process (in the mode in force)."""
    kind = device if isinstance(device, str) else device.type
    answer = _AVAILABLE.get(kind)
    if answer is None:
        answer = _AVAILABLE[kind] = _runs_on(kind, _SETTING[0], interpreted())
    return answer


def _runs_on(device_type: str, setting: str, interpreted: bool) -> bool:
    if setting == "off" or (device_type == "cpu" and not (setting in ("triton", "layout") and interpreted)):
        return False
    if device_type not in ("cpu", "cuda", "xpu"):  # MPS: Triton has no Metal back end
        return False
    try:
        import triton

        from . import triton_gguf  # noqa: F401  (the kernels must build)
    except ImportError:  # torch wheels without Triton (macOS, some CPU builds)
        return False
    if interpreted:
        return True
    try:
        return triton.runtime.driver.active.get_current_target().backend in ("cuda", "hip", "xpu")
    except Exception:  # no driver or no compiler: torch's products serve
        return False


def supports(qtype: QT, in_features: int) -> bool:
    """Whether the kernel reads this weight type with rows of `in_features` values."""
    return qtype in KERNEL_TYPES and in_features % GGML_QUANT_SIZES[qtype][0] == 0


_WORKS: dict[tuple, bool] = {}  # (qtype, input dtype, device) -> the kernel compiled and computed right


def works(qtype: QT, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel for this weight type and input dtype compiles on `device` and agrees with
    the torch dequantization on a small product, checked once per process; otherwise the layers use
    torch's products (with a warning), so a GPU or compiler the kernel fails on still runs."""
    device = indexed_device(device)
    key = (qtype, dtype, device)
    answer = _WORKS.get(key)
    if answer is None:
        answer = _WORKS[key] = _check(qtype, dtype, device)
    return answer


def _check(qtype: QT, dtype: torch.dtype, device: torch.device) -> bool:
    from ...formats.gguf.quants import dequantize, random_blocks

    g = torch.Generator().manual_seed(0)
    n, k = 48, 512
    if qtype in _FLOATS:
        weight = torch.randn(n, k, generator=g).to(FLOAT_DTYPES[qtype])
        values = weight.float()
    else:
        weight = random_blocks(qtype, n, k, generator=g)
        values = dequantize(weight, qtype, (n, k))
    x = torch.randn(3, k, generator=g)
    want = x.to(dtype).double() @ values.to(dtype).double().T
    try:
        got = fused_linear(x.to(device, dtype), weight.to(device), qtype).double().cpu()
        error = float((got - want).norm() / want.norm())
    except Exception as e:  # a compiler or driver that cannot build it
        warnings.warn(f"the fused {qtype.name} kernel cannot run on {device} ({type(e).__name__}: {e}); "
                      "using torch's products", stacklevel=3)
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    if not error < tolerance:
        warnings.warn(f"the fused {qtype.name} kernel computes wrongly on {device} for {dtype} inputs "
                      f"(relative error {error:.1e}); using torch's products", stacklevel=3)
        return False
    return True


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). Decode-shaped inputs (up to 32 rows) take the smallest row tile
    (`tl.dot` needs 16) and narrow column tiles, so many programs share the weight read; wider
    inputs take square tiles. K tiles need not align with the type's blocks (every value's block
    is found from its column) and the last one is masked."""
    if m <= 32:
        return (16 if m <= 16 else 32), 16, 128
    return 64, 64, 64


def fused_linear(x: torch.Tensor, weight: torch.Tensor, qtype: QT, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype, W given as stored: uint8 block rows
    [N, row_bytes] for a quantized type, a float tensor [N, K] otherwise (all on x's device)."""
    import triton

    from .triton_gguf import fused_linear_kernel

    k = x.shape[-1]
    if qtype in _FLOATS:
        n, w_stride = weight.shape[0], weight.stride(0)
        if weight.stride(-1) != 1 or weight.shape[1] != k:
            raise ValueError(f"float weight {list(weight.shape)} does not match inputs of {k} values")
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        n, w_stride = weight.shape[0], weight.stride(0)
        if weight.dtype != torch.uint8 or weight.stride(-1) != 1 or weight.shape[1] * block != k * size:
            raise ValueError(f"{qtype.name} rows of {weight.shape[1]} bytes do not hold {k} values")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        bm, bn, bk = _tiles(m)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        fused_linear_kernel[grid](x2, weight, bias if bias is not None else y, y, m, n, k, x2.stride(0),
                                   y.stride(0), w_stride, QTYPE=CODES[qtype], HAS_BIAS=bias is not None,
                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.view(*x.shape[:-1], n)


def report_specs(decode: list, prefill: list) -> list:
    """The fused block kernels as `mm3.backends.gpu.kernel_report` compiles them: per weight type a decode
    kernel (the CFG pair's two rows) and a prefill one, with bfloat16 inputs (the CUDA compute
    dtype; BF16 weights, which bfloat16 compute multiplies with torch, with float32 inputs), for
    the products `decode` and `prefill` (`kernel_report.Launch`)."""
    import triton

    from .kernel_report import KernelSpec
    from .triton_gguf import fused_linear_kernel

    specs = []
    for qtype, code in CODES.items():
        if qtype == QT.F32:
            continue
        x_type = "fp32" if qtype == QT.BF16 else "bf16"
        w_type = {QT.BF16: "*bf16", QT.F16: "*fp16"}.get(qtype, "*u8")
        block, size = GGML_QUANT_SIZES[qtype]
        for shape, launches in (("decode", decode), ("prefill", prefill)):
            rows = launches[0].rows
            bm, bn, bk = _tiles(rows)
            k = launches[0].k
            w_stride = k if qtype in _FLOATS else k // block * size
            signature = {"x_ptr": "*" + x_type, "w_ptr": w_type, "b_ptr": "*" + x_type, "y_ptr": "*" + x_type,
                         "M": "i32", "N": "i32", "K": "i32", "x_stride": "i32", "y_stride": "i32", "w_stride": "i32",
                         **dict.fromkeys(("QTYPE", "HAS_BIAS", "BLOCK_M", "BLOCK_N", "BLOCK_K"), "constexpr")}
            aligned = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K", "x_stride", "y_stride") + \
                (("w_stride",) if w_stride % 16 == 0 else ())

            def programs(launch, sms, bm=bm, bn=bn):
                return triton.cdiv(launch.rows, bm) * triton.cdiv(launch.n, bn)

            specs.append(KernelSpec(
                name=f"triton/{qtype.name}/{shape}", family="triton", weight_type=qtype.name, shape=shape,
                fn=fused_linear_kernel, signature=signature, aligned=aligned, weight_args=("w_ptr",),
                constexprs={"QTYPE": code, "HAS_BIAS": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                programs=programs, launches=list(launches)))
    return specs
