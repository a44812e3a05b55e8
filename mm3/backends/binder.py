"""The back ends' answers to the layers (`mm3.weights.binding`): each layer's product from the rule
table (`products`), the form a weight takes where it moves (`gpu.placement`), a table's rows (the
CPU library's one call, else the dequantization op), packings for the CPU kernels
(`products.KERNELS`, the one registry of kernels that read a packing of their own), and the form a
kept float copy takes (`cpu.onednn`: oneDNN's layout for bfloat16 on the CPU)."""

from __future__ import annotations

import torch

from ..weights.binding import Portable
from . import products, steps
from .cpu import forms as cpu_forms
from .cpu import int4 as cpu_int4
from .cpu import onednn as cpu_onednn
from .gpu import custom_ops, placement


class Backends(Portable):
    """The binder of the CPU and GPU back ends, over torch's operations where neither serves."""

    def linear(self, layer, dtype: torch.dtype, device: torch.device):
        return products.for_linear(layer, dtype, device)

    def fused(self, fused, dtype: torch.dtype, device: torch.device):
        return products.for_fused(fused, dtype, device)

    def separate(self, parts: list):
        return products.Separate(parts)

    def ready(self, product) -> None:
        products.ready(product)

    def settle(self, layer, name: str, value: torch.Tensor, form: str | None):
        return placement.settle(layer, name, value, form)

    def file_form(self, layer, name: str, value: torch.Tensor) -> torch.Tensor:
        return placement.file_form(layer, name, value)

    def rows(self, table: torch.Tensor, qtype, ids: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        rows = steps.lookup(table, qtype, ids.reshape(-1), width, dtype)  # few rows in one call of a back end
        if rows is not None:
            return rows.to(dtype).view(*ids.shape, -1)
        raw = table[ids.reshape(-1)]
        return custom_ops.dequantize(raw, qtype, (raw.shape[0], width), dtype).view(*ids.shape, -1)

    def packing(self, kernel: str, blocks: torch.Tensor, qtype, n: int, k: int):
        return products.KERNELS[kernel].repack(blocks, qtype, n, k)

    def release_pages(self, layer) -> None:
        if not layer._pages:
            layer._pages.append(cpu_int4.file_pages(layer.stored("weight")))
        cpu_int4.release_pages(layer._pages[0])

    def wants_copy(self, layer, qtype, device: torch.device) -> bool:
        return cpu_forms.wants_copy(layer, qtype, device)

    def kept_form(self, layer, name: str, value: torch.Tensor) -> torch.Tensor:
        return cpu_onednn.laid_out(value) if name == "weight" else value
