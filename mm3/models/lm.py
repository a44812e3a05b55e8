"""The global language model: Qwen3 (transformers `Qwen3ForCausalLM` names) with a static KV cache.

Decoder-only, pre-norm: RMSNorm -> attention (q_norm / k_norm over the head dim before RoPE, GQA)
-> residual; RMSNorm -> SwiGLU MLP -> residual; final RMSNorm. Every size comes from the config
JSON stored in the GGUF (`mm3.config_json`). The AR stage calls its parts directly: the token
embedding, the decoder over `inputs_embeds` with the cache, and the LM head (SPEC section 4).

Numerics follow transformers 5 on purpose (float32 RMSNorm, RoPE tables computed per call with the
same shapes, SDPA with `enable_gqa`), so that on CPU float32 the hidden states are bit-identical to
the reference's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gguf import ops as default_ops
from ..gguf.errors import ComponentError
from ..gguf.ops import load_tensors


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the variance in float32 (transformers Qwen3RMSNorm / diffusers RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """Static per-layer key/value buffers [layers, batch, kv_heads, max_len, head_dim]; `length`
    positions are filled. Rows are independent sequences (for the AR stage: cond, uncond, ...)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int = 0):
        self.k, self.v, self.length = k, v, length

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
              device) -> "KVCache":
        k = torch.zeros(layers, batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        return cls(k, torch.zeros_like(k))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def repeat(self, n: int) -> "KVCache":
        """A cache of n copies of every row, row-major by copy: rows [r0, r1, r0, r1, ...]."""
        return KVCache(self.k.repeat(1, n, 1, 1, 1), self.v.repeat(1, n, 1, 1, 1), self.length)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: dict, ops):
        super().__init__()
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        self.heads, self.kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.eps = cfg["rms_norm_eps"]
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = ops.Linear(h, self.heads * hd, bias=bias)
        self.k_proj = ops.Linear(h, self.kv_heads * hd, bias=bias)
        self.v_proj = ops.Linear(h, self.kv_heads * hd, bias=bias)
        self.o_proj = ops.Linear(self.heads * hd, h, bias=bias)
        self.q_norm = ops.Vector(hd)
        self.k_norm = ops.Vector(hd)

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask):
        b, s, _ = x.shape
        dt = x.dtype
        q = rms_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim), self.q_norm(dt), self.eps)
        k = rms_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim), self.k_norm(dt), self.eps)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, S, head_dim]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        start, end = cache.length, cache.length + s
        cache.k[layer, :, :, start:end] = k
        cache.v[layer, :, :, start:end] = v
        keys, values = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]
        # From an empty cache the causal flag is the mask; one new token sees everything; a chunk
        # after earlier positions needs the explicit mask.
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=start == 0 and s > 1,
                                             scale=self.head_dim ** -0.5, enable_gqa=self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(b, s, -1).contiguous()  # [B, S, heads * head_dim]
        return self.o_proj(out)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: dict, ops):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = ops.Linear(h, i, bias=False)
        self.up_proj = ops.Linear(h, i, bias=False)
        self.down_proj = ops.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, ops):
        super().__init__()
        self.eps = cfg["rms_norm_eps"]
        self.input_layernorm = ops.Vector(cfg["hidden_size"])
        self.self_attn = Qwen3Attention(cfg, ops)
        self.post_attention_layernorm = ops.Vector(cfg["hidden_size"])
        self.mlp = Qwen3MLP(cfg, ops)

    def forward(self, x, cos, sin, cache, layer, mask):
        dt = x.dtype
        x = x + self.self_attn(rms_norm(x, self.input_layernorm(dt), self.eps), cos, sin, cache, layer, mask)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm(dt), self.eps))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: dict, ops):
        super().__init__()
        self.embed_tokens = ops.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, ops) for _ in range(cfg["num_hidden_layers"]))
        self.norm = ops.Vector(cfg["hidden_size"])


