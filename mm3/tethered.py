"""Run a command tied to the process that asked for it (this script's arguments: that process's id,
then the command and its arguments).

The command runs in a process group of its own (a compiler's passes and linker with it). When the
parent process ends, even by SIGKILL, this runner is told by the kernel (Linux `PR_SET_PDEATHSIG`)
and kills the whole group, so no compiler is left running after an interrupted build. Elsewhere the
command simply runs. A standalone script: it imports nothing of the engine, so it starts at once.
"""

import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _tie_to(parent: int) -> bool:
    """Ask for SIGTERM when `parent` ends; False where it has ended already."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    return os.getppid() == parent


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("arguments: the parent process id, then the command and its arguments", file=sys.stderr)
        return 2
    group: list[int] = []

    def stop(signum, frame):
        if group:
            try:
                os.killpg(group[0], signal.SIGKILL)
            except OSError:
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if not _tie_to(int(argv[0])):
        return 1
    try:
        child = subprocess.Popen(argv[1:], start_new_session=True)
    except OSError as e:
        print(f"cannot run {argv[1]}: {e}", file=sys.stderr)
        return 127
    group.append(child.pid)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
