"""The form a weight is held in on its device: the file's (GGUF blocks, or floats) or the device
layout (`mm3.backends.gpu.device_layout`), which replaces the blocks where the layout kernels serve the
weight (`kernel_choice.family` says "layout"). So a memory manager that moves a layer moves the
layout itself and counts its bytes: there is one copy of the weight on the device.

`mm3.weights.slots.WeightSlots._apply` asks `settle` for every slot it moves (a layer sent back to the
CPU gets its file view back; a layout reaching a device where it does not serve turns back into the
blocks, bit for bit); `file_form` gives the blocks of a layout to whatever reads the file's form
(a dequantization per use, a copy to another device). `relayout` settles a model where it is (after
`MM3_KERNELS` changed, or to hold the layout on CPU tensors under Triton's interpreter).
"""

from __future__ import annotations

import torch

from . import device_layout

LAYOUT = "layout"


def _layout_slot(layer, name: str) -> bool:
    """Only a linear layer's quantized weight (a `mm3.weights.layers.Linear`) takes the layout."""
    return name == "weight" and hasattr(layer, "in_features") and hasattr(layer, "fused_kernels") and \
        layer.qtype(name) in device_layout.LAYOUT_TYPES


def wants_layout(layer, device: torch.device) -> bool:
    """Whether `layer`'s weight is held in the device layout on `device`."""
    from . import kernel_choice

    if not layer.fused_kernels:  # reference numerics: products of the dequantized weight
        return False
    return kernel_choice.family(layer.qtype("weight"), layer.out_features, layer.in_features, device) == LAYOUT


def settle(layer, name: str, value: torch.Tensor, form: str | None) -> tuple[torch.Tensor, str | None]:
    """(tensor, form) of slot `name` of `layer` holding `value` (in `form`) on value's device."""
    if not _layout_slot(layer, name) or value.device.type == "meta":
        return value, form
    want = wants_layout(layer, value.device)
    qtype, k = layer.qtype(name), layer.in_features
    with torch.no_grad():
        if form == LAYOUT and not want:
            return device_layout.to_blocks(value, qtype, k), None
        if form is None and want:
            return device_layout.to_planes(value.reshape(value.shape[0], -1), qtype, k), LAYOUT
    return value, form


def file_form(layer, name: str, value: torch.Tensor) -> torch.Tensor:
    """The slot's tensor as the file has it: the blocks of a layout (made for this use), else itself."""
    if layer.form(name) == LAYOUT:
        return device_layout.to_blocks(value, layer.qtype(name), layer.in_features)
    return value


def relayout(module: torch.nn.Module) -> int:
    """Settle every weight under `module` where it is (the form the kernel mode in force asks for);
    returns how many changed form."""
    changed = 0
    for sub in module.modules():
        forms = getattr(sub, "_forms", None)
        if forms is None:
            continue
        for name in list(sub._slot_types):
            value = sub._parameters.get(name)
            if value is None:
                continue
            moved, form = settle(sub, name, value.data, forms.get(name))
            if form != forms.get(name):
                forms.pop(name, None)
                if form is not None:
                    forms[name] = form
                sub._parameters[name] = torch.nn.Parameter(moved, requires_grad=False)
                sub._changed(weights=True)
                changed += 1
    return changed
