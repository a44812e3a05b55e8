"""The LM's static key/value cache, in the compute dtype or in 8 bits.

The 8-bit cache (`MM3_GPU_INT8_KV_CACHE`, where the GPU back end serves the device) holds each
group of GROUP values of a key or value head as int8 codes and one float32 scale: about 0.56 of
the 16-bit cache's bytes, which is what a late decode step's attention reads and what a long song
keeps in memory. `kv_codes` defines the rounding; the GPU kernels round and read it the same way
(`mm3.backends.gpu.attention_kernels`), and torch's path writes and reads it here: the prompt, a
continuation's known frames, replays and the compiled step, each read widening the layer's filled
keys and values (`attended`).
"""

from __future__ import annotations

import torch

GROUP = 32  # values a scale of the 8-bit cache covers (a head of fewer: the whole head)


def group_size(head_dim: int) -> int:
    """Values per scale of an 8-bit cache of heads of `head_dim`."""
    return min(GROUP, head_dim)


def kv_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as the 8-bit cache holds it: (codes [..., D] int8, scales [..., D / group]
    float32). A group's scale is its largest magnitude / 127 and each code round(x / scale), half
    to even, in float32; a group of zeros has scale 0 and codes 0; a NaN or infinite value makes its
    group's scale non-finite, so the group reads back as NaN (`kv_values`)."""
    d = x.shape[-1]
    blocks = x.float().unflatten(-1, (d // group_size(d), group_size(d)))
    # amax propagates NaN; a tensor divisor: torch divides by a host number as a multiply on CUDA
    scales = blocks.abs().amax(-1) / torch.full((), 127.0, device=x.device)
    codes = torch.round(blocks / scales[..., None]).nan_to_num_(0.0, 0.0, 0.0)
    codes = torch.where(scales[..., None] > 0, codes, 0.0).clamp_(-127, 127)
    return codes.to(torch.int8).flatten(-2), scales


def kv_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values an 8-bit cache's codes [..., D] and scales [..., D / group] stand for, each code
    times its scale in float32, in `dtype`."""
    d = codes.shape[-1]
    values = codes.float().unflatten(-1, (scales.shape[-1], d // scales.shape[-1])) * scales[..., None]
    return values.flatten(-2).to(dtype)


class KVCache:
    """Static key/value buffers [layers, rows, kv_heads, max_len, head_dim]; rows are independent
    sequences (for the AR stage: cond, uncond, ... per song). `length` positions are filled; the
    next position is `length` on the host and `pos` ([1], long) on the buffers' device.

    8-bit (`k_scales`, `v_scales` set: [layers, rows, kv_heads, max_len, head_dim / group]
    float32): k and v hold int8 codes (`kv_codes`); `attended` reads them back in `dtype`.

    `bucket`: when set, one-position steps attend over the first `bucket` positions with the
    unfilled ones masked (a static shape: what a compiled step needs); else over exactly `length + 1`.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int = 0, scales=None,
                 dtype: torch.dtype | None = None):
        self.k, self.v, self.length = k, v, length
        self.k_scales, self.v_scales = scales if scales is not None else (None, None)
        self.dtype = dtype or k.dtype  # the compute dtype the cache's keys and values are read in
        self.pos = torch.tensor([length], dtype=torch.long, device=k.device)
        self.bucket: int | None = None
        # False while a compiled step runs: it must not read or guard on the host count, which its
        # caller then advances.
        self.host_counting = True

    @classmethod
    def empty(cls, layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
              device, bits: int = 16) -> "KVCache":
        """A cache of zeros in `dtype`, or with `bits` 8 in int8 codes and float32 scales."""
        if bits == 16:
            k = torch.zeros(layers, rows, kv_heads, max_len, head_dim, dtype=dtype, device=device)
            return cls(k, torch.zeros_like(k))
        if bits != 8:
            raise ValueError(f"a KV cache holds 16 or 8 bits a value, not {bits}")
        k = torch.zeros(layers, rows, kv_heads, max_len, head_dim, dtype=torch.int8, device=device)
        scales = torch.zeros(layers, rows, kv_heads, max_len, head_dim // group_size(head_dim), dtype=torch.float32,
                             device=device)
        return cls(k, torch.zeros_like(k), scales=(scales, torch.zeros_like(scales)), dtype=dtype)

    @property
    def quantized(self) -> bool:
        return self.k_scales is not None

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s (key, value) scales [rows, kv_heads, max_len, head_dim / group] of an 8-bit
        cache, or None."""
        return None if self.k_scales is None else (self.k_scales[layer], self.v_scales[layer])

    def repeat(self, n: int) -> "KVCache":
        """A cache of n copies of every row, row-major by copy: rows [r0, r1, r0, r1, ...]."""
        copies = [t if t is None else t.repeat(1, n, 1, 1, 1) for t in (self.k, self.v, self.k_scales, self.v_scales)]
        return KVCache(copies[0], copies[1], self.length, None if self.k_scales is None else tuple(copies[2:]),
                       self.dtype)

    def positions(self, s: int) -> torch.Tensor:
        """Positions of the next `s` entries, on the device: [s]."""
        return self.pos + torch.arange(s, device=self.pos.device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [rows, kv_heads, s, head_dim] at the next s positions."""
        stored = [(self.k, k), (self.v, v)]
        if self.quantized:
            (k, ks), (v, vs) = kv_codes(k), kv_codes(v)
            stored = [(self.k, k), (self.v, v), (self.k_scales, ks), (self.v_scales, vs)]
        s = k.shape[2]
        for buffer, new in stored:
            if s == 1:  # at the device position: no host value read
                buffer[layer].index_copy_(2, self.pos, new)
            else:
                buffer[layer, :, :, self.length:self.length + s] = new

    def _read(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s first n keys and values, in the compute dtype."""
        if not self.quantized:
            return self.k[layer, :, :, :n], self.v[layer, :, :, :n]
        return (kv_values(self.k[layer, :, :, :n], self.k_scales[layer, :, :, :n], self.dtype),
                kv_values(self.v[layer, :, :, :n], self.v_scales[layer, :, :, :n], self.dtype))

    def attended(self, layer: int, s: int):
        """(keys, values, mask, is_causal) for `s` new positions after `length` filled ones."""
        if s == 1 and self.bucket is not None:  # before `length` is read: a compiled step must not guard on it
            n = self.bucket
            mask = (torch.arange(n, device=self.pos.device) <= self.pos)[None, None, None]  # [1, 1, 1, n]
            return *self._read(layer, n), mask, False
        start, end = self.length, self.length + s
        mask = None
        if start > 0 and s > 1:  # a chunk after cached positions: causal within, all before
            dev = self.k.device
            mask = torch.arange(end, device=dev)[None] <= torch.arange(start, end, device=dev)[:, None]
        # From an empty cache the causal flag is the mask; one new position sees everything.
        return *self._read(layer, end), mask, start == 0 and s > 1

    def span(self) -> int:
        """The keys a one-position step's attention launch covers: the bucket where one is set (a
        static shape), else the filled positions and the one being written."""
        return self.length + 1 if self.bucket is None else self.bucket

    def advance(self, s: int):
        self.pos += s
        if self.host_counting:
            self.length += s

    def nbytes(self) -> int:
        scales = 0 if self.k_scales is None else 2 * self.k_scales.numel() * self.k_scales.element_size()
        return 2 * self.k.numel() * self.k.element_size() + scales


def value_bytes(bits: int, head_dim: int, elem: int) -> float:
    """Bytes a cached value takes: `elem` in a 16-bit cache (the compute dtype's), one and its
    share of a float32 scale in an 8-bit one."""
    return elem if bits == 16 else 1 + 4 / group_size(head_dim)
