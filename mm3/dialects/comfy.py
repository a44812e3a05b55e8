"""ComfyUI's own MiniMax Music 3 files (the Comfy-Org repackaging) and GGUFs made from them.

Three files, each recognised by a signature tensor (never by file name): the text encoder (LM, depth
decoder, tokenizer), the DiT with the condition encoder folded in, and the DAV vocoder; each builder
below says its keys. Sizes come from the tensor shapes; what the files do not store is ComfyUI's fixed
configuration, kept below. A file may carry a key prefix (a saved checkpoint's `model.diffusion_model.`):
it is found from the signature key.
"""

from __future__ import annotations

import json
import math
import re

import torch

from ..formats.diffusers import rename_dav_key, tokenizer_arrays
from ..formats.gguf.errors import ComponentError
from . import mapped as M
from .source import Source

NAME = "ComfyUI"
# ComfyUI's fixed configuration (comfy/text_encoders/minimax_music.py MODEL_CONFIG, comfy/ldm/minimax_music/).
LM_FIXED = {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 10240}
LM_VOCAB_SIZE = 200000  # rows of the released LM; the reference draws its semantic code over all of them
DEPTH_HEADS = 16
DIT_HEAD_DIM = 64
DIT_ROTARY_DIM = 32  # where the file has no rotary_pos_emb.inv_freq
COND_RATES = {"input_sampling_rate": 24000, "input_hop_length": 960, "output_sampling_rate": 44100,
              "output_hop_length": 512}
VAE_SAMPLING_RATE = 44100

_TE_SIGNATURE = "audio_decoder.layers.0.input_layernorm.weight"
_DIT_SIGNATURE = "diffusion_transformer.transformer.layers.0.self_attn.to_qkv.weight"
_DAV_SIGNATURE = "decoder.model.0."


def _prefix(src: Source, signature: str) -> str | None:
    """The key prefix of the tensor whose name ends with `signature` (None: no such tensor)."""
    for key in src.infos:
        if key.endswith(signature):
            return key[:-len(signature)]
    return None


def detect(src: Source) -> dict[str, tuple[str, callable]]:
    """{kind: (what the file is, builder)} for the components this file holds in ComfyUI's layout."""
    found = {}
    p = _prefix(src, _TE_SIGNATURE)
    if p is not None and p.endswith("model."):
        what = "ComfyUI MiniMax Music 3 text encoder"
        if p + "layers.0.input_layernorm.weight" in src.infos:
            found["lm"] = (what, lambda s, p=p: _lm(s, p))
        found["depth"] = (what, lambda s, p=p: _depth(s, p))
    p = _prefix(src, _DIT_SIGNATURE)
    if p is not None and p + "cond_layer_logits" in src.infos:
        what = "ComfyUI MiniMax Music 3 DiT"
        found["cond"] = (what, lambda s, p=p: _cond(s, p))
        found["dit"] = (what, lambda s, p=p: _dit(s, p))
    p = _prefix(src, "dec_in_proj.weight")
    if p is not None and any(k.startswith(p + _DAV_SIGNATURE) for k in src.infos):
        found["vae"] = ("ComfyUI MiniMax Music 3 DAV vocoder", lambda s, p=p: _vae(s, p))
    return found


def _count(src: Source, pattern: str) -> int:
    n = 0
    while pattern.format(n) in src.infos:
        n += 1
    return n


# -- int8 weights ---------------------------------------------------------------------------------
# ComfyUI's int8 files ("int8_convrot"): per linear layer an int8 `weight`, a float32 `weight_scale`
# per output row and the `comfy_quant` JSON ({"format": "int8_tensorwise", "convrot": true,
# "convrot_groupsize": 256}); ComfyUI-GGUF's Q8_CR keeps the int8 tensor under the weight's name, the
# scale as `<name>_scale` and the JSON as metadata `comfy.gguf.quant.<name>`. The weight is
# W = ((q * scale) per group of G inputs) @ H, H the Sylvester-type Hadamard matrix of order G built
# from h4 and scaled by 1/sqrt(G) (comfy-kitchen's dequantize_int8_convrot_weight), computed here in
# float32 exactly as that reference does; the engine then holds it as float32.
_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


