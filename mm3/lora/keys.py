"""How adapter files name the layers they change, mapped onto the engine's layer names.

The engine's layers are named as the GGUF tensors (`mm3.tools.convert` copies the diffusers and
transformers names as they are): the LM's `model.layers.N.self_attn.q_proj` ..., the DiT's
`transformer_blocks.N.attn.to_q` .... Adapter files name them in four ways:

- PEFT / diffusers: `[base_model.model.][language_model. | transformer.]<module>.lora_A[.<name>].weight`
  and `lora_B`, the module in those same names (`language_model.` is SimpleTuner's LM prefix, which
  HOT-Step's LM adapter loader reads; PEFT's own files start `base_model.model.`);
- ComfyUI: the DiT's modules as ComfyUI's MiniMax Music 3 model names them, under
  `diffusion_model.` (what SimpleTuner exports), `to_qkv` holding q, k and v rows and `ff.ff.0.proj`
  / `ff.ff.2` for `ff_in` / `ff_out` (the same renames as `mm3.dialects.comfy`); the text encoder's
  LM under `text_encoders.model.` (ComfyUI's generic spelling), `qkv_proj` / `gate_up_proj` merged;
- kohya: `lora_unet_` / `lora_te_` + the module path with underscores, `.lora_down` / `.lora_up`;
- a per-module `.alpha` scalar in the ComfyUI and kohya spellings.

A module holding several of our layers (a fused `to_qkv`, `qkv_proj`, `gate_up_proj`) is split by
rows in the order listed, each part a view. Each layer falls in one strength group (`GROUPS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("lm", "dit")
NAMES = {"lm": "LM", "dit": "DiT"}  # in messages
# Strength groups: an adapter's q/k rows shape the song's structure, its v/out and MLP rows the
# timbre (HOT-Step's finding), so a user can keep one without the other.
GROUPS = ("attn_qk", "attn_vo", "mlp")
OTHER = "other"  # the DiT's proj_in / proj_out / time embedding: the adapter's strength alone


@dataclass(frozen=True)
class Target:
    """What one adapter module changes: the engine layers of `kind`, several when the module is a
    fused one (split by rows in this order); `layout`: the naming it was written in."""

    kind: str
    layers: tuple[str, ...]
    layout: str


def _qkv(prefix: str, names=("q", "k", "v"), fmt="{}_proj") -> tuple[str, ...]:
    return tuple(prefix + fmt.format(n) for n in names)


# (kind, layout, module pattern, layer names built from the pattern's groups)
_RULES = (
    ("lm", "PEFT", r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj",
     lambda i, n: (f"model.layers.{i}.self_attn.{n}_proj",)),
    ("lm", "PEFT", r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj", lambda i, n: (f"model.layers.{i}.mlp.{n}_proj",)),
    ("lm", "ComfyUI", r"model\.layers\.(\d+)\.self_attn\.qkv_proj", lambda i: _qkv(f"model.layers.{i}.self_attn.")),
    ("lm", "ComfyUI", r"model\.layers\.(\d+)\.mlp\.gate_up_proj",
     lambda i: _qkv(f"model.layers.{i}.mlp.", ("gate", "up"))),
    ("dit", "PEFT", r"transformer_blocks\.(\d+)\.attn\.to_([qkv])",
     lambda i, n: (f"transformer_blocks.{i}.attn.to_{n}",)),
    ("dit", "PEFT", r"transformer_blocks\.(\d+)\.attn\.to_qkv",
     lambda i: _qkv(f"transformer_blocks.{i}.attn.", fmt="to_{}")),
    ("dit", "PEFT", r"transformer_blocks\.(\d+)\.attn\.to_out\.0",
     lambda i: (f"transformer_blocks.{i}.attn.to_out.0",)),
    ("dit", "PEFT", r"transformer_blocks\.(\d+)\.(ff_in|ff_out)", lambda i, n: (f"transformer_blocks.{i}.{n}",)),
    ("dit", "PEFT", r"(proj_in|proj_out)", lambda n: (n,)),
    ("dit", "PEFT", r"time_embed\.(linear_[12])", lambda n: (f"time_embed.{n}",)),
    ("dit", "ComfyUI", r"diffusion_transformer\.transformer\.layers\.(\d+)\.self_attn\.to_qkv",
     lambda i: _qkv(f"transformer_blocks.{i}.attn.", fmt="to_{}")),
    ("dit", "ComfyUI", r"diffusion_transformer\.transformer\.layers\.(\d+)\.self_attn\.to_out",
     lambda i: (f"transformer_blocks.{i}.attn.to_out.0",)),
    ("dit", "ComfyUI", r"diffusion_transformer\.transformer\.layers\.(\d+)\.ff\.ff\.0\.proj",
     lambda i: (f"transformer_blocks.{i}.ff_in",)),
    ("dit", "ComfyUI", r"diffusion_transformer\.transformer\.layers\.(\d+)\.ff\.ff\.2",
     lambda i: (f"transformer_blocks.{i}.ff_out",)),
    ("dit", "ComfyUI", r"diffusion_transformer\.transformer\.project_(in|out)", lambda n: (f"proj_{n}",)),
    ("dit", "ComfyUI", r"diffusion_transformer\.to_timestep_embed\.0", lambda: ("time_embed.linear_1",)),
    ("dit", "ComfyUI", r"diffusion_transformer\.to_timestep_embed\.2", lambda: ("time_embed.linear_2",)),
)
_DOTTED = [(kind, layout, re.compile(p), build) for kind, layout, p, build in _RULES]
_UNDERSCORED = [(kind, layout, re.compile(p.replace(r"\.", "_")), build) for kind, layout, p, build in _RULES]

# Wrappers before the module path: (prefix, the kind it names or None, the tool whose spelling it is).
_PREFIXES = (("base_model.model.", None, "PEFT"), ("language_model.", "lm", "SimpleTuner"),
             ("text_encoders.", "lm", "ComfyUI"), ("transformer.", "dit", "diffusers"),
             ("model.diffusion_model.", "dit", "ComfyUI"), ("diffusion_model.", "dit", "ComfyUI"))
_KOHYA = (("lora_unet_", "dit"), ("lora_te1_", "lm"), ("lora_te_", "lm"))

# A factor's name after its module: lora_A / lora_B (PEFT, optionally `.<adapter name>`), lora_down /
# lora_up (kohya, ComfyUI), the per-module alpha.
_PART = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_down|lora_up|lora\.down|lora\.up)"
                   r"(?:\.[A-Za-z0-9_-]+)?\.weight$")
_PARTS = {"lora_A": "down", "lora_down": "down", "lora.down": "down", "lora_B": "up", "lora_up": "up", "lora.up": "up"}


def split_key(key: str) -> tuple[str, str] | None:
    """(module, "down" | "up" | "alpha") of a tensor name, None when it is no LoRA factor."""
    m = _PART.match(key)
    if m:
        return m["module"], _PARTS[m["part"]]
    if key.endswith(".alpha") and len(key) > len(".alpha"):
        return key[:-len(".alpha")], "alpha"
    return None


def target_of(module: str) -> Target | None:
    """The engine layers an adapter module changes, None when it names none of them."""
    for prefix, kind in _KOHYA:
        if module.startswith(prefix):
            return _match(module[len(prefix):], kind, _UNDERSCORED, "kohya")
    hint, path, layout = None, module, None
    while True:
        for prefix, kind, tool in _PREFIXES:
            if path.startswith(prefix):
                if kind is not None and hint is not None and kind != hint:
                    return None
                hint, path, layout = hint or kind, path[len(prefix):], layout or tool
                break
        else:
            break
    return _match(path, hint, _DOTTED, layout)


def _match(path: str, hint: str | None, rules, layout: str | None) -> Target | None:
    for kind, rule_layout, pattern, build in rules:
        m = pattern.fullmatch(path)
        if m and hint in (None, kind):
            return Target(kind, build(*m.groups()), rule_layout if rule_layout == "ComfyUI" else layout or rule_layout)
    return None


def group_of(layer: str) -> str:
    """The strength group of an engine layer name (`GROUPS`, or `OTHER`)."""
    last = layer.removesuffix(".0").rsplit(".", 1)[-1]
    if last in ("q_proj", "k_proj", "to_q", "to_k"):
        return "attn_qk"
    if last in ("v_proj", "o_proj", "to_v", "to_out"):
        return "attn_vo"
    if last in ("gate_proj", "up_proj", "down_proj", "ff_in", "ff_out"):
        return "mlp"
    return OTHER
