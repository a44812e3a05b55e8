"""The AR frame's draw, embedding and LM attention kernels (`draw_kernels`, `lookup_kernels`,
`attention_kernels`) as `mm3.backends.gpu.kernel_report` compiles them: with the arguments
`mm3.backends.gpu.steps` passes at the released sizes (bfloat16 logits and rows, the CFG pair of one
song, 32 query heads on 8 key heads of 128), specialised as Triton's JIT does (pointers 16-byte
aligned, integers that are multiples of 16), without fused multiply-adds where they are launched
so. An attention kernel's "weights" are the cache's keys: its SASS figure is a key's instructions
in each thread."""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from .kernels import CODES

LOOKUP_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.BF16)  # the published mixes' tables
FEEDBACK_TYPES = ((QT.Q6_K, QT.Q4_K), (QT.Q5_K, QT.Q5_K), (QT.Q8_0, QT.Q8_0), (QT.BF16, QT.BF16))  # (LM, audio)
BLOCK_K = 256  # `steps._block_k` at the released width
ROWS = 2  # the CFG pair


def _row_bytes(qtype: QT, k: int) -> int:
    if qtype == QT.BF16:
        return k
    block, size = GGML_QUANT_SIZES[qtype]
    return k // block * size


def _table_type(qtype: QT) -> str:
    return "*bf16" if qtype == QT.BF16 else "*u8"


