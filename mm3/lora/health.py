"""The adapter health check: how far adapters move the base weights, per strength group.

For each layer the relative change ||sum s B A||_F / ||W||_F (W dequantized), and per group the
same over the group's layers together (norms added in quadrature). ||B A||_F comes from the rank-r
products, ||B A||^2 = sum((B^T B) * (A A^T)), so no [out, in] delta is formed; the weights' norms are
read once per file. Healthy adapters move the weights by 1-5 %; HOT-Step measured 17-34 % on an
overtrained one, which sounds like a damaged model rather than a strong style: above
`WARN_ABOVE` the command line and the nodes warn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..components import Component
from ..filecache import FileCache
from .attach import layer_terms
from .keys import GROUPS, OTHER, group_of

WARN_ABOVE = 0.10  # relative change of a group's weights
_NORMS = FileCache(8)


@dataclass(frozen=True)
class GroupChange:
    """One strength group: its layers' relative change together, and the layer changed most."""

    group: str
    layers: int
    relative: float
    worst_layer: str
    worst: float

    def line(self) -> str:
        return (f"{self.group:8s} {self.layers:4d} layers  {100 * self.relative:6.2f} %  (most: {self.worst_layer} "
                f"{100 * self.worst:.2f} %)")


def base_shapes(component: Component) -> dict[str, tuple[int, int]]:
    """{layer: (out, in)} of the 2-D weights of a component file (header only)."""
    return {name[:-len(".weight")]: tuple(shape) for name, shape, _ in component.file.tensor_infos()
            if name.endswith(".weight") and len(shape) == 2}


def weight_norms(component: Component, layers) -> dict[str, float]:
    """||W||_F of the named layers' weights, dequantized to float32 one at a time (kept per file)."""
    norms = _NORMS.get(component.path, lambda st: {})
    for layer in layers:
        if layer not in norms:
            w = component.tensors[layer + ".weight"].dequantize(torch.float32)
            norms[layer] = float(torch.linalg.vector_norm(w.double()))
    return {layer: norms[layer] for layer in layers}


def delta_norms(applied, shapes: dict[str, tuple[int, int]]) -> dict[str, float]:
    """||sum s B A||_F per layer of `applied` (`mm3.lora.attach.Applied`s of one component)."""
    out = {}
    for layer, terms in layer_terms(applied, shapes).items():
        down = torch.cat([d.double() for d, _, _ in terms])  # [R, in]
        up = torch.cat([u.double() * s for _, u, s in terms], dim=1)  # [out, R]
        square = float(((up.T @ up) * (down @ down.T)).sum())
        out[layer] = square if math.isnan(square) else math.sqrt(max(0.0, square))  # NaN factors stay NaN
    return out


def group_changes(applied, component: Component) -> list[GroupChange]:
    """The relative change of each group `applied` touches, in `GROUPS` order (then OTHER)."""
    deltas = delta_norms(applied, base_shapes(component))
    norms = weight_norms(component, deltas)
    out = []
    for group in GROUPS + (OTHER,):
        layers = [layer for layer in deltas if group_of(layer) == group]
        if not layers:
            continue
        delta = math.sqrt(sum(deltas[layer] ** 2 for layer in layers))
        weight = math.sqrt(sum(norms[layer] ** 2 for layer in layers))
        worst = max(layers, key=lambda layer: deltas[layer] / norms[layer] if norms[layer] else math.inf)
        out.append(GroupChange(group, len(layers), delta / weight if weight else math.inf, worst,
                               deltas[worst] / norms[worst] if norms[worst] else math.inf))
    return out


def warnings_of(changes: list[GroupChange], what: str) -> list[str]:
    """A warning for each group moved more than `WARN_ABOVE`, or by no finite amount."""
    return [f"{what} changes the {c.group} weights by {100 * c.relative:.1f} % (healthy adapters: 1-5 %; above "
            f"{100 * WARN_ABOVE:.0f} % it tends to sound like a damaged model): lower its strength or that group's"
            if math.isfinite(c.relative) else
            f"{what} changes the {c.group} weights by {c.relative} (its factors or alpha are not finite numbers): it "
            "cannot be used"
            for c in changes if not c.relative <= WARN_ABOVE]
