"""Decode steps a back end may take over whole: the one seam between the models (and the planner's
draws) and the back ends, beyond each layer's own product.

A model asks here, at a decode step, whether a back end runs a piece of it (a norm, an
attention's preparation, a whole LM layer, the depth decoder's blocks, a guided draw; the DiT's
attention over a window) and gets the result, or None where no back end serves it; the model then
runs its own torch operations. Each answer is given before anything is written. The CPU back end's
kernel library serves the fast numerics (`mm3.backends.cpu.steps`) and the DiT's bfloat16
attention (`mm3.backends.cpu.long_attention`); the GPU back end's kernels serve a decode step's
pieces and whole layers (`mm3.backends.gpu.steps`).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from .. import switches
from . import products
from .cpu import long_attention as cpu_long_attention, steps as cpu_steps
from .cpu.steps import draw_from_raw, exponentials, raw_draws, raw_draws_exact, skip_draws
from .gpu import steps as gpu_steps
from .gpu.emulation import cpu_path, gpu_device, gpu_path

__all__ = ["held_parts", "rms_norm", "add_rms_norm", "lookup", "code_rows", "frame_feedback", "rope_table",
           "kv_cache_bits", "prepare_attention", "attention_step", "decode_attention", "short_attention",
           "long_attention", "lm_layer", "depth_blocks", "top_k_draw", "semantic_draw", "draw_from_raw",
           "exponentials", "raw_draws", "raw_draws_exact", "skip_draws"]

# a model's blocks -> (their products chosen, held weakly, and what the library reads of them), while alive
_HELD: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
# an LM layer or a depth decoder on the GPU path -> (dtype, device, its layers' checks (`_unchanged`), each
# block's `products.layout_block` held weakly): asked once, again only where a layer's answer can have changed
_LAYOUT: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def held_parts(owner: torch.nn.Module):
    """What the kernel library reads of `owner`'s blocks (a `mm3.backends.cpu.steps.BlockParts`) since
    its last whole step, or None where no whole step ran or one of its products is not the native
    kernel's."""
    held = _HELD.get(owner)
    return None if held is None else held[1]


def _whole_steps(x: torch.Tensor) -> bool:
    """Whether a back end may run a whole step on `x`: the CPU library, outside tracing."""
    return cpu_path(x) and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x's rows by `weight` in one call, or None."""
    if cpu_path(x):
        return cpu_steps.rms_norm(x, weight, eps)
    return gpu_steps.rms_norm(x, weight, eps) if gpu_path(x) else None


def lookup(table: torch.Tensor, qtype, ids: torch.Tensor, k: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A few rows `ids` [n] of a quantized table dequantized in one call ([n, k]: float32 from the CPU
    back end, `dtype` from the GPU one), or None."""
    if cpu_path(table):
        return cpu_steps.lookup(table, qtype, ids, k)
    return gpu_steps.lookup(table, qtype, ids, k, dtype) if gpu_path(table) else None


def code_rows(table: torch.Tensor, qtype, codes: torch.Tensor, k: int, dtype: torch.dtype, repeat: int = 1,
              add: int = 0) -> torch.Tensor | None:
    """Rows `codes[i // repeat] + add` of an embedding table (an AR frame's codes, each song's
    repeated for its LM rows) in one call, the ids made on the device -> [codes.numel() * repeat, k]
    `dtype`, or None."""
    return gpu_steps.code_rows(table, qtype, codes, k, dtype, repeat, add) if gpu_path(codes) else None


def frame_feedback(lm_table: torch.Tensor, lm_qtype, audio_table: torch.Tensor, audio_qtype, frame: torch.Tensor,
                   code_offset: int, audio_vocab: int, k: int, dtype: torch.dtype,
                   repeat: int = 1) -> torch.Tensor | None:
    """A frame's LM input (`mm3.plan.replay.frame_feedback` of `frame` [songs, ncb], each song's row
    repeated `repeat` times) in one call -> [songs * repeat, 1, k] `dtype`, or None."""
    if not gpu_path(frame):
        return None
    return gpu_steps.frame_feedback(lm_table, lm_qtype, audio_table, audio_qtype, frame, code_offset, audio_vocab,
                                    k, dtype, repeat)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, RMSNorm of that sum by `weight`) in one call, or None."""
    return gpu_steps.add_rms_norm(x, delta, weight, eps) if gpu_path(x) else None


