"""What a model's weights occupy, and the float copies kept of them.

Dequantizing on every use costs a full write and read of the float weight. Where memory allows,
`cache_dequantized(modules, dtype, budget)` keeps float copies in a layer's slots that its uses
return instead (the DiT reuses every weight 2 x steps times per window, the AR stage every frame);
`release_dequantized` drops them. `compressed_nbytes` is what the weights take as stored, what a
memory manager must budget.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .binding import binder
from .layers import FLOAT_TYPES, Embedding, Fused, Linear, WeightSlots, adjacent


def _slots(modules) -> list[tuple[WeightSlots, str]]:
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    return [(sub, name) for m in modules for sub in m.modules() if isinstance(sub, WeightSlots)
            for name in sub._slot_types]


def cache_dequantized(modules, dtype: torch.dtype, budget_bytes: int | None = None,
                      device: torch.device | None = None) -> int:
    """Keep float copies in `dtype` of the weights under `modules` (a module or a list, most used
    first) that a use would otherwise dequantize or cast, in order until `budget_bytes` (None: no
    limit) is spent; returns the bytes they take. The parts of a fused product share one copy (one
    product); embedding tables are left out (a lookup expands only its rows). Only weights that
    live on `device` (default: wherever they are) get a copy: a copy of a weight a memory manager
    left elsewhere would have to travel on every use."""
    used = 0
    element = torch.empty(0, dtype=dtype).element_size()
    want = None if device is None else torch.device(device)
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    done: set[int] = set()
    grouped: set[int] = set()  # parts of fusing groups: a stack may view their copies (seen before the parts)
    for m in modules:
        for sub in m.modules():
            for fused in (v for v in vars(sub).values() if isinstance(v, Fused) and v.fuse):
                grouped.update(id(p) for p in fused.parts)
                stored = [p.stored("weight") for p in fused.parts]
                if not all(binder().wants_copy(p, p.qtype("weight"), t.device) for p, t in zip(fused.parts, stored)):
                    continue  # parts whose CPU form reads no copy (int4, dequantization per product); others below
                done.update(id(p) for p in fused.parts)
                if want is not None and any(t.device != want for t in stored):
                    continue
                kept = [p._dequantized.get("weight") for p in fused.parts]
                if all(k is not None and k.dtype == dtype and k.device == stored[0].device for k in kept) \
                        and adjacent(kept):
                    used += fused.nbytes(dtype)
                elif budget_bytes is None or used + fused.nbytes(dtype) <= budget_bytes:
                    used += fused.keep_dequantized(dtype)
            if not isinstance(sub, WeightSlots) or isinstance(sub, Embedding) or id(sub) in done:
                continue
            done.add(id(sub))
            for name, qtype in sub._slot_types.items():
                value = sub.stored(name)
                if want is not None and value.device != want:
                    continue
                if qtype in FLOAT_TYPES and FLOAT_TYPES[qtype] == dtype:
                    continue  # already what a use returns
                if name == "weight" and not binder().wants_copy(sub, qtype, value.device):
                    continue
                nbytes = math.prod(sub._slot_shapes[name]) * element
                cached = sub._dequantized.get(name)
                if cached is not None and cached.dtype == dtype and cached.device == value.device:
                    used += nbytes
                    continue
                if budget_bytes is not None and used + nbytes > budget_bytes:
                    continue  # a smaller tensor further on may still fit
                copy = sub.get(name, dtype)
                if isinstance(sub, Linear) and id(sub) not in grouped:
                    copy = binder().kept_form(sub, name, copy)  # the form its product reads best
                sub.keep_copy(name, copy)
                used += nbytes
    return used


def dequantized_nbytes(modules) -> int:
    """Bytes of the copies `cache_dequantized` keeps under `modules` now."""
    return sum(t.numel() * t.element_size() for sub, name in _slots(modules)
               for t in ([sub._dequantized[name]] if name in sub._dequantized else []))


def release_dequantized(modules) -> int:
    """Drop every copy `cache_dequantized` kept under `modules`; returns the bytes freed."""
    freed = dequantized_nbytes(modules)
    for sub in {id(sub): sub for sub, _ in _slots(modules)}.values():
        sub.drop_copies()
    return freed


def set_aside(modules) -> list[tuple[WeightSlots, str, torch.Tensor]]:
    """Take every copy kept under `modules` out of use without freeing it; `put_back` returns
    them (to time forms that read copies beside forms that must not see them)."""
    saved = [(sub, name, sub._dequantized[name]) for sub, name in _slots(modules) if name in sub._dequantized]
    for sub in {id(sub): sub for sub, _, _ in saved}.values():
        sub.drop_copies()
    return saved


def put_back(saved: list[tuple[WeightSlots, str, torch.Tensor]]) -> None:
    """The copies `set_aside` took, in use again."""
    for sub, name, value in saved:
        sub.keep_copy(name, value)


def compressed_nbytes(module: nn.Module, device: torch.device | None = None) -> int:
    """Bytes the module's weights and buffers occupy as stored (what a memory manager must budget),
    or only those that live on `device`; a tensor shared by two slots counts once."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if device is not None and not _on(t, torch.device(device)):
            continue
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.storage_offset(), t.numel(), t.dtype) if ptr else ("no data", id(t))  # meta tensors: ptr 0
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether t lives on `device` ("cuda" names any CUDA device, "cuda:1" one)."""
    return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))
