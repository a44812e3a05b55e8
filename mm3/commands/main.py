"""Command-line entry: one subcommand per tool, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import Cancelled, InputError, MM3Error

# What the command line imports from outside the standard library (requirements-cli.txt installs
# them all); a package missing at run time is named with the command that installs it.
CLI_PACKAGES = ("torch", "numpy", "safetensors", "gguf", "tokenizers", "lameenc", "tqdm", "huggingface_hub")
CLI_REQUIREMENTS = "requirements-cli.txt"
# Packages whose plain install would be wrong: each torchaudio release pins the one torch it was built for.
PIP_COMMANDS = {"torchaudio": "python -m pip install --no-deps torchaudio==<the version of your torch>"}

# Modules that register a subcommand through `add_cli(subparsers)`.
TOOLS = ("mm3.commands.jobs", "mm3.commands.edit", "mm3.commands.align", "mm3.tools.info", "mm3.tools.tiny",
         "mm3.tools.convert", "mm3.tools.quantize", "mm3.tools.download", "mm3.tools.kernels", "mm3.synth.codec",
         "mm3.commands.demo", "mm3.bench")


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


def missing_package(e: ModuleNotFoundError) -> str | None:
    """The one-line message for a package that is not installed (None: a module of this engine
    itself is missing, which is a broken checkout rather than an install to make)."""
    name = (e.name or "").split(".")[0]
    if not name or name == __package__.split(".")[0]:
        return None
    where = f" (or everything the command line needs: `python -m pip install -r {CLI_REQUIREMENTS}` in the " \
            "pack's folder)" if name in CLI_PACKAGES else ""
    command = PIP_COMMANDS.get(name, f"python -m pip install {name}")
    return f"the Python package {name!r} is not installed: `{command}`{where}"


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 bad input (`InputError`: request, prompt, codes, model files, output
    paths) or a package that is not installed; 1 a run that failed (`RunError`: NaN/Inf, out of
    device memory, the LM ended at once); 130 cancelled (Ctrl+C). Every failure is one line on
    stderr; no output file or temporary is left behind."""
    try:
        return _run(argv)
    except ModuleNotFoundError as e:
        message = missing_package(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except Cancelled as e:
        print(f"cancelled: {e}; nothing was written", file=sys.stderr)
        return e.exit_code
    except MM3Error as e:
        done = "" if isinstance(e, InputError) or e.exit_code == 2 else "; nothing was written"
        print(f"error: {e}{done}", file=sys.stderr)
        return e.exit_code
    except (FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into a reader that closed early (`| head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # keep the interpreter's final flush quiet
        return 0
