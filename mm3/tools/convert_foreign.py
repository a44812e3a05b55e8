"""Our five component files from another tool's files (`python -m mm3 convert --from comfy|hotstep`).

Each component is read through its dialect (`mm3.dialects`) and written in the minimaxmusic.cpp
contract: the engine's tensor names, sorted, in the source's own types (BF16 stays BF16, a
quantized tensor keeps its blocks), the condition encoder and the vocoder in F32, the sizes in our
metadata keys, the LM's config JSON and tokenizer arrays. A pruned LM (ComfyUI's
`embed_tokens_prefill` / `lm_head_pruned`) is written with the whole vocabulary's rows, the rows it
lacks zero (never read by the engine), since the contract has no pruned form.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..components import ARCH_OF, COMPONENTS, DESCRIPTIONS, KINDS
from ..dialects import describe
from ..formats.diffusers import U32_KEYS
from ..formats.gguf.errors import ComponentError
from ..formats.gguf.reader import CompressedTensor
from ..formats.gguf.writer import Writer, write_streaming
from ..files.opener import open_component
from ..files.registry import MODEL_SUFFIXES

logger = logging.getLogger(__name__)

DIALECT_NAMES = {"comfy": "ComfyUI", "hotstep": "HOT-Step"}
F32_KINDS = ("cond", "vae")  # the contract keeps these in F32
_LM_EXTRAS = ("embed_rows", "head_start", "head_rows")  # our dialect-only LM config keys


def find_files(src: Path, dialect: str) -> dict[str, Path]:
    """{kind: file} of the dialect's files in `src` (a file or a folder searched recursively)."""
    paths = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in MODEL_SUFFIXES)
    found: dict[str, Path] = {}
    for p in paths:
        d = describe(p)
        if d is None or not d[0].startswith(DIALECT_NAMES[dialect]):
            continue
        for kind in d[1]:
            if kind in found:
                raise ComponentError(f"{src}: both {found[kind].name} and {p.name} hold the {DESCRIPTIONS[kind]}; "
                                     "pass the one to convert")
            found[kind] = p
    return found


def _padded_rows(t: CompressedTensor, start: int, total: int) -> CompressedTensor:
    """`t`'s rows placed at rows [start, start + rows) of a [total, width] tensor of zeros."""
    block, size = GGML_QUANT_SIZES[t.qtype]
    row = t.shape[1] // block * size
    out = torch.zeros(total * row, dtype=torch.uint8)
    out[start * row:start * row + t.raw.numel()] = t.raw
    return CompressedTensor(t.name, t.qtype, (total, t.shape[1]), out)


def _tensors(comp) -> dict[str, CompressedTensor]:
    tensors = dict(comp.tensors)
    if comp.kind == "lm":
        cfg = comp.hparams
        vocab = cfg["vocab_size"]
        emb = tensors["model.embed_tokens.weight"]
        if emb.shape[0] != vocab:
            tensors[emb.name] = _padded_rows(emb, 0, vocab)
        head = tensors.get("lm_head.weight")
        if head is not None and head.shape[0] != vocab:
            tensors[head.name] = _padded_rows(head, int(cfg.get("head_start", 0)), vocab)
    if comp.kind in F32_KINDS:
        for name, t in tensors.items():
            if t.qtype != GGMLQuantizationType.F32:  # floats or quantized blocks: the contract is F32
                value = t.dequantize(torch.float32).contiguous()
                tensors[name] = CompressedTensor(name, GGMLQuantizationType.F32, t.shape, value.view(-1).view(torch.uint8))
    return dict(sorted(tensors.items()))


def _metadata(comp) -> list[tuple]:
    spec = COMPONENTS[comp.kind]
    S, U32, I32, ARR = (gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
                        gguf.GGUFValueType.ARRAY)
    kv = [("general.name", spec.general_name, S, None)]
    if comp.kind == "lm":
        cfg = {k: v for k, v in comp.hparams.items() if k not in _LM_EXTRAS}
        f = comp.file
        kv += [("mm3.config_json", json.dumps(cfg, separators=(",", ":")), S, None),
               ("tokenizer.ggml.model", "gpt2", S, None),
               ("tokenizer.ggml.tokens", f.strings("tokenizer.ggml.tokens"), ARR, S)]
        if "tokenizer.ggml.merges" in f.metadata:
            kv.append(("tokenizer.ggml.merges", f.strings("tokenizer.ggml.merges"), ARR, S))
        return kv
    keys = U32_KEYS[spec.folder]
    kv += [(f"{spec.arch}.{k}", int(comp.hparams[k]), U32, None) for k in keys]
    if comp.kind == "vae":
        kv.append((f"{spec.arch}.upsampling_ratios", [int(r) for r in comp.hparams["upsampling_ratios"]], ARR, I32))
    return kv


def _type_tag(tensors: dict[str, CompressedTensor]) -> str:
    by: Counter = Counter()
    for t in tensors.values():
        by[t.qtype.name] += t.nbytes
    return by.most_common(1)[0][0] if by else "F32"


def write_component(comp, out_dir: Path, progress=None) -> Path:
    """Write one opened component (any dialect) as our GGUF in `out_dir`; an existing file is kept."""
    tensors = _tensors(comp)
    spec = COMPONENTS[comp.kind]
    path = Path(out_dir) / f"MiniMax-Music3-{spec.folder}-{_type_tag(tensors)}.gguf"
    if path.exists():
        logger.info("skip %s: %s exists", comp.kind, path)
        return path
    tmp = path.with_name(path.name + ".part")
    w = Writer(tmp, arch=ARCH_OF[comp.kind])
    for key, value, vtype, sub in _metadata(comp):
        w.add_key_value(key, value, vtype, sub)
    for name, t in tensors.items():
        block, size = GGML_QUANT_SIZES[t.qtype]
        w.add_tensor_info(name, (*t.shape[:-1], t.shape[-1] // block * size), np.dtype(np.uint8), t.nbytes,
                          raw_dtype=t.qtype)
    total, done = sum(t.nbytes for t in tensors.values()), 0

    def data():
        nonlocal done
        for t in tensors.values():
            yield t.raw.numpy()
            done += t.nbytes
            if progress is not None:
                progress(spec.folder, done, total)

    write_streaming(w, tmp, path, data())
    return path


def convert_foreign(src, out_dir, dialect: str, *, components=None, progress=None) -> list[Path]:
    """Our GGUFs of the components found in `src` (a file or folder of `dialect` files)."""
    src, out = Path(src), Path(out_dir)
    if not src.exists():
        raise FileNotFoundError(f"{src} not found")
    files = find_files(src, dialect)
    want = list(components or KINDS)
    missing = [k for k in want if k not in files]
    if components and missing:
        raise ComponentError(f"{src}: no {DIALECT_NAMES[dialect]} file holds the {', '.join(DESCRIPTIONS[k] for k in missing)}")
    if not files:
        raise ComponentError(f"{src}: no {DIALECT_NAMES[dialect]} MiniMax Music 3 file found")
    for k in missing:
        logger.warning("%s: no %s file holds the %s; not written", src, DIALECT_NAMES[dialect], DESCRIPTIONS[k])
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in want:
        if kind not in files:
            continue
        comp = open_component(files[kind], kind)
        try:
            written.append(write_component(comp, out, progress))
        finally:
            comp.close()
    return written
