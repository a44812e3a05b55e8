"""The five component files: architecture strings, hyper-parameters read from metadata, and the
checks that a set of components fits together."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

from .gguf.errors import ComponentError, GGUFFormatError
from .gguf.reader import GGUFFile

# general.architecture -> component kind (the minimaxmusic.cpp file contract, SPEC section 2).
ARCHITECTURES = {
    "mm3-lm": "lm",
    "mm3-depth": "depth",
    "mm3-cond": "cond",
    "mm3-dit": "dit",
    "mm3-vae": "vae",
}
KINDS = tuple(ARCHITECTURES.values())
ARCH_OF = {kind: arch for arch, kind in ARCHITECTURES.items()}
DESCRIPTIONS = {
    "lm": "language model (Qwen3)",
    "depth": "RVQ depth decoder",
    "cond": "condition encoder",
    "dit": "flow DiT",
    "vae": "vocoder (flow VAE)",
}

# Metadata keys each architecture must carry, under the `<arch>.` prefix.
HPARAM_KEYS = {
    "depth": ("hidden_size", "num_layers", "num_attention_heads", "intermediate_size",
              "audio_vocab_size", "num_codebooks", "max_position_embeddings"),
    "cond": ("condition_hidden_dim", "num_condition_layers", "out_dim", "input_sampling_rate",
             "input_hop_length", "output_sampling_rate", "output_hop_length"),
    "dit": ("in_channels", "condition_dim", "num_layers", "num_attention_heads", "attention_head_dim",
            "ff_inner_dim", "rotary_dim", "fourier_embedding_dim"),
    "vae": ("latent_channels", "sampling_rate", "upsampling_ratios"),
}
LM_CONFIG_KEY = "mm3.config_json"
LM_CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "num_hidden_layers", "rms_norm_eps",
                    "max_position_embeddings")


@dataclass
class Component:
    """An opened component file: its kind, hyper-parameters and compressed tensors."""

    kind: str
    path: str
    file: GGUFFile = field(repr=False)
    hparams: dict

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def tensors(self):
        return self.file.tensors

    def quant_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(t.qtype.name for t in self.tensors.values()).items()))

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def close(self):
        self.file.close()


def read_hparams(f: GGUFFile, kind: str) -> dict:
    """Hyper-parameters of a component, from its metadata; errors name the file and the key."""
    if kind == "lm":
        raw = f.metadata.get(LM_CONFIG_KEY)
        if not isinstance(raw, str):
            raise ComponentError(f"{f.path}: missing metadata {LM_CONFIG_KEY} (the LM's config.json)")
        try:
            cfg = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ComponentError(f"{f.path}: {LM_CONFIG_KEY} is not valid JSON ({e})") from None
        missing = [k for k in LM_CONFIG_FIELDS if k not in cfg]
        if missing:
            raise ComponentError(f"{f.path}: {LM_CONFIG_KEY} lacks {', '.join(missing)}")
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
        if theta is None:
            raise ComponentError(f"{f.path}: {LM_CONFIG_KEY} has no rope_theta")
        cfg["rope_theta"] = float(theta)
        cfg.setdefault("tie_word_embeddings", False)
        return cfg
    arch = ARCH_OF[kind]
    out = {}
    for key in HPARAM_KEYS[kind]:
        full = f"{arch}.{key}"
        if full not in f.metadata:
            raise ComponentError(f"{f.path}: missing metadata {full}")
        out[key] = f.metadata[full]
    return out


def open_component(path: str | os.PathLike, expect: str | None = None) -> Component:
    """Open a component file, classified by `general.architecture` (never by its name).

    `expect` is a kind ("lm", "depth", "cond", "dit", "vae"); another architecture is an error
    that says what the file is and what was expected.
    """
    f = GGUFFile(path)
    try:
        arch = f.architecture
        kind = ARCHITECTURES.get(arch)
        if kind is None:
            raise ComponentError(
                f"{f.path}: unknown architecture {arch!r} (expected one of {', '.join(ARCHITECTURES)})")
        if expect is not None and kind != expect:
            raise ComponentError(f"{f.path} is {arch}, expected {ARCH_OF[expect]} ({DESCRIPTIONS[expect]})")
        return Component(kind, str(path), f, read_hparams(f, kind))
    except (ComponentError, GGUFFormatError):
        f.close()
        raise


def check_compatible(components: dict[str, Component]) -> None:
    """Components that must agree on a size do; the error names both files and both values."""

    def same(a, ka, b, kb, what):
        ca, cb = components.get(a), components.get(b)
        if ca is None or cb is None:
            return
        va, vb = ca.hparams[ka], cb.hparams[kb]
        if va != vb:
            raise ComponentError(
                f"{what} do not fit together: {ca.name} has {ka} {va}, {cb.name} has {kb} {vb}")

    same("lm", "hidden_size", "depth", "hidden_size", "LM and depth decoder")
    same("depth", "hidden_size", "cond", "condition_hidden_dim", "depth decoder and condition encoder")
    same("depth", "num_codebooks", "cond", "num_condition_layers", "depth decoder and condition encoder")
    same("cond", "out_dim", "dit", "condition_dim", "condition encoder and DiT")
    same("dit", "in_channels", "vae", "latent_channels", "DiT and vocoder")
