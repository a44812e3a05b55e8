"""The five components: the one table that names them, an opened component file, its
hyper-parameters read from metadata, and the checks that a set of components fits together and that
a file can be built into a model. Opening and classifying files is `mm3.files.opener`."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field

from .formats.published import FULL_SIZE_SHARE, RELEASED_VALUES
from .formats.gguf.errors import ComponentError
from .formats.gguf.reader import GGUFFile


@dataclass(frozen=True)
class ComponentSpec:
    """One of the five components, under every name the project gives it."""

    kind: str  # short key used throughout the code ("lm")
    arch: str  # GGUF general.architecture (the minimaxmusic.cpp file contract)
    folder: str  # diffusers subfolder, and the published file names' middle part
    description: str  # in messages
    title: str  # in the node titles ("MM3 Load Language Model")
    general_name: str  # GGUF general.name, as minimaxmusic.cpp's converter writes it
    group: str  # memory group: "ar" (used per frame) or "synth" (used per window)

    @property
    def request_field(self) -> str:
        """The request JSON's field naming this component's file."""
        return f"{self.kind}_model"

    @property
    def node_id(self) -> str:
        return "MM3Load" + self.title.replace(" ", "")


COMPONENTS = {s.kind: s for s in (
    ComponentSpec("lm", "mm3-lm", "language_model", "language model (Qwen3)", "Language Model",
                  "MiniMax-Music3 global LM (Qwen3 8B)", "ar"),
    ComponentSpec("depth", "mm3-depth", "rvq_depth_decoder", "RVQ depth decoder", "Depth Decoder",
                  "MiniMax-Music3 RVQ depth decoder", "ar"),
    ComponentSpec("cond", "mm3-cond", "condition_encoder", "condition encoder", "Condition Encoder",
                  "MiniMax-Music3 condition encoder", "synth"),
    ComponentSpec("dit", "mm3-dit", "transformer", "flow DiT", "DiT", "MiniMax-Music3 flow matching DiT", "synth"),
    ComponentSpec("vae", "mm3-vae", "vocoder", "vocoder (flow VAE)", "Vocoder", "MiniMax-Music3 Flow-VAE", "synth"),
)}
# Views of the table.
KINDS = tuple(COMPONENTS)
ARCHITECTURES = {s.arch: s.kind for s in COMPONENTS.values()}  # general.architecture -> kind
ARCH_OF = {s.kind: s.arch for s in COMPONENTS.values()}
DESCRIPTIONS = {s.kind: s.description for s in COMPONENTS.values()}
MODEL_FIELDS = {s.kind: s.request_field for s in COMPONENTS.values()}
BY_FOLDER = {s.folder: s for s in COMPONENTS.values()}
GROUPS = {g: tuple(s.kind for s in COMPONENTS.values() if s.group == g) for g in ("ar", "synth")}
GROUP_OF = {s.kind: s.group for s in COMPONENTS.values()}

def is_full_size(component: "Component") -> bool:
    """Whether a component holds (about) the released model's number of values, whatever its
    precision: a tiny test model or a toy conversion does not."""
    return component.values() >= FULL_SIZE_SHARE * RELEASED_VALUES[component.kind]


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
LIST_HPARAMS = ("upsampling_ratios",)  # the only list-valued key; every other one is a positive integer
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

    def values(self) -> int:
        """Number of stored values over its tensors (header read)."""
        return sum(math.prod(shape) for _, shape, _ in self.file.tensor_infos())

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
        except (json.JSONDecodeError, RecursionError) as e:
            raise ComponentError(f"{f.path}: {LM_CONFIG_KEY} is not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ComponentError(f"{f.path}: {LM_CONFIG_KEY} is not a JSON object")
        missing = [k for k in LM_CONFIG_FIELDS if k not in cfg]
        if missing:
            raise ComponentError(f"{f.path}: {LM_CONFIG_KEY} lacks {', '.join(missing)}")
        rope = cfg.get("rope_parameters")
        theta = cfg.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
        if theta is None:
            raise ComponentError(f"{f.path}: {LM_CONFIG_KEY} has no rope_theta")
        for key in LM_CONFIG_FIELDS:
            if key != "rms_norm_eps":
                _check_size(f.path, f"{LM_CONFIG_KEY} {key}", cfg[key])
        for key, value in (("rms_norm_eps", cfg["rms_norm_eps"]), ("rope_theta", theta)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ComponentError(f"{f.path}: {LM_CONFIG_KEY} {key} must be a positive number, "
                                     f"got {json.dumps(value)}")
        cfg["rope_theta"] = float(theta)
        cfg.setdefault("tie_word_embeddings", False)
        if not isinstance(cfg["tie_word_embeddings"], bool):
            raise ComponentError(f"{f.path}: {LM_CONFIG_KEY} tie_word_embeddings must be true or false, "
                                 f"got {json.dumps(cfg['tie_word_embeddings'])}")
        return cfg
    arch = ARCH_OF[kind]
    out = {}
    for key in HPARAM_KEYS[kind]:
        full = f"{arch}.{key}"
        if full not in f.metadata:
            raise ComponentError(f"{f.path}: missing metadata {full}")
        value = f.metadata[full]
        if key in LIST_HPARAMS:
            if not isinstance(value, list) or not value:
                raise ComponentError(f"{f.path}: metadata {full} must be a non-empty list of positive integers, "
                                     f"got {value!r}")
            for v in value:
                _check_size(f.path, f"metadata {full}", v)
        else:
            _check_size(f.path, f"metadata {full}", value)
        out[key] = value
    return out


def _check_size(path: str, what: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ComponentError(f"{path}: {what} must be a positive integer, got {value!r}")


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
    same("cond", "output_sampling_rate", "vae", "sampling_rate", "condition encoder and vocoder")
    cond, vae = components.get("cond"), components.get("vae")
    if cond is not None and vae is not None:
        hop, ratios = cond.hparams["output_hop_length"], vae.hparams["upsampling_ratios"]
        if math.prod(ratios) != hop:  # one latent per output_hop_length samples
            raise ComponentError(
                f"condition encoder and vocoder do not fit together: {cond.name} has output_hop_length {hop}, "
                f"{vae.name} upsamples by {' x '.join(map(str, ratios))} = {math.prod(ratios)}")


# Hyper-parameters that count repeated parts (one or more tensors each), and those that are rates
# or positions rather than tensor sizes; every other one sizes some tensor dimension.
COUNT_HPARAMS = ("num_layers", "num_hidden_layers", "num_codebooks")
RATE_HPARAMS = ("input_sampling_rate", "input_hop_length", "output_sampling_rate", "output_hop_length",
                "sampling_rate", "rope_theta", "rms_norm_eps", "max_position_embeddings")


def check_loadable(component: Component) -> None:
    """Before a model is built from `component`: every tensor has a type the engine dequantizes,
    and no size in the metadata is beyond what the file's tensors can hold (a corrupt header must
    not make the model constructor loop over millions of layers or allocate huge tables)."""
    from .formats.gguf.quants import SUPPORTED_TYPES

    infos = component.file.tensor_infos()
    for name, _, qtype in infos:
        if qtype not in SUPPORTED_TYPES:
            names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise ComponentError(f"{component.path}: tensor {name} is {qtype.name}, which this engine cannot "
                                 f"dequantize (supported: {names}); use a file quantized to one of those")
    largest = max((math.prod(shape) for _, shape, _ in infos), default=0)
    sizes = dict(component.hparams)
    if component.kind == "lm":
        sizes = {k: sizes[k] for k in LM_CONFIG_FIELDS}
    if component.kind == "vae":
        sizes.update({f"upsampling_ratios[{i}]": r for i, r in enumerate(sizes.pop("upsampling_ratios"))})
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or key in RATE_HPARAMS:
            continue
        if key in COUNT_HPARAMS and value > len(infos):
            raise ComponentError(f"{component.path}: {key} {value} is more than the {len(infos)} tensors the "
                                 "file holds (corrupt metadata?)")
        if value > largest:
            raise ComponentError(f"{component.path}: {key} {value} is larger than any tensor in the file "
                                 f"(the largest holds {largest} values; corrupt metadata?)")
