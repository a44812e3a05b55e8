"""One AR frame as one function: LM-head sampling, 7 depth steps, feedback and the LM decode step.

`FrameStep` reads the weights of a loaded `Qwen3LM` and `RVQDepthDecoder` (packed: fused QKV and
gate/up, the LM-head rows of the sampler's candidates) and runs, for every song of a batch at once
(rows [cond_0, uncond_0, cond_1, ...]), the same math as `mm3.ar.plan`'s default path (SPEC
section 4). Random draws come in as tensors (`q_sem`, `q_dep`: Exponential(1) draws made on the
songs' CPU generators by the caller), so the step never waits for the host: its only outputs the
host must read are the END flags. Shapes are static (KV caches preallocated, the write position a
device tensor); with `kv_bucket` the LM attends over a fixed-length, masked view of its cache, so
the step can be compiled / captured as a CUDA graph (`torch.compile(mode="reduce-overhead")`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gguf import ops as gguf_ops
from ..models.depth import NORM_EPS, RVQDepthDecoder
from ..models.lm import KVCache, Qwen3LM, rms_norm, rotate_half
from ..sampling import guide, kth_largest, top_k_probs
from .linear import PackedWeight, Scratch, pack_linears, pack_rows

_NEG_INF = -float("inf")


def supports(*models: torch.nn.Module) -> str | None:
    """None when the fast step can run these models; else why not. It reads weights directly, so
    every layer must be this package's own GGUF layer (not another `ops` implementation, whose
    forward may do more) and every weight must sit on one device."""
    devices = set()
    for model in models:
        for sub in model.modules():
            if isinstance(sub, gguf_ops.WeightSlots) and type(sub) not in (gguf_ops.Linear, gguf_ops.Embedding,
                                                                             gguf_ops.Vector):
                return f"layer {type(sub).__name__} is not one of mm3.gguf.ops' own layers"
            if isinstance(sub, gguf_ops.Linear) and sub.has_bias:
                return "a linear layer with a bias (the packed products have none)"
        devices |= {b.device for b in model.buffers()}
    if len(devices) != 1:
        return f"weights on several devices ({', '.join(sorted(map(str, devices)))})"
    return None


class _Layer:
    """Packed weights and norm scales of one decoder layer (LM or depth)."""

    def __init__(self, norm1, qkv, out, norm2, gate_up, down, q_norm=None, k_norm=None):
        self.norm1, self.qkv, self.out, self.norm2 = norm1, qkv, out, norm2
        self.gate_up, self.down, self.q_norm, self.k_norm = gate_up, down, q_norm, k_norm


class FrameStep:
    """The per-frame function of the AR stage for `songs` songs (2 * songs rows).

    `last` [rows, H] is the state between frames (final-normed LM hidden of every row); `pos` the
    LM position the next feedback goes to. `frame(q_sem [songs, C], q_dep [songs, ncb - 1,
    audio_vocab])` samples one frame for every song, feeds it back and returns
    (codes [songs, ncb] int64, end [songs] bool, hidden [songs, ncb, H]: the LM hidden that
    predicted the frame, then the 7 conditional depth states). C is the number of candidate ids
    (the LM-head rows in `candidates`, ascending), q_sem the draws at those ids.
    """

    def __init__(self, lm: Qwen3LM, depth: RVQDepthDecoder, *, code_offset: int, end_id: int,
                 candidates: list[tuple[int, int]], songs: int, cache: KVCache, lm_cfg: float, top_k: int,
                 dtype: torch.dtype, kv_bucket: int | None = None):
        self.lm, self.depth, self.dtype = lm, depth, dtype
        self.device = lm.device
        self.scratch = Scratch(self.device)
        self.code_offset, self.lm_cfg, self.top_k = code_offset, float(lm_cfg), int(top_k)
        self.songs, self.rows = songs, 2 * songs
        self.cache, self.kv_bucket = cache, kv_bucket
        self.ncb, self.audio_vocab = depth.num_codebooks, depth.audio_vocab
        c = lm.cfg
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], lm.head_dim
        self.lm_layers = [self._lm_layer(layer) for layer in lm.model.layers]
        self.lm_norm = lm.model.norm(dtype)
        head = lm.model.embed_tokens if lm.tied else lm.lm_head
        self.head = pack_rows(head, candidates, self.scratch)
        ids = torch.cat([torch.arange(a, b) for a, b in candidates])
        self.candidate_ids = ids.to(self.device)
        self.end_id = end_id
        self.depth_layers = [self._depth_layer(block) for block in depth.layers]
        self.depth_norm = depth.norm(dtype)
        self.projection = pack_linears([depth.projection], self.scratch)
        self.audio_heads = [pack_linears([h], self.scratch) for h in depth.audio_heads]
        self.depth_pos = depth.pos_embedding.lookup(torch.arange(self.ncb, device=self.device), dtype)  # [ncb, H]
        self.depth_k = torch.zeros(len(depth.layers), self.rows, depth.heads, self.ncb,
                                   depth.hidden_size // depth.heads, dtype=dtype, device=self.device)
        self.depth_v = torch.zeros_like(self.depth_k)
        shift = torch.arange(self.ncb - 1, device=self.device) * self.audio_vocab
        self.code_shift = shift[None]  # [1, ncb - 1]: codebook j's rows start at (j - 1) * audio_vocab
        self.last = torch.zeros(self.rows, lm.hidden_size, dtype=dtype, device=self.device)
        self.pos_host = cache.length  # the next LM position, on the host (eager attention length) ...
        self.pos = torch.tensor([cache.length], dtype=torch.long, device=self.device)  # ... and on the device

    # -- weights -----------------------------------------------------------------------------------
    def _lm_layer(self, layer) -> _Layer:
        a, m, dt = layer.self_attn, layer.mlp, self.dtype
        return _Layer(layer.input_layernorm(dt), pack_linears([a.q_proj, a.k_proj, a.v_proj], self.scratch),
                      pack_linears([a.o_proj], self.scratch), layer.post_attention_layernorm(dt),
                      pack_linears([m.gate_proj, m.up_proj], self.scratch), pack_linears([m.down_proj], self.scratch),
                      a.q_norm(dt), a.k_norm(dt))

    def _depth_layer(self, block) -> _Layer:
        a, dt = block.attn, self.dtype
        return _Layer(block.input_layernorm(dt), pack_linears([a.to_q, a.to_k, a.to_v], self.scratch),
                      pack_linears([a.to_out], self.scratch), block.post_attention_layernorm(dt),
                      pack_linears([block.gate_proj, block.up_proj], self.scratch),
                      pack_linears([block.down_proj], self.scratch))

    def packed(self) -> list[PackedWeight]:
        """Every packed weight, the most used per frame first (depth: 7 passes, then LM, head)."""
        out = [self.projection] + [w for L in self.depth_layers for w in (L.qkv, L.out, L.gate_up, L.down)]
        out += self.audio_heads
        out += [w for L in self.lm_layers for w in (L.qkv, L.out, L.gate_up, L.down)]
        return out + [self.head]

    def cache_weights(self, budget_bytes: int) -> int:
        """Keep dequantized copies of packed weights, most used first, within `budget_bytes`."""
        used = 0
        for w in self.packed():
            cost = w.cost(self.dtype)
            if cost and used + cost <= budget_bytes:
                used += w.cache(self.dtype)
        return used

    def release(self):
        for w in self.packed():
            w.release()

    def mark_static(self):
        """Tell torch.compile that the weights, caches and state keep their addresses, so a CUDA
        graph reads them in place rather than copying them in at every replay."""
        mark = getattr(getattr(torch, "_dynamo", None), "mark_static_address", None)
        if mark is None:
            return
        tensors = [self.last, self.pos, self.depth_k, self.depth_v, self.cache.k, self.cache.v, self.depth_pos,
                   self.candidate_ids, self.code_shift, self.lm_norm, self.depth_norm]
        for L in self.lm_layers + self.depth_layers:
            tensors += [t for t in (L.norm1, L.norm2, L.q_norm, L.k_norm) if t is not None]
        for w in self.packed():
            tensors += [t for s in w.segments for t in (s.data, s.cached) if t is not None]
        for t in tensors:
            mark(t)

    # -- the LM ------------------------------------------------------------------------------------
    def _rope(self, pos: torch.Tensor):
        freqs = pos[:, None].float() * self.lm.inv_freq.to(self.device)  # [1, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype).view(1, 1, 1, -1), emb.sin().to(self.dtype).view(1, 1, 1, -1)

    def lm_decode(self, x: torch.Tensor) -> torch.Tensor:
        """One position per row: x [rows, H] at `self.pos` -> final-normed hidden [rows, H]."""
        r, hd, eps, dt = x.shape[0], self.head_dim, self.lm.eps, self.dtype
        nq, nkv = self.heads * hd, self.kv_heads * hd
        cos, sin = self._rope(self.pos)
        if self.kv_bucket is None:  # eager: attend over exactly the filled positions (host count)
            n_keys, mask = self.pos_host + 1, None
        else:  # static length, later positions masked out
            n_keys = self.kv_bucket
            mask = (torch.arange(n_keys, device=self.device) <= self.pos)[None, None, None]  # [1, 1, 1, n_keys]
        for i, L in enumerate(self.lm_layers):
            h = rms_norm(x, L.norm1, eps)
            q, k, v = L.qkv.linear(h, dt).split([nq, nkv, nkv], dim=-1)
            q = rms_norm(q.view(r, 1, self.heads, hd), L.q_norm, eps).transpose(1, 2)  # [rows, heads, 1, hd]
            k = rms_norm(k.view(r, 1, self.kv_heads, hd), L.k_norm, eps).transpose(1, 2)
            v = v.view(r, 1, self.kv_heads, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.cache.k[i].index_copy_(2, self.pos, k)
            self.cache.v[i].index_copy_(2, self.pos, v)
            o = F.scaled_dot_product_attention(q, self.cache.k[i, :, :, :n_keys], self.cache.v[i, :, :, :n_keys],
                                               attn_mask=mask, scale=hd ** -0.5,
                                               enable_gqa=self.heads != self.kv_heads)
            x = x + L.out.linear(o.reshape(r, nq), dt)  # [rows, heads * hd]
            h = rms_norm(x, L.norm2, eps)
            gate, up = L.gate_up.linear(h, dt).chunk(2, dim=-1)
            x = x + L.down.linear(F.silu(gate) * up, dt)
        self.pos += 1
        return rms_norm(x, self.lm_norm, eps)

    # -- the depth decoder -------------------------------------------------------------------------
    def _depth_extend(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Positions start .. start + s - 1 of the depth sequence (x [rows, s, H], projected) with
        its KV cache -> normed hidden of the last one [rows, H]."""
        r, s, h = x.shape
        heads, dt = self.depth.heads, self.dtype
        hd = h // heads
        x = x + self.depth_pos[start:start + s]
        end = start + s
        for i, L in enumerate(self.depth_layers):
            n = rms_norm(x, L.norm1, NORM_EPS)
            q, k, v = (t.view(r, s, heads, hd).transpose(1, 2) for t in L.qkv.linear(n, dt).chunk(3, dim=-1))
            self.depth_k[i, :, :, start:end] = k
            self.depth_v[i, :, :, start:end] = v
            o = F.scaled_dot_product_attention(q, self.depth_k[i, :, :, :end], self.depth_v[i, :, :, :end],
                                               is_causal=start == 0 and s > 1)
            x = x + L.out.linear(o.transpose(1, 2).reshape(r, s, h), dt)
            n = rms_norm(x, L.norm2, NORM_EPS)
            gate, up = L.gate_up.linear(n, dt).chunk(2, dim=-1)
            x = x + L.down.linear(F.silu(gate) * up, dt)
        return rms_norm(x[:, -1], self.depth_norm, NORM_EPS)

    # -- one frame ---------------------------------------------------------------------------------
    def frame(self, q_sem: torch.Tensor, q_dep: torch.Tensor):
        """One frame: tensors in, tensors out, state updated in place (`last`, `pos`, the caches).
        This is the function to compile; it reads no host value when `kv_bucket` is set. The
        caller advances `pos_host` after each call (a compiled function must not)."""
        dt, cfg, k = self.dtype, self.lm_cfg, self.top_k
        last = self.last
        # 1. semantic code: CFG over the candidate rows, kept where the conditional logit is in its top-k
        logits = self.head.linear(last, dt).float()  # [rows, C]
        c, u = logits[0::2], logits[1::2]
        guided = guide(c, u, cfg).masked_fill(c < kth_largest(c, k), _NEG_INF)
        pick = torch.argmax(top_k_probs(guided, k) / q_sem, dim=-1)  # [songs]: multinomial's draw
        token = self.candidate_ids[pick]
        end = token == self.end_id
        sem = (token - self.code_offset).clamp_min(0)  # END rows carry code 0; the host discards them
        sem_rows = sem.repeat_interleave(2)  # [rows]
        sem_emb = self.lm.embed(sem_rows + self.code_offset, dt)  # [rows, H]
        # 2. acoustic codes: depth sequence [proj(last), proj(c0 embedding), proj(c1), ...]
        codes = [sem]
        hiddens = []
        x = self.projection.linear(torch.stack((last, sem_emb), dim=1), dt)  # [rows, 2, H]
        start = 0
        for j in range(1, self.ncb):
            h = self._depth_extend(x, start)  # [rows, H]
            start += x.shape[1]
            hiddens.append(h[0::2])
            lg = self.audio_heads[j - 1].linear(h, dt).float()  # [rows, audio_vocab]
            g = guide(lg[0::2], lg[1::2], cfg)
            code = torch.argmax(top_k_probs(g, k) / q_dep[:, j - 1], dim=-1)  # [songs]
            codes.append(code)
            if j < self.ncb - 1:
                emb = self.depth.code_embedding(code.repeat_interleave(2), j, dt)  # [rows, H]
                x = self.projection.linear(emb, dt)[:, None]
        codes = torch.stack(codes, dim=1)  # [songs, ncb]
        hidden = torch.cat((last[0::2, None], torch.stack(hiddens, dim=1)), dim=1)  # [songs, ncb, H]
        # 3. feedback: (LM embedding of c0 + acoustic embeddings) * ncb ** -0.5 at the next position
        rows_codes = codes.repeat_interleave(2, dim=0)  # [rows, ncb]
        extra = self.depth.audio_embeddings.lookup(rows_codes[:, 1:] + self.code_shift, dt).sum(dim=1)
        feedback = (sem_emb + extra.to(sem_emb.dtype)) * self.ncb ** -0.5
        self.last.copy_(self.lm_decode(feedback))
        return codes, end, hidden