class Qwen3LM(nn.Module):
    """The MM3 global LM. `forward(inputs_embeds [B, S, H], cache) -> final-normed hidden [B, S, H]`
    for positions `cache.length .. cache.length + S - 1` (the cache advances by S).

    `embed(ids)` looks rows up in `model.embed_tokens`; `logits(h)` is the LM head over the whole
    vocabulary, `logits_rows(h, rows)` over a few contiguous row ranges only (the sampler needs the
    16385 code and END rows of 200000).
    """

    def __init__(self, cfg: dict, ops=default_ops):
        super().__init__()
        unsupported = [k for k in ("use_sliding_window",) if cfg.get(k)]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}  # transformers 4 / 5 spelling
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            unsupported.append(f"rope_scaling {rope}")
        if unsupported:
            raise ComponentError(f"LM config: {', '.join(map(str, unsupported))} is not supported (Qwen3 default RoPE, "
                                 "full attention expected)")
        self.cfg = dict(cfg)
        self.hidden_size = cfg["hidden_size"]
        self.vocab_size = cfg["vocab_size"]
        self.head_dim = cfg["head_dim"]
        self.eps = cfg["rms_norm_eps"]
        self.max_positions = cfg["max_position_embeddings"]
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.model = Qwen3Model(cfg, ops)
        if not self.tied:
            self.lm_head = ops.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        # transformers' default RoPE: inv_freq in float32 from a float base.
        inv = 1.0 / (float(cfg["rope_theta"]) ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    @classmethod
    def load(cls, component, ops=default_ops) -> "Qwen3LM":
        """Build from an opened `mm3-lm` component (sizes from its config JSON)."""
        model = cls(component.hparams, ops)
        tensors = component.tensors
        if model.tied:
            tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
        load_tensors(model, tensors, source=component.path)
        return model.eval()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device=None) -> KVCache:
        if max_len > self.max_positions:
            raise ValueError(f"KV cache of {max_len} positions exceeds the LM context {self.max_positions}")
        c = self.cfg
        return KVCache.empty(c["num_hidden_layers"], batch, c["num_key_value_heads"], max_len, self.head_dim, dtype,
                       self.device if device is None else device)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.model.embed_tokens.lookup(ids, dtype)

    def _rope(self, start: int, s: int, dtype, device):
        pos = torch.arange(start, start + s, device=device)[None]  # [1, S]
        freqs = pos[..., None].float() * self.inv_freq.to(device)  # [1, S, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [1, 1, S, head_dim]

    def forward(self, inputs_embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        b, s, _ = inputs_embeds.shape
        start = cache.length
        if b != cache.batch:
            raise ValueError(f"batch {b} does not match the KV cache's {cache.batch} rows")
        if start + s > cache.max_len:
            raise ValueError(f"KV cache full: {start} + {s} positions > {cache.max_len}")
        dev = inputs_embeds.device
        cos, sin = self._rope(start, s, inputs_embeds.dtype, dev)
        mask = None
        if start > 0 and s > 1:  # a chunk after cached positions: causal within, all before
            mask = torch.arange(start + s, device=dev)[None] <= torch.arange(start, start + s, device=dev)[:, None]
        x = inputs_embeds
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, mask)
        cache.length = start + s
        return rms_norm(x, self.model.norm(x.dtype), self.eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.tied:
            return F.linear(h, self.model.embed_tokens.get("weight", h.dtype))
        return self.lm_head(h)

    def logits_rows(self, h: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """LM-head logits for the rows in `ranges` ([start, stop) pairs, concatenated in order),
        dequantizing only those rows."""
        head = self.model.embed_tokens if self.tied else self.lm_head
        if not hasattr(head, "rows"):  # an ops implementation without row access: whole head, then pick
            cols = torch.cat([torch.arange(a, b, device=h.device) for a, b in ranges])
            return self.logits(h)[..., cols]
        # One product per range: float rows are views of the weight (no copy of 16385 x H per frame).
        return torch.cat([F.linear(h, head.rows(a, b, h.dtype).to(h.device)) for a, b in ranges], dim=-1)
