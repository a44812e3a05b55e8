"""Command-line entry: one subcommand per tool, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ..errors import Cancelled, InputError, MM3Error

# Modules that register a subcommand through `add_cli(subparsers)`.
TOOLS = ("mm3.commands.jobs", "mm3.commands.align", "mm3.tools.info", "mm3.tools.tiny", "mm3.tools.convert", "mm3.tools.quantize",
         "mm3.tools.download", "mm3.tools.kernels", "mm3.synth.codec", "mm3.commands.demo", "mm3.bench")


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


def _show_choices() -> None:
    """The line a machine's first plan writes about the CPU products it measured (`mm3.backends.cpu.choice`),
    on stderr, where nothing else has set up logging."""
    choice_log = logging.getLogger("mm3.backends.cpu.choice")
    if not logging.getLogger().handlers and not choice_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        choice_log.addHandler(handler)
        choice_log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 bad input (`InputError`: request, prompt, codes, model files, output
    paths); 1 a run that failed (`RunError`: NaN/Inf, out of device memory, the LM ended at once);
    130 cancelled (Ctrl+C). Every failure is one line on stderr; no output file or temporary is
    left behind."""
    args = build_parser().parse_args(argv)
    _show_choices()
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