def attention_specs(late: int = 9000) -> list:
    """The LM's decode attention, alone and as the whole step (`attention_decode_kernel`,
    `attention_step_kernel`), over a 16-bit cache ("BF16") and an 8-bit one ("I8"), at `late`
    filled positions (a program a split of keys, for each row and key head)."""
    from . import attention_kernels as ak
    from .kernel_report import KernelSpec, Launch

    heads, kv_heads, d = 32, 8, 128
    g = heads // kv_heads
    gp = max(ak.DOT_ROWS, g)
    common = {"pos_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "count_ptr": "*i32",
              "out_ptr": "*bf16"}
    kernels = {"decode": (ak.attention_decode_kernel, {"q_ptr": "*bf16"}, {"COMBINE": True}),
               "step": (ak.attention_step_kernel, {"qkv_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
                                                    "cos_ptr": "*bf16", "sin_ptr": "*bf16"},
                        {"HEADS": heads, "KV_HEADS": kv_heads})}
    specs = []
    for name, (fn, pointers, extra) in kernels.items():
        for cache, quant in (("BF16", False), ("I8", True)):
            block = ak.BLOCK_N_8BIT if quant else ak.BLOCK_N
            caches = {"k_ptr": "*i8" if quant else "*bf16", "v_ptr": "*i8" if quant else "*bf16",
                      "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
            constexprs = {"G": g, "GP": gp, "D": d, "SPLIT": ak.SPLIT, "BLOCK_N": block, "QUANT": quant, "GROUP": 32,
                          **extra}
            all_pointers = {**common, **pointers, **caches}
            ints = {"cap": 16384, "sq": (heads + 2 * kv_heads) * d, "n_splits": 36}
            signature = {a: all_pointers.get(a) or ("constexpr" if a in constexprs else "i32" if a in ints else "fp32")
                         for a in fn.arg_names}
            aligned = tuple(all_pointers) + tuple(a for a, v in ints.items() if v % 16 == 0 and a in fn.arg_names)
            specs.append(KernelSpec(
                name=f"attention/{name}/{cache}", family="steps", weight_type=cache, shape="decode", fn=fn,
                signature=signature, constexprs=constexprs, aligned=aligned, weight_args=("k_ptr", "v_ptr"),
                programs=lambda launch, sms: ROWS * kv_heads * -(-launch.k // ak.SPLIT), num_warps=4,
                launches=[Launch(f"LM attention after {late} keys", d, late, ROWS)], loop_weights=block))
    return specs


def report_specs(decode: list) -> list:
    """One spec per kernel: the LM's gated draw over its head rows and a depth head's draw (one
    program per song), a row lookup per table type and the frame's feedback per published pair
    of table types (16 programs a row), and the LM's decode attention (`attention_specs`)."""
    from . import draw_kernels as dk
    from . import lookup_kernels as lk
    from .kernel_report import KernelSpec, Launch

    by_layer = {launch.layer: launch for launch in decode}
    head, audio_head = by_layer["lm.head"], by_layer["depth.audio_head"]
    hidden = head.k
    specs = []

    def spec(name, weight_type, fn, pointers, ints, constexprs, weight_args, launches, programs, num_warps):
        signature = {**pointers, **{a: "i32" for a in ints}, **dict.fromkeys(constexprs, "constexpr")}
        signature = {a: signature.get(a, "fp32") for a in fn.arg_names}  # the rest: float scalars
        aligned = tuple(pointers) + tuple(a for a, v in ints.items() if v % 16 == 0)
        specs.append(KernelSpec(name=name, family="steps", weight_type=weight_type, shape="decode", fn=fn,
                                signature=signature, constexprs=constexprs, aligned=aligned, weight_args=weight_args,
                                programs=programs, num_warps=num_warps, num_stages=1, launches=launches,
                                fp_fusion=False))

    draw_pointers = {"logits_ptr": "*bf16", "q_ptr": "*fp32", "excl_ptr": "*i1", "out_ptr": "*i64", "end_ptr": "*i1"}
    for name, launch, gate in (("draw/semantic", head, True), ("draw/acoustic", audio_head, False)):
        n = launch.n
        block = min(4096, 1 << (n - 1).bit_length())
        ints = {"N": n, "row_stride": n, "q_stride": n, "k": 50, "start_id": 0, "code_offset": 0, "end_id": 0}
        constexprs = {"R": ROWS, "HAS_EXCL": gate, "GATE": gate, "CODED": gate, "PRECISE_EXP": True,
                      "COND_LEVELS": 2, "BLOCK": block, "WHOLE": n <= block}
        spec(name, "BF16", dk.draw_top_k_kernel, draw_pointers, ints, constexprs, ("logits_ptr",), [launch],
             lambda launch, sms: launch.rows // ROWS, max(4, min(16, block // 256)))

    def lookup_programs(launch, sms):
        return launch.rows * -(-launch.k // BLOCK_K)

    for qtype in LOOKUP_TYPES:
        stride = _row_bytes(qtype, hidden)
        pointers = {"table_ptr": _table_type(qtype), "codes_ptr": "*i64", "out_ptr": "*bf16"}
        ints = {"K": hidden, "rows": 16384, "row_stride": stride, "code_stride": 1, "out_stride": hidden,
                "add": 3}
        constexprs = {"QTYPE": CODES[qtype], "REPEAT": ROWS, "BLOCK_K": BLOCK_K}
        spec(f"lookup/rows/{qtype.name}", qtype.name, lk.lookup_rows_kernel, pointers, ints, constexprs,
             ("table_ptr",), [Launch("embedding rows", 16384, hidden, ROWS)], lookup_programs, 4)
    for lm_type, audio_type in FEEDBACK_TYPES:
        pointers = {"lm_ptr": _table_type(lm_type), "audio_ptr": _table_type(audio_type), "frame_ptr": "*i64",
                    "out_ptr": "*bf16"}
        ints = {"K": hidden, "lm_rows": 200000, "audio_rows": 7 * audio_head.n,
                "lm_stride": _row_bytes(lm_type, hidden), "audio_stride": _row_bytes(audio_type, hidden), "frame_stride": 8, "out_stride": hidden,
                "code_offset": 3, "audio_vocab": audio_head.n}
        constexprs = {"LM_QTYPE": CODES[lm_type], "AUDIO_QTYPE": CODES[audio_type], "NCB": 8, "REPEAT": ROWS,
                      "BLOCK_K": BLOCK_K}
        spec(f"lookup/feedback/{lm_type.name}+{audio_type.name}", lm_type.name, lk.lookup_feedback_kernel, pointers,
             ints, constexprs, ("lm_ptr", "audio_ptr"), [Launch("frame feedback", 200000, hidden, ROWS)],
             lookup_programs, 4)
    return specs + attention_specs()
