"""`python -m mm3 quantize IN.gguf OUT.gguf --type Q4_K_M`: the published quant mixes of a native component file.

Mixes (as the published files): every tensor with two or more dimensions whose rows fill whole blocks
takes the base type; everything else (norms, biases, the DiT's 1x1 convs and time projection)
is written F32. `_M` mixes of the LM raise `embed_tokens` and every `v_proj` / `down_proj` to
Q6_K. The condition encoder and the vocoder are never quantized. Metadata is copied unchanged,
plus `general.quantization_version` (u32 2) and `general.file_type` as a string.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..components import ARCHITECTURES, DESCRIPTIONS
from ..gguf.errors import ComponentError
from ..gguf.ops import FLOAT_TYPES
from ..gguf.reader import GGUFFile
from ..gguf.writer import Writer, copy_metadata, write_streaming

Q = GGMLQuantizationType

# name -> (base type, LM tensors raised to Q6_K or None)
MIXES = {
    "Q8_0": (Q.Q8_0, None),
    "Q6_K": (Q.Q6_K, None),
    "Q5_K_M": (Q.Q5_K, Q.Q6_K),
    "Q4_K_M": (Q.Q4_K, Q.Q6_K),
    "Q5_0": (Q.Q5_0, None),
    "Q4_0": (Q.Q4_0, None),
}
QUANTIZABLE = {"lm", "depth", "dit"}
_RAISED_LM = re.compile(r"(^model\.embed_tokens\.weight$|\.v_proj\.weight$|\.down_proj\.weight$)")
QUANTIZATION_VERSION = 2  # ggml's current block layout version


def choose_type(kind: str, name: str, shape: tuple[int, ...], mix: str) -> GGMLQuantizationType:
    """The type a tensor gets in `mix`."""
    base, raised = MIXES[mix]
    if len(shape) < 2:
        return Q.F32
    target = raised if (raised is not None and kind == "lm" and _RAISED_LM.search(name)) else base
    block = GGML_QUANT_SIZES[target][0]
    return target if shape[-1] % block == 0 else Q.F32


def _encode(values: torch.Tensor, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == Q.F32:
        return values.float().numpy()
    from ..gguf.encode import quantize

    return quantize(values.float().numpy(), qtype)


def quantize_file(src_path, dst_path, mix: str, *, progress=None, overwrite: bool = False) -> Path:
    """Write `dst_path`, the `mix` quantization of the native component file `src_path`."""
    if mix not in MIXES:
        raise ValueError(f"unknown quant type {mix!r} (expected one of {', '.join(MIXES)})")
    dst = Path(dst_path)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists (remove it or pass --overwrite)")
    src = GGUFFile(src_path)
    try:
        kind = ARCHITECTURES.get(src.architecture)
        if kind is None:
            raise ComponentError(f"{src_path}: unknown architecture {src.architecture!r}")
        if kind not in QUANTIZABLE:
            raise ComponentError(
                f"{src_path}: the {DESCRIPTIONS[kind]} ({src.architecture}) is never quantized; "
                "use the native F32 file")
        already = sorted({t.qtype.name for t in src.tensors.values() if t.qtype not in FLOAT_TYPES})
        if already:
            raise ComponentError(
                f"{src_path} is already quantized ({', '.join(already)}); quantize from the native file")
        from ..gguf.encode import WRITABLE_TYPES

        plan = {n: choose_type(kind, n, t.shape, mix) for n, t in src.tensors.items()}
        for n, qt in plan.items():
            if qt != Q.F32 and qt not in WRITABLE_TYPES:
                raise ComponentError(f"writing {qt.name} is not supported (tensor {n}); "
                                     f"writable: {', '.join(sorted(t.name for t in WRITABLE_TYPES))}")
        tmp = dst.with_name(dst.name + ".part")
        writer = Writer(str(tmp), src.architecture)
        copy_metadata(writer, src, skip=("general.file_type", "general.quantization_version"))
        writer.add_uint32("general.quantization_version", QUANTIZATION_VERSION)
        writer.add_key_value("general.file_type", mix, GGUFValueType.STRING)
        for name, t in src.tensors.items():
            qt = plan[name]
            block, block_bytes = GGML_QUANT_SIZES[qt]
            nbytes = t.numel // block * block_bytes
            if qt == Q.F32:
                writer.add_tensor_info(name, t.shape, np.dtype(np.float32), nbytes)
            else:
                row_bytes = t.shape[-1] // block * block_bytes
                writer.add_tensor_info(name, (*t.shape[:-1], row_bytes), np.dtype(np.uint8), nbytes, raw_dtype=qt)
        total = len(src.tensors)

        def tensor_data():
            for i, (name, t) in enumerate(src.tensors.items()):
                yield _encode(t.dequantize(torch.float32), plan[name])
                if progress:
                    progress(name, i + 1, total)

        write_streaming(writer, tmp, dst, tensor_data())
        return dst
    finally:
        src.close()


def run(args) -> int:
    start = time.perf_counter()

    def show(name, done, total):
        print(f"\r[{done}/{total}] {name[:60]:60s}", end="", file=sys.stderr, flush=True)

    out = quantize_file(args.input, args.output, args.type, progress=show, overwrite=args.overwrite)
    print(file=sys.stderr)
    size_in, size_out = os.path.getsize(args.input), os.path.getsize(out)
    print(f"wrote {out}: {size_out / 2**20:.1f} MiB from {size_in / 2**20:.1f} MiB "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


def add_cli(sub):
    p = sub.add_parser("quantize", help="quantize a native component file (LM, depth decoder, DiT)")
    p.add_argument("input", metavar="IN")
    p.add_argument("output", metavar="OUT")
    p.add_argument("--type", required=True, choices=list(MIXES), help="quant mix")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.set_defaults(func=run)
