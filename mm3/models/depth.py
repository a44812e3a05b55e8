"""The RVQ depth decoder: a small causal transformer that samples the 7 acoustic codes of a frame.

Names and math of diffusers' `MiniMaxMusic3RVQDepthDecoder`: learned position embeddings (no RoPE),
pre-norm RMSNorm layers, causal multi-head attention, SwiGLU MLP; `audio_embeddings` holds codebooks
1..7 in one table (row `(j - 1) * audio_vocab + code`), `audio_heads[j - 1]` gives codebook j's logits.
`forward(x)` runs the whole sequence (as the reference does at every step), `forward(x, cache)` only
the positions appended to a `DepthCache`: the same numbers up to float rounding. `load(numerics=...)`
fuses q/k/v and gate/up ("fast") or keeps the reference's products, as the LM's.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from ..backends import steps
from ..weights import layers as default_ops
from ..weights.layers import Fused, load_tensors
from ..backends.gpu.emulation import cpu_path
from .lm import add_rms_norm, rms_norm, set_numerics

NORM_EPS = 1e-6  # diffusers RMSNorm(eps=1e-6) in the depth decoder


class DepthAttention(nn.Module):
    fast_numerics = False  # with a cache, one call of a back end where one serves: set by `set_numerics`

    def __init__(self, dim: int, heads: int, ops):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_q = ops.Linear(dim, dim, bias=False)
        self.to_k = ops.Linear(dim, dim, bias=False)
        self.to_v = ops.Linear(dim, dim, bias=False)
        self.to_out = ops.Linear(dim, dim, bias=False)
        self.qkv = Fused([self.to_q, self.to_k, self.to_v], fuse=False)

    def _split(self, t):  # [B, S, dim] -> [B, heads, S, head_dim]
        b, s, _ = t.shape
        return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x, cache=None, layer: int = 0):
        b, s, _ = x.shape
        q, k, v = self.qkv(x)
        if cache is not None and self.fast_numerics:
            out = steps.short_attention(q, k, v, cache.k[layer], cache.v[layer], cache.length, self.head_dim ** -0.5)
            if out is not None:
                return self.to_out(out)
        q, k, v = self._split(q), self._split(k), self._split(v)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            start, end = cache.length, cache.length + s
            cache.k[layer, :, :, start:end] = k
            cache.v[layer, :, :, start:end] = v
            mask = None
            if start > 0 and s > 1:
                mask = torch.arange(end, device=x.device)[None] <= torch.arange(start, end, device=x.device)[:, None]
            out = F.scaled_dot_product_attention(q, cache.k[layer, :, :, :end], cache.v[layer, :, :, :end],
                                                 attn_mask=mask, is_causal=start == 0 and s > 1)
        return self.to_out(out.transpose(1, 2).flatten(2, 3))  # [B, S, dim]


class DepthBlock(nn.Module):
    fast_numerics = False  # RMSNorm by `rms_norm(..., native=True)`: set by `set_numerics`

    def __init__(self, dim: int, heads: int, intermediate: int, ops):
        super().__init__()
        self.input_layernorm = ops.Vector(dim)
        self.attn = DepthAttention(dim, heads, ops)
        self.post_attention_layernorm = ops.Vector(dim)
        self.gate_proj = ops.Linear(dim, intermediate, bias=False)
        self.up_proj = ops.Linear(dim, intermediate, bias=False)
        self.down_proj = ops.Linear(intermediate, dim, bias=False)
        self.gate_up = Fused([self.gate_proj, self.up_proj], fuse=False)

    def forward(self, x, cache=None, layer: int = 0, normed=None, then=None):
        """The block's output for x; `normed`: x already normalized by the input norm (the block
        before gave it); `then`: the weight of the norm after the block: (output, output normed)."""
        dt, dev = x.dtype, x.device
        native = self.fast_numerics
        h = rms_norm(x, self.input_layernorm(dt, dev), NORM_EPS, native) if normed is None else normed
        x, h = add_rms_norm(x, self.attn(h, cache, layer), self.post_attention_layernorm(dt, dev), NORM_EPS, native)
        out = self.down_proj(self.gate_up.swiglu(h))
        return x + out if then is None else add_rms_norm(x, out, then, NORM_EPS, native)

    def products(self) -> tuple:
        """The block's four products in their order of use (q/k/v, out, gate/up, down)."""
        return self.attn.qkv, self.attn.to_out, self.gate_up, self.down_proj


