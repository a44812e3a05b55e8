"""A model file cut short while a unit of work reads its mapping: with the SIGBUS guard the reads
past its new end get zeros and the run stops with `FileChanged` naming the file; without it (no
compiler) the process dies of SIGBUS; a SIGBUS elsewhere still kills the process. Each case runs in a
process of its own: the guard is installed once a process, and the unguarded ones die."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mm3 import fault_guard

from .helpers.gguf_util import write_gguf

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.name != "posix", reason="the guard is for Linux and macOS")

BIG = 64 * 1024  # floats of the tensor read past the cut: 256 KiB, many pages


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache folder with the guard built in it (skipped where it cannot be built)."""
    folder = tmp_path_factory.mktemp("cache")
    old = os.environ.get("MM3_CACHE_DIR")
    os.environ["MM3_CACHE_DIR"] = str(folder)
    try:
        if fault_guard.build() is None:
            pytest.skip("the SIGBUS guard cannot be built here (no C compiler)")
    finally:
        if old is None:
            del os.environ["MM3_CACHE_DIR"]
        else:
            os.environ["MM3_CACHE_DIR"] = old
    return folder


def run(code: str, *args, cache: Path, guarded: bool = True, **env) -> subprocess.CompletedProcess:
    """`code` in a process of its own (with the variables `env`); not `guarded`: no compiler and an
    empty cache folder, so the guard cannot be had."""
    env = {**os.environ, "MM3_CACHE_DIR": str(cache), **env}
    if not guarded:
        env.update(CC=str(cache / "no-such-compiler"), MM3_CACHE_DIR=str(cache / "empty"))
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def model(tmp_path):
    """A small GGUF file whose second tensor spans many pages."""
    return write_gguf(tmp_path / "model.gguf", "test", {"test.n": 1},
                      {"small": np.arange(8, dtype=np.float32), "big": np.ones(BIG, dtype=np.float32)})


READ_PAST_THE_CUT = """
import os, sys
from mm3 import fault_guard
from mm3.filewatch import FileChanged, check
from mm3.formats.gguf.reader import GGUFFile

path = sys.argv[1]
size = os.path.getsize(path)
f = GGUFFile(path)
print("guarded" if fault_guard.library() is not None else "unguarded", flush=True)
start = f.data_offset + f.tensors["big"].raw.data_ptr() - f.tensors["small"].raw.data_ptr()
os.truncate(path, start + 4 * 1024 * 4)  # the first 4096 floats of "big" stay in the file
big = f.tensors["big"].dequantize()
print(int(big.sum()), int(big[-1]), flush=True)
if sys.argv[2] == "grown again":
    os.truncate(path, size)
try:
    check(path)
except FileChanged as e:
    print(e)
f.close()
"""


@pytest.mark.parametrize("after", ["", "grown again"])
def test_a_read_past_the_end_of_a_file_cut_short_gets_zeros_and_stops_the_run(cache, model, after):
    """The reads past the cut get zeros; `check` names the file, also where it has its old size
    again by then (only the guard's count tells)."""
    size = os.path.getsize(model)
    done = run(READ_PAST_THE_CUT, model, after, cache=cache)
    assert done.returncode == 0, done.stderr
    now = os.path.getsize(model)
    guarded, sums, error = done.stdout.splitlines()
    assert guarded == "guarded"
    assert sums == "4096 0"  # the floats left in the file, then zeros (the page holding the cut reads zeros past it)
    what = f"{size} bytes, read while shorter, now {size}" if after else f"{size} bytes, now {now}"
    assert error == (f"{model} was cut short while in use ({what}): the run stopped; write a new model file beside "
                     "it and rename it over the old one, never into it")


def test_without_the_guard_the_same_read_ends_the_process_with_sigbus(cache, model):
    done = run(READ_PAST_THE_CUT, model, "", cache=cache, guarded=False)
    assert done.stdout.splitlines() == ["unguarded"]
    assert done.returncode == -signal.SIGBUS


