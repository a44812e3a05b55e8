"""HOT-Step's MiniMax Music 3 GGUFs (its `convert-mm3.py` / `split-mm3.py`, converter version 1).

Every file carries `mm3.model` = "MiniMax-Music3". Five files: the LM (architecture `qwen3`, llama.cpp
names and keys, the tokenizer over all 200000 ids), `mm3-depth` / `mm3-cond` / `mm3-dit` (our
architecture strings, but tensors `depth.*`, `cond.*`, `dit.*` and no sizes under our keys),
`mm3-voc` (`voc.*`); or the legacy `mm3-synth-*` bundle (architecture `mm3`) with the last four. The
data is the reference's (weight norm already folded, no weight negated): renames, the DiT's fused
`attn_qkv` split by rows (q, k, v) and Snake alphas [1, C, 1] read as [C].
"""

from __future__ import annotations

import json

import numpy as np

from ..formats.gguf.errors import ComponentError
from . import mapped as M
from .source import Source

NAME = "HOT-Step"
MARKER = ("mm3.model", "MiniMax-Music3")
_PREFIX = {"depth": "depth.", "cond": "cond.", "dit": "dit.", "vae": "voc."}


def detect(src: Source) -> dict[str, tuple[str, callable]]:
    if src.format != "gguf" or src.metadata.get(MARKER[0]) != MARKER[1]:
        return {}
    found = {}
    if "token_embd.weight" in src.infos and "blk.0.attn_q.weight" in src.infos:
        found["lm"] = ("HOT-Step MiniMax Music 3 LM", _lm)
    bundle = src.metadata.get("general.architecture") == "mm3"
    what = "HOT-Step MiniMax Music 3 synthesis bundle" if bundle else "HOT-Step MiniMax Music 3 file"
    for kind, builder in (("depth", _depth), ("cond", _cond), ("dit", _dit), ("vae", _vae)):
        if any(n.startswith(_PREFIX[kind]) for n in src.infos):
            found[kind] = (what, builder)
    return found


def _meta(src: Source, key: str):
    value = src.metadata.get(key)
    if value is None:
        raise ComponentError(f"{src.path}: missing metadata {key} ({NAME} layout)")
    return value


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _lm(src: Source):
    q = "qwen3."
    layers = int(_meta(src, q + "block_count"))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "hidden_size": int(_meta(src, q + "embedding_length")),
              "intermediate_size": int(_meta(src, q + "feed_forward_length")),
              "num_hidden_layers": layers, "num_attention_heads": int(_meta(src, q + "attention.head_count")),
              "num_key_value_heads": int(_meta(src, q + "attention.head_count_kv")),
              "head_dim": int(_meta(src, q + "attention.key_length")),
              "vocab_size": M.shape_of(src, "token_embd.weight")[0],
              "rms_norm_eps": _f32(_meta(src, q + "attention.layer_norm_rms_epsilon")),
              "rope_theta": _f32(_meta(src, q + "rope.freq_base")),
              "max_position_embeddings": int(_meta(src, q + "context_length")),
              "tie_word_embeddings": False, "attention_bias": False}
    # The token list covers every LM id (codes and padding named by the converter); the text
    # tokens end where the codes begin.
    offset = int(_meta(src, "mm3.semantic_vocab_offset"))
    tokens = src.strings("tokenizer.ggml.tokens")[:offset]
    merges = src.strings("tokenizer.ggml.merges") if "tokenizer.ggml.merges" in src.metadata else []
    plans = [M.same(src, "model.embed_tokens.weight", "token_embd.weight"),
             M.same(src, "lm_head.weight", "output.weight"),
             M.same(src, "model.norm.weight", "output_norm.weight")]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(layers):
        plans += [M.same(src, f"model.layers.{i}.{ours}.weight", f"blk.{i}.{theirs}.weight")
                  for theirs, ours in names.items()]
    cfg = src.metadata.get("mm3.plan.ar.cfg_scale")
    if isinstance(cfg, float) and cfg > 0:
        config["trained_lm_cfg"] = _f32(cfg)  # the guidance the file was made for (1.0: a distilled composer LM)
    metadata = {"mm3.config_json": json.dumps(config), "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens}
    if merges:
        metadata["tokenizer.ggml.merges"] = merges
    return "mm3-lm", metadata, plans


def _depth(src: Source):
    d = "depth."
    layers = int(_meta(src, "mm3.depth.block_count"))
    codebooks = int(_meta(src, "mm3.depth.num_codebooks"))
    plans = [M.same(src, "audio_embeddings.weight", d + "audio_embd.weight"),
             M.same(src, "projection.weight", d + "proj.weight"),
             M.same(src, "pos_embedding.weight", d + "pos_embd.weight"),
             M.same(src, "norm.weight", d + "output_norm.weight")]
    plans += [M.same(src, f"audio_heads.{j}.weight", f"{d}head.{j}.weight") for j in range(codebooks - 1)]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "attn.to_q",
             "attn_k": "attn.to_k", "attn_v": "attn.to_v", "attn_output": "attn.to_out", "ffn_gate": "gate_proj",
             "ffn_up": "up_proj", "ffn_down": "down_proj"}
    for i in range(layers):
        plans += [M.same(src, f"layers.{i}.{ours}.weight", f"{d}blk.{i}.{theirs}.weight") for theirs, ours in names.items()]
    hp = {"hidden_size": _meta(src, "mm3.depth.embedding_length"), "num_layers": layers,
          "num_attention_heads": _meta(src, "mm3.depth.head_count"),
          "intermediate_size": _meta(src, "mm3.depth.feed_forward_length"),
          "audio_vocab_size": _meta(src, "mm3.depth.audio_vocab_size"), "num_codebooks": codebooks,
          "max_position_embeddings": _meta(src, "mm3.depth.max_position")}
    return "mm3-depth", M.sizes("mm3-depth", hp), plans


