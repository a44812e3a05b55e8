"""Tiny files in other tools' layouts, written from a tiny diffusers checkpoint (`mm3.tools.tiny`):
ComfyUI's three repackaged safetensors (written the way ComfyUI's modules name their state) and
GGUFs made from them; the same weights as our GGUFs of that checkpoint.

The tiny must use the sizes those layouts cannot record (`FOREIGN_SIZES`: ComfyUI fixes 16 depth
heads, 64-wide DiT heads and a 200000-row vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mm3.formats.diffusers import tokenizer_arrays

# Sizes of a tiny checkpoint that every foreign layout can describe.
FOREIGN_VOCAB = 200000
FOREIGN_SIZES = {"rvq_depth_decoder": {"num_attention_heads": 16},
                 "transformer": {"num_attention_heads": 1, "attention_head_dim": 64, "rotary_dim": 32}}


def _load(root: Path, component: str) -> dict[str, torch.Tensor]:
    folder = root / component
    files = sorted(folder.glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def _tokenizer_tensor(root: Path) -> torch.Tensor:
    data = (root / "tokenizer" / "tokenizer.json").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def comfy_text_encoder(root: Path, out: Path, *, pruned: bool = False, merged: bool = False,
                       dtype: torch.dtype | None = None) -> Path:
    """ComfyUI's text encoder: LM + depth decoder + tokenizer_json. `pruned`: the embedding split
    into text and audio rows and the head cut to END + the codes; `merged`: one qkv_proj and one
    gate_up_proj per layer (LM and depth decoder)."""
    lm, depth = _load(root, "language_model"), _load(root, "rvq_depth_decoder")
    cfg = json.loads((root / "language_model" / "config.json").read_text())
    tokens, _ = tokenizer_arrays(root / "tokenizer" / "tokenizer.json")
    code_offset, end = len(tokens), tokens.index("<|audio_end|>")
    sd: dict[str, torch.Tensor] = {}
    for name, t in lm.items():
        if name == "lm_head.weight":
            if pruned:
                sd["model.lm_head_pruned.weight"] = torch.cat([t[end:end + 1], t[code_offset:code_offset + 16384]])
            else:
                sd["model.lm_head.weight"] = t
        elif name == "model.embed_tokens.weight" and pruned:
            sd["model.embed_tokens_prefill.weight"] = t[:code_offset].clone()
            sd["model.embed_tokens_audio.weight"] = t[code_offset:code_offset + 16384].clone()
        else:
            sd[name] = t
    if merged:
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            sd[p + "self_attn.qkv_proj.weight"] = torch.cat([sd.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            sd[p + "mlp.gate_up_proj.weight"] = torch.cat([sd.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    d = "model.audio_decoder."
    for name, t in depth.items():
        f = name.split(".")
        if name == "audio_embeddings.weight":
            sd["model.audio_extra_embedding.weight"] = t
        elif f[0] == "layers" and f[2] == "attn":
            part = {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "o_proj"}[f[3]]
            sd[f"{d}layers.{f[1]}.self_attn.{part}.weight"] = t
        elif f[0] == "layers" and f[2] in ("gate_proj", "up_proj", "down_proj"):
            sd[f"{d}layers.{f[1]}.mlp.{f[2]}.weight"] = t
        else:
            sd[d + name] = t
    if merged:
        n_layers = sum(1 for k in sd if k.startswith(d + "layers.") and k.endswith("input_layernorm.weight"))
        for i in range(n_layers):
            p = f"{d}layers.{i}."
            sd[p + "self_attn.qkv_proj.weight"] = torch.cat([sd.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            sd[p + "mlp.gate_up_proj.weight"] = torch.cat([sd.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    sd["tokenizer_json"] = _tokenizer_tensor(root)
    save_file({k: v.contiguous() for k, v in sd.items()}, out)
    return out


def comfy_dit(root: Path, out: Path, *, prefix: str = "") -> Path:
    """ComfyUI's DiT file: the flow transformer with the condition encoder folded in, fused to_qkv."""
    tr, cond = _load(root, "transformer"), _load(root, "condition_encoder")
    cfg = json.loads((root / "transformer" / "config.json").read_text())
    d, t = "diffusion_transformer.", "diffusion_transformer.transformer."
    sd = {d + "preprocess_conv.weight": tr["preprocess_conv.weight"],
          d + "postprocess_conv.weight": tr["postprocess_conv.weight"],
          d + "timestep_features.weight": tr["time_proj.weight"],
          d + "to_timestep_embed.0.weight": tr["time_embed.linear_1.weight"],
          d + "to_timestep_embed.0.bias": tr["time_embed.linear_1.bias"],
          d + "to_timestep_embed.2.weight": tr["time_embed.linear_2.weight"],
          d + "to_timestep_embed.2.bias": tr["time_embed.linear_2.bias"],
          t + "project_in.weight": tr["proj_in.weight"], t + "project_out.weight": tr["proj_out.weight"]}
    rotary = cfg["rotary_dim"]
    sd[t + "rotary_pos_emb.inv_freq"] = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    for i in range(cfg["num_layers"]):
        a, o = f"transformer_blocks.{i}.", f"{t}layers.{i}."
        sd[o + "self_attn.to_qkv.weight"] = torch.cat([tr[a + f"attn.to_{n}.weight"] for n in "qkv"])
        sd[o + "self_attn.to_out.weight"] = tr[a + "attn.to_out.0.weight"]
        sd[o + "pre_norm.gamma"], sd[o + "pre_norm.beta"] = tr[a + "norm1.weight"], tr[a + "norm1.bias"]
        sd[o + "ff_norm.gamma"], sd[o + "ff_norm.beta"] = tr[a + "norm2.weight"], tr[a + "norm2.bias"]
        sd[o + "ff.ff.0.proj.weight"], sd[o + "ff.ff.0.proj.bias"] = tr[a + "ff_in.weight"], tr[a + "ff_in.bias"]
        sd[o + "ff.ff.2.weight"], sd[o + "ff.ff.2.bias"] = tr[a + "ff_out.weight"], tr[a + "ff_out.bias"]
    sd["cond_layer_logits"], sd["cond_layer_scale"] = cond["layer_weight_logits"], cond["layer_scale"]
    sd["latent_conditioners.0.weight"], sd["latent_conditioners.0.bias"] = cond["proj.weight"], cond["proj.bias"]
    save_file({prefix + k: v.contiguous() for k, v in sd.items()}, out)
    return out


