"""The device check script (`.ci/gpu`): it parses, each step's command is one this repository runs
(test files that exist, bench arguments the bench accepts), it covers what it promises (kernel tests,
Q8_0 and Q4_K_M at the released sizes, CUDA graphs on and off, each kernel family), and on a machine
where every step fails or runs out of time it still writes its one JSON, saying so per step."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu"


def _env(**extra) -> dict[str, str]:
    """The environment of a run of the script: this interpreter for its steps (PYTHON), whatever
    `python3` the shell would find."""
    return {**os.environ, "PYTHON": sys.executable, **extra}


def _steps() -> dict[str, list[str]]:
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", "/nonexistent/out"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=_env())
    assert done.returncode == 0, done.stderr
    assert not Path("/nonexistent/out").exists()
    return {name: shlex.split(cmd) for name, cmd in (line.split("\t", 1) for line in done.stdout.splitlines())}


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], timeout=30).returncode == 0
    assert os.access(SCRIPT, os.X_OK)


def test_every_step_runs_something_that_exists():
    from mm3.commands.main import build_parser

    steps = _steps()
    benches = {}
    for name, argv in steps.items():
        if "pytest" in argv:
            files = [a for a in argv if a.startswith("tests/")]
            assert files and all((ROOT / f).is_file() for f in files), name
        if argv[1:4] == ["-m", "mm3", "bench"]:
            args = build_parser().parse_args(argv[3:])  # exits on an unknown flag or choice
            benches[name] = args
            assert args.config == "real" and args.direct and args.device == "cuda" and args.json.endswith(f"{name}.json")
    assert {a.quant for a in benches.values() if "dit" in a.stages} == {"Q8_0", "Q4_K_M"}
    assert {a.graphs for a in benches.values()} >= {"on", "off"}
    assert {a.kernels for a in benches.values()} >= {"layout", "triton"}
    assert "kernel_tests" in steps and "environment" in steps
    assert all(steps[name][0] == sys.executable for name in benches)


def test_failures_and_timeouts_are_recorded_not_fatal(tmp_path):
    """No GPU here: the steps fail, time out (2 s each) or are skipped once the budget is spent;
    the JSON still comes, step by step. The steps run this interpreter, not the `python3` first on
    PATH (here one that cannot run anything, as a system Python without pytest could not)."""
    shadow = tmp_path / "bin"
    shadow.mkdir()
    for name in ("python3", "python"):
        (shadow / name).write_text("#!/bin/sh\necho 'not this interpreter' >&2\nexit 1\n")
        (shadow / name).chmod(0o755)
    env = _env(BUDGET="9", STEP_CAP="2", MIN_STEP="1", MM3_GPU_WORK=str(tmp_path / "work"),
               PATH=f"{shadow}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert json.loads(done.stdout) == report
    statuses = {s["step"]: s["status"] for s in report["steps"]}
    assert list(statuses) == list(_steps())  # every step has its record, in order
    assert report["ok"] is False and set(statuses.values()) <= {"ok", "failed", "timeout", "skipped"}
    assert statuses["kernel_tests"] in ("timeout", "skipped") and "skipped" in statuses.values()
    timed = [s for s in report["steps"] if s["status"] == "timeout"]
    assert all(s["limit_s"] <= 2 and "log_tail" in s for s in timed)


def test_the_kernels_of_a_frame_are_gathered_per_quant(tmp_path):
    """The bench steps' frame counts (`ar.frame_kernels`) reach the JSON's `kernels_per_frame`, one
    entry per quant: here from a stand-in interpreter whose bench writes a fixed report."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
argv = sys.argv[1:]
if argv[:3] == ["-m", "mm3", "bench"]:
    quant = argv[argv.index("--quant") + 1]
    report = {{"quant": quant, "ar": {{"frame_kernels": {{"counted": len(quant), "profiled_eager": {{"kernels": 7}},
                                                          "profiled_graph": None}}}}}}
    open(argv[argv.index("--json") + 1], "w").write(json.dumps(report))
    sys.exit(0)
os.execv({sys.executable!r}, [{sys.executable!r}] + argv)
""")
    fake.chmod(0o755)
    env = _env(PYTHON=str(fake), ONLY="q4km_graphs_on q8_graphs_on", MM3_GPU_WORK=str(tmp_path / "work"))
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert report["kernels_per_frame"] == {
        "Q4_K_M": {"step": "q4km_graphs_on", "counted": 6, "profiled_eager": 7, "profiled_graph": None, "error": None},
        "Q8_0": {"step": "q8_graphs_on", "counted": 4, "profiled_eager": 7, "profiled_graph": None, "error": None}}
