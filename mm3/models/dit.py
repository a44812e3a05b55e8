"""The flow-matching DiT: predicts the velocity of audio latents, conditioned per latent frame.

The math of diffusers' `MiniMaxMusic3Transformer1DModel`. Input channels are
[latent, zeros, condition] with a residual 1x1 conv, the flow time enters as an extra token 0,
partial RoPE rotates the first `rotary_dim` dims of each head, pre-norm blocks with a gated MLP
(first half of `ff_in` is the value, second the gate), no final norm, residual 1x1 conv out.
Every layer comes from an `ops` namespace so quantized weights drop in unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..backends import steps
from ..weights import layers as default_ops
from ..weights.layers import WeightSlots, load_tensors

ROPE_THETA = 10000.0  # MiniMaxMusic3RotaryEmbedding default (diffusers 0.42.1)
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm default, used by the reference blocks


class LayerNorm(WeightSlots):
    """Affine LayerNorm whose weight and bias are GGUF slots (`normN.weight`, `normN.bias`)."""

    def __init__(self, dim: int, eps: float = LAYER_NORM_EPS):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.declare("weight", dim)
        self.declare("bias", dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.get("weight", x.dtype, x.device), self.get("bias", x.dtype, x.device)
        return F.layer_norm(x, (self.dim,), w, b, self.eps)


def activation_bytes(hp: dict, latent_len: int, elem: int) -> int:
    """Bytes beyond the weights for one CFG pair of a window of `latent_len` frames (the sampler
    runs one variation at a time) through the widest layer, with a few temporaries."""
    inner = hp["num_attention_heads"] * hp["attention_head_dim"]
    return int(4 * 2 * (latent_len + 1) * max(hp["ff_inner_dim"], 3 * inner) * elem)


def rope_tables(seq_len: int, rotary_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, rotary_dim] for positions 0..S-1 (non-interleaved halves), float32."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, rotary_dim, 2, device=device).float() / rotary_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading `cos.shape[-1]` dims of x [B, S, heads, head_dim]."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # [S, 1, rd]
    rot = x[..., :rd]
    first, second = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rot, x[..., rd:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, ops):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = ops.Linear(dim, inner, bias=False)
        self.to_k = ops.Linear(dim, inner, bias=False)
        self.to_v = ops.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([ops.Linear(inner, dim, bias=False)])  # GGUF name: attn.to_out.0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.to_q(x).view(b, s, self.heads, self.head_dim)
        k = self.to_k(x).view(b, s, self.heads, self.head_dim)
        v = self.to_v(x).view(b, s, self.heads, self.head_dim)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        o = steps.long_attention(q, k, v)  # a back end's kernel, where one serves
        if o is None:  # bidirectional, default scale 1/sqrt(head_dim); [B, heads, S, hd] views as the reference passes
            o = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
            o = o.permute(0, 2, 1, 3).flatten(2, 3)  # [B, S, inner]
        return self.to_out[0](o)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, ff_inner: int, ops):
        super().__init__()
        self.norm1 = LayerNorm(dim)
        self.attn = Attention(dim, heads, head_dim, ops)
        self.norm2 = LayerNorm(dim)
        self.ff_in = ops.Linear(dim, 2 * ff_inner)
        self.ff_out = ops.Linear(ff_inner, dim)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), cos, sin)
        value, gate = self.ff_in(self.norm2(h)).chunk(2, dim=-1)  # value first, gate second
        return h + self.ff_out(value * F.silu(gate))


class TimeEmbedding(nn.Module):
    """diffusers' TimestepEmbedding: linear_2(silu(linear_1(f)))."""

    def __init__(self, in_dim: int, dim: int, ops):
        super().__init__()
        self.linear_1 = ops.Linear(in_dim, dim)
        self.linear_2 = ops.Linear(dim, dim)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(f)))


class FlowDiT(nn.Module):
    """`forward(x [B, C, L], t [B], cond [B, L, condition_dim]) -> velocity [B, C, L]`.

    t is flow time in [0, 1): 0 is noise, 1 is data; the velocity is not negated (x += dt * v).
    Pass zeros as `cond` for the unconditional branch.
    """

    def __init__(self, hp: dict, ops=default_ops):
        super().__init__()
        self.hp = dict(hp)
        c, d = int(hp["in_channels"]), int(hp["condition_dim"])
        heads, hd = int(hp["num_attention_heads"]), int(hp["attention_head_dim"])
        self.in_channels, self.condition_dim, self.rotary_dim = c, d, int(hp["rotary_dim"])
        if self.rotary_dim > hd or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most attention_head_dim {hd}")
        inner, concat, fourier = heads * hd, 2 * c + d, int(hp["fourier_embedding_dim"])
        self.time_proj = ops.Vector(fourier // 2, 1)  # Fourier frequencies, GGUF time_proj.weight
        self.time_embed = TimeEmbedding(fourier, inner, ops)
        self.preprocess_conv = ops.Conv1d(concat, concat, 1, bias=False)
        self.proj_in = ops.Linear(concat, inner, bias=False)
        self.transformer_blocks = nn.ModuleList(
            [Block(inner, heads, hd, int(hp["ff_inner_dim"]), ops) for _ in range(int(hp["num_layers"]))])
        self.proj_out = ops.Linear(inner, c, bias=False)
        self.postprocess_conv = ops.Conv1d(c, c, 1, bias=False)
        self._rope_cache: dict = {}

    @classmethod
    def load(cls, component, ops=default_ops) -> "FlowDiT":
        model = cls(component.hparams, ops)
        load_tensors(model, component.tensors, source=component.path)
        return model

    def time_features(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cat(cos a, sin a) with a = 2 pi t w, cos first: [B, fourier_embedding_dim]."""
        w = self.time_proj.get("weight", dtype, t.device)  # [fourier/2, 1]
        angles = 2.0 * math.pi * t.to(dtype).unsqueeze(-1) @ w.T
        return torch.cat((angles.cos(), angles.sin()), dim=-1)

    def rope(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._rope_cache:
            if len(self._rope_cache) > 8:
                self._rope_cache.clear()
            self._rope_cache[key] = rope_tables(seq_len, self.rotary_dim, device)
        return self._rope_cache[key]

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        b, c, length = x.shape
        if c != self.in_channels or cond.shape != (b, length, self.condition_dim):
            raise ValueError(f"DiT input x {list(x.shape)} / cond {list(cond.shape)} do not fit in_channels "
                             f"{self.in_channels}, condition_dim {self.condition_dim}")
        h = torch.cat((x, torch.zeros_like(x), cond.transpose(1, 2)), dim=1)  # [B, 2C + D, L]
        h = (self.preprocess_conv(h) + h).transpose(1, 2)  # [B, L, 2C + D]
        temb = self.time_embed(self.time_features(t, x.dtype))  # [B, inner]
        h = torch.cat((temb.unsqueeze(1), self.proj_in(h)), dim=1)  # time token at position 0: [B, L+1, inner]
        cos, sin = self.rope(h.shape[1], h.device)
        for block in self.transformer_blocks:
            h = block(h, cos, sin)
        o = self.proj_out(h[:, 1:]).transpose(1, 2)  # drop the time token: [B, C, L]
        return self.postprocess_conv(o) + o