def _cond(src: Source):
    c = "mm3.cond."
    plans = [M.same(src, "layer_weight_logits", "cond.layer_logits"), M.same(src, "layer_scale", "cond.layer_scale"),
             M.same(src, "proj.weight", "cond.proj.weight"), M.same(src, "proj.bias", "cond.proj.bias")]
    hp = {"condition_hidden_dim": _meta(src, c + "hidden_dim"), "num_condition_layers": _meta(src, c + "num_layers"),
          "out_dim": _meta(src, c + "out_dim")}
    for k in ("input_sampling_rate", "input_hop_length", "output_sampling_rate", "output_hop_length"):
        hp[k] = _meta(src, c + k)
    return "mm3-cond", M.sizes("mm3-cond", hp), plans


def _dit(src: Source):
    d, k = "dit.", "mm3.dit."
    layers, inner = int(_meta(src, k + "block_count")), int(_meta(src, k + "embedding_length"))
    if _meta(src, k + "glu_order") != "value_gate":
        raise ComponentError(f"{src.path}: {k}glu_order {src.metadata[k + 'glu_order']!r}, expected 'value_gate'")
    plans = [M.same(src, "time_proj.weight", d + "time_fourier.weight"),
             M.same(src, "time_embed.linear_1.weight", d + "time_embd.0.weight"),
             M.same(src, "time_embed.linear_1.bias", d + "time_embd.0.bias"),
             M.same(src, "time_embed.linear_2.weight", d + "time_embd.1.weight"),
             M.same(src, "time_embed.linear_2.bias", d + "time_embd.1.bias"),
             M.same(src, "preprocess_conv.weight", d + "preprocess_conv.weight"),
             M.same(src, "postprocess_conv.weight", d + "postprocess_conv.weight"),
             M.same(src, "proj_in.weight", d + "proj_in.weight"), M.same(src, "proj_out.weight", d + "proj_out.weight")]
    for i in range(layers):
        a, o = f"{d}blk.{i}.", f"transformer_blocks.{i}."
        plans += [M.rows(src, o + f"attn.to_{n}.weight", a + "attn_qkv.weight", j * inner, (j + 1) * inner)
                  for j, n in enumerate("qkv")]
        pairs = {"attn_output.weight": "attn.to_out.0.weight", "attn_norm.weight": "norm1.weight",
                 "attn_norm.bias": "norm1.bias", "ffn_norm.weight": "norm2.weight", "ffn_norm.bias": "norm2.bias",
                 "ffn_in.weight": "ff_in.weight", "ffn_in.bias": "ff_in.bias", "ffn_out.weight": "ff_out.weight",
                 "ffn_out.bias": "ff_out.bias"}
        plans += [M.same(src, o + ours, a + theirs) for theirs, ours in pairs.items()]
    hp = {"in_channels": _meta(src, k + "in_channels"), "condition_dim": _meta(src, k + "condition_dim"),
          "num_layers": layers, "num_attention_heads": _meta(src, k + "head_count"),
          "attention_head_dim": _meta(src, k + "head_dim"), "ff_inner_dim": _meta(src, k + "ff_inner"),
          "rotary_dim": _meta(src, k + "rope_dim"), "fourier_embedding_dim": _meta(src, k + "fourier_dim")}
    return "mm3-dit", M.sizes("mm3-dit", hp), plans


def _vae(src: Source):
    v = "voc."
    rates = [int(r) for r in _meta(src, "mm3.voc.upsample_rates")]
    res = len(_meta(src, "mm3.voc.res_dilations"))

    def alpha(ours: str, theirs: str):
        return M.same(src, ours, theirs, (M.shape_of(src, theirs)[1],))

    plans = [M.same(src, "dec_in_proj.weight", v + "dec_in.weight"), M.same(src, "dec_in_proj.bias", v + "dec_in.bias"),
             M.same(src, "conv_in.weight", v + "conv_in.weight"), M.same(src, "conv_in.bias", v + "conv_in.bias"),
             alpha("snake_out.alpha", v + "snake_out.alpha"),
             M.same(src, "conv_out.weight", v + "conv_out.weight"), M.same(src, "conv_out.bias", v + "conv_out.bias")]
    for b in range(len(rates)):
        p, o = f"{v}blk.{b}.", f"blocks.{b}."
        plans += [alpha(o + "snake1.alpha", p + "snake.alpha"), M.same(src, o + "conv_t1.weight", p + "convt.weight"),
                  M.same(src, o + "conv_t1.bias", p + "convt.bias")]
        for r in range(res):
            q, u = f"{p}res.{r}.", f"{o}res_unit{r + 1}."
            plans += [alpha(u + "snake1.alpha", q + "snake1.alpha"), alpha(u + "snake2.alpha", q + "snake2.alpha")]
            plans += [M.same(src, u + f"{c}.{t}", q + f"{c}.{t}") for c in ("conv1", "conv2") for t in ("weight", "bias")]
    hp = {"latent_channels": int(_meta(src, "mm3.voc.latent_channels")),
          "sampling_rate": int(_meta(src, "mm3.voc.sampling_rate"))}
    return "mm3-vae", {**M.sizes("mm3-vae", hp), "mm3-vae.upsampling_ratios": rates}, plans