def hadamard(size: int) -> torch.Tensor:
    h = torch.tensor(_H4, dtype=torch.float32)
    out = h
    while out.shape[0] < size:
        out = torch.kron(out, h)
    if out.shape[0] != size:
        raise ComponentError(f"int8 rotation group {size} is not a power of 4")
    return out / math.sqrt(size)


def _int8_config(src: Source, weight: str) -> tuple[str, dict] | None:
    """(scale tensor, quantization config) of an int8 weight, None for any other weight."""
    info = src.infos.get(weight)
    if info is None or info.type != "I8":
        return None
    raw = None
    if weight.endswith(".weight") and weight[:-len("weight")] + "comfy_quant" in src.infos:
        raw, scale = src.raw_bytes(weight[:-len("weight")] + "comfy_quant"), weight + "_scale"
    elif f"comfy.gguf.quant.{weight}" in src.metadata:
        raw, scale = src.metadata[f"comfy.gguf.quant.{weight}"], weight + "_scale"
    if raw is None or scale not in src.infos:
        raise ComponentError(f"{src.path}: tensor {weight} is int8 without the scale and quantization config "
                             "ComfyUI stores beside it")
    try:
        cfg = json.loads(raw if isinstance(raw, str) else bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ComponentError(f"{src.path}: the quantization config of {weight} is not JSON ({e})") from None
    cfg = {**cfg.get("params", {}), **cfg} if isinstance(cfg, dict) else {}
    if cfg.get("format") != "int8_tensorwise":
        raise ComponentError(f"{src.path}: tensor {weight} is in ComfyUI's {cfg.get('format')!r} format; this engine "
                             "reads its int8_tensorwise (convrot) weights only: use the bf16 file")
    return scale, cfg


def _int8_weight(src: Source, weight: str, scale: str, cfg: dict) -> torch.Tensor:
    q = src.int8(weight)
    n, k = q.shape
    s = src.tensor(scale).dequantize(torch.float32)
    if s.numel() not in (1, n):
        raise ComponentError(f"{src.path}: {scale} holds {s.numel()} scales, expected 1 or one per row of {weight} ({n})")
    w = q.float() * s.reshape(-1, 1)
    if cfg.get("convrot", False):
        g = int(cfg.get("convrot_groupsize", 256))
        if k % g:
            raise ComponentError(f"{src.path}: {weight} has {k} inputs, not a multiple of its rotation group {g}")
        w = (w.reshape(n, k // g, g) @ hadamard(g).T).reshape(n, k)
    return w


def _int8_rows(src, weight, scale, cfg, start, stop):
    """Rows of a dequantized int8 weight; the parts of a fused one (q, k, v) share one dequantization
    (the last one is kept in `src.derived`)."""
    memo = src.derived.get("int8")
    if memo is None or memo[0] != weight:
        memo = src.derived["int8"] = (weight, _int8_weight(src, weight, scale, cfg))
    return memo[1][start:stop]


def _same(src: Source, name: str, source_name: str, shape=None) -> M.Plan:
    q = _int8_config(src, source_name)
    if q is None:
        return M.same(src, name, source_name, shape)
    n = src.infos[source_name].shape[0]
    return M.computed(name, src.infos[source_name].shape, lambda s: _int8_rows(s, source_name, *q, 0, n))


def _rows(src: Source, name: str, source_name: str, start: int, stop: int) -> M.Plan:
    q = _int8_config(src, source_name)
    if q is None:
        return M.rows(src, name, source_name, start, stop)
    k = src.infos[source_name].shape[1]
    return M.computed(name, (stop - start, k), lambda s: _int8_rows(s, source_name, *q, start, stop))


# -- text encoder ---------------------------------------------------------------------------------
def tokenizer_json(src: Source) -> dict:
    name = next((k for k in src.infos if k == "tokenizer_json" or k.endswith(".tokenizer_json")), None)
    if name is None:
        raise ComponentError(f"{src.path}: no tokenizer_json tensor (a {NAME} MiniMax Music 3 text encoder carries "
                             "its tokenizer)")
    info = src.infos[name]
    if info.type in ("U8", "I8"):
        data = src.raw_bytes(name)
    else:  # older ComfyUI-GGUF files: the byte values as floats
        data = bytes(src.tensor(name).dequantize(torch.float32).round().to(torch.uint8).tolist())
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ComponentError(f"{src.path}: tokenizer_json is not a tokenizer.json ({e})") from None


def _lm(src: Source, p: str):
    """The LM of a text encoder, keys `model.*` as in `comfy/text_encoders/minimax_music.py`: q/k/v
    separate or one `qkv_proj` (rows q, k, v), gate/up separate or one `gate_up_proj` (rows gate, up).
    The "pruned" variant keeps only the rows the model can use: `embed_tokens_prefill` (text ids) +
    `embed_tokens_audio` (semantic codes), and `lm_head_pruned` (row 0 = END, row 1 + c = code c)."""
    try:
        tokens, merges = tokenizer_arrays(tokenizer_json(src), source=f"{src.path} tokenizer_json")
    except ComponentError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise ComponentError(f"{src.path}: tokenizer_json is not a usable tokenizer.json ({e})") from None
    code_offset = len(tokens)
    layers = _count(src, p + "layers.{}.input_layernorm.weight")
    head_dim = M.shape_of(src, p + "layers.0.self_attn.q_norm.weight")[0]
    hidden = M.shape_of(src, p + "norm.weight")[0]
    heads = M.shape_of(src, p + "layers.0.self_attn.o_proj.weight")[1] // head_dim
    merged_qkv = p + "layers.0.self_attn.qkv_proj.weight" in src.infos
    if merged_qkv:
        kv = (M.shape_of(src, p + "layers.0.self_attn.qkv_proj.weight")[0] // head_dim - heads) // 2
    else:
        kv = M.shape_of(src, p + "layers.0.self_attn.k_proj.weight")[0] // head_dim
    intermediate = M.shape_of(src, p + "layers.0.mlp.down_proj.weight")[1]
    plans = [_same(src, "model.norm.weight", p + "norm.weight")]
    for i in range(layers):
        a, o = f"{p}layers.{i}.", f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                  "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.down_proj.weight"):
            plans.append(_same(src, o + n, a + n))
        if a + "self_attn.qkv_proj.weight" in src.infos:
            q, k = heads * head_dim, kv * head_dim
            for n, lo, hi in (("q", 0, q), ("k", q, q + k), ("v", q + k, q + 2 * k)):
                plans.append(_rows(src, o + f"self_attn.{n}_proj.weight", a + "self_attn.qkv_proj.weight", lo, hi))
        else:
            plans += [_same(src, o + f"self_attn.{n}_proj.weight", a + f"self_attn.{n}_proj.weight") for n in "qkv"]
        if a + "mlp.gate_up_proj.weight" in src.infos:
            plans.append(_rows(src, o + "mlp.gate_proj.weight", a + "mlp.gate_up_proj.weight", 0, intermediate))
            plans.append(_rows(src, o + "mlp.up_proj.weight", a + "mlp.gate_up_proj.weight", intermediate,
                                2 * intermediate))
        else:
            plans += [_same(src, o + f"mlp.{n}_proj.weight", a + f"mlp.{n}_proj.weight") for n in ("gate", "up")]

    extra, vocab = {}, None
    if p + "embed_tokens.weight" in src.infos:
        plans.append(_same(src, "model.embed_tokens.weight", p + "embed_tokens.weight"))
        vocab = M.shape_of(src, p + "embed_tokens.weight")[0]
    else:
        text, audio = p + "embed_tokens_prefill.weight", p + "embed_tokens_audio.weight"
        n_text, n_audio = M.shape_of(src, text)[0], M.shape_of(src, audio)[0]
        if n_text != code_offset:
            raise ComponentError(f"{src.path}: embed_tokens_prefill has {n_text} rows, the tokenizer {code_offset} "
                                 "tokens (they must agree: codes follow the text ids)")
        plans.append(M.stacked(src, "model.embed_tokens.weight", [(text, 0, n_text), (audio, 0, n_audio)]))
        extra["embed_rows"] = n_text + n_audio
    if p + "lm_head.weight" in src.infos:
        plans.append(_same(src, "lm_head.weight", p + "lm_head.weight"))
        vocab = vocab or M.shape_of(src, p + "lm_head.weight")[0]
    else:
        head = p + "lm_head_pruned.weight"
        n = M.shape_of(src, head)[0]
        end = tokens.index("<|audio_end|>") if "<|audio_end|>" in tokens else None
        if end is None or end >= code_offset:
            raise ComponentError(f"{src.path}: the tokenizer has no <|audio_end|> below the codes")
        # Rows of ids END .. last code: END, the ids between it and the codes (never drawn), the codes.
        plans.append(M.stacked(src, "lm_head.weight", [(head, 0, 1), code_offset - end - 1, (head, 1, n)]))
        extra.update(head_start=end, head_rows=code_offset - end + n - 1)
    if vocab is None:
        vocab = max(LM_VOCAB_SIZE, extra["embed_rows"])
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab, "tie_word_embeddings": False,
              "attention_bias": False, **LM_FIXED, **extra}
    metadata = {"mm3.config_json": json.dumps(config), "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens}
    if merges:
        metadata["tokenizer.ggml.merges"] = merges
    return "mm3-lm", metadata, plans


def _depth(src: Source, p: str):
    """The RVQ depth decoder of a text encoder, under `model.audio_decoder.`, its code embeddings in
    `model.audio_extra_embedding`."""
    d = p + "audio_decoder."
    layers = _count(src, d + "layers.{}.input_layernorm.weight")
    heads = _count(src, d + "audio_heads.{}.weight")
    hidden = M.shape_of(src, d + "norm.weight")[0]
    intermediate = M.shape_of(src, d + "layers.0.mlp.down_proj.weight")[1]
    plans = [_same(src, "audio_embeddings.weight", p + "audio_extra_embedding.weight"),
             _same(src, "projection.weight", d + "projection.weight"),
             _same(src, "pos_embedding.weight", d + "pos_embedding.weight"),
             _same(src, "norm.weight", d + "norm.weight")]
    plans += [_same(src, f"audio_heads.{j}.weight", d + f"audio_heads.{j}.weight") for j in range(heads)]
    for i in range(layers):
        a, o = f"{d}layers.{i}.", f"layers.{i}."
        plans += [_same(src, o + n, a + n) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        plans.append(_same(src, o + "attn.to_out.weight", a + "self_attn.o_proj.weight"))
        if a + "self_attn.qkv_proj.weight" in src.infos:
            plans += [_rows(src, o + f"attn.to_{n}.weight", a + "self_attn.qkv_proj.weight", j * hidden,
                             (j + 1) * hidden) for j, n in enumerate("qkv")]
        else:
            plans += [_same(src, o + f"attn.to_{n}.weight", a + f"self_attn.{n}_proj.weight") for n in "qkv"]
        if a + "mlp.gate_up_proj.weight" in src.infos:
            plans += [_rows(src, o + "gate_proj.weight", a + "mlp.gate_up_proj.weight", 0, intermediate),
                      _rows(src, o + "up_proj.weight", a + "mlp.gate_up_proj.weight", intermediate, 2 * intermediate)]
        else:
            plans += [_same(src, o + f"{n}.weight", a + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj")]
        plans.append(_same(src, o + "down_proj.weight", a + "mlp.down_proj.weight"))
    hp = {"hidden_size": hidden, "num_layers": layers, "num_attention_heads": DEPTH_HEADS,
          "intermediate_size": intermediate, "audio_vocab_size": M.shape_of(src, d + "audio_heads.0.weight")[0],
          "num_codebooks": heads + 1, "max_position_embeddings": M.shape_of(src, d + "pos_embedding.weight")[0]}
    return "mm3-depth", M.sizes("mm3-depth", hp), plans


# -- DiT and condition encoder --------------------------------------------------------------------
def _cond(src: Source, p: str):
    """The condition encoder folded into the DiT file (`cond_layer_logits`, `cond_layer_scale`,
    `latent_conditioners.0`)."""
    w = M.shape_of(src, p + "latent_conditioners.0.weight")
    plans = [_same(src, "layer_weight_logits", p + "cond_layer_logits"),
             _same(src, "layer_scale", p + "cond_layer_scale"),
             _same(src, "proj.weight", p + "latent_conditioners.0.weight"),
             _same(src, "proj.bias", p + "latent_conditioners.0.bias")]
    hp = {"condition_hidden_dim": w[1], "num_condition_layers": M.shape_of(src, p + "cond_layer_logits")[0],
          "out_dim": w[0], **COND_RATES}
    return "mm3-cond", M.sizes("mm3-cond", hp), plans


def _dit(src: Source, p: str):
    """The flow transformer (`comfy/ldm/minimax_music/dit.py`) under `diffusion_transformer.`, fused
    `to_qkv` (rows q, k, v). ComfyUI's wrapper negates the output and feeds 1 - t; the weights are the
    reference's, so nothing here changes sign."""
    d, t = p + "diffusion_transformer.", p + "diffusion_transformer.transformer."
    layers = _count(src, t + "layers.{}.self_attn.to_qkv.weight")
    inner = M.shape_of(src, t + "project_in.weight")[0]
    channels = M.shape_of(src, d + "postprocess_conv.weight")[0]
    if inner % DIT_HEAD_DIM:
        raise ComponentError(f"{src.path}: DiT width {inner} is not a multiple of ComfyUI's head size {DIT_HEAD_DIM}")
    rotary = DIT_ROTARY_DIM
    if t + "rotary_pos_emb.inv_freq" in src.infos:
        rotary = 2 * M.shape_of(src, t + "rotary_pos_emb.inv_freq")[0]
    plans = [_same(src, "time_proj.weight", d + "timestep_features.weight"),
             _same(src, "time_embed.linear_1.weight", d + "to_timestep_embed.0.weight"),
             _same(src, "time_embed.linear_1.bias", d + "to_timestep_embed.0.bias"),
             _same(src, "time_embed.linear_2.weight", d + "to_timestep_embed.2.weight"),
             _same(src, "time_embed.linear_2.bias", d + "to_timestep_embed.2.bias"),
             _same(src, "preprocess_conv.weight", d + "preprocess_conv.weight"),
             _same(src, "postprocess_conv.weight", d + "postprocess_conv.weight"),
             _same(src, "proj_in.weight", t + "project_in.weight"),
             _same(src, "proj_out.weight", t + "project_out.weight")]
    for i in range(layers):
        a, o = f"{t}layers.{i}.", f"transformer_blocks.{i}."
        plans += [_rows(src, o + f"attn.to_{n}.weight", a + "self_attn.to_qkv.weight", j * inner, (j + 1) * inner)
                  for j, n in enumerate("qkv")]
        plans += [_same(src, o + "attn.to_out.0.weight", a + "self_attn.to_out.weight"),
                  _same(src, o + "norm1.weight", a + "pre_norm.gamma"), _same(src, o + "norm1.bias", a + "pre_norm.beta"),
                  _same(src, o + "norm2.weight", a + "ff_norm.gamma"), _same(src, o + "norm2.bias", a + "ff_norm.beta"),
                  _same(src, o + "ff_in.weight", a + "ff.ff.0.proj.weight"),
                  _same(src, o + "ff_in.bias", a + "ff.ff.0.proj.bias"),
                  _same(src, o + "ff_out.weight", a + "ff.ff.2.weight"), _same(src, o + "ff_out.bias", a + "ff.ff.2.bias")]
    hp = {"in_channels": channels, "condition_dim": M.shape_of(src, d + "preprocess_conv.weight")[0] - 2 * channels,
          "num_layers": layers, "num_attention_heads": inner // DIT_HEAD_DIM, "attention_head_dim": DIT_HEAD_DIM,
          "ff_inner_dim": M.shape_of(src, t + "layers.0.ff.ff.2.weight")[1], "rotary_dim": rotary,
          "fourier_embedding_dim": 2 * M.shape_of(src, d + "timestep_features.weight")[0]}
    return "mm3-dit", M.sizes("mm3-dit", hp), plans


# -- vocoder --------------------------------------------------------------------------------------
_RES_PARTS = ("snake1", "conv1", "snake2", "conv2")  # a residual unit's block.0 .. block.3


def _fold(src: Source, name: str, source: str) -> M.Plan:
    """A conv weight (weight-normed as torch parametrizations, as weight_g/weight_v, or plain)."""
    for g, v in ((source + ".parametrizations.weight.original0", source + ".parametrizations.weight.original1"),
                 (source + ".weight_g", source + ".weight_v")):
        if g in src.infos and v in src.infos:
            # torch._weight_norm over dim 0, in float32: what our converter writes for the same g and v.
            return M.computed(name, M.shape_of(src, v), lambda s, g=g, v=v: torch._weight_norm(
                M.as_float(s, v), M.as_float(s, g), 0))
    return _same(src, name, source + ".weight")


def _vae(src: Source, p: str):
    """The vocoder decoder (`comfy/ldm/minimax_music/dav.py`) in DAC's names (`decoder.model.K...`),
    convs weight-normed as torch parametrizations (`original0` = g, `original1` = v), folded by `_fold`."""
    m = p + "decoder.model."
    blocks = 0
    while f"{m}{blocks + 1}.block.0.alpha" in src.infos:
        blocks += 1
    if not blocks:
        raise ComponentError(f"{src.path}: no decoder blocks ({m}1.block.0.alpha) in the {NAME} DAV layout")
    plans = [_same(src, "dec_in_proj.weight", p + "dec_in_proj.weight"),
             _same(src, "dec_in_proj.bias", p + "dec_in_proj.bias")]

    def conv(name: str, source: str):
        plans.append(_fold(src, name + ".weight", source))
        plans.append(_same(src, name + ".bias", source + ".bias"))

    def alpha(name: str, source: str):
        c = M.shape_of(src, source)
        plans.append(_same(src, name, source, (c[1] if len(c) == 3 else c[-1],)))

    conv("conv_in", m + "0")
    ratios = []
    for b in range(blocks):
        s = f"{m}{b + 1}.block."
        alpha(f"blocks.{b}.snake1.alpha", s + "0.alpha")
        conv(f"blocks.{b}.conv_t1", s + "1")
        ratios.append(plans[-2].shape[2] // 2)  # ConvTranspose1d kernel = 2 x stride
        for r in range(3):
            for j, part in enumerate(_RES_PARTS):
                source = f"{s}{r + 2}.block.{j}"
                if part.startswith("snake"):
                    alpha(f"blocks.{b}.res_unit{r + 1}.{part}.alpha", source + ".alpha")
                else:
                    conv(f"blocks.{b}.res_unit{r + 1}.{part}", source)
    alpha("snake_out.alpha", f"{m}{blocks + 1}.alpha")
    conv("conv_out", f"{m}{blocks + 2}")
    plans += _encoder_plans(src, p)
    hp = {"latent_channels": 2 * M.shape_of(src, p + "dec_in_proj.weight")[1], "sampling_rate": VAE_SAMPLING_RATE}
    meta = {**M.sizes("mm3-vae", hp), "mm3-vae.upsampling_ratios": ratios}
    return "mm3-vae", meta, plans


def _encoder_plans(src: Source, p: str) -> list[M.Plan]:
    """The vocoder encoder where the file has one (the DAC training names of dav.pth)."""
    keys = [k[len(p):] for k in src.infos if k.startswith(p + "encoder.block.") or k.startswith(p + "mean_proj.")]
    if not keys:
        return []
    tops = [int(x[1]) for k in keys if (x := re.match(r"encoder\.block\.(\d+)\.", k))]
    if not tops:  # a posterior projection without the encoder itself: nothing to encode with
        return []
    convs, out = {}, []
    for key in keys:
        try:
            name = rename_dav_key(key, max(tops))
        except KeyError as e:
            raise ComponentError(f"{src.path}: {e.args[0]}") from None
        if name is None:
            continue
        for tail in (".parametrizations.weight.original0", ".parametrizations.weight.original1", ".weight_g",
                     ".weight_v", ".weight"):
            if key.endswith(tail):
                convs[name[:-len(tail)]] = p + key[:-len(tail)]
                break
        else:
            if key.endswith(".alpha"):
                c = M.shape_of(src, p + key)
                out.append(_same(src, name, p + key, (c[1] if len(c) == 3 else c[-1],)))
            else:
                out.append(_same(src, name, p + key))
    out += [_fold(src, name + ".weight", source) for name, source in sorted(convs.items())]
    return out
