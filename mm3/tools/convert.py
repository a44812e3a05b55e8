"""Convert the diffusers layout of MiniMax Music 3 into the five GGUF component files that minimaxmusic.cpp reads.

`convert(src, out)` reads `src/{language_model,rvq_depth_decoder,condition_encoder,transformer,vocoder}/`
(+ `tokenizer/` for the LM, + an optional `dav.pth` for the vocoder encoder) and writes
`MiniMax-Music3-<subfolder>-<TYPE>.gguf` as the port does: LM, depth decoder and DiT byte for byte in the
source dtype, in the port's order (shard by shard, names sorted within each); the condition encoder and
vocoder F32, sorted by name, vocoder weight norm folded with torch's arithmetic. Each file streams one
tensor at a time from a memory map into `<name>.part`, renamed when complete; existing outputs are skipped.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from ..components import BY_FOLDER
from ..formats.diffusers import DIFFUSERS_DEFAULTS, U32_KEYS, rename_dav_key, tokenizer_arrays
from ..formats.safetensors_raw import TensorEntry, load_entries
from ..formats.gguf.writer import Writer, write_streaming

logger = logging.getLogger(__name__)

# subfolder -> (architecture, general.name), from the component table.
COMPONENTS = {folder: (s.arch, s.general_name) for folder, s in BY_FOLDER.items()}
ALIASES = {s.kind: s.folder for s in BY_FOLDER.values()}
NATIVE = ("language_model", "rvq_depth_decoder", "transformer")  # copied byte for byte

LM_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

_GGML = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
         "BF16": gguf.GGMLQuantizationType.BF16}
_NP_OF = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # numpy carrier of each dtype

Progress = Callable[[str, int, int], None]


# --------------------------------------------------------------------------------------------
# Expected tensors (names and torch shapes) of each component, from its config.


def load_config(folder: Path, component: str) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (the {component} config)")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if component == "language_model":
        missing = [k for k in LM_REQUIRED if k not in cfg]
        if missing:
            raise KeyError(f"{path}: missing {', '.join(missing)}")
        return cfg
    return {**DIFFUSERS_DEFAULTS[component], **cfg}


def expected_tensors(component: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Source tensor names and torch shapes of a component, as the diffusers/transformers classes
    hold them (vocoder: weight-normed `weight_g`/`weight_v` pairs, alphas [1, C, 1])."""
    t: dict[str, tuple[int, ...]] = {}
    if component == "language_model":
        h, v, n_inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
        heads = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads") or heads
        hd = cfg.get("head_dim") or h // heads
        bias = bool(cfg.get("attention_bias", False))
        t["model.embed_tokens.weight"] = (v, h)
        if not cfg.get("tie_word_embeddings", False):
            t["lm_head.weight"] = (v, h)
        t["model.norm.weight"] = (h,)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = (h,)
            for proj, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
                t[p + f"self_attn.{proj}_proj.weight"] = (rows, h)
                if bias:
                    t[p + f"self_attn.{proj}_proj.bias"] = (rows,)
            t[p + "self_attn.o_proj.weight"] = (h, heads * hd)
            t[p + "self_attn.q_norm.weight"] = t[p + "self_attn.k_norm.weight"] = (hd,)
            t[p + "mlp.gate_proj.weight"] = t[p + "mlp.up_proj.weight"] = (n_inter, h)
            t[p + "mlp.down_proj.weight"] = (h, n_inter)
    elif component == "rvq_depth_decoder":
        h, inter, av, nc = (cfg[k] for k in ("hidden_size", "intermediate_size", "audio_vocab_size", "num_codebooks"))
        t["audio_embeddings.weight"] = (av * (nc - 1), h)
        t["projection.weight"] = (h, h)
        t["pos_embedding.weight"] = (cfg["max_position_embeddings"], h)
        for i in range(cfg["num_layers"]):
            p = f"layers.{i}."
            t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = (h,)
            for proj in ("to_q", "to_k", "to_v", "to_out"):
                t[p + f"attn.{proj}.weight"] = (h, h)
            t[p + "gate_proj.weight"] = t[p + "up_proj.weight"] = (inter, h)
            t[p + "down_proj.weight"] = (h, inter)
        t["norm.weight"] = (h,)
        for j in range(nc - 1):
            t[f"audio_heads.{j}.weight"] = (av, h)
    elif component == "condition_encoder":
        t["layer_weight_logits"] = (cfg["num_condition_layers"],)
        t["layer_scale"] = (1,)
        t["proj.weight"] = (cfg["out_dim"], cfg["condition_hidden_dim"], 3)
        t["proj.bias"] = (cfg["out_dim"],)
    elif component == "transformer":
        c, fe, ff = cfg["in_channels"], cfg["fourier_embedding_dim"], cfg["ff_inner_dim"]
        inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        cat = 2 * c + cfg["condition_dim"]  # [x, zeros, cond] channels
        t["time_proj.weight"] = (fe // 2, 1)
        t["time_embed.linear_1.weight"], t["time_embed.linear_1.bias"] = (inner, fe), (inner,)
        t["time_embed.linear_2.weight"], t["time_embed.linear_2.bias"] = (inner, inner), (inner,)
        t["preprocess_conv.weight"] = (cat, cat, 1)
        t["proj_in.weight"] = (inner, cat)
        for i in range(cfg["num_layers"]):
            p = f"transformer_blocks.{i}."
            for norm in ("norm1", "norm2"):
                t[p + f"{norm}.weight"] = t[p + f"{norm}.bias"] = (inner,)
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                t[p + f"attn.{proj}.weight"] = (inner, inner)
            t[p + "ff_in.weight"], t[p + "ff_in.bias"] = (2 * ff, inner), (2 * ff,)
            t[p + "ff_out.weight"], t[p + "ff_out.bias"] = (inner, ff), (inner,)
        t["proj_out.weight"] = (c, inner)
        t["postprocess_conv.weight"] = (c, c, 1)
    elif component == "vocoder":
        lc, di, dh = cfg["latent_channels"], cfg["decoder_input_dim"], cfg["decoder_hidden_dim"]

        def wn(name, c_out, c_in, k, bias_ch):  # weight-normed conv: g over dim 0
            t[name + ".weight_g"], t[name + ".weight_v"] = (c_out, 1, 1), (c_out, c_in, k)
            t[name + ".bias"] = (bias_ch,)

        t["dec_in_proj.weight"], t["dec_in_proj.bias"] = (di, lc // 2, 1), (di,)
        wn("conv_in", dh, di, 7, dh)
        c_out = dh
        for b, s in enumerate(cfg["upsampling_ratios"]):
            c_in, c_out = dh // 2 ** b, dh // 2 ** (b + 1)
            p = f"blocks.{b}."
            t[p + "snake1.alpha"] = (1, c_in, 1)
            wn(p + "conv_t1", c_in, c_out, 2 * s, c_out)  # ConvTranspose1d: dim 0 is the input channel
            for r in (1, 2, 3):
                t[p + f"res_unit{r}.snake1.alpha"] = t[p + f"res_unit{r}.snake2.alpha"] = (1, c_out, 1)
                wn(p + f"res_unit{r}.conv1", c_out, c_out, 7, c_out)
                wn(p + f"res_unit{r}.conv2", c_out, c_out, 1, c_out)
        t["snake_out.alpha"] = (1, c_out, 1)
        wn("conv_out", 1, c_out, 7, 1)
    else:
        raise ValueError(f"unknown component {component!r}, expected one of {sorted(COMPONENTS)}")
    return t


def _check_tensors(folder: Path, component: str, cfg: dict, entries: dict[str, TensorEntry]) -> None:
    want = expected_tensors(component, cfg)
    missing = [n for n in want if n not in entries]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise KeyError(f"{folder}: missing tensor(s) {', '.join(missing[:5])}{more} that config.json implies")
    for name, shape in want.items():
        if entries[name].shape != shape:
            raise ValueError(f"{entries[name].path}: tensor {name} has shape {list(entries[name].shape)}, "
                             f"expected {list(shape)} from {folder / 'config.json'}")
    extra = sorted(set(entries) - set(want))
    if extra:
        logger.warning("%s: %d tensor(s) not implied by config.json, copied as they are: %s", folder,
                       len(extra), ", ".join(extra[:5]))


# --------------------------------------------------------------------------------------------
# The vocoder encoder of the dav.pth training checkpoint (DAC naming).


def _flatten(obj, prefix=""):
    for k, v in obj.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v


def dav_encoder_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The encoder tensors of a dav.pth checkpoint, renamed to `encoder.*` (weight norm not folded)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) format: no mmap
        obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(obj).__name__}")
    flat = dict(_flatten(obj))
    # The state dict may sit under a wrapper key ("generator.", "state_dict." ...): find its prefix.
    prefix = next((m[1] for k in flat if (m := re.match(r"((?:[^.]+\.)*?)encoder\.block\.0\.", k))), None)
    if prefix is None:
        raise KeyError(f"{path}: no encoder.block.0.* tensor (expected the DAC encoder of the training checkpoint)")
    keys = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    tops = [int(m[1]) for k in keys if (m := re.match(r"encoder\.block\.(\d+)\.", k))]
    out = {}
    for key, t in keys.items():
        name = rename_dav_key(key, max(tops))
        if name is not None:
            out[name] = t
    return out


