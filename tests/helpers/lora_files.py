"""Random LoRA files for the tiny models, in the formats other tools write, and the same change
merged offline into a checkpoint's weights (what the runtime application must equal).

A file is described by the modules it changes in its own layout's names (diffusers / transformers
names for PEFT, diffusers, kohya and SimpleTuner files; ComfyUI's module names for its files) and
their weight shapes, read from the checkpoint the change is merged into. Key spellings:

  peft       base_model.model.<module>.lora_A.weight / lora_B; lora_alpha in adapter_config.json beside it
  diffusers  transformer.<module> (DiT) or language_model.<module> (LM); lora_alpha in the
             `lora_adapter_metadata` JSON of the file's metadata (what diffusers writes)
  comfy      diffusion_model.<module> (DiT) or text_encoders.<module> (LM), lora_A / lora_B and a
             per-module .alpha (SimpleTuner's ComfyUI export)
  kohya      lora_unet_ / lora_te_ + the module with underscores, .lora_down / .lora_up / .alpha
  simpletuner  language_model.<module>, no alpha (alpha = rank: what HOT-Step's LM loader reads)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FORMATS = ("peft", "diffusers", "comfy", "kohya", "simpletuner")
_PREFIX = {("diffusers", "dit"): "transformer.", ("diffusers", "lm"): "language_model.",
           ("comfy", "dit"): "diffusion_model.", ("comfy", "lm"): "text_encoders.",
           ("simpletuner", "lm"): "language_model.", ("peft", "dit"): "base_model.model.",
           ("peft", "lm"): "base_model.model."}


def dit_modules(state: dict, comfy: bool = False) -> list[str]:
    """The DiT modules a LoRA trainer targets, by the names of `state` (a diffusers transformer
    state dict, or with `comfy` a ComfyUI DiT file's)."""
    if comfy:
        p = "diffusion_transformer.transformer."
        n = sum(1 for k in state if k.startswith(p + "layers.") and k.endswith("self_attn.to_qkv.weight"))
        out = [p + "project_in", p + "project_out"]
        for i in range(n):
            out += [f"{p}layers.{i}.self_attn.to_qkv", f"{p}layers.{i}.self_attn.to_out", f"{p}layers.{i}.ff.ff.0.proj",
                    f"{p}layers.{i}.ff.ff.2"]
        return out
    n = sum(1 for k in state if k.startswith("transformer_blocks.") and k.endswith("attn.to_q.weight"))
    out = ["proj_in", "proj_out", "time_embed.linear_1"]
    for i in range(n):
        out += [f"transformer_blocks.{i}.attn.to_{x}" for x in ("q", "k", "v", "out.0")]
        out += [f"transformer_blocks.{i}.ff_in", f"transformer_blocks.{i}.ff_out"]
    return out


def lm_modules(state: dict, merged: bool = False) -> list[str]:
    """The LM's attention and MLP modules (`merged`: ComfyUI's qkv_proj / gate_up_proj)."""
    n = sum(1 for k in state if k.startswith("model.layers.") and k.endswith("self_attn.o_proj.weight"))
    out = []
    for i in range(n):
        p = f"model.layers.{i}."
        attn = ["qkv"] if merged else ["q", "k", "v"]
        mlp = ["gate_up"] if merged else ["gate", "up"]
        out += [f"{p}self_attn.{x}_proj" for x in attn + ["o"]] + [f"{p}mlp.{x}_proj" for x in mlp + ["down"]]
    return out


def write_lora(path: Path, state: dict, modules: list[str], fmt: str, kind: str, *, rank: int = 4, seed: int = 0,
               alpha: float | None = 8.0, magnitude: float = 0.05, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Write a random LoRA on `modules` (weights of `state`) in `fmt`; returns {weight name in
    `state`: its change at strength 1, alpha / rank B A, float32}."""
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    scale = (alpha if alpha is not None and fmt != "simpletuner" else rank) / rank
    for module in modules:
        out_f, in_f = state[module + ".weight"].shape
        a = (torch.randn(rank, in_f, generator=g) * magnitude).to(dtype)
        b = (torch.randn(out_f, rank, generator=g) * magnitude).to(dtype)
        deltas[module + ".weight"] = (b.float() @ a.float()) * scale
        if fmt == "kohya":
            key = ("lora_unet_" if kind == "dit" else "lora_te_") + module.replace(".", "_")
            tensors[key + ".lora_down.weight"], tensors[key + ".lora_up.weight"] = a, b
            tensors[key + ".alpha"] = torch.tensor(float(alpha))
        else:
            key = _PREFIX.get((fmt, kind), "") + module
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = a, b
            if fmt == "comfy":
                tensors[key + ".alpha"] = torch.tensor(float(alpha))
    metadata = {"format": "pt"}
    if fmt == "diffusers" and alpha is not None:
        metadata["lora_adapter_metadata"] = json.dumps({"lora_alpha": alpha, "r": rank})
    save_file(tensors, str(path), metadata=metadata)
    if fmt == "peft" and alpha is not None:
        (Path(path).parent / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(modules)}))
    return deltas


def merged(state: dict, *changes: tuple[dict, float]) -> dict:
    """`state` with each (deltas, strength) added, in float32 (the weights the runtime must give)."""
    out = dict(state)
    for deltas, strength in changes:
        for name, d in deltas.items():
            out[name] = (out[name].float() + strength * d).to(state[name].dtype)
    return out
