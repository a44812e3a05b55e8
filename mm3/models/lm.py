"""The global language model: Qwen3 (transformers `Qwen3ForCausalLM` names) over a static KV cache.

Every size comes from the config JSON stored in the GGUF (`mm3.config_json`). One forward serves the
prompt and each decode step: the cache is written at a position kept on the device, so a decode step
reads no host value and can be captured as a CUDA graph. `load(numerics=...)`: "reference" keeps the
reference's products (CPU float32 gives its hidden states bit for bit); "fast" fuses them
(`set_numerics`) and keeps only the LM-head rows the sampler can draw (END and the semantic codes).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..backends import steps
from ..backends.gpu.emulation import cpu_path
from ..weights import layers as default_ops
from ..formats.gguf.errors import ComponentError
from ..weights.layers import Fused, Linear, fused_layers, load_tensors
from .kv_cache import KVCache, value_bytes

NUMERICS = ("fast", "reference")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, native: bool = False) -> torch.Tensor:
    """RMSNorm with the variance in float32 (transformers Qwen3RMSNorm / diffusers RMSNorm). On the
    CPU in float32, torch's `rms_norm`, which computes the same operations in one call, bit for bit;
    with `native` (the fast numerics) a back end's one call where it serves (`mm3.backends.steps`: up
    to the float rounding of the sum; torch's call is a dozen small operations)."""
    if native:
        y = steps.rms_norm(x, weight, eps)
        if y is not None:
            return y
    if x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, `rms_norm` of that sum): with `native` a back end's one call where it serves (the
    same additions, the norm as `rms_norm`'s)."""
    if native:
        both = steps.add_rms_norm(x, delta, weight, eps)
        if both is not None:
            return both
    x = x + delta
    return x, rms_norm(x, weight, eps, native)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def set_numerics(model: nn.Module, numerics: str) -> None:
    """"fast": the fused products (q/k/v, gate/up) run as one product each, few-row products take
    the device's fastest form and quantized weights are read by the fused kernels where they run;
    "reference": every product is the reference's own `F.linear` over the dequantized weight."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    fast = numerics == "fast"
    for fused in fused_layers(model):
        fused.fuse = fast and fused.fusable
    for sub in model.modules():
        if isinstance(sub, Linear):
            sub.decode_products = sub.fused_kernels = fast
        if hasattr(sub, "fast_numerics"):  # the layers' own fast paths (norms, attention)
            sub.fast_numerics = fast
    model.numerics = numerics


def activation_bytes(cfg: dict, prompt_tokens: int, frames: int, rows: int, elem: int, kv_bits: int = 16) -> int:
    """Bytes beyond the weights for `rows` sequences (`mm3.plan.ar.rows_per_song` per song) of a prompt
    and `frames` more positions, `elem` bytes a value: the KV cache (of `kv_bits`, `KVCache.empty`)
    plus the prefill's widest activation (float32, a few temporaries deep); an 8-bit cache also one
    layer's keys and values widened where torch's path reads them (`KVCache.attended`)."""
    length = prompt_tokens + frames + 1
    values = rows * cfg["num_key_value_heads"] * length * cfg["head_dim"]  # a layer's keys (or values)
    kv = 2 * cfg["num_hidden_layers"] * values * value_bytes(kv_bits, cfg["head_dim"], elem)
    prefill = 3 * rows * prompt_tokens * max(cfg["intermediate_size"], cfg["hidden_size"]) * 4
    read_back = 0 if kv_bits == 16 else 2 * values * (4 + elem)  # float32 products, then the compute dtype
    return int(kv + prefill + read_back)


class AttentionTap:
    """A read-only view of some heads' attention over a span of keys (`Qwen3LM.tapped`). `heads`
    maps a layer to the heads read there, `keys` is the span (first, stop) of key positions. A
    tapped layer also computes those heads' attention weights explicitly (float32, from the same
    queries and keys; its output still comes from the fused attention, so no number changes),
    renormalised over the span: the weights the head gives each key of the span divided by what
    it gives the whole span (0 for a query that sees none of it), which is the softmax of the
    span's scores alone. It hands them to `observe(layer, position, weights [rows, len(heads), s,
    stop - first])` for the `s` queries at positions `position` .. `position + s - 1`."""

    heads: dict[int, tuple[int, ...]] = {}
    keys: tuple[int, int] = (0, 0)

    def observe(self, layer: int, position: int, weights: torch.Tensor) -> None:
        raise NotImplementedError


def head_problem(layer: int, head: int | None, layers: int, heads: int) -> str | None:
    """Why (layer, head) is not a head of an LM of `layers` layers of `heads` heads, or None."""
    if not 0 <= layer < layers:
        return f"layer {layer} is not in this LM: it has {layers} layers (0-{layers - 1})"
    if head is not None and not 0 <= head < heads:
        return f"head {head} of layer {layer} is not in this LM: it has {heads} heads a layer (0-{heads - 1})"
    return None


def one_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """Attention of one query position a row, q [B, heads, 1, D] over keys and values [B, kv_heads,
    L, D] (a query head reads key head h // (heads / kv_heads)) with an optional boolean mask
    broadcast to [B, 1, 1, L] (True: attended) -> [B, heads, 1, D], as two batched float products.
    On the CPU this is faster than torch's fused attention for a single query, the more so the
    longer the song."""
    b, heads, _, d = q.shape
    kv = keys.shape[1]
    scores = torch.matmul(q.reshape(b, kv, heads // kv, d), keys.transpose(-1, -2)).mul_(scale)  # [B, kv, g, L]
    if mask is not None:
        scores.masked_fill_(~mask.reshape(mask.shape[0], 1, 1, -1), -float("inf"))
    return torch.matmul(scores.softmax(-1), values).view(b, heads, 1, d)


class Qwen3Attention(nn.Module):
    taps: tuple[AttentionTap, ...] = ()  # set while `Qwen3LM.tapped` covers this layer
    # The fast numerics (set by `set_numerics`): a decode step normalizes, rotates, caches and
    # attends in one call of a back end where one serves (`steps.attention_step`), else normalizes,
    # rotates and caches in one (`steps.prepare_attention`) and attends over the filled keys by a
    # back end's call (`steps.decode_attention`) or, on the CPU, `one_query_attention`; norms are
    # `rms_norm(..., native=True)`.
    fast_numerics = False

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
        self.qkv = Fused([self.q_proj, self.k_proj, self.v_proj], fuse=False)  # fused in the "fast" numerics

    def forward(self, x, cos, sin, cache: KVCache, layer: int):
        b, s, _ = x.shape
        dt, dev = x.dtype, x.device
        q, k, v = self.qkv(x)
        native = self.fast_numerics
        if native and s == 1 and not self.taps:  # a decode step: one back-end call, or two
            out = steps.attention_step(q, k, v, self.q_norm(dt, dev), self.k_norm(dt, dev), self.eps, cos, sin,
                                       cache.k[layer], cache.v[layer], cache.pos, cache.span(), self.head_dim ** -0.5,
                                       cache.scales(layer))
            if out is not None:
                return self.o_proj(out.view(b, 1, -1))
            at = cache.length if cache.bucket is None else None  # the host position, where the step may read it
            rotated = steps.prepare_attention(q, k, v, self.q_norm(dt, dev), self.k_norm(dt, dev), self.eps, cos, sin,
                                              cache.k[layer], cache.v[layer], at, cache.pos, cache.scales(layer))
            if rotated is not None:
                return self.o_proj(self._attend(rotated, cache, layer).transpose(1, 2).reshape(b, 1, -1))
        q = rms_norm(q.view(b, s, self.heads, self.head_dim), self.q_norm(dt, dev), self.eps, native).transpose(1, 2)
        k = rms_norm(k.view(b, s, self.kv_heads, self.head_dim), self.k_norm(dt, dev), self.eps, native).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, heads, S, head_dim]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache.write(layer, k, v)
        keys, values, mask, causal = cache.attended(layer, s)
        if self.taps:
            self.show_taps(q, keys, mask, causal, cache.length, layer)
        if s == 1 and self.fast_numerics and cpu_path(q):
            out = one_query_attention(q, keys, values, mask, self.head_dim ** -0.5)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                                 scale=self.head_dim ** -0.5, enable_gqa=self.heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(b, s, -1).contiguous()  # [B, S, heads * head_dim]
        return self.o_proj(out)

    def _attend(self, q, cache: KVCache, layer: int) -> torch.Tensor:
        """A decode step's attention of q [B, heads, 1, D] over the cache (its position written): a
        back end's call over the filled keys where one serves, else torch's."""
        scale = self.head_dim ** -0.5
        out = steps.decode_attention(q, cache.k[layer], cache.v[layer], cache.pos, cache.span(), scale,
                                     cache.scales(layer))
        if out is not None:
            return out
        keys, values, mask, _ = cache.attended(layer, 1)
        if cpu_path(q):
            return one_query_attention(q, keys, values, mask, scale)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=self.heads != self.kv_heads)

    def show_taps(self, q, keys, mask, causal: bool, position: int, layer: int) -> None:
        """Each tap's heads' attention over its key span, computed apart from the layer's own: what
        `AttentionTap.observe` receives (the softmax over every key the query may see, restricted to
        the span and renormalised; 0 for a query that sees none of it)."""
        group = self.heads // self.kv_heads  # query head h reads key head h // group (enable_gqa)
        s = q.shape[2]
        for tap in self.taps:
            first, stop = tap.keys
            heads = list(tap.heads[layer])
            kv = torch.tensor([h // group for h in heads], device=q.device)
            span = keys[:, :, first:stop].float()[:, kv]  # [rows, heads, T, head_dim]
            scores = torch.matmul(q[:, heads].float() * self.head_dim ** -0.5, span.transpose(-1, -2))
            if causal:  # from an empty cache: query i (position i) sees keys 0 .. i
                blocked = torch.arange(first, stop, device=q.device)[None] > torch.arange(s, device=q.device)[:, None]
            else:
                blocked = None if mask is None else ~mask[..., first:stop]
            if blocked is not None:
                scores.masked_fill_(blocked, -float("inf"))
            tap.observe(layer, position, scores.softmax(-1).nan_to_num_(0.0))  # a query that sees none of it: 0


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: dict, ops):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = ops.Linear(h, i, bias=False)
        self.up_proj = ops.Linear(h, i, bias=False)
        self.down_proj = ops.Linear(i, h, bias=False)
        self.gate_up = Fused([self.gate_proj, self.up_proj], fuse=False)

    def forward(self, x):
        return self.down_proj(self.gate_up.swiglu(x))


class Qwen3DecoderLayer(nn.Module):
    fast_numerics = False  # RMSNorm by `rms_norm(..., native=True)`: set by `set_numerics`

    def __init__(self, cfg: dict, ops):
        super().__init__()
        self.eps = cfg["rms_norm_eps"]
        self.input_layernorm = ops.Vector(cfg["hidden_size"])
        self.self_attn = Qwen3Attention(cfg, ops)
        self.post_attention_layernorm = ops.Vector(cfg["hidden_size"])
        self.mlp = Qwen3MLP(cfg, ops)

    def forward(self, x, cos, sin, cache, layer, normed=None, then=None):
        """The layer's output for x; `normed`: x already normalized by the input norm (the layer
        before gave it); `then`: the weight of the norm after the layer: (output, output normed,
        or None where a back end's whole step ran: the next layer normalizes in its own step)."""
        dt, dev = x.dtype, x.device
        native = self.fast_numerics
        attn = self.self_attn
        if native and x.shape[1] == 1 and not attn.taps:  # a back end's whole step
            y = steps.lm_layer(self, x, cos, sin, cache, layer, one_query_attention)
            if y is not None:
                return y if then is None else (y, None)
        h = rms_norm(x, self.input_layernorm(dt, dev), self.eps, native) if normed is None else normed
        x, h = add_rms_norm(x, attn(h, cos, sin, cache, layer), self.post_attention_layernorm(dt, dev), self.eps,
                            native)
        return x + self.mlp(h) if then is None else add_rms_norm(x, self.mlp(h), then, self.eps, native)

    def products(self) -> tuple:
        """The layer's four products in their order of use (q/k/v, out, gate/up, down)."""
        return self.self_attn.qkv, self.self_attn.o_proj, self.mlp.gate_up, self.mlp.down_proj


class Qwen3Model(nn.Module):
    def __init__(self, cfg: dict, ops):
        super().__init__()
        self.embed_tokens = ops.Embedding(cfg.get("embed_rows", cfg["vocab_size"]), cfg["hidden_size"])
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, ops) for _ in range(cfg["num_hidden_layers"]))
        self.norm = ops.Vector(cfg["hidden_size"])


class Qwen3LM(nn.Module):
    """The MM3 global LM. `forward(inputs_embeds [B, S, H], cache) -> final-normed hidden [B, S, H]`
    for the next S positions of `cache` (which then advances by S).

    `embed(ids)` looks rows up in `model.embed_tokens`; `head(h)` gives the logits of the vocabulary
    ids `head_ids` (start, stop): the whole vocabulary, or after `keep_head_rows` only the rows the
    sampler can draw.
    """

    fast_numerics = False  # the final norm by `rms_norm(..., native=True)`: set by `set_numerics`


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
        # A file may hold only the head rows of ids [head_start, head_start + head_rows) and the first
        # embed_rows embeddings (ComfyUI's pruned text encoder): the rows the sampler can draw and
        # the ids a prompt or a code can be. The semantic draw still spans vocab_size ids.
        start = int(cfg.get("head_start", 0))
        rows = int(cfg.get("head_rows", self.vocab_size - start))
        whole = (start, rows) == (0, self.vocab_size)
        if start < 0 or rows <= 0 or start + rows > self.vocab_size or (self.tied and not whole):
            raise ComponentError(f"LM config: head rows {start}..{start + rows} do not fit the vocab_size "
                                 f"{self.vocab_size}")
        if not self.tied:
            self.lm_head = ops.Linear(cfg["hidden_size"], rows, bias=False)
        self.head_ids = (start, start + rows)
        # transformers' default RoPE: inv_freq in float32 from a float base.
        inv = 1.0 / (float(cfg["rope_theta"]) ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.numerics = "reference"  # as built; load() sets the numerics asked for

    @classmethod
    def load(cls, component, ops=default_ops, *, numerics: str = "fast") -> "Qwen3LM":
        """Build from an opened `mm3-lm` component (sizes from its config JSON) for `numerics`
        (`set_numerics`); "fast" keeps the head rows of END and the semantic codes only."""
        model = cls(component.hparams, ops)
        tensors = component.tensors
        if model.tied:
            tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
        load_tensors(model, tensors, source=component.path)
        set_numerics(model, numerics)
        if numerics == "fast":
            from ..tokenizer import MM3Tokenizer

            cs = MM3Tokenizer.from_component(component).codes
            lo, hi = min(cs.end_id, cs.code_offset), max(cs.end_id + 1, cs.code_offset + cs.num_semantic)
            model.keep_head_rows(lo, hi)
        return model.eval()

    def keep_head_rows(self, start: int, stop: int):
        """Keep only the LM-head rows of vocabulary ids [start, stop) (views; the rest is dropped)."""
        first, last = self.head_ids
        if not first <= start < stop <= last:
            raise ComponentError(f"LM head rows {start}..{stop} are outside the file's head rows {first}..{last}")
        source = self.model.embed_tokens if self.tied else self.lm_head
        rows = source.rows(start - first, stop - first)
        rows.decode_products = self.numerics == "fast"
        if not self.tied:
            del self.lm_head
        self.lm_head = rows
        self.head_ids = (start, stop)
        self.tied = False

    def new_cache(self, rows: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        """A cache of `rows` sequences of up to `max_len` positions, in 8 bits where the back end
        asks for it on `device` (`mm3.backends.steps.kv_cache_bits`), else in `dtype`."""
        if max_len > self.max_positions:
            raise ValueError(f"KV cache of {max_len} positions exceeds the LM context {self.max_positions}")
        c = self.cfg
        bits = steps.kv_cache_bits(device, self.head_dim) if self.fast_numerics else 16
        return KVCache.empty(c["num_hidden_layers"], rows, c["num_key_value_heads"], max_len, self.head_dim, dtype,
                             device, bits)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        return self.model.embed_tokens.lookup(ids, dtype, device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [1, 1, S, head_dim] for positions [S] (float32 angles, as transformers)."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)  # [S, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]

    @contextmanager
    def tapped(self, *taps: AttentionTap):
        """Within the block, each tap sees its heads' attention weights at every forward
        (`AttentionTap`); a head this LM lacks is refused. No computed number changes."""
        layers, heads = len(self.model.layers), self.cfg["num_attention_heads"]
        for tap in taps:
            for layer, chosen in tap.heads.items():
                problem = next((p for h in chosen if (p := head_problem(layer, h, layers, heads))), None)
                problem = problem or head_problem(layer, None, layers, heads)
                if problem:
                    raise ValueError(problem)
        attention = [layer.self_attn for layer in self.model.layers]
        for i, a in enumerate(attention):
            a.taps = tuple(t for t in taps if i in t.heads)
        try:
            yield
        finally:
            for a in attention:
                a.taps = ()

    def forward(self, inputs_embeds: torch.Tensor, cache: KVCache, stop_after: int | None = None) -> torch.Tensor:
        """`stop_after`: run layers 0 .. stop_after only and return that layer's output (not
        final-normed; later layers' cache entries stay unwritten): for a caller that only reads
        attention (`tapped`)."""
        b, s, _ = inputs_embeds.shape
        if b != cache.rows:
            raise ValueError(f"batch {b} does not match the KV cache's {cache.rows} rows")
        if cache.bucket is None and cache.length + s > cache.max_len:  # (a static step is sized by its caller)
            raise ValueError(f"KV cache full: {cache.length} + {s} positions > {cache.max_len}")
        x, dt, dev = inputs_embeds, inputs_embeds.dtype, inputs_embeds.device
        tables = steps.rope_table(cache.pos, self.inv_freq, dt) if s == 1 and self.fast_numerics else None
        cos, sin = tables or self.rope(cache.positions(s), dt)
        layers = self.model.layers if stop_after is None else self.model.layers[:stop_after + 1]
        # Off the CPU library, each residual add goes with the norm after it (a back end's one call),
        # unless a back end runs the next layer whole (h then None: that step normalizes).
        chained = self.fast_numerics and not cpu_path(x) and stop_after is None
        h = None
        for i, layer in enumerate(layers):
            if chained:
                x, h = layer(x, cos, sin, cache, i, h, (layers[i + 1].input_layernorm if i + 1 < len(layers)
                                                        else self.model.norm)(dt, dev))
            else:
                x = layer(x, cos, sin, cache, i)
        cache.advance(s)
        if stop_after is not None:
            return x
        return h if chained and h is not None else rms_norm(x, self.model.norm(dt, dev), self.eps, self.fast_numerics)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the vocabulary ids `head_ids` for hidden states h [..., H]."""
        if self.tied:
            return F.linear(h, self.model.embed_tokens.get("weight", h.dtype, h.device))
        return self.lm_head(h)
