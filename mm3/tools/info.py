"""`python -m mm3 info FILE...`: what a component file is, its quant types, hyper-parameters, size;
for a LoRA file, what it changes and, with `--base`, by how much (`mm3.lora.health`)."""

from __future__ import annotations

import json
import math
import os
from collections import Counter

from gguf import GGML_QUANT_SIZES

from ..components import ARCH_OF, DESCRIPTIONS
from ..lora.adapter import AdapterError, adapter_kinds, read_adapter
from ..lora.attach import Applied
from ..lora.health import WARN_ABOVE, group_changes, warnings_of
from ..lora.keys import NAMES
from ..lora.use import LoraUse
from ..files.opener import kinds_of, open_component


def describe(path: str) -> list[dict]:
    """One entry per component the file holds (another tool's file may hold several); headers only."""
    out = []
    for kind in kinds_of(path) or (None,):  # None: let open_component say what the file is not
        comp = open_component(path, kind, header_only=True)
        try:
            infos = comp.file.tensor_infos()
            out.append({
                "file": path,
                "component": comp.kind,
                "description": DESCRIPTIONS[comp.kind],
                "architecture": ARCH_OF[comp.kind],
                "layout": getattr(comp.file, "dialect", "MiniMax Music 3 (minimaxmusic.cpp)"),
                "file_type": comp.file.metadata.get("general.file_type", "native"),
                "tensors": len(infos),
                "quant_types": dict(sorted(Counter(q.name for _, _, q in infos).items())),
                "hparams": comp.hparams,
                "tensor_bytes": sum(math.prod(s) // GGML_QUANT_SIZES[q][0] * GGML_QUANT_SIZES[q][1]
                                    for _, s, q in infos),
                "file_bytes": os.path.getsize(path),
            })
        finally:
            comp.close()
    return out


def describe_lora(path: str, bases: list[str], strength: float = 1.0) -> dict:
    """An adapter file: its layout, components, modules, ranks and scales; with `bases` (component
    files; those of what it changes are used) the relative change of each strength group at `strength`."""
    adapter = read_adapter(path)
    out = {"file": path, "lora": True, "layout": adapter.layout, "components": list(adapter.kinds),
           "modules": len(adapter.modules), "ranks": list(adapter.ranks()),
           "scales": sorted({m.scale for m in adapter.modules if math.isfinite(m.scale)})
           + sorted({str(m.scale) for m in adapter.modules if not math.isfinite(m.scale)}),
           "groups": {k: list(adapter.groups(k)) for k in adapter.kinds},
           "strength": strength, "warn_above": WARN_ABOVE, "warnings": list(adapter.problems), "changes": []}
    fitting = [(base, k) for base in bases for k in kinds_of(base)[:2] if k in adapter.kinds]
    if bases and not fitting:
        held = ", ".join(f"{b} ({' and '.join(DESCRIPTIONS[k] for k in kinds_of(b)) or 'no component'})" for b in bases)
        raise AdapterError(f"{adapter.name} changes the {' and '.join(NAMES[k] for k in adapter.kinds)}; --base gave "
                           f"{held}")
    for base, kind in fitting:
        comp = open_component(base, kind)
        try:
            use = LoraUse(path, adapter.fingerprint, comp.kind, float(strength))
            changes = group_changes([Applied(adapter, use)], comp)
        finally:
            comp.close()
        out["changes"].append({"base": base, "component": kind,
                               "groups": [vars(c) | {} for c in changes],
                               "warnings": warnings_of(changes, adapter.name)})
    return out


def _print_lora(d: dict):
    print(d["file"])
    comps = " and ".join(NAMES[k] for k in d["components"])
    scales = ", ".join(s if isinstance(s, str) else f"{s:g}" for s in d["scales"])
    print(f"  LoRA        {comps}, {d['layout']} names, {d['modules']} modules, rank "
          f"{', '.join(map(str, d['ranks']))}, scale (alpha / rank) {scales}")
    for kind, groups in d["groups"].items():
        print(f"  {kind + ' groups':11s} {', '.join(groups)}")
    for w in d["warnings"]:
        print(f"  warning: {w}")
    for change in d["changes"]:
        print(f"  change of {change['base']} at strength {d['strength']:g} (||s B A|| / ||W||):")
        for g in change["groups"]:
            print(f"    {g['group']:8s} {g['layers']:4d} layers  {100 * g['relative']:6.2f} %  (most: "
                  f"{g['worst_layer']} {100 * g['worst']:.2f} %)")
        for w in change["warnings"]:
            print(f"  warning: {w}")


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _print_text(d: dict):
    print(f"{d['file']}")
    print(f"  component   {d['component']} ({d['description']}), architecture {d['architecture']}")
    print(f"  layout      {d['layout']}")
    quants = ", ".join(f"{k} x{v}" for k, v in d["quant_types"].items())
    print(f"  tensors     {d['tensors']} ({quants}), file type {d['file_type']}")
    print(f"  size        {human_size(d['file_bytes'])}")
    for k, v in d["hparams"].items():
        if k in ("architectures", "dtype", "torch_dtype", "transformers_version", "model_type"):
            continue
        print(f"  {k:27s} {v}")


def run(args) -> int:
    bases = args.base or []
    infos = []
    for p in args.files:
        if adapter_kinds(p):
            infos.append(describe_lora(p, bases, args.strength))
        elif p.endswith(".safetensors") and not kinds_of(p):
            read_adapter(p)  # says which tensor is no LoRA factor of this model
        else:
            infos += describe(p)
    if args.json:
        print(json.dumps(infos, indent=1))
    else:
        for d in infos:
            _print_lora(d) if d.get("lora") else _print_text(d)
    return 0


def add_cli(sub):
    p = sub.add_parser("info", help="describe component files (ours, or ComfyUI's and HOT-Step's)")
    p.add_argument("files", nargs="+", metavar="FILE", help="component files, or LoRA files (.safetensors)")
    p.add_argument("--base", action="append", metavar="FILE",
                   help="for a LoRA: the LM or DiT file it changes; prints how far it moves each group's weights "
                        f"(relative Frobenius norm; above {100 * WARN_ABOVE:.0f} %% is a warning)")
    p.add_argument("--strength", type=float, default=1.0, help="for a LoRA with --base: its strength (default 1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