def expected_encoder_names(n_blocks: int) -> list[str]:
    """Renamed encoder tensors every checkpoint must hold (convs by their weight or weight_v)."""
    convs = ["encoder.conv_in", "encoder.conv_out", "encoder.mean_proj"]
    alphas = ["encoder.snake_out.alpha"]
    for b in range(n_blocks):
        p = f"encoder.blocks.{b}."
        convs.append(p + "conv1")
        alphas.append(p + "snake1.alpha")
        for r in (1, 2, 3):
            convs += [p + f"res_unit{r}.conv1", p + f"res_unit{r}.conv2"]
            alphas += [p + f"res_unit{r}.snake1.alpha", p + f"res_unit{r}.snake2.alpha"]
    return alphas + [c + ".weight" for c in convs]


# --------------------------------------------------------------------------------------------
# Writing.


class _Plan:
    """One output tensor: torch-order shape, dtype name, byte count and a function giving its data."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, data: Callable[[], np.ndarray]):
        self.name, self.shape, self.dtype, self.data = name, tuple(shape), dtype, data
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NP_OF[dtype]).itemsize


def _write(path: Path, arch: str, kv: list[tuple], plans: list[_Plan], component: str,
           progress: Progress | None) -> None:
    tmp = path.with_name(path.name + ".part")
    w = Writer(tmp, arch=arch)  # nothing is written to disk before write_streaming
    for key, value, vtype, sub in kv:
        w.add_key_value(key, value, vtype, sub)
    for p in plans:
        w.add_tensor_info(p.name, p.shape, np.dtype(_NP_OF[p.dtype]), p.nbytes, raw_dtype=_GGML[p.dtype])
    write_streaming(w, tmp, path, _tensor_data(plans, component, progress))


def _tensor_data(plans: list[_Plan], component: str, progress: Progress | None):
    total, done = sum(p.nbytes for p in plans), 0
    for p in plans:
        data = p.data()
        if data.nbytes != p.nbytes:
            raise AssertionError(f"{p.name}: {data.nbytes} bytes produced, {p.nbytes} planned")
        yield data
        done += p.nbytes
        if progress is not None:
            progress(component, done, total)


def _native_plans(entries: dict[str, TensorEntry]) -> list[_Plan]:
    """Byte-copy plans in the port's order: shard by shard (shards in file-name order, as
    `load_entries` lists them), names sorted within each shard, so a sharded checkpoint is not
    sorted globally."""
    by_shard: dict[Path, list[str]] = {}
    for name, e in entries.items():
        by_shard.setdefault(e.path, []).append(name)
    plans = []
    for names in by_shard.values():
        for name in sorted(names):
            e = entries[name]
            if e.dtype not in _GGML:
                raise ValueError(f"{e.path}: tensor {name} has dtype {e.dtype}, expected F32, F16 or BF16")
            plans.append(_Plan(name, e.shape, e.dtype, e.raw))
    return plans


def _f32(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to(torch.float32).numpy())


def _vae_plans(tensors: dict[str, Callable[[], torch.Tensor]], shapes: dict[str, tuple[int, ...]]) -> list[_Plan]:
    """F32 plans with weight-norm pairs folded and Snake alphas flattened to [C], sorted by output
    name (as the port writes them).

    The fold keeps torch's arithmetic (torch._weight_norm, what diffusers computes), not the port's
    numpy float32 one (g / sqrt(sum(v**2)) then v * that), so folded weights can differ from the
    port's file in the last bits; every other tensor is the same bytes.
    """
    plans = []
    for name in shapes:
        if name.endswith(".weight_g"):
            continue
        if name.endswith(".weight_v"):
            base = name[: -len("_v")]
            if base + "_g" not in tensors:
                raise KeyError(f"{name} has no matching {base}_g")
            v, g = tensors[name], tensors[base + "_g"]
            # torch._weight_norm is what torch.nn.utils.weight_norm (and so diffusers) computes.
            plans.append(_Plan(base, shapes[name], "F32",
                               lambda v=v, g=g: _f32(torch._weight_norm(v().float(), g().float(), 0))))
        elif name.endswith(".alpha"):
            n = int(np.prod(shapes[name]))
            plans.append(_Plan(name, (n,), "F32", lambda f=tensors[name]: _f32(f()).reshape(-1)))
        else:
            plans.append(_Plan(name, shapes[name], "F32", lambda f=tensors[name]: _f32(f())))
    return sorted(plans, key=lambda p: p.name)


def _output_type(folder: Path, component: str) -> str:
    """TYPE of the output name: the dtype holding most bytes for the byte-copied components, else F32."""
    if component not in NATIVE:
        return "F32"
    by: dict[str, int] = {}
    for e in load_entries(folder).values():
        by[e.dtype] = by.get(e.dtype, 0) + e.nbytes
    return max(by, key=by.get) if by else "F32"


def _component_folder(src: Path, component: str) -> Path:
    folder = src / component
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} not found (the {component} subfolder of the diffusers layout)")
    return folder


def component_metadata(component: str, cfg: dict, tokenizer_json: Path | None = None,
                       config_path: Path | str = "config.json") -> list[tuple]:
    """The metadata entries (key, value, type, element type) of a component file made from `cfg`;
    the LM's carry its config JSON and the tokenizer arrays of `tokenizer_json`."""
    arch, title = COMPONENTS[component]
    S, U32, I32, ARR = (gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
                        gguf.GGUFValueType.ARRAY)
    kv = [("general.name", title, S, None)]
    if component == "language_model":
        tokens, merges = tokenizer_arrays(tokenizer_json)
        if len(tokens) > cfg["vocab_size"]:
            raise ValueError(f"{tokenizer_json} has {len(tokens)} tokens, more than the LM "
                             f"vocab_size {cfg['vocab_size']} in {config_path}")
        kv += [("mm3.config_json", json.dumps(cfg, separators=(",", ":")), S, None),
               ("tokenizer.ggml.model", "gpt2", S, None),
               ("tokenizer.ggml.tokens", tokens, ARR, S)]
        if merges:  # as gguf-py's add_token_merges in the port: an empty list writes no key
            kv.append(("tokenizer.ggml.merges", merges, ARR, S))
    else:
        kv += [(f"{arch}.{k}", int(cfg[k]), U32, None) for k in U32_KEYS[component]]
    if component == "vocoder":
        kv.append((f"{arch}.upsampling_ratios", [int(r) for r in cfg["upsampling_ratios"]], ARR, I32))
    return kv


