"""The layout kernels (`mm3.backends.gpu.layout_kernels`) as `mm3.backends.gpu.kernel_report` compiles
them without a GPU: per weight type the decode and prefill kernels, and the decode kernel's fused
forms, with the arguments their launchers pass at the released products (`python -m mm3 kernels
--report --family layout|fused`)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QT

from . import device_layout as dl
from .kernels import CODES, FLOAT_DTYPES as FLOATS
from .layout_kernels import PREFILL, PREFILL_F32, REFERENCE_SMS, chunks_of, decode_config, decode_grid, planes


_PLANE_TYPES = {qtype: ("*i32",) * 4 for qtype in dl.LAYOUT_TYPES}  # (q, qh, s, s2) pointer types
_PLANE_TYPES.update({QT.F16: ("*fp16",) * 4, QT.BF16: ("*bf16",) * 4})


def report_specs(decode: list, prefill: list) -> list:
    """The layout kernels as `mm3.backends.gpu.kernel_report` compiles them, with bfloat16 inputs (the CUDA
    compute dtype; BF16 weights, which bfloat16 compute multiplies with torch, with float32): per
    weight type the decode kernel for two input rows (the CFG pair) and the prefill kernel, with the
    arguments the launcher passes at the first product of `decode` / `prefill` (specialised as
    Triton's JIT does: pointers 16-byte aligned, integers that are multiples of 16)."""
    from .kernel_report import KernelSpec
    from .layout_triton import gemm_kernel, gemv_kernel

    specs = []
    for qtype, plane_types in _PLANE_TYPES.items():
        x_type = "fp32" if qtype == QT.BF16 else "bf16"
        for shape, launches in (("decode", decode), ("prefill", prefill)):
            first = launches[0]
            k, n, rows = first.k, first.n, first.rows
            q, qh, s, s2 = planes(_empty_weight(qtype, n, k), qtype, k)
            ints = {"M": rows, "N": n, "K": k, "x_stride": k, "y_stride": n, "q_stride": q.stride(0),
                    "qh_stride": qh.stride(0), "s_stride": s.stride(0), "s2_stride": s2.stride(0),
                    "chunks": chunks_of(k)}
            pointers = {"x_ptr": "*" + x_type, "q_ptr": plane_types[0], "qh_ptr": plane_types[1],
                        "s_ptr": plane_types[2], "s2_ptr": plane_types[3], "b_ptr": "*" + x_type,
                        "y_ptr": "*" + x_type, "nw_ptr": "*" + x_type, "res_ptr": "*" + x_type,
                        "add_ptr": "*" + x_type}
            ints.update(res_stride=n, add_rows=1, add_stride=n)
            if shape == "decode":
                pointers.update(part_ptr="*fp32", count_ptr="*i32")
                block_m, block_c, _, _, splits = decode_grid(rows, n, k, REFERENCE_SMS)
                ints["split_chunks"] = -(-chunks_of(k) // (splits * block_c)) * block_c
                fn, config = gemv_kernel, decode_config()
                constexprs = {"QTYPE": CODES[qtype], "HAS_BIAS": False, "PARTIAL": False, "BLOCK_M": block_m,
                              "BLOCK_N": config.block_n, "BLOCK_C": block_c, "SWIGLU": False, "PRECISE": True,
                              "NORM": False, "RESIDUAL": False, "ADD": False, "INT8": config.int8_inputs}
                mix = {"loop_weights": config.block_n * block_c * dl.CHUNK // (32 * config.num_warps),
                       "inner_trips": dl.SLICES}

                def programs(launch, sms):
                    _, _, groups, tiles, splits = decode_grid(launch.rows, launch.n, launch.k, sms)
                    return groups * tiles * splits
            else:
                fn, config = gemm_kernel, PREFILL_F32 if x_type == "fp32" else PREFILL
                mix = {}
                constexprs = {"QTYPE": CODES[qtype], "HAS_BIAS": False, "BLOCK_M": config.block_m,
                              "BLOCK_N": config.block_n, "BLOCK_C": config.block_c}

                def programs(launch, sms, config=config):
                    return -(-launch.rows // config.block_m) * -(-launch.n // config.block_n)
            signature = {**pointers, **{a: "i32" for a in ints}, "eps": "fp32",
                         **dict.fromkeys(constexprs, "constexpr")}
            signature = {a: signature[a] for a in fn.arg_names}
            aligned = tuple(a for a in pointers if a in signature) + \
                tuple(a for a, v in ints.items() if v % 16 == 0 and a in signature)
            specs.append(KernelSpec(
                name=f"layout/{qtype.name}/{shape}", family="layout", weight_type=qtype.name, shape=shape, fn=fn,
                signature=signature, constexprs=constexprs, aligned=aligned,
                weight_args=("q_ptr", "qh_ptr", "s_ptr", "s2_ptr"), programs=programs, num_warps=config.num_warps,
                num_stages=config.num_stages, launches=list(launches), **mix))
    return specs


def _empty_weight(qtype: QT, n: int, k: int) -> torch.Tensor:
    """A weight's stored form without its data (meta tensors): what `planes` reads the strides from."""
    if qtype in FLOATS:
        return torch.empty(n, k, dtype=FLOATS[qtype], device="meta")
    return torch.empty(n, dl.layout_of(qtype, k).row_bytes, dtype=torch.uint8, device="meta")


def fused_report_specs(decode: list) -> list:
    """The decode kernels' fused forms (family "fused"), bfloat16 inputs, two rows: per common type
    the SwiGLU epilogue (at the gate/up products) without and with the RMSNorm of its inputs inside
    (the frame's form), and the K split with its in-kernel sum and the residual add (at the products
    whose grid splits), and the two-type kernel of the Q4_K_M and Q5_K_M q/k/v groups (v in Q6_K)
    without and with the norm; the residual's and the norm's with rows added to the stream ("+add":
    the depth decoder's first block, its position embeddings; q/k/v of one type, its form there)."""
    from .kernel_report import KernelSpec
    from .layout_triton import gemv_kernel, gemv_segments_kernel

    def spec(name, fn, qtypes, launches, extra, halve=False):
        first = launches[0]
        k, n, rows = first.k, first.n, first.rows
        block_m, block_c, _, _, splits = decode_grid(rows, n, k, REFERENCE_SMS)
        config = decode_config()
        pointers = {"x_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
                    "nw_ptr": "*bf16", "res_ptr": "*bf16", "add_ptr": "*bf16"}
        ints = {"M": rows, "N": n // 2 if halve else n, "K": k, "x_stride": k, "y_stride": n, "chunks": chunks_of(k),
                "split_chunks": -(-chunks_of(k) // (splits * block_c)) * block_c, "res_stride": n,
                "add_rows": 2 if extra.get("ADD") else 1, "add_stride": n if extra.get("RESIDUAL") else k}
        weight_args = []
        for names, qtype in zip((("q", "qh", "s", "s2"), ("q2", "qh2", "s3", "s4")), qtypes):
            arrays = planes(_empty_weight(qtype, n, k), qtype, k)
            for plane, array, kind in zip(names, arrays, _PLANE_TYPES[qtype]):
                pointers[plane + "_ptr"], ints[plane + "_stride"] = kind, array.stride(0)
                weight_args.append(plane + "_ptr")
        if len(qtypes) == 2:
            ints["N1"] = n - n // 3  # q and k of a group with as many v rows as k rows
        constexprs = {"QTYPE": CODES[qtypes[0]], "HAS_BIAS": False, "PARTIAL": False, "BLOCK_M": block_m,
                      "BLOCK_N": config.block_n, "BLOCK_C": block_c, "NORM": False, "RESIDUAL": False,
                      "ADD": False, "PRECISE": True, "INT8": config.int8_inputs, **extra}
        signature = {**pointers, **{a: "i32" for a in ints}, "eps": "fp32", **dict.fromkeys(constexprs, "constexpr")}
        signature = {a: signature[a] for a in fn.arg_names}
        aligned = tuple(pointers) + tuple(a for a, v in ints.items() if v % 16 == 0)

        def programs(launch, sms):
            _, _, groups, tiles, splits = decode_grid(launch.rows, launch.n, launch.k, sms)
            return groups * tiles * splits
        return KernelSpec(
            name=name, family="fused", weight_type="+".join(q.name for q in qtypes), shape="decode", fn=fn,
            signature=signature, constexprs=constexprs, aligned=aligned, weight_args=tuple(weight_args),
            programs=programs, num_warps=config.num_warps, num_stages=config.num_stages, launches=list(launches),
            loop_weights=config.block_n * block_c * dl.CHUNK // (32 * config.num_warps), inner_trips=dl.SLICES)

    gate_up = [launch for launch in decode if launch.layer.endswith("gate_up")]
    split = [launch for launch in decode if decode_grid(launch.rows, launch.n, launch.k, REFERENCE_SMS)[-1] > 1]
    qkv = [launch for launch in decode if launch.layer.endswith("qkv")]
    specs = []
    for qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0):
        for norm in (False, True):
            specs.append(spec(f"fused/{qtype.name}/swiglu" + "+norm" * norm, gemv_kernel, (qtype,), gate_up,
                              {"SWIGLU": True, "NORM": norm}, halve=True))
        specs.append(spec(f"fused/{qtype.name}/qkv+norm+add", gemv_kernel, (qtype,), qkv,
                          {"SWIGLU": False, "NORM": True, "ADD": True}))
        for add in (False, True) if split else ():
            specs.append(spec(f"fused/{qtype.name}/split+residual" + "+add" * add, gemv_kernel, (qtype,), split,
                              {"PARTIAL": True, "SWIGLU": False, "RESIDUAL": True, "ADD": add}))
    for qtype in (QT.Q4_K, QT.Q5_K):
        for norm, add in ((False, False), (True, False), (True, True)):
            specs.append(spec(f"fused/{qtype.name}+Q6_K/qkv" + "+norm" * norm + "+add" * add, gemv_segments_kernel,
                              (qtype, QT.Q6_K), qkv, {"QTYPE2": CODES[QT.Q6_K], "NORM": norm, "ADD": add}))
    return specs