_RES = {"snake1": "0", "conv1": "1", "snake2": "2", "conv2": "3"}


def comfy_dav(root: Path, out: Path, *, parametrizations: bool = False) -> Path:
    """ComfyUI's DAV file: the vocoder decoder in DAC's names, weight norm as weight_g / weight_v
    (the released file) or, with `parametrizations`, as a torch parametrizations state dict."""
    voc = _load(root, "vocoder")
    n = len({k.split(".")[1] for k in voc if k.startswith("blocks.")})
    sd = {}
    for name, t in voc.items():
        f = name.split(".")
        if f[0] == "dec_in_proj":
            key = name
        elif f[0] == "conv_in":
            key = "decoder.model.0." + ".".join(f[1:])
        elif f[0] == "snake_out":
            key = f"decoder.model.{n + 1}.alpha"
        elif f[0] == "conv_out":
            key = f"decoder.model.{n + 2}." + ".".join(f[1:])
        else:
            b = f"decoder.model.{int(f[1]) + 1}.block."
            if f[2].startswith("res_unit"):
                key = f"{b}{int(f[2][-1]) + 1}.block.{_RES[f[3]]}." + ".".join(f[4:])
            else:
                key = b + ("0." if f[2] == "snake1" else "1.") + ".".join(f[3:])
        if parametrizations:
            key = key.replace(".weight_g", ".parametrizations.weight.original0")
            key = key.replace(".weight_v", ".parametrizations.weight.original1")
        sd[key] = t
    save_file({k: v.contiguous() for k, v in sd.items()}, out)
    return out


