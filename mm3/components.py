"""The five component files: the one table that names them, hyper-parameters read from metadata, and
the checks that a set of components fits together."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field

from .filecache import FileCache
from .gguf.errors import ComponentError, GGUFFormatError
from .gguf.reader import GGUFFile


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

# Sizes of the published files in bytes, by component kind and file type (the figures of the released
# model table, rounded as published: 17.2 GB, 0.69 GB, 101 MB, ...).
PUBLISHED_SIZES = {
    ("lm", "BF16"): 17.2e9, ("lm", "Q8_0"): 9.1e9, ("lm", "Q6_K"): 7.0e9, ("lm", "Q5_K_M"): 6.3e9,
    ("depth", "BF16"): 1.3e9, ("depth", "Q8_0"): 0.69e9,
    ("cond", "F32"): 101e6,
    ("dit", "F32"): 9.7e9, ("dit", "Q8_0"): 2.6e9, ("dit", "Q6_K"): 2.0e9, ("dit", "Q5_K_M"): 1.7e9,
    ("dit", "Q4_K_M"): 1.4e9,
    ("vae", "F32"): 306e6,
}
SIZE_TOLERANCE = 0.1  # a published file's size is its table figure within this share (the figures are rounded)
# Values (weights) of each released component, from its unquantized published file (BF16: 2 bytes, F32: 4).
RELEASED_VALUES = {"lm": 17.2e9 / 2, "depth": 1.3e9 / 2, "cond": 101e6 / 4, "dit": 9.7e9 / 4, "vae": 306e6 / 4}
FULL_SIZE_SHARE = 0.5  # a full-size file holds at least this share of them (a vocoder without its encoder: 0.7)


def matches_published(kind: str, file_type: str, size: int) -> bool:
    """Whether a file of `kind` and `file_type` has the size of the published file of that type."""
    want = PUBLISHED_SIZES.get((kind, file_type))
    return want is not None and abs(size - want) <= SIZE_TOLERANCE * want


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


# HOT-Step writes `mm3-depth`, `mm3-cond` and `mm3-dit` too, with other tensor names; its files carry this.
FOREIGN_MARKER = ("mm3.model", "MiniMax-Music3")


def _foreign_namesake(path) -> bool:
    """Whether a file under one of our architecture names is another tool's (header read)."""
    try:
        with GGUFFile(path, header_only=True) as f:
            return f.metadata.get(FOREIGN_MARKER[0]) == FOREIGN_MARKER[1]
    except GGUFFormatError:
        return False  # ours by its name, and broken: opening it says how


def kinds_of(path: str | os.PathLike) -> tuple[str, ...]:
    """The component kinds a file holds: one for our files (by `general.architecture`), one or more
    for another tool's files (`mm3.dialects`: a ComfyUI text encoder holds the LM and the depth
    decoder), none for anything else (header read, cached)."""
    from .dialects import describe
    from .dialects.source import file_format
    from .gguf.reader import read_architecture

    def classify(st) -> tuple[str, ...]:
        found = None
        fmt = file_format(path)
        if fmt == "gguf":
            kind = ARCHITECTURES.get(read_architecture(path))
            found = (None, (kind,)) if kind is not None and not _foreign_namesake(path) else None
        if found is None and fmt:
            found = describe(path)
        return found[1] if found else ()

    try:
        return _KINDS.get(path, classify)
    except (OSError, ValueError):
        return ()  # unreadable now: not remembered, so a repaired file is classified again


_KINDS = FileCache(512)


def open_component(path: str | os.PathLike, expect: str | None = None, *, header_only: bool = False) -> Component:
    """Open a component file, classified by `general.architecture` or, for another tool's file, by
    its tensor names (never by its file name).

    `expect` is a kind ("lm", "depth", "cond", "dit", "vae"); another architecture is an error
    that says what the file is and what was expected (a file holding several components gives the
    one asked for, the first one without `expect`). `header_only`: metadata and the tensor table
    only (no tensors mapped), enough for `hparams` and `check_compatible`.
    """
    from .dialects import describe, open_mapped
    from .dialects.source import file_format

    fmt = file_format(path)
    if fmt == "gguf":
        f = GGUFFile(path, header_only=header_only)
        try:
            arch = f.architecture
            kind = ARCHITECTURES.get(arch)
            if kind is not None and f.metadata.get(FOREIGN_MARKER[0]) == FOREIGN_MARKER[1]:
                kind = None  # HOT-Step's file under our architecture name: a dialect reads it
            if kind is not None:
                if expect is not None and kind != expect:
                    raise ComponentError(f"{f.path} is {arch}, expected {ARCH_OF[expect]} ({DESCRIPTIONS[expect]})")
                return Component(kind, str(path), f, read_hparams(f, kind))
        except BaseException:
            f.close()
            raise
        f.close()
    elif not os.path.isfile(path):
        raise GGUFFormatError(f"{path}: no such file")
    found = describe(path) if fmt else None
    if found is None:
        if fmt == "gguf":
            raise ComponentError(f"{path}: unknown architecture {arch!r} (expected one of {', '.join(ARCHITECTURES)}, "
                                 "or a ComfyUI or HOT-Step MiniMax Music 3 file)")
        raise GGUFFormatError(f"{path}: not a GGUF file, nor a safetensors file in a known MiniMax Music 3 layout")
    what, kinds = found
    kind = expect or kinds[0]
    if kind not in kinds:
        held = " and ".join(DESCRIPTIONS[k] for k in kinds)
        raise ComponentError(f"{path} is a {what} (it holds the {held}), expected {ARCH_OF[expect]} "
                             f"({DESCRIPTIONS[expect]})")
    f = open_mapped(path, kind, header_only=header_only)
    try:
        return Component(kind, str(path), f, read_hparams(f, kind))
    except BaseException:
        f.close()
        raise


def read_component(path: str | os.PathLike, expect: str | None = None) -> Component:
    """Kind and hyper-parameters of a file from its header alone (the file is not kept open), cached
    by path, size, mtime and kind: a whole request's files can be checked with `check_compatible`
    before any model is loaded."""
    kinds = kinds_of(path)
    kind = expect if expect in kinds else None

    def header(st) -> Component:
        comp = open_component(path, kind, header_only=True)
        comp.close()
        return comp

    comp = _HEADERS.get(path, header, kind)
    if expect is not None and comp.kind != expect:
        raise ComponentError(f"{comp.path} is {ARCH_OF[comp.kind]}, expected {ARCH_OF[expect]} ({DESCRIPTIONS[expect]})")
    return comp


_HEADERS = FileCache(64)


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
    from .gguf.quants import SUPPORTED_TYPES

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
