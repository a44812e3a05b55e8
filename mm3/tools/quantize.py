"""`python -m mm3 quantize IN.gguf OUT.gguf --type Q4_K_M`: the published quant mixes of a native component file.

The rules, bytes and layout of minimaxmusic.cpp's `quantize` tool (ggml's reference quantizers, no
importance matrix), so the same input gives the same file. `choose_type` gives each tensor's type;
the condition encoder and vocoder are never quantized. Metadata is copied, plus
`general.quantization_version` and `general.file_type`; the last tensor's data is not padded
(`_PortWriter`). Q4_0 and Q5_0 are ours (the port has no such mix): base type only, nothing raised.
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
from ..formats.gguf.errors import ComponentError
from ..weights.layers import FLOAT_TYPES
from ..formats.gguf.reader import GGUFFile
from ..formats.gguf.writer import Writer, copy_metadata, write_streaming

Q = GGMLQuantizationType

# name -> (base type, raised type or None): the raised type is the one of `embed_tokens` (and, in
# `_M` mixes, of v_proj / down_proj); without one, embed_tokens takes the base type.
MIXES = {
    "Q8_0": (Q.Q8_0, None),
    "Q6_K": (Q.Q6_K, Q.Q6_K),
    "Q5_K_M": (Q.Q5_K, Q.Q6_K),
    "Q4_K_M": (Q.Q4_K, Q.Q6_K),
    "Q5_0": (Q.Q5_0, None),
    "Q4_0": (Q.Q4_0, None),
}
_LAYER_RAISE = frozenset({"Q5_K_M", "Q4_K_M"})  # the port's bump mode 2 ("M" variants)
_NEVER = ("silence_latent", "scale_shift_table", "null_condition_emb")
_SOURCE_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})  # what the port converts (anything else is copied)
QUANTIZABLE = {"lm", "depth", "dit"}
QUANTIZATION_VERSION = 2  # ggml's current block layout version


def ggml_n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims of a tensor of torch-order `shape`: its dimensions without the leading size-1
    ones (ggml's trailing ne of 1), at least 1. The port decides and writes shapes with it."""
    n = len(shape)
    while n > 1 and shape[len(shape) - n] == 1:
        n -= 1
    return max(n, 1)


def _layer(name: str) -> int:
    """extract_layer: atoi of what follows the first `layers.`, -1 without one."""
    at = name.find("layers.")
    if at < 0:
        return -1
    m = re.match(r"[ \t\n\v\f\r]*([+-]?\d+)", name[at + 7:])
    return int(m[1]) if m else 0


def _raised_in_layer(name: str, block_count: int) -> bool:
    """The port's "first n/9, last n/7 and every third layer" rule; with no `<arch>.block_count`
    (n = 0, as in every MM3 file) it raises every layer."""
    layer, n = _layer(name), block_count
    return layer >= 0 and (layer < n // 9 or layer >= n - n // 7 or layer % 3 == 0)


def choose_type(kind: str, name: str, shape: tuple[int, ...], mix: str, src_type: GGMLQuantizationType = Q.F32,
                block_count: int = 0) -> GGMLQuantizationType:
    """The type tensor `name` ([torch-order] `shape`, stored as `src_type`) gets in `mix`. Vectors (as
    ggml counts dimensions) are F32 or copied; else Q6_K for `embed_tokens` in the K mixes and, in `_M`
    mixes, for each layer's `v_proj` / `down_proj`, the base type for the rest; `src_type` unchanged
    where the rows are not whole blocks. `block_count`: the file's `<arch>.block_count` (0 if absent)."""
    base, raised = MIXES[mix]
    n_dims = ggml_n_dims(shape)
    if kind == "vae" or n_dims < 2 or any(s in name for s in _NEVER):
        return Q.F32 if n_dims < 2 and src_type in (Q.BF16, Q.F16) else src_type
    if "embed_tokens.weight" in name:
        target = raised or base
    elif (mix in _LAYER_RAISE and ("v_proj.weight" in name or "down_proj.weight" in name)
          and _raised_in_layer(name, block_count)):
        target = raised
    else:
        target = base
    if src_type in _SOURCE_TYPES and shape[-1] % GGML_QUANT_SIZES[target][0] == 0:
        return target
    return src_type


class _PortWriter(Writer):
    """Writer whose last tensor's data is not followed by alignment padding (the port's quantize
    tool pads before each tensor only; gguf-py also pads after the last)."""

    def write_tensor_data(self, tensor, tensor_endianess=None) -> None:
        super().write_tensor_data(tensor, tensor_endianess)
        if not any(self.tensors):  # that was the last one: take back its trailing padding
            pad = self.ggml_pad(tensor.nbytes, self.data_alignment) - tensor.nbytes
            if pad:
                fout = self.fout[0]
                fout.flush()
                end = fout.tell() - pad
                fout.truncate(end)
                fout.seek(end)


def _encode(t, qtype: GGMLQuantizationType) -> np.ndarray:
    """The bytes of tensor `t` in `qtype`: its own bytes when the type is kept, else F32 values or
    the blocks of the F32 values."""
    if qtype == t.qtype:
        return t.raw.numpy()
    values = t.dequantize(torch.float32).numpy()
    if qtype == Q.F32:
        return values.reshape(-1).view(np.uint8)
    from ..formats.gguf.encode import quantize

    return quantize(values, qtype).reshape(-1)


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
        from ..formats.gguf.encode import WRITABLE_TYPES

        block_count = src.metadata.get(f"{src.architecture}.block_count", 0)
        block_count = block_count if isinstance(block_count, int) else 0
        plan = {n: choose_type(kind, n, t.shape, mix, t.qtype, block_count) for n, t in src.tensors.items()}
        for n, qt in plan.items():
            if qt not in (Q.F32, src.tensors[n].qtype) and qt not in WRITABLE_TYPES:
                raise ComponentError(f"writing {qt.name} is not supported (tensor {n}); "
                                     f"writable: {', '.join(sorted(t.name for t in WRITABLE_TYPES))}")
        tmp = dst.with_name(dst.name + ".part")
        writer = _PortWriter(str(tmp), src.architecture)
        copy_metadata(writer, src, skip=("general.file_type", "general.quantization_version"))
        writer.add_uint32("general.quantization_version", QUANTIZATION_VERSION)
        writer.add_key_value("general.file_type", mix, GGUFValueType.STRING)
        for name, t in src.tensors.items():
            qt = plan[name]
            block, block_bytes = GGML_QUANT_SIZES[qt]
            nbytes = t.numel // block * block_bytes
            shape = t.shape[len(t.shape) - ggml_n_dims(t.shape):]  # as ggml writes it
            row_bytes = shape[-1] // block * block_bytes
            writer.add_tensor_info(name, (*shape[:-1], row_bytes), np.dtype(np.uint8), nbytes, raw_dtype=qt)
        total = len(src.tensors)

        def tensor_data():
            for i, (name, t) in enumerate(src.tensors.items()):
                yield _encode(t, plan[name])
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
