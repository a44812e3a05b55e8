"""Random weights written straight into component GGUF files, in any quant mix, at any size.

For sizes that no float checkpoint can be built for on the machine at hand (the released LM is 8.6 B
parameters: 34 GB of float32 draws): quantized tensors are random block bytes whose scale fields are
set so the values have a standard deviation of about 1/sqrt(fan-in), as `mm3.tools.tiny`'s weights;
float tensors are drawn one at a time (norm scales 1, biases 0). Files are written one tensor at a
time, so memory holds one tensor at most. The names, shapes, metadata and quant mix are those of
the converter and the quantizer (`mm3.tools.convert`, `mm3.tools.quantize`), so the engine reads
these files exactly as the published ones. The LM head's END row is zero (songs rarely stop).
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..components import BY_FOLDER
from ..formats.gguf.quants import SCALE_OFFSETS, dequantize
from ..formats.gguf.writer import Writer, write_streaming
from ..formats.diffusers import tokenizer_arrays
from ..tools.convert import COMPONENTS, component_metadata, expected_tensors
from ..tools.quantize import MIXES, QUANTIZATION_VERSION, choose_type

Q = GGMLQuantizationType
FLOAT_DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
# Second scale field (a min or offset) as a multiple of the first, so a block's values centre on 0:
# w = q*d + m (Q4_1, Q5_1) or w = d*sc*q - dmin*mn (Q2_K, Q4_K, Q5_K), q uniform in [0, 2^bits).
_CENTRE = {Q.Q4_1: -7.5, Q.Q5_1: -15.5, Q.Q2_K: 1.5, Q.Q4_K: 7.5, Q.Q5_K: 15.5}
_ONES = ("norm.weight", "layernorm.weight", "norm1.weight", "norm2.weight", "layer_scale")
DIRECT_COMPONENTS = ("language_model", "rvq_depth_decoder", "condition_encoder", "transformer")


def _f16_pair(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float16).view(np.uint8)


@functools.lru_cache(maxsize=None)
def _unit_std(qtype: Q) -> float:
    """Standard deviation of random blocks of `qtype` whose first scale field is 1."""
    g = torch.Generator().manual_seed(0)
    raw = _random_blocks(qtype, 4096, 1.0, g)
    return float(dequantize(torch.from_numpy(raw).reshape(-1), qtype, (raw.shape[0], GGML_QUANT_SIZES[qtype][0])).std())


def _random_blocks(qtype: Q, n_blocks: int, scale: float, gen: torch.Generator) -> np.ndarray:
    size = GGML_QUANT_SIZES[qtype][1]
    raw = torch.randint(0, 256, (n_blocks, size), dtype=torch.uint8, generator=gen).numpy()
    offsets = SCALE_OFFSETS[qtype]
    raw[:, offsets[0]:offsets[0] + 2] = _f16_pair(scale)
    if len(offsets) > 1:
        raw[:, offsets[1]:offsets[1] + 2] = _f16_pair(_CENTRE[qtype] * scale)
    return raw


def _fan_in(shape: tuple[int, ...]) -> int:
    return max(1, math.prod(shape[1:])) if len(shape) > 1 else 1


def random_tensor(name: str, shape: tuple[int, ...], qtype: Q, gen: torch.Generator) -> np.ndarray:
    """The bytes (quantized) or values (float) of one random tensor, as the writer takes them."""
    std = 1.0 / math.sqrt(_fan_in(shape))
    if qtype in FLOAT_DTYPES:
        if name.endswith(_ONES):
            t = torch.ones(shape)
        elif name.endswith(".bias") or name == "layer_weight_logits":
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * std
        t = t.to(FLOAT_DTYPES[qtype])
        return t.view(torch.int16).numpy().view(np.uint16) if qtype == Q.BF16 else t.numpy()
    block = GGML_QUANT_SIZES[qtype][0]
    n_blocks = math.prod(shape) // block
    raw = _random_blocks(qtype, n_blocks, std / _unit_std(qtype), gen)
    return raw.reshape(*shape[:-1], -1)


def _zero_row(raw: np.ndarray, qtype: Q, row: int) -> None:
    """Set every scale field of one row's blocks to 0: the row dequantizes to zeros."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = raw[row].reshape(-1, size)
    for offset in SCALE_OFFSETS[qtype]:
        blocks[:, offset:offset + 2] = 0


def write_component(path: Path, component: str, cfg: dict, quant: str, gen: torch.Generator, *,
                    tokenizer_json: Path | None = None, zero_head_row: int | None = None) -> Path:
    """Write one component file of random weights in `quant` (a mix of mm3.tools.quantize, or F32 /
    BF16 for every weight matrix); condition encoder weights stay F32 as in the published files."""
    if component not in DIRECT_COMPONENTS:
        raise ValueError(f"random files are written for {', '.join(DIRECT_COMPONENTS)}, not {component}")
    kind = BY_FOLDER[component].kind
    arch = COMPONENTS[component][0]
    shapes = expected_tensors(component, cfg)
    plan = {}
    for name, shape in shapes.items():
        if quant in MIXES and kind in ("lm", "depth", "dit"):
            plan[name] = choose_type(kind, name, shape, quant)
        elif quant == "BF16" and len(shape) >= 2 and kind != "cond":
            plan[name] = Q.BF16
        else:
            plan[name] = Q.F32
    tmp = path.with_name(path.name + ".part")
    writer = Writer(str(tmp), arch)
    for key, value, vtype, sub in component_metadata(component, cfg, tokenizer_json):
        writer.add_key_value(key, value, vtype, sub)
    if quant in MIXES:
        writer.add_uint32("general.quantization_version", QUANTIZATION_VERSION)
    names = sorted(shapes)
    for name in names:
        shape, qtype = shapes[name], plan[name]
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(shape) // block * size
        if qtype in FLOAT_DTYPES:
            carrier = np.dtype(np.uint16) if qtype == Q.BF16 else np.dtype(np.float32)
            writer.add_tensor_info(name, shape, carrier, nbytes, raw_dtype=qtype if qtype == Q.BF16 else None)
        else:
            writer.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), nbytes,
                                   raw_dtype=qtype)

    def data():
        for name in names:
            values = random_tensor(name, shapes[name], plan[name], gen)
            if name == "lm_head.weight" and zero_head_row is not None:
                if plan[name] in FLOAT_DTYPES:
                    values[zero_head_row] = 0
                else:
                    _zero_row(values, plan[name], zero_head_row)
            yield values

    return write_streaming(writer, tmp, path, data())


def write_random_models(out: Path, lm_cfg: dict, cfgs: dict, quant: str, tokenizer: dict, end_id: int,
                        components=DIRECT_COMPONENTS, seed: int = 0) -> list[Path]:
    """The component files `components` of random weights in `out` (kept when already there)."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        tj = Path(tmp) / "tokenizer.json"
        tj.write_text(json.dumps(tokenizer))
        tokenizer_arrays(tj)  # fail early on a bad vocabulary
        for component in components:
            path = out / f"MiniMax-Music3-{component}-{quant}.gguf"
            if not path.exists():
                cfg = lm_cfg if component == "language_model" else cfgs[component]
                write_component(path, component, cfg, quant, gen,
                                tokenizer_json=tj if component == "language_model" else None,
                                zero_head_row=end_id if component == "language_model" else None)
            written.append(path)
    return written
