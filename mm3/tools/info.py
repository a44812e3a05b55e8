"""`python -m mm3 info FILE...`: what a component file is, its quant types, hyper-parameters, size."""

from __future__ import annotations

import json
import os

from ..components import ARCH_OF, DESCRIPTIONS, open_component


def describe(path: str) -> dict:
    comp = open_component(path)
    try:
        return {
            "file": path,
            "component": comp.kind,
            "description": DESCRIPTIONS[comp.kind],
            "architecture": ARCH_OF[comp.kind],
            "file_type": comp.file.metadata.get("general.file_type", "native"),
            "tensors": len(comp.tensors),
            "quant_types": comp.quant_counts(),
            "hparams": comp.hparams,
            "tensor_bytes": comp.nbytes(),
            "file_bytes": os.path.getsize(path),
        }
    finally:
        comp.close()


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _print_text(d: dict):
    print(f"{d['file']}")
    print(f"  component   {d['component']} ({d['description']}), architecture {d['architecture']}")
    quants = ", ".join(f"{k} x{v}" for k, v in d["quant_types"].items())
    print(f"  tensors     {d['tensors']} ({quants}), file type {d['file_type']}")
    print(f"  size        {human_size(d['file_bytes'])}")
    for k, v in d["hparams"].items():
        if k in ("architectures", "dtype", "torch_dtype", "transformers_version", "model_type"):
            continue
        print(f"  {k:27s} {v}")


def run(args) -> int:
    infos = [describe(p) for p in args.files]
    if args.json:
        print(json.dumps(infos, indent=1))
    else:
        for d in infos:
            _print_text(d)
    return 0


def add_cli(sub):
    p = sub.add_parser("info", help="describe GGUF component files")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
