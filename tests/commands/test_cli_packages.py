"""The command line on an install that lacks a package: `--help` still runs, and a command that
needs the package ends in one `error:` line naming it and the pip command that installs it, with
exit code 2 and no traceback. Each run is a fresh interpreter (this one, `sys.executable`) in
which the package cannot be imported, as on a machine where it was never installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_without(package: str, *argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The command line with the arguments `argv` and `package` unimportable (a None entry in sys.modules makes every
    import of it raise ModuleNotFoundError naming it, as a missing install does)."""
    hide = (f"import sys, runpy; sys.modules[{package!r}] = None; sys.path.insert(0, {str(ROOT)!r}); "
            f"sys.argv = ['mm3', *{list(argv)!r}]; runpy.run_module('mm3', run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=300, cwd=cwd)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    return done.stderr


def test_help_runs_without_safetensors():
    done = run_without("safetensors", "--help")
    assert done.returncode == 0, done.stderr
    assert "demo" in done.stdout and "generate" in done.stdout and not done.stderr


def test_demo_without_safetensors_names_it_and_its_install(tmp_path):
    err = one_error_line(run_without("safetensors", "demo", "--dir", str(tmp_path / "demo"), "--quiet"))
    assert "the Python package 'safetensors' is not installed: `python -m pip install safetensors`" in err
    assert "python -m pip install -r requirements-cli.txt" in err


@pytest.mark.parametrize("package", ["torch", "gguf"])
def test_a_missing_core_package_is_one_error_line(package):
    err = one_error_line(run_without(package, "--help"))
    assert f"the Python package {package!r} is not installed: `python -m pip install {package}`" in err


def test_requirements_cover_what_the_command_line_imports():
    """requirements-cli.txt (through requirements.txt) names every package the command line
    reports by name, so the one install command the error gives is enough."""
    from mm3.commands.main import CLI_PACKAGES, CLI_REQUIREMENTS

    def names(path: Path) -> set[str]:
        out = set()
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("-r "):
                out |= names(path.parent / line[3:].strip())
            elif line:
                out.add(line.split(">")[0].split("=")[0].split("<")[0].strip())
        return out

    assert set(CLI_PACKAGES) <= names(ROOT / CLI_REQUIREMENTS)
    assert {"torch", "numpy"}.isdisjoint(names(ROOT / "requirements.txt"))  # never ComfyUI's torch


def test_an_optional_package_gets_the_install_that_keeps_torch():
    """torchaudio (reading recordings) is named with an install that leaves torch as it is."""
    from mm3.commands.main import missing_package

    message = missing_package(ModuleNotFoundError("no torchaudio", name="torchaudio"))
    assert message == ("the Python package 'torchaudio' is not installed: `python -m pip install --no-deps "
                       "torchaudio==<the version of your torch>`")
    assert missing_package(ModuleNotFoundError("broken checkout", name="mm3.song.stages")) is None
