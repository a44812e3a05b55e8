"""The forms a CPU product of a few rows can take, and which one each layer serves with.

A decode step multiplies a few rows by large weights, so its speed is the speed of reading them:

  int4                  torch's int4 product over the weight repacked once (`cpu_int4`)
  native                this package's integer kernel built on the machine (`cpu_native`) for
                        the types it reads, the int4 product for the others
  dequant-linear        the blocks dequantized at every product, then `F.linear`
  dequant-weight-major  the same, multiplied as `w @ x.T` (`mm3.backends.cpu.matmul.weight_major_linear`)
  copy-linear           a float copy kept (within the memory budget), then `F.linear`
  copy-weight-major     the same, weight-major

A layer's `cpu_form` (a `Serving`, set by `mm3.backends.cpu.choice` by rule or as named) picks
one; `mm3.backends.products` reads it when it chooses the layer's product, and `weight_copies` when
it decides which weights get copies. Float weights at hand skip the holding part (only the
`F.linear` / weight-major part applies); a type the int4 product cannot read is held as `copy`.
A layer without a form in the fast numerics on the CPU takes `DEFAULT`; other devices and the
reference numerics have no form (`F.linear`, the reference's product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import int4 as cpu_int4, native as cpu_native

HOLDERS = ("int4", "native", "dequant", "copy")
PACKED = ("int4", "native")  # holders that repack the weight once for a kernel of their own


@dataclass(frozen=True)
class Form:
    """How a few-row product reads its weight: `holds` (one of `HOLDERS`) and whether a float
    product is weight-major."""

    holds: str
    weight_major: bool = False

    @property
    def name(self) -> str:
        if self.holds in PACKED:
            return self.holds
        return f"{self.holds}-{'weight-major' if self.weight_major else 'linear'}"


FORMS = {f.name: f for f in (Form("int4"), Form("native"), Form("dequant"), Form("dequant", True), Form("copy"),
                              Form("copy", True))}
DEFAULT = FORMS["int4"]  # a layer given no form (the plan gives the LM and depth decoder theirs)


@dataclass
class Serving:
    """A layer's CPU form and the component it belongs to."""

    form: Form
    component: str = ""


def form_of(layer, device: torch.device) -> Form | None:
    """The form of `layer`'s few-row products on `device`: its `cpu_form`, `DEFAULT` without one,
    None off the CPU, outside the fast numerics (`decode_products` off) or for a layer that is no
    product (a norm's vector, a convolution)."""
    if torch.device(device).type != "cpu" or not getattr(layer, "decode_products", False):
        return None
    serving = getattr(layer, "cpu_form", None)
    return DEFAULT if serving is None else serving.form


def weight_major(layer, device: torch.device) -> bool:
    """Whether `layer`'s float products of a few rows are weight-major."""
    form = form_of(layer, device)
    return form is not None and form.weight_major


def packed_kernel(layer, qtype, device: torch.device) -> str | None:
    """The kernel of its own (`PACKED`: "native", "int4") that `layer`'s few-row products on
    `device` go to, or None: the form's, where that kernel reads the type; under `native`, the
    int4 product for the types the native kernel does not read."""
    form = form_of(layer, device)
    if form is None or form.holds not in PACKED:
        return None
    if form.holds == "native" and cpu_native.serves(layer, qtype, device):
        return "native"
    return "int4" if cpu_int4.serves(layer, qtype, device) else None


def wants_copy(layer, qtype, device: torch.device) -> bool:
    """Whether a float copy of `layer`'s weight serves it: always without a CPU form (an
    accelerator, the reference numerics, the DiT), never for a packed kernel or per-product
    dequantization, and for `copy` forms and the types no packed kernel of the form reads."""
    form = form_of(layer, device)
    if form is None:
        return True
    if form.holds in PACKED:
        return packed_kernel(layer, qtype, device) is None
    return form.holds == "copy"
