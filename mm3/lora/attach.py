"""Adapters set on a built LM or DiT: each layer an adapter changes gets its low-rank terms
(`mm3.backends.products.LowRank`), which its product carries beside the weight.

`attach(model, kind, applied)` makes the model's adapters exactly `applied` (none: every layer
back to its plain product, bit for bit): the command line sets them per request, the ComfyUI nodes
for each node that runs the model. A fused module's factor is split by rows into its layers (views).
A layer whose scale comes out 0 (strength or group strength 0) gets no term at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..weights.layers import Linear
from ..backends.products import LowRank
from .adapter import Adapter, AdapterError, Module
from .keys import NAMES
from .use import LoraUse


@dataclass(frozen=True, eq=False)
class Applied:
    """An adapter file and how it is used on one component."""

    adapter: Adapter
    use: LoraUse

    @property
    def modules(self) -> list[Module]:
        return self.adapter.of_kind(self.use.component)


def layer_terms(applied, shapes: dict[str, tuple[int, int]]) -> dict[str, list[tuple]]:
    """{layer: [(down, up rows, scale), ...]} of `applied` (in order) over layers of `shapes`
    ({layer: (out, in)}); AdapterError naming the file and module where one does not fit."""
    out: dict[str, list[tuple]] = {}
    for a in applied:
        for m in a.modules:
            for layer, (lo, hi) in zip(m.target.layers, _rows(a.adapter, m, shapes)):
                scale = m.scale * a.use.scale(layer)
                if scale != 0.0:
                    out.setdefault(layer, []).append((m.down, m.up[lo:hi], scale))
    return out


def _rows(adapter: Adapter, m: Module, shapes: dict) -> list[tuple[int, int]]:
    missing = [layer for layer in m.target.layers if layer not in shapes]
    if missing:
        count = sum(1 for s in shapes if s.endswith((".q_proj", ".to_q")))
        raise AdapterError(f"LoRA {adapter.name}: module {m.key} changes {missing[0]}, which this {NAMES[m.kind]} "
                           f"does not have (it has {count} layers)")
    sizes = [shapes[layer] for layer in m.target.layers]
    widths = {w for _, w in sizes}
    rows = sum(n for n, _ in sizes)
    if widths != {m.down.shape[1]} or m.up.shape[0] != rows:
        want = f"[rank, {sizes[0][1]}] and [{rows}, rank]"
        raise AdapterError(f"LoRA {adapter.name}: module {m.key} has factors {list(m.down.shape)} and "
                           f"{list(m.up.shape)}; {' + '.join(m.target.layers)} of this model take {want} (a LoRA "
                           "made for another model size?)")
    out, start = [], 0
    for n, _ in sizes:
        out.append((start, start + n))
        start += n
    return out


def model_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {name: (m.out_features, m.in_features) for name, m in _linears(model).items()}


def _linears(model: nn.Module) -> dict[str, Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def attach(model: nn.Module, applied=(), *, merge: bool = False) -> int:
    """Set `model`'s adapters to exactly `applied` (`Applied`s of its component, in order);
    `merge`: added into float copies of the weights as PEFT merges them (the reference numerics)
    instead of side products. Returns the number of layers with terms. Unchanged settings change
    nothing (the layers keep their products)."""
    applied = tuple(applied)
    key = (tuple((a.adapter, a.use) for a in applied), merge)  # adapters compare by identity
    if getattr(model, "_mm3_adapters", ((), False)) == key:
        return getattr(model, "_mm3_adapted_layers", 0)
    layers = _linears(model)
    terms = layer_terms(applied, {name: (m.out_features, m.in_features) for name, m in layers.items()})
    for name, layer in layers.items():
        if name in terms:
            layer.set_low_rank(LowRank(tuple(terms[name]), merge))
        elif layer.low_rank is not None:
            layer.set_low_rank(None)
    model._mm3_adapters, model._mm3_adapted_layers = key, len(terms)
    return len(terms)
