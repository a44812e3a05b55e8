"""The AR stage's few-row CPU product form, by rule.

A decode step multiplies a few rows by every weight in turn, so its speed is the speed of reading
them. The integer kernel built on the machine (`mm3.backends.cpu.native`) reads the values as
stored, and in whole frames it is the fastest form wherever it builds. So each component (the LM,
the depth decoder) takes the `native` form where that kernel serves one of its weight types, else
torch's int4 product (`int4`); within either, a type no packed kernel reads is dequantized per use
or held as a float copy within the memory budget (`mm3.backends.cpu.forms.wants_copy`). Nothing is
timed: the first plan starts at once, and a seed gives the same song on every run of a machine.

`MM3_CPU_PRODUCT` names one form instead (`mm3.backends.cpu.forms.FORMS`), `MM3_CPU_NATIVE=off`
keeps the native kernel out of the rule.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ... import switches
from ...cache_dir import drop_old_records
from ...weights.layers import Linear, fused_layers
from . import native as cpu_native
from .forms import DEFAULT, FORMS, Serving, packed_kernel

log = logging.getLogger(__name__)

ENV_FORM = "MM3_CPU_PRODUCT"
COMPONENTS = ("lm", "depth")


@dataclass
class Choice:
    """The form of each component's few-row products (`forms.FORMS` names) and where it came from
    ("rule" or "named", `MM3_CPU_PRODUCT`)."""

    forms: dict[str, str]
    source: str = "rule"

    @property
    def label(self) -> str:
        names = set(self.forms.values())
        if len(names) == 1:
            return names.pop()
        return " + ".join(f"{c} {self.forms[c]}" for c in COMPONENTS if c in self.forms)

    def line(self) -> str:
        """One line: which form serves, and why."""
        return f"CPU products of the AR stage: {self.label} ({self.source})"


# -- the machine ----------------------------------------------------------------------------------
@functools.cache
def processor() -> str:
    """The processor's model name (Linux: /proc/cpuinfo; elsewhere what Python reports), read once."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """The logical CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# -- the rule -------------------------------------------------------------------------------------
def _linears(model) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear) and m.qtype("weight") is not None]


def named_form() -> str | None:
    """The form `MM3_CPU_PRODUCT` names, None for "auto" or unset (an unknown name is warned about)."""
    value = switches.value(ENV_FORM)
    return None if value == "auto" else value


def ruled_form(model) -> str:
    """The rule's form for `model`'s few-row products on the CPU: `native` where the integer kernel
    builds here and reads one of its weight types, else `int4`."""
    cpu = torch.device("cpu")
    layers = _linears(model)
    if any(cpu_native.serves(layer, layer.qtype("weight"), cpu) for layer in layers):  # builds it at most once
        return "native"
    return "int4"


def applies(models: dict, device: torch.device) -> bool:
    """Whether the models take CPU forms: on the CPU, in the fast numerics."""
    return torch.device(device).type == "cpu" and all(getattr(m, "numerics", "fast") == "fast" for m in models.values())


def serve(models: dict, device: torch.device) -> Choice | None:
    """The forms of these models ({component: model}, `COMPONENTS`) on `device`: the one
    `MM3_CPU_PRODUCT` names, else the rule's (`ruled_form`), applied to them; None where no CPU form
    applies (another device, the reference numerics)."""
    if not applies(models, device):
        return None
    drop_old_records()
    named = named_form()
    if named is not None:
        choice = Choice({name: named for name in models}, "named")
    else:
        choice = Choice({name: ruled_form(model) for name, model in models.items()})
    log.debug("%s", choice.line())
    apply(choice.forms, models)
    return choice


def apply(forms: dict[str, str], models: dict) -> None:
    """Give every product layer of each model its component's form, and free the packings
    (`forms.PACKED`) its layers no longer read."""
    cpu = torch.device("cpu")
    for name, model in models.items():
        form = FORMS[forms.get(name, DEFAULT.name)]
        for layer in _linears(model):
            now = layer.cpu_form
            if now is None or now.form != form or now.component != name:
                layer.cpu_form = Serving(form, name)
        for layer in _linears(model):
            layer.drop_packing(keep=packed_kernel(layer, layer.qtype("weight"), cpu))
        for fused in fused_layers(model):
            first = fused.parts[0]
            fused.drop_packing(keep=packed_kernel(first, first.qtype("weight"), cpu))


@contextmanager
def at_threads(count: int | None):
    """The block at `count` torch threads (None: as it is), torch's count restored after."""
    before = torch.get_num_threads()
    if count is not None and count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)

