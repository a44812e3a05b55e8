"""The engine's environment switches, every one declared and parsed here.

Each `MM3_*` variable has one entry: its values, its default and what it changes. `value(name)`
reads it at the call (so a test or a long-lived process may change it), folds the spellings of
on and off, and warns about a value it does not know, then takes the default. Nothing else in the
engine reads an `MM3_*` variable.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


@dataclass(frozen=True)
class Switch:
    """`choices`: the values it takes (None: any text, such as a folder); a flag takes "on"/"off"."""

    name: str
    default: str
    choices: tuple[str, ...] | None
    effect: str

    @property
    def flag(self) -> bool:
        return self.choices == ("on", "off")


CPU_FORMS = ("int4", "native", "dequant-linear", "dequant-weight-major", "copy-linear", "copy-weight-major")

SWITCHES = {s.name: s for s in (
    Switch("MM3_CACHE_DIR", "", None,
           "the folder of what the engine measured and built on this machine (default: the user cache folder + mm3)"),
    Switch("MM3_KERNELS", "auto", ("auto", "off", "triton", "layout"),
           "the quantized GPU kernels: auto (the layout kernels wherever they read the weight, the block kernels "
           "elsewhere), off (torch's products), or one family named"),
    Switch("MM3_CUDA_GRAPHS", "on", ("on", "off"), "the AR frame step replayed from CUDA graphs on CUDA"),
    Switch("MM3_GPU_LAYERS", "whole", ("whole", "chained"),
           "an AR decode step's LM layers and depth blocks on the GPU: whole (five launches a layer, each norm "
           "inside the product that reads it) or chained (each norm with its residual add a launch of its own)"),
    Switch("MM3_GPU_DECODE_ROWS", "4", ("4", "8"),
           "weight rows a program of the GPU's few-row products takes: 4, or 8 (each input value serves twice as "
           "many weights, fewer instructions a weight, about twice the registers: for a GPU to time); read once a "
           "process"),
    Switch("MM3_GPU_INT8_INPUTS", "off", ("on", "off"),
           "the few-row products over quantized weights on CUDA with their inputs rounded to int8 a block of 32 "
           "(integer dot products, as llama.cpp's: fewer instructions a weight, the inputs to 1/254 of each block's "
           "largest value; for a GPU to time); read once a process"),
    Switch("MM3_GPU_INT8_KV_CACHE", "off", ("on", "off"),
           "the LM's KV cache on the GPU in 8 bits (int8 codes and a float32 scale a group of 32 values, each value "
           "to 1/254 of its group's largest): about 0.56 of the 16-bit cache's memory and of what a late step's "
           "attention reads; for a GPU to time"),
    Switch("MM3_KEEP_COPIES", "off", ("on", "off"),
           "keep float copies of the AR weights even where a fused kernel reads the blocks"),
    Switch("MM3_CPU_NATIVE", "on", ("on", "off"), "build and use the native integer kernel on the CPU"),
    Switch("MM3_CPU_PRODUCT", "auto", ("auto",) + CPU_FORMS,
           "the form of the AR stage's few-row CPU products: auto (the native integer kernel where it builds, "
           "else torch's int4 product) or one form named"),
    Switch("MM3_CPU_BF16", "auto", ("auto", "on", "off"),
           "the DiT's CPU compute dtype: auto (measured on the machine's own products), on (bfloat16), off (float32)"),
)}

def value(name: str) -> str:
    """The value of switch `name` in force now: its default when unset or unknown (warned about)."""
    switch = SWITCHES[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return switch.default
    if switch.choices is None:
        return raw
    got = raw.lower()
    if switch.flag:
        got = "on" if got in _ON else "off" if got in _OFF else got
    if got in switch.choices:
        return got
    warnings.warn(f"{name}={raw!r} is not one of {', '.join(switch.choices)}; using {switch.default}", stacklevel=3)
    return switch.default


def on(name: str) -> bool:
    """Whether flag switch `name` is on."""
    return value(name) == "on"