class DepthCache:
    """Keys/values of the positions run so far, [layers, batch, heads, max_positions, head_dim]."""

    def __init__(self, layers: int, batch: int, heads: int, max_len: int, head_dim: int, dtype, device):
        self.k = torch.zeros(layers, batch, heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def reset(self):
        self.length = 0


class RVQDepthDecoder(nn.Module):
    """`forward(inputs_embeds [B, S, H], cache=None) -> normed hidden [B, S, H]` (causal; inputs
    already projected): the whole sequence, or the positions appended to `cache`."""

    fast_numerics = False  # the final norm by `rms_norm(..., native=True)`: set by `set_numerics`


    def __init__(self, hp: dict, ops=default_ops):
        super().__init__()
        self.hp = dict(hp)
        h = int(hp["hidden_size"])
        self.hidden_size = h
        self.heads = int(hp["num_attention_heads"])
        self.audio_vocab = int(hp["audio_vocab_size"])
        self.num_codebooks = int(hp["num_codebooks"])
        self.max_positions = int(hp["max_position_embeddings"])
        if h % self.heads:
            raise ValueError(f"depth decoder hidden_size {h} is not divisible by num_attention_heads {self.heads}")
        if self.max_positions < self.num_codebooks:
            raise ValueError(f"depth decoder max_position_embeddings {self.max_positions} < num_codebooks "
                             f"{self.num_codebooks}: a frame needs {self.num_codebooks} positions")
        self.audio_embeddings = ops.Embedding(self.audio_vocab * (self.num_codebooks - 1), h)
        self.projection = ops.Linear(h, h, bias=False)
        self.pos_embedding = ops.Embedding(self.max_positions, h)
        self.layers = nn.ModuleList(DepthBlock(h, self.heads, int(hp["intermediate_size"]), ops)
                                    for _ in range(int(hp["num_layers"])))
        self.norm = ops.Vector(h)
        self.audio_heads = nn.ModuleList(ops.Linear(h, self.audio_vocab, bias=False)
                                         for _ in range(self.num_codebooks - 1))
        self.numerics = "reference"  # as built; load() sets the numerics asked for
        self._pos_table: dict = {}  # (dtype, device) -> (the table it came from, expanded rows)

    @classmethod
    def load(cls, component, ops=default_ops, *, numerics: str = "fast") -> "RVQDepthDecoder":
        """Build from an opened `mm3-depth` component (sizes from its `mm3-depth.*` metadata) for
        `numerics` (`mm3.models.lm.set_numerics`)."""
        model = cls(component.hparams, ops)
        load_tensors(model, component.tensors, source=component.path)
        set_numerics(model, numerics)
        return model.eval()

    def _apply(self, fn, recurse=True):
        self._pos_table.clear()  # expanded on the device the table lived on
        return super()._apply(fn, recurse)

    def new_cache(self, rows: int, dtype: torch.dtype, device) -> DepthCache:
        return DepthCache(len(self.layers), rows, self.heads, self.max_positions, self.hidden_size // self.heads,
                          dtype, device)

    def code_embedding(self, codes: torch.Tensor, codebook: int, dtype: torch.dtype) -> torch.Tensor:
        """Embedding of acoustic codes of codebook `codebook` (1 .. num_codebooks - 1)."""
        return self.audio_embeddings.lookup(codes + (codebook - 1) * self.audio_vocab, dtype, codes.device)

    def ready(self, dtype: torch.dtype, device) -> None:
        """Expand the position table for `dtype` on `device` now, as the first step would (a step
        about to be compiled then finds it made, at every call)."""
        self._positions(0, 1, dtype, device)

    def _positions(self, start: int, s: int, dtype, device) -> torch.Tensor:
        """Position embeddings [1, s, H] of positions start .. start + s - 1 (the table is small:
        it is expanded once per dtype and device, then sliced)."""
        table = self._pos_table.get((dtype, device))
        if table is None or table[0] is not self.pos_embedding.stored("weight"):
            rows = self.pos_embedding.lookup(torch.arange(self.max_positions, device=device), dtype)
            table = self._pos_table[(dtype, device)] = (self.pos_embedding.stored("weight"), rows)
        return table[1][start:start + s][None]

    def forward(self, inputs_embeds: torch.Tensor, cache: DepthCache | None = None) -> torch.Tensor:
        s = inputs_embeds.shape[1]
        start = 0 if cache is None else cache.length
        if start + s > self.max_positions:
            raise ValueError(f"depth sequence of {start + s} positions exceeds {self.max_positions}")
        dt, dev = inputs_embeds.dtype, inputs_embeds.device
        positions = self._positions(start, s, dt, dev)
        whole = None
        if self.fast_numerics and cache is not None:  # the blocks in one back-end call where one serves
            whole = steps.depth_blocks(self, inputs_embeds, positions, cache, NORM_EPS)
        h = None
        if whole is not None:
            x = whole
        elif self.fast_numerics and not cpu_path(inputs_embeds):
            # Off the CPU library, each residual add (the position embeddings' too) goes with the
            # norm after it: a back end's one call.
            x, h = add_rms_norm(inputs_embeds, positions.expand_as(inputs_embeds),
                                self.layers[0].input_layernorm(dt, dev), NORM_EPS, True)
            for i, layer in enumerate(self.layers):
                x, h = layer(x, cache, i, h, (self.layers[i + 1].input_layernorm if i + 1 < len(self.layers)
                                              else self.norm)(dt, dev))
        else:
            x = inputs_embeds + positions
            for i, layer in enumerate(self.layers):
                x = layer(x, cache, i)
        if cache is not None:
            cache.length += s
        return h if h is not None else rms_norm(x, self.norm(dt, dev), NORM_EPS, self.fast_numerics)
