"""A random adapter for the benchmark: rank `r` factors on every attention and MLP layer of an LM
or DiT, attached as the command line attaches a file's (side products in the fast numerics), to
measure what an adapter costs per AR frame and per DiT step."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..lora.adapter import Adapter, Module
from ..lora.attach import Applied, attach, model_shapes
from ..lora.keys import OTHER, Target, group_of
from ..lora.use import LoraUse


def random_adapter(model: nn.Module, kind: str, rank: int, seed: int = 0) -> Adapter:
    """Factors of standard deviation 0.01 (scale 1) for each layer of a strength group."""
    g = torch.Generator().manual_seed(seed)
    modules = []
    for name, (out, width) in model_shapes(model).items():
        if group_of(name) == OTHER:
            continue
        down, up = torch.randn(rank, width, generator=g) * 0.01, torch.randn(out, rank, generator=g) * 0.01
        modules.append(Module(name, Target(kind, (name,), "random"), down, up, float(rank), 1.0))
    return Adapter(f"random rank {rank}", "random", tuple(modules), "")


def attach_random(model: nn.Module, kind: str, rank: int, seed: int = 0) -> int:
    """`random_adapter` set on `model`; returns the layers it changes."""
    adapter = random_adapter(model, kind, rank, seed)
    return attach(model, [Applied(adapter, LoraUse(adapter.path, "", kind))])