def _component_job(src: Path, component: str, dav: Path | None):
    """(kv list, plans) for one component."""
    folder = _component_folder(src, component)
    cfg = load_config(folder, component)
    entries = load_entries(folder)
    _check_tensors(folder, component, cfg, entries)
    kv = component_metadata(component, cfg, src / "tokenizer" / "tokenizer.json" if component == "language_model"
                            else None, folder / "config.json")
    if component in NATIVE:
        return kv, _native_plans(entries)
    tensors = {n: e.to_torch for n, e in entries.items()}
    shapes = {n: e.shape for n, e in entries.items()}
    if component == "vocoder" and dav is not None:
        enc = dav_encoder_tensors(dav)
        have = set(enc) | {n[: -len("_v")] for n in enc if n.endswith(".weight_v")}
        missing = [n for n in expected_encoder_names(len(cfg["upsampling_ratios"])) if n not in have]
        if missing:
            raise KeyError(f"{dav}: missing encoder tensor(s) {', '.join(missing[:5])} (renamed names)")
        tensors.update({n: (lambda t=t: t) for n, t in enc.items()})
        shapes.update({n: tuple(t.shape) for n, t in enc.items()})
    return kv, _vae_plans(tensors, shapes)


def _resolve_components(components) -> list[str]:
    if components is None:
        return list(COMPONENTS)
    out = []
    for c in components:
        c = ALIASES.get(c, c)
        if c not in COMPONENTS:
            raise ValueError(f"unknown component {c!r}, expected one of {sorted(COMPONENTS)} or {sorted(ALIASES)}")
        out.append(c)
    return out


