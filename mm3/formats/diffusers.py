"""The diffusers checkpoint's conventions that the converters and the dialects share: its
constructor defaults and the GGUF metadata keys they become, a HF tokenizer.json as the GGUF token
arrays, and the vocoder encoder's DAC training names (dav.pth) as the engine's `encoder.*` names."""

from __future__ import annotations

import json
import re
from pathlib import Path

# Source: the constructor defaults of diffusers 0.42.1's MiniMax Music 3 model classes (the released
# checkpoint's sizes): as in diffusers, a key missing from config.json means its default. Read by the
# converters, the tiny model and the bench; converted files carry the sizes in their metadata, which
# is where the engine reads them.
DIFFUSERS_DEFAULTS = {
    "rvq_depth_decoder": dict(hidden_size=4096, num_layers=4, num_attention_heads=16, intermediate_size=6144,
                              audio_vocab_size=1024, num_codebooks=8, max_position_embeddings=16),
    "condition_encoder": dict(condition_hidden_dim=4096, num_condition_layers=8, out_dim=2048,
                              input_sampling_rate=24000, input_hop_length=960, output_sampling_rate=44100,
                              output_hop_length=512),
    "transformer": dict(in_channels=128, condition_dim=2048, num_layers=36, num_attention_heads=32,
                        attention_head_dim=64, ff_inner_dim=8192, rotary_dim=32, fourier_embedding_dim=256),
    "vocoder": dict(latent_channels=128, decoder_input_dim=1024, decoder_hidden_dim=1536,
                    upsampling_ratios=[8, 8, 4, 2], sampling_rate=44100),
}
# u32 metadata keys `<arch>.<key>` per component; the vocoder's ratios are an INT32 array.
U32_KEYS = {
    "rvq_depth_decoder": list(DIFFUSERS_DEFAULTS["rvq_depth_decoder"]),
    "condition_encoder": list(DIFFUSERS_DEFAULTS["condition_encoder"]),
    "transformer": list(DIFFUSERS_DEFAULTS["transformer"]),
    "vocoder": ["latent_channels", "sampling_rate"],
}

# Tokenizer arrays for the LM file.


def tokenizer_arrays(tokenizer_json: Path | dict, *, source: str | None = None) -> tuple[list[str], list[str]]:
    """(tokens by id, merges as "a b") of a HF tokenizer.json (a path, or its parsed content named
    `source` in errors): base vocab plus added tokens in their id slots. The ids must be contiguous
    from 0."""
    if isinstance(tokenizer_json, dict):
        tj = tokenizer_json
    else:
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"{tokenizer_json} not found (the LM file embeds the tokenizer)")
        tj = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    tokenizer_json = source or tokenizer_json
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{tokenizer_json}: model type {model.get('type')!r}, expected 'BPE'")
    by_id: dict[int, str] = {}
    for text, i in model["vocab"].items():
        if i in by_id:
            raise ValueError(f"{tokenizer_json}: id {i} is used by {by_id[i]!r} and {text!r}")
        by_id[i] = text
    for added in tj.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
    n = max(by_id) + 1 if by_id else 0
    if len(by_id) != n:
        gap = next(i for i in range(n) if i not in by_id)
        raise ValueError(f"{tokenizer_json}: no token for id {gap}; ids must be contiguous 0..{n - 1}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return [by_id[i] for i in range(n)], merges


# --------------------------------------------------------------------------------------------
# The vocoder encoder of the dav.pth training checkpoint (DAC naming).

_RES_PART = {"0": "snake1", "1": "conv1", "2": "snake2", "3": "conv2"}  # inside a residual unit


def rename_dav_key(key: str, last: int) -> str | None:
    """DAC training name -> `encoder.*` name (None for keys outside the encoder). `last` is the
    index of the final conv in `encoder.block` (6 for four encoder blocks)."""
    if key.startswith("mean_proj."):
        return "encoder." + key
    m = re.fullmatch(r"encoder\.block\.(\d+)\.(.+)", key)
    if m is None:
        return None
    k, rest = int(m[1]), m[2]
    if k == 0:
        return "encoder.conv_in." + rest
    if k == last:
        return "encoder.conv_out." + rest
    if k == last - 1:
        return "encoder.snake_out." + rest
    m = re.fullmatch(r"block\.(\d+)\.(?:block\.([0-3])\.)?(.+)", rest)
    if m is None or (m[2] is None) == (m[1] in ("0", "1", "2")):
        raise KeyError(f"unexpected encoder tensor {key!r} (DAC EncoderBlock naming expected)")
    if m[2] is not None:
        tail = f"res_unit{int(m[1]) + 1}.{_RES_PART[m[2]]}.{m[3]}"
    elif m[1] == "3":
        tail = "snake1." + m[3]
    elif m[1] == "4":
        tail = "conv1." + m[3]
    else:
        raise KeyError(f"unexpected encoder tensor {key!r} (EncoderBlock has parts 0..4)")
    return f"encoder.blocks.{k - 1}.{tail}"
