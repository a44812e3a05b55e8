"""The system's C compiler, for the small C libraries the engine builds on the machine that runs it
(the CPU kernels, `mm3.backends.cpu.build`; the SIGBUS guard, `mm3.fault_guard`).

`find` names it (`CC`, else `cc`, `gcc` or `clang`); `run` runs a command tied to this process
(`tethered.py`): a build cut short by this process's death, Ctrl-C or the time limit leaves no
compiler running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TETHERED = Path(__file__).with_name("tethered.py")


def find() -> str | None:
    """The compiler to build with: the one `CC` names, else the first of cc, gcc and clang found."""
    named = os.environ.get("CC", "").strip()
    if named:
        return shutil.which(named) or named
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`cmd` run to its end within `timeout` seconds (else `subprocess.TimeoutExpired`), tied to this
    process: interrupted, it takes its whole process group down."""
    runner = subprocess.Popen([sys.executable, str(TETHERED), str(os.getpid()), *cmd], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        out, err = runner.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        runner.terminate()  # the runner kills the command's whole process group
        try:
            runner.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            runner.kill()
            runner.communicate()
        raise
    except BaseException:  # Ctrl-C while building: take the compiler down with us
        runner.terminate()
        runner.wait()
        raise
    return subprocess.CompletedProcess(cmd, runner.returncode, out, err)