def comfy_files(root: Path, folder: Path, **te) -> dict[str, Path]:
    """The three files in ComfyUI's model folders under `folder` (text_encoders, diffusion_models, vae)."""
    for sub in ("text_encoders", "diffusion_models", "vae"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    tag = "_pruned" if te.get("pruned") else ""
    return {"te": comfy_text_encoder(root, folder / "text_encoders" / f"minimax_music3_text_encoder{tag}_bf16.safetensors",
                                     **te),
            "dit": comfy_dit(root, folder / "diffusion_models" / "minimax_music3_dit_fp32.safetensors"),
            "vae": comfy_dav(root, folder / "vae" / "minimax_music3_dav.safetensors")}


# -- int8 (ComfyUI's "int8_convrot") ---------------------------------------------------------------
def _group(k: int) -> int:
    return next(g for g in (256, 64, 16, 4) if k % g == 0)


def convrot_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """comfy-kitchen's int8 ConvRot quantization of a [N, K] weight: (int8 q, float32 scale [N, 1], G)."""
    from mm3.dialects.comfy import hadamard

    n, k = w.shape
    g = _group(k)
    rot = (w.float().reshape(n, k // g, g) @ hadamard(g).T).reshape(n, k)
    scale = (rot.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(1e-30)
    return torch.round(rot / scale).clamp(-128, 127).to(torch.int8), scale, g


def int8_convrot(path: Path, out: Path, *, layers=("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "to_qkv",
                                                  "to_out", "ff.ff.0.proj", "ff.ff.2")) -> Path:
    """The int8 ConvRot variant of a ComfyUI safetensors file: the 2-D weights of `layers` as int8 +
    weight_scale + comfy_quant JSON, everything else as it is."""
    sd = load_file(path)
    out_sd = {}
    for name, t in sd.items():
        layer = name[:-len(".weight")] if name.endswith(".weight") else None
        if layer is not None and t.dim() == 2 and any(layer.endswith(x) for x in layers):
            q, scale, g = convrot_quantize(t)
            out_sd[name], out_sd[layer + ".weight_scale"] = q, scale
            cfg = json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": g}).encode()
            out_sd[layer + ".comfy_quant"] = torch.frombuffer(bytearray(cfg), dtype=torch.uint8)
        else:
            out_sd[name] = t
    save_file({k: v.contiguous() for k, v in out_sd.items()}, out)
    return out


# -- ComfyUI-GGUF conversions ------------------------------------------------------------------------
def comfy_gguf(path: Path, out: Path, *, quant: str | None = None, convrot: bool = False,
               tokenizer_as_float: bool = False) -> Path:
    """A GGUF of a ComfyUI safetensors file the way ComfyUI-GGUF's MiniMax converter writes it:
    architecture minimax_music3, the names verbatim, tokenizer_json as I8 bytes (or, as older files,
    the byte values as F32), 1-D tensors F32; with `quant` ("Q8_0", "Q4_0") the 2-D weights beyond
    1024 values in that type, with `convrot` as Q8_CR (I8 + `<name>_scale` + comfy.gguf.quant.<name>)."""
    import gguf
    import numpy as np

    sd = load_file(path)
    w = gguf.GGUFWriter(str(out), arch="minimax_music3")
    data = {}
    keep = ("embed_tokens_prefill", "embed_tokens_audio", "audio_extra_embedding", "pos_embedding")
    for name, t in sorted(sd.items()):
        if name == "tokenizer_json":
            if tokenizer_as_float:
                data[name] = (t.numpy().astype(np.float32), None)
            else:
                data[name] = (t.numpy().view(np.int8), gguf.GGMLQuantizationType.I8)
            continue
        arr = t.float().numpy()
        two_d = t.dim() == 2 and t.numel() > 1024 and not any(k in name for k in keep)
        if convrot and two_d and "lm_head" not in name and "audio_heads" not in name and "projection" not in name:
            q, scale, g = convrot_quantize(t)
            data[name] = (q.numpy(), gguf.GGMLQuantizationType.I8)
            data[name + "_scale"] = (scale.numpy(), None)
            w.add_string(f"comfy.gguf.quant.{name}", json.dumps(
                {"format": "int8_tensorwise", "convrot": True, "weight_rotated": True, "per_row": True,
                 "convrot_groupsize": g}))
        elif quant and two_d:
            qt = getattr(gguf.GGMLQuantizationType, quant)
            data[name] = (gguf.quants.quantize(arr, qt), qt)
        else:
            data[name] = (arr, None)
    for name, (arr, qt) in data.items():
        if qt is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# -- HOT-Step --------------------------------------------------------------------------------------
def _gguf_writer(out: Path, arch: str):
    import gguf

    w = gguf.GGUFWriter(str(out), arch=arch)
    w.add_string("mm3.model", "MiniMax-Music3")
    w.add_uint32("mm3.converter_version", 1)
    w.add_string("mm3.source_layout", "diffusers")
    return w


def _finish(w, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        w.add_tensor(name, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hotstep_lm(root: Path, w, lm_cfg: float = 1.5) -> dict[str, torch.Tensor]:
    lm = _load(root, "language_model")
    cfg = json.loads((root / "language_model" / "config.json").read_text())
    tokens, merges = tokenizer_arrays(root / "tokenizer" / "tokenizer.json")
    offset, vocab = len(tokens), cfg["vocab_size"]
    q = "qwen3."
    w.add_uint32(q + "context_length", cfg["max_position_embeddings"])
    w.add_uint32(q + "embedding_length", cfg["hidden_size"])
    w.add_uint32(q + "block_count", cfg["num_hidden_layers"])
    w.add_uint32(q + "feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(q + "attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(q + "attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_uint32(q + "attention.key_length", cfg["head_dim"])
    w.add_uint32(q + "attention.value_length", cfg["head_dim"])
    w.add_float32(q + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(q + "rope.freq_base", cfg["rope_theta"])
    w.add_uint32(q + "vocab_size", vocab)
    w.add_uint32("mm3.semantic_vocab_offset", offset)
    w.add_uint32("mm3.semantic_vocab_size", 16384)
    w.add_float32("mm3.plan.ar.cfg_scale", lm_cfg)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    names = tokens + [f"<|audio_code_{i - offset}|>" if i < offset + 16384 else f"[PAD{i}]" for i in range(offset, vocab)]
    w.add_token_list(names)
    if merges:
        w.add_token_merges(merges)
    out = {"token_embd.weight": lm["model.embed_tokens.weight"], "output.weight": lm["lm_head.weight"],
           "output_norm.weight": lm["model.norm.weight"]}
    parts = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(cfg["num_hidden_layers"]):
        for theirs, ours in parts.items():
            out[f"blk.{i}.{theirs}.weight"] = lm[f"model.layers.{i}.{ours}.weight"]
    return out


def _hotstep_synth(root: Path, w, kinds) -> dict[str, torch.Tensor]:
    out = {}
    if "depth" in kinds:
        d, cfg = _load(root, "rvq_depth_decoder"), json.loads((root / "rvq_depth_decoder" / "config.json").read_text())
        for k, v in (("block_count", cfg["num_layers"]), ("embedding_length", cfg["hidden_size"]),
                     ("feed_forward_length", cfg["intermediate_size"]), ("head_count", cfg["num_attention_heads"]),
                     ("max_position", cfg["max_position_embeddings"]), ("num_codebooks", cfg["num_codebooks"]),
                     ("audio_vocab_size", cfg["audio_vocab_size"])):
            w.add_uint32(f"mm3.depth.{k}", v)
        out.update({"depth.proj.weight": d["projection.weight"], "depth.pos_embd.weight": d["pos_embedding.weight"],
                    "depth.output_norm.weight": d["norm.weight"], "depth.audio_embd.weight": d["audio_embeddings.weight"]})
        out.update({f"depth.head.{j}.weight": d[f"audio_heads.{j}.weight"] for j in range(cfg["num_codebooks"] - 1)})
        parts = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "attn.to_q",
                 "attn_k": "attn.to_k", "attn_v": "attn.to_v", "attn_output": "attn.to_out", "ffn_gate": "gate_proj",
                 "ffn_up": "up_proj", "ffn_down": "down_proj"}
        for i in range(cfg["num_layers"]):
            out.update({f"depth.blk.{i}.{t}.weight": d[f"layers.{i}.{o}.weight"] for t, o in parts.items()})
    if "cond" in kinds:
        c, cfg = _load(root, "condition_encoder"), json.loads((root / "condition_encoder" / "config.json").read_text())
        for k, key in (("num_layers", "num_condition_layers"), ("hidden_dim", "condition_hidden_dim"),
                       ("out_dim", "out_dim"), ("input_sampling_rate", None), ("input_hop_length", None),
                       ("output_sampling_rate", None), ("output_hop_length", None)):
            w.add_uint32(f"mm3.cond.{k}", cfg[key or k])
        out.update({"cond.layer_logits": c["layer_weight_logits"], "cond.layer_scale": c["layer_scale"],
                    "cond.proj.weight": c["proj.weight"], "cond.proj.bias": c["proj.bias"]})
    if "dit" in kinds:
        t, cfg = _load(root, "transformer"), json.loads((root / "transformer" / "config.json").read_text())
        inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        for k, v in (("block_count", cfg["num_layers"]), ("embedding_length", inner),
                     ("head_count", cfg["num_attention_heads"]), ("head_dim", cfg["attention_head_dim"]),
                     ("ff_inner", cfg["ff_inner_dim"]), ("in_channels", cfg["in_channels"]),
                     ("condition_dim", cfg["condition_dim"]), ("rope_dim", cfg["rotary_dim"]),
                     ("fourier_dim", cfg["fourier_embedding_dim"])):
            w.add_uint32(f"mm3.dit.{k}", v)
        w.add_string("mm3.dit.glu_order", "value_gate")
        w.add_bool("mm3.dit.output_negated", True)
        r = cfg["rotary_dim"]
        out.update({"dit.preprocess_conv.weight": t["preprocess_conv.weight"],
                    "dit.postprocess_conv.weight": t["postprocess_conv.weight"],
                    "dit.time_fourier.weight": t["time_proj.weight"],
                    "dit.time_embd.0.weight": t["time_embed.linear_1.weight"],
                    "dit.time_embd.0.bias": t["time_embed.linear_1.bias"],
                    "dit.time_embd.1.weight": t["time_embed.linear_2.weight"],
                    "dit.time_embd.1.bias": t["time_embed.linear_2.bias"],
                    "dit.proj_in.weight": t["proj_in.weight"], "dit.proj_out.weight": t["proj_out.weight"],
                    "dit.rope_inv_freq": 1.0 / (10000.0 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))})
        pairs = {"attn_output.weight": "attn.to_out.0.weight", "attn_norm.weight": "norm1.weight",
                 "attn_norm.bias": "norm1.bias", "ffn_norm.weight": "norm2.weight", "ffn_norm.bias": "norm2.bias",
                 "ffn_in.weight": "ff_in.weight", "ffn_in.bias": "ff_in.bias", "ffn_out.weight": "ff_out.weight",
                 "ffn_out.bias": "ff_out.bias"}
        for i in range(cfg["num_layers"]):
            a = f"transformer_blocks.{i}."
            out[f"dit.blk.{i}.attn_qkv.weight"] = torch.cat([t[a + f"attn.to_{n}.weight"] for n in "qkv"])
            out.update({f"dit.blk.{i}.{k}": t[a + v] for k, v in pairs.items()})
    if "vae" in kinds:
        v, cfg = _load(root, "vocoder"), json.loads((root / "vocoder" / "config.json").read_text())
        w.add_uint32("mm3.voc.latent_channels", cfg["latent_channels"])
        w.add_uint32("mm3.voc.sampling_rate", cfg.get("sampling_rate", 44100))
        w.add_array("mm3.voc.upsample_rates", [int(x) for x in cfg["upsampling_ratios"]])
        w.add_array("mm3.voc.res_dilations", [1, 3, 9])

        def folded(name):  # weight norm folded as our converter does (HOT-Step folds in float64)
            return torch._weight_norm(v[name + ".weight_v"].float(), v[name + ".weight_g"].float(), 0)

        out.update({"voc.dec_in.weight": v["dec_in_proj.weight"], "voc.dec_in.bias": v["dec_in_proj.bias"],
                    "voc.conv_in.weight": folded("conv_in"), "voc.conv_in.bias": v["conv_in.bias"],
                    "voc.snake_out.alpha": v["snake_out.alpha"], "voc.conv_out.weight": folded("conv_out"),
                    "voc.conv_out.bias": v["conv_out.bias"]})
        for b in range(len(cfg["upsampling_ratios"])):
            p = f"blocks.{b}."
            out.update({f"voc.blk.{b}.snake.alpha": v[p + "snake1.alpha"], f"voc.blk.{b}.convt.weight": folded(p + "conv_t1"),
                        f"voc.blk.{b}.convt.bias": v[p + "conv_t1.bias"]})
            for r in range(3):
                u, o = f"{p}res_unit{r + 1}.", f"voc.blk.{b}.res.{r}."
                out.update({o + "snake1.alpha": v[u + "snake1.alpha"], o + "snake2.alpha": v[u + "snake2.alpha"],
                            o + "conv1.weight": folded(u + "conv1"), o + "conv1.bias": v[u + "conv1.bias"],
                            o + "conv2.weight": folded(u + "conv2"), o + "conv2.bias": v[u + "conv2.bias"]})
    return out


def hotstep_files(root: Path, folder: Path, *, bundle: bool = False, lm_cfg: float = 1.5) -> dict[str, Path]:
    """HOT-Step's GGUFs of the tiny checkpoint in `folder` (F32): the LM (made for `lm_cfg`), and the
    four split files or one legacy `mm3-synth` bundle."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"lm": folder / "mm3-lm-f32.gguf"}
    w = _gguf_writer(files["lm"], "qwen3")
    _finish(w, _hotstep_lm(root, w, lm_cfg))
    roles = {"depth": "depth", "cond": "cond", "dit": "dit", "vae": "voc"}
    if bundle:
        path = folder / "mm3-synth-f32.gguf"
        w = _gguf_writer(path, "mm3")
        _finish(w, _hotstep_synth(root, w, tuple(roles)))
        files.update({k: path for k in roles})
        return files
    for kind, role in roles.items():
        files[kind] = folder / f"mm3-{role}-f32.gguf"
        w = _gguf_writer(files[kind], f"mm3-{role}")
        _finish(w, _hotstep_synth(root, w, (kind,)))
    return files