def test_the_fault_is_counted_in_the_mapping_it_hit(cache, tmp_path):
    code = """
import mmap, os, sys
from mm3 import fault_guard

out = []
for name in ("a", "b"):
    path = os.path.join(sys.argv[1], name)
    with open(path, "wb") as f:
        f.write(b"x" * 65536)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    out.append((path, m, fault_guard.guard(m)))
os.truncate(out[1][0], 4096)
print(out[1][1][40000], out[1][1][50000], out[0][1][40000])
print(*(fault_guard.faults(slot) for _, _, slot in out))
out[1][1].close()  # the mapping closes as before: the guard holds none of its memory
"""
    done = run(code, tmp_path, cache=cache)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["0 0 120", "0 2"]


SIGBUS_ELSEWHERE = """
import faulthandler, mmap, os, signal, sys
from mm3.formats.gguf.reader import GGUFFile
from mm3 import fault_guard

how, model, other = sys.argv[1:]
if how == "under faulthandler":
    faulthandler.enable()
f = GGUFFile(model)  # guarded
print("guarded" if fault_guard.library() is not None else "unguarded", flush=True)
if how == "sent":
    os.kill(os.getpid(), signal.SIGBUS)
with open(other, "wb") as g:
    g.write(bytes(65536))
with open(other, "rb") as g:
    m = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)  # not a model file: not guarded
os.truncate(other, 0)
print(m[40000])
"""


@pytest.mark.parametrize("how", ["read past an unguarded file's end", "under faulthandler", "sent"])
def test_a_sigbus_outside_the_model_files_still_ends_the_process(cache, model, tmp_path, how):
    done = run(SIGBUS_ELSEWHERE, how, model, tmp_path / "other", cache=cache)
    assert done.stdout.splitlines() == ["guarded"]
    assert done.returncode == -signal.SIGBUS
    if how == "under faulthandler":
        assert "Fatal Python error: Bus error" in done.stderr


CUT_IN_A_UNIT = """
import os, sys
from mm3.commands.main import main
from mm3.plan import ar
from mm3.models.vocoder import Vocoder

target, where, count = sys.argv[1], sys.argv[2], [0]

def cut_inside(real, at):
    def unit(*a, **k):
        count[0] += 1
        if count[0] == at:  # inside the unit, before it reads the file's weights
            os.truncate(target, os.path.getsize(target) // 2)
        return real(*a, **k)
    return unit

if where == "lm":  # the third AR frame
    ar.FrameSampler.step = cut_inside(ar.FrameSampler.step, 3)
else:  # the vocoder's last window (of one): no unit follows, the stage's end checks
    Vocoder.decode_sides = cut_inside(Vocoder.decode_sides, 1)
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("where, guarded", [("lm", True), ("lm", False), ("vae", True)])
def test_a_model_file_cut_short_inside_a_unit_stops_the_run_naming_it(tiny, cache, tmp_path, where, guarded):
    """Through the command line: the LM's file cut short inside an AR frame, or the vocoder's inside
    its last window (where only the stage's end checks), which then read past the new end. With the
    guard: one line naming the file, nothing written; without: SIGBUS."""
    import shutil

    models = tmp_path / "models"
    models.mkdir()
    for p in tiny.gguf.glob("*.gguf"):
        shutil.copy(p, models)
    target = next(models.glob("*language_model*.gguf" if where == "lm" else "*vocoder*.gguf"))
    size = target.stat().st_size
    out = tmp_path / "out"
    song = ["--caption", "a", "--lyrics", "b", "--duration", "2", "--steps", "2", "--seed", "1", "--lm-seed", "1",
            "--quiet", "--format", "wav16"]
    done = run(CUT_IN_A_UNIT, target, where, "generate", "--models", models, *song, "--out", out / "song.wav",
               cache=cache, guarded=guarded, MM3_CPU_NATIVE="off")
    if not guarded:
        assert done.returncode == -signal.SIGBUS, done.stderr
        return
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"error: {target} was cut short while in use ({size} bytes, now {size // 2}): the run stopped; write a new "
        "model file beside it and rename it over the old one, never into it; nothing was written"]
    assert not out.exists() or list(out.iterdir()) == []


def test_a_damaged_build_in_the_cache_is_built_again(cache, model, tmp_path):
    import shutil

    own = tmp_path / "cache"
    shutil.copytree(cache, own)
    (built,) = (own / "native").glob("fault_guard-*.so")
    built.write_bytes(b"not a library")
    done = run(READ_PAST_THE_CUT, model, "", cache=own)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == ["guarded", "4096 0"]
    assert built.stat().st_size > 1000