def rope_table(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """The rotation's (cos, sin) [1, 1, 1, D] for the one position `pos` ([1], on the device) in one
    call, or None."""
    return gpu_steps.rope_table(pos, inv_freq, dtype) if gpu_path(pos) else None


def kv_cache_bits(device, head_dim: int) -> int:
    """Bits a value of an LM's KV cache on `device` takes: 8 where `MM3_GPU_INT8_KV_CACHE` is on and
    the GPU back end serves the device and its attention kernels take heads of `head_dim` (they read
    8-bit caches; `gpu.steps.attends_heads_of`), else 16 (the compute dtype)."""
    if not switches.on("MM3_GPU_INT8_KV_CACHE") or not gpu_device(device) or not gpu_steps.attends_heads_of(head_dim):
        return 16
    return 8


def prepare_attention(q, k, v, q_norm, k_norm, eps: float, cos, sin, cache_k, cache_v, at: int | None,
                      pos: torch.Tensor, scales=None):
    """An LM decode step's q/k norms, rotation and cache write at the next position (`at` on the
    host, None where the step may not read it; `pos` [1] on the device) in one call -> the rotated
    queries [B, heads, 1, D], or None (nothing written). `scales`: an 8-bit cache's (`KVCache.scales`)."""
    if cpu_path(q):
        return None if at is None or scales is not None else \
            cpu_steps.decode_prepare(q, k, v, q_norm, k_norm, eps, cos, sin, cache_k, cache_v, at)
    return gpu_steps.prepare_attention(q, k, v, q_norm, k_norm, eps, cos, sin, cache_k, cache_v, pos, scales) \
        if gpu_path(q) else None


def attention_step(q, k, v, q_norm, k_norm, eps: float, cos, sin, cache_k, cache_v, pos: torch.Tensor, span: int,
                   scale: float, scales=None):
    """An LM decode step's q/k norms, rotation, cache write at the device position `pos` and its
    attention over the filled keys (`span` >= pos + 1 keys the call is sized for) in one call, from
    q, k, v as one q/k/v product's split gives them -> [B, heads, 1, D], or None (nothing written).
    `scales`: an 8-bit cache's (`KVCache.scales`)."""
    if not gpu_path(q):
        return None
    return gpu_steps.attention_step(q, k, v, q_norm, k_norm, eps, cos, sin, cache_k, cache_v, pos, span, scale,
                                    scales)


def decode_attention(q, cache_k, cache_v, pos: torch.Tensor, span: int, scale: float, scales=None):
    """One query position's attention (q [B, heads, 1, D]) over the cache's first pos + 1 keys (`pos`
    on the device; `span` >= pos + 1 keys the call is sized for) -> [B, heads, 1, D], or None.
    `scales`: an 8-bit cache's (`KVCache.scales`)."""
    return gpu_steps.decode_attention(q, cache_k, cache_v, pos, span, scale, scales) if gpu_path(q) else None


def short_attention(q, k, v, cache_k, cache_v, at: int, scale: float):
    """The depth decoder's attention of new rows over its short cache (written at `at`), or None."""
    if cpu_path(q):
        return cpu_steps.attend(q, k, v, cache_k, cache_v, at, scale)
    return gpu_steps.short_attention(q, k, v, cache_k, cache_v, at, scale) if gpu_path(q) else None


def long_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """Every position's attention over all positions of q, k, v [B, S, heads, D] (the DiT's, scale
    1 / sqrt(D)) -> [B, S, heads * D], or None."""
    return cpu_long_attention.attention(q, k, v) if cpu_path(q) else None


def top_k_draw(logits: torch.Tensor, rows_per_song: int, cfg: float, top_k: int, q: torch.Tensor,
               excluded: torch.Tensor | None = None, gate: bool = False) -> torch.Tensor | None:
    """A guided top-k draw in one call (`mm3.backends.cpu.steps.top_k_draw` says what it computes;
    logits of any float dtype, computed on as float32) -> [songs] int64, or None."""
    if cpu_path(logits):
        return cpu_steps.top_k_draw(logits.float(), rows_per_song, cfg, top_k, q, excluded, gate)
    return gpu_steps.top_k_draw(logits, rows_per_song, cfg, top_k, q, excluded, gate) if gpu_path(logits) else None


def semantic_draw(logits: torch.Tensor, rows_per_song: int, cfg: float, top_k: int, q: torch.Tensor,
                  excluded: torch.Tensor | None, start: int, code_offset: int, end_id: int):
    """The LM's gated draw (`top_k_draw` with `gate`) over head rows from id `start`, with its code
    made in the same call -> (codes [songs]: id - code_offset, at least 0; end [songs]: id is
    `end_id`), or None."""
    if not gpu_path(logits):
        return None
    return gpu_steps.semantic_draw(logits, rows_per_song, cfg, top_k, q, excluded, start, code_offset, end_id)


def _parts(owner: torch.nn.Module, blocks: list[tuple], dtype: torch.dtype, device: torch.device):
    """What the library reads of `blocks` (each block's products in their order of use), kept for
    `owner` while its products stay the ones chosen; None where anything but the native kernel
    serves one of them."""
    held = _HELD[owner] = products.native_blocks(_HELD.get(owner), blocks, dtype, device)
    return held[1]


def lm_layer(layer, x: torch.Tensor, cos, sin, cache, index: int,
             attend: Callable[..., torch.Tensor]) -> torch.Tensor | None:
    """An LM layer's whole decode step (`layer`: a Qwen3 decoder layer; x [B, 1, dim], not normed):
    on the CPU in two calls of the kernel library around `attend(q, keys, values, mask, scale)` over
    the cache, where the native integer kernel serves all four of its products (and the host knows
    the position: no bucket); on the GPU path in five launches (`gpu.steps.lm_layer`) where the
    device layout holds them; else None, nothing written."""
    dt, dev = x.dtype, x.device
    if gpu_path(x):  # (torch.compile traces the model's own operations)
        return None if torch.compiler.is_compiling() else _gpu_lm_layer(layer, x, cos, sin, cache, index)
    if not _whole_steps(x) or cache.bucket is not None or cache.quantized:
        return None
    parts = _parts(layer, [layer.products()], dt, dev)
    if parts is None:
        return None
    attn = layer.self_attn
    q = cpu_steps.lm_enter(x, layer.input_layernorm(dt, dev), layer.eps, parts, attn.q_norm(dt, dev),
                           attn.k_norm(dt, dev), attn.eps, cos, sin, cache.k[index], cache.v[index], cache.length)
    if q is None:
        return None
    end = cache.length + 1
    out = attend(q, cache.k[index, :, :, :end], cache.v[index, :, :, :end], None, attn.head_dim ** -0.5)
    y = cpu_steps.lm_leave(x, out.transpose(1, 2).reshape(x.shape), layer.post_attention_layernorm(dt, dev),
                           layer.eps, parts)
    if y is None:  # lm_enter checked the whole layer's parts: the step is half done
        raise RuntimeError("the kernel library refused the second half of an LM decode step it began")
    return y


def _whole_gpu_layers() -> bool:
    """Whether the GPU back end runs LM layers and depth blocks whole (`MM3_GPU_LAYERS`)."""
    return switches.value("MM3_GPU_LAYERS") == "whole"


def _ref(obj):
    return None if obj is None else weakref.ref(obj)


def _version(layer, parts) -> object:
    """A layer's weights' version (a `Linear`'s; a `Fused` group's: whether it fuses and its parts')."""
    return layer.version if parts is None else (layer.fuse, *[p.version for p in parts])


def _unchanged(checks: tuple) -> bool:
    """Whether every layer of `checks` ((layer, its product then, held weakly, its `_version` then,
    its parts), ...) holds the same product and version now: what `products.layout_block` read of
    it is the same (a move, new weights, adapters or settings change the version and drop the
    product; one chosen again is another)."""
    for layer, ref, version, parts in checks:
        product = layer.chosen_product()
        if (product is not None if ref is None else ref() is not product) or _version(layer, parts) != version:
            return False
    return True


def _layout_blocks(owner: torch.nn.Module, blocks, dtype: torch.dtype, device: torch.device) -> list | None:
    """Each block's `products.layout_block` (None where any block has none), asked at `owner`'s
    first whole step for `dtype` on `device` and held for it, weakly (the products stay the
    layers'), while every layer keeps the product and version it had then (`_unchanged`); asked
    again after a layer moved, was rebound or changed, or for another dtype or device. `blocks`:
    a callable giving each block's layers (`products()`), called when asking."""
    held = _LAYOUT.get(owner)
    if held is not None and held[0] == dtype and held[1] == device and _unchanged(held[2]):
        if held[3] is None:
            return None
        parts = [tuple(ref() for ref in refs) for refs in held[3]]
        if not any(None in block for block in parts):
            return parts
    layers = blocks()
    parts = [products.layout_block(block, dtype, device) for block in layers]
    if None in parts:
        parts = None
    checks = []
    for layer in (layer for block in layers for layer in block):  # as the lookups left them
        inner = getattr(layer, "parts", None)
        checks.append((layer, _ref(layer.chosen_product()), _version(layer, inner), inner))
    _LAYOUT[owner] = (dtype, device, tuple(checks), None if parts is None else
                      [tuple(weakref.ref(product) for product in block) for block in parts])
    return parts


def _gpu_lm_layer(layer, x: torch.Tensor, cos, sin, cache, index: int) -> torch.Tensor | None:
    dt, dev = x.dtype, x.device
    held = _layout_blocks(layer, lambda: [layer.products()], dt, dev) if _whole_gpu_layers() else None
    if held is None:
        return None
    parts = held[0]
    attn = layer.self_attn
    return gpu_steps.lm_layer(parts, x, (layer.input_layernorm(dt, dev), layer.post_attention_layernorm(dt, dev)),
                              layer.eps, (attn.q_norm(dt, dev), attn.k_norm(dt, dev)), attn.eps, cos, sin,
                              cache.k[index], cache.v[index], cache.pos, cache.span(), attn.heads,
                              attn.head_dim ** -0.5, cache.scales(index))


def depth_blocks(decoder, inputs: torch.Tensor, positions: torch.Tensor, cache, eps: float) -> torch.Tensor | None:
    """The depth decoder's blocks over inputs [B, S, dim] plus their position embeddings and its
    cache: on the CPU in one call of the kernel library where the native integer kernel serves all
    their products, on the GPU path in five launches a block (`gpu.steps.depth_blocks`) where the
    device layout holds them; else None, nothing computed (each block runs itself)."""
    dt, dev = inputs.dtype, inputs.device
    blocks = decoder.layers
    if gpu_path(inputs):
        if torch.compiler.is_compiling() or not _whole_gpu_layers():
            return None
        parts = _layout_blocks(decoder, lambda: [b.products() for b in blocks], dt, dev)
        if parts is None:
            return None
        norms = [(b.input_layernorm(dt, dev), b.post_attention_layernorm(dt, dev)) for b in blocks]
        return gpu_steps.depth_blocks(parts, inputs, positions, norms, eps, cache.k, cache.v, cache.length,
                                      blocks[0].attn.head_dim ** -0.5)
    if not _whole_steps(inputs):
        return None
    parts = _parts(decoder, [b.products() for b in blocks], dt, dev)
    if parts is None:
        return None
    norms = [w for block in blocks for w in (block.input_layernorm(dt, dev), block.post_attention_layernorm(dt, dev))]
    x = inputs + positions
    return cpu_steps.depth_layers(x.contiguous(), norms, eps, parts, cache.k, cache.v, cache.length,
                                  blocks[0].attn.head_dim ** -0.5)
