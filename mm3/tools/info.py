"""`python -m mm3 info FILE...`: what a component file is, its quant types, hyper-parameters, size."""

from __future__ import annotations

import json
import math
import os
from collections import Counter

from gguf import GGML_QUANT_SIZES

from ..components import ARCH_OF, DESCRIPTIONS
from ..opener import kinds_of, open_component


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
    infos = [d for p in args.files for d in describe(p)]
    if args.json:
        print(json.dumps(infos, indent=1))
    else:
        for d in infos:
            _print_text(d)
    return 0


def add_cli(sub):
    p = sub.add_parser("info", help="describe component files (ours, or ComfyUI's and HOT-Step's)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