def convert(src_dir, out_dir, *, dav=None, components=None, progress: Progress | None = None,
            prefix: str = "MiniMax-Music3-") -> list[Path]:
    """Convert `src_dir` (diffusers layout) into GGUF files in `out_dir`; returns their paths
    (existing outputs are kept and returned). `dav`: the training checkpoint whose encoder goes
    into the vocoder file (default `src_dir/dav.pth` when present). `components`: subfolder names
    or aliases (lm, depth, cond, dit, vae); all five by default. `progress(component, done_bytes,
    total_bytes)` is called after each tensor. `prefix`: the file names' start (`<prefix><subfolder>-<TYPE>.gguf`)."""
    src, out = Path(src_dir), Path(out_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} not found (expected the diffusers layout of MiniMax Music 3)")
    if dav is None and (src / "dav.pth").is_file():
        dav = src / "dav.pth"
    dav = Path(dav) if dav is not None else None
    if dav is not None and not dav.is_file():
        raise FileNotFoundError(f"{dav} not found (the dav.pth training checkpoint for the vocoder encoder)")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for component in _resolve_components(components):
        path = out / f"{prefix}{component}-{_output_type(_component_folder(src, component), component)}.gguf"
        if path.exists():
            logger.info("skip %s: %s exists", component, path)
        else:
            if component == "vocoder" and dav is None:
                logger.warning("no dav.pth: %s gets the decoder only (no encoder tensors)", path.name)
            kv, plans = _component_job(src, component, dav)
            _write(path, COMPONENTS[component][0], kv, plans, component, progress)
            logger.info("wrote %s (%d tensors, %.1f MB)", path, len(plans), path.stat().st_size / 1e6)
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------
# Command line.


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("convert", help="diffusers-layout safetensors, or ComfyUI's or HOT-Step's files -> "
                                              "the five MM3 GGUF files", description=convert.__doc__)
    p.add_argument("src", metavar="SRC", help="folder with language_model/, tokenizer/, ... (diffusers layout); "
                                              "with --from comfy/hotstep a file or a folder of such files")
    p.add_argument("--from", dest="layout", choices=("diffusers", "comfy", "hotstep"), default="diffusers",
                   help="layout of SRC: the diffusers checkpoint (default), ComfyUI's MiniMax Music 3 files "
                        "(text encoder, DiT, DAV; safetensors or GGUF), or HOT-Step's GGUFs")
    p.add_argument("out", metavar="OUT", help="output folder for the .gguf files")
    p.add_argument("--dav", metavar="PATH", help="dav.pth training checkpoint (default: SRC/dav.pth if present)")
    p.add_argument("--only", nargs="+", metavar="COMPONENT", choices=[*COMPONENTS, *ALIASES],
                   help=f"convert only these ({', '.join(COMPONENTS)} or {', '.join(ALIASES)})")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.getLogger("gguf").setLevel(logging.WARNING)  # its per-file plan lines repeat ours
    shown: dict[str, int] = {}

    def report(component, done, total):  # one line per 10 %
        step = 10 * done // max(total, 1)
        if step != shown.get(component):
            shown[component] = step
            print(f"  {component}: {100 * done // max(total, 1)}%", flush=True)

    if args.layout == "diffusers":
        paths = convert(args.src, args.out, dav=args.dav, components=args.only, progress=report)
    else:
        from .convert_foreign import convert_foreign

        kinds = [BY_FOLDER[c].kind for c in _resolve_components(args.only)] if args.only else None
        paths = convert_foreign(args.src, args.out, args.layout, components=kinds, progress=report)
    for path in paths:
        print(path)
    return 0

