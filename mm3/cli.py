"""Command-line entry: one subcommand per tool, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .gguf.errors import ComponentError, GGUFFormatError
from .output import OutputError

# Modules that register a subcommand through `add_cli(subparsers)`.
TOOLS = ("mm3.jobs_cli", "mm3.info", "mm3.tiny", "mm3.convert", "mm3.quantize", "mm3.download", "mm3.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mm3", description="MiniMax Music 3 from GGUF files")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in TOOLS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # a tool not present in this build
            raise
        module.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (GGUFFormatError, ComponentError, OutputError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into a reader that closed early (`| head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # keep the interpreter's final flush quiet
        return 0
