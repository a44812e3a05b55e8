"""The benchmark's checkpoints: random weights at a chosen size, in the diffusers layout (the
reference loads them) and as the five GGUF files (ours, converted and quantized from them)."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..formats.diffusers import DIFFUSERS_DEFAULTS
from ..tools.convert import convert, expected_tensors
from ..tools.tiny import RELEASED_LM_CONFIG, TINY, TINY_LM, build_tokenizer, build_weights

# Bench configs: LM (Qwen3 config keys), the four diffusers components, the vocabulary layout of
# mm3.tools.tiny ("small": 256 bytes + specials; "real": the released ids) and the semantic codebook size.
CONFIGS = {
    "tiny": dict(lm=TINY_LM, **TINY, vocab="small", codes=64, native="F32", frames=48, seconds=4.0),
    "medium": dict(
        lm=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=128),  # released GQA ratio 4:1 and head_dim 128
        rvq_depth_decoder=dict(hidden_size=1024, num_layers=4, num_attention_heads=4, intermediate_size=1536),
        condition_encoder=dict(condition_hidden_dim=1024, out_dim=512),
        transformer=dict(condition_dim=512, num_layers=4, num_attention_heads=8, ff_inner_dim=2048),
        vocoder=dict(decoder_input_dim=256, decoder_hidden_dim=384),
        vocab="real", codes=16384, native="F32", frames=48, seconds=8.0),
    "real": dict(lm={}, rvq_depth_decoder={}, condition_encoder={}, transformer={}, vocoder={}, vocab="real",
                 codes=16384, native="BF16", frames=100, seconds=30.0),
}
COMPONENTS = ("rvq_depth_decoder", "condition_encoder", "transformer", "vocoder")
QUANTIZED = {"lm": "language_model", "depth": "rvq_depth_decoder", "dit": "transformer"}  # what --quant changes
CAPTION = "a bright synth pop song with warm female vocals and a punchy drum groove"
LYRICS = "[verse]\nneon lights are calling\nwe are dancing through the night\n[chorus]\nsing it loud"


@dataclass
class Checkpoint:
    """A built bench checkpoint: the diffusers layout, the GGUF folder for one quant, and sizes."""

    name: str
    root: Path
    diffusers: Path | None  # None: random files written directly (build_direct), no reference side
    models: Path
    quant: str
    native: str  # the weight type the checkpoint was written in (F32, or BF16 for real)
    lm_cfg: dict
    cfgs: dict  # component -> full diffusers config
    special_ids: dict
    code_offset: int


def _save(folder: Path, cfg: dict, tensors: dict, filename: str, dtype: torch.dtype):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, folder / filename, metadata={"format": "pt"})


def build_checkpoint(name: str, root: Path, quant: str, seed: int = 0) -> Checkpoint:
    """Write (or reuse) the checkpoint of config `name` under `root`; returns where things are."""
    c = CONFIGS[name]
    tj, special_ids, code_offset = build_tokenizer(c["vocab"])
    vocab = RELEASED_LM_CONFIG["vocab_size"] if name == "real" else code_offset + c["codes"]
    lm_cfg = {**RELEASED_LM_CONFIG, **c["lm"], "vocab_size": vocab}
    cfgs = {comp: {**DIFFUSERS_DEFAULTS[comp], **c[comp]} for comp in COMPONENTS}
    if name != "real":
        lm_cfg["torch_dtype"] = "float32"
    diff = root / "diffusers"
    marker = root / "bench_checkpoint.json"
    stamp = {"config": name, "seed": seed, "lm": lm_cfg, "components": cfgs}
    if not (marker.is_file() and json.loads(marker.read_text()) == stamp):
        shutil.rmtree(root, ignore_errors=True)
        wdtype = torch.bfloat16 if c["native"] == "BF16" else torch.float32
        gen = torch.Generator().manual_seed(seed)
        (diff / "tokenizer").mkdir(parents=True)
        (diff / "tokenizer" / "tokenizer.json").write_text(json.dumps(tj))
        w = build_weights("language_model", lm_cfg, gen)
        head = w["lm_head.weight"]  # code rows of std 0.5 and a zero END row, as mm3.tools.tiny: songs rarely stop
        head[code_offset:] = 0.5 * torch.randn(head[code_offset:].shape, generator=gen)
        head[special_ids["<|audio_end|>"]] = 0.0
        _save(diff / "language_model", lm_cfg, w, "model.safetensors", wdtype)
        del w, head
        for comp in COMPONENTS:
            w = build_weights(comp, cfgs[comp], gen)
            if comp == "vocoder":  # keep tanh out of saturation, as mm3.tools.tiny does
                w["conv_out.weight_g"] *= 0.02
            keep = wdtype if comp in QUANTIZED.values() else torch.float32
            _save(diff / comp, cfgs[comp], w, "diffusion_pytorch_model.safetensors", keep)
            del w
        convert(diff, root / "gguf")
        marker.write_text(json.dumps(stamp))
    models = root / f"models-{quant}"
    if not models.is_dir():
        _quantized_folder(root / "gguf", models, quant, c["native"])
    return Checkpoint(name, root, diff, models, quant, c["native"], lm_cfg, cfgs, special_ids, code_offset)


def build_direct(name: str, root: Path, quant: str, seed: int = 0, components=None) -> Checkpoint:
    """Config `name` as random GGUF files written straight in `quant` (`mm3.bench.random_models`): no
    float checkpoint and no diffusers layout, so the reference cannot run on it; for the released
    sizes on machines that cannot hold them in float."""
    from .random_models import DIRECT_COMPONENTS, write_random_models

    c = CONFIGS[name]
    tj, special_ids, code_offset = build_tokenizer(c["vocab"])
    vocab = RELEASED_LM_CONFIG["vocab_size"] if name == "real" else code_offset + c["codes"]
    lm_cfg = {**RELEASED_LM_CONFIG, **c["lm"], "vocab_size": vocab}
    cfgs = {comp: {**DIFFUSERS_DEFAULTS[comp], **c[comp]} for comp in COMPONENTS}
    models = root / f"direct-{quant}-seed{seed}"
    write_random_models(models, lm_cfg, cfgs, quant, tj, special_ids["<|audio_end|>"],
                        components or DIRECT_COMPONENTS, seed)
    return Checkpoint(name, root, None, models, quant, quant, lm_cfg, cfgs, special_ids, code_offset)


def direct_bytes(cfgs: dict, lm_cfg: dict, quant: str) -> int:
    """About the bytes of `build_direct`'s files: every weight at the mix's base type (+15 % for the
    tensors a mix raises to Q6_K)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ..tools.quantize import MIXES

    qtype = MIXES[quant][0] if quant in MIXES else GGMLQuantizationType[quant]
    block, size = GGML_QUANT_SIZES[qtype]
    return int(param_bytes(cfgs, lm_cfg, size / block) * 1.15)


def _quantized_folder(native: Path, out: Path, quant: str, native_type: str):
    """A models folder with the LM, depth and DiT files in `quant` and the others as converted."""
    from ..tools.quantize import quantize_file

    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for src in sorted(native.glob("*.gguf")):
        if quant != native_type and any(f"-{sub}-" in src.name for sub in QUANTIZED.values()):
            quantize_file(src, tmp / src.name.replace(f"-{native_type}.gguf", f"-{quant}.gguf"), quant)
            continue
        try:
            os.link(src, tmp / src.name)
        except OSError:
            shutil.copy2(src, tmp / src.name)
    tmp.rename(out)


def param_bytes(cfgs: dict, lm_cfg: dict, bytes_per: float) -> int:
    """Bytes of every weight of the five components at `bytes_per` bytes per value."""
    shapes = list(expected_tensors("language_model", lm_cfg).values())
    shapes += [s for comp, cfg in cfgs.items() for s in expected_tensors(comp, cfg).values()]
    return int(sum(math.prod(s) for s in shapes) * bytes_per)
