"""The cache folder (`MM3_CACHE_DIR`) and what runs leave behind: a folder that cannot be written
never fails a run (one warning, nothing kept); a damaged cache record or library is set right or
warned about; the temporaries of a killed run are removed by the next; an unreadable model file is
called unreadable. Runs go through the command line in a process of their own where the engine's
once-a-process state (the kernel library, the warning) is what is tested."""

import builtins
import errno
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mm3.cache_dir import RECORD_NAME, recorded, remember
from mm3.commands.main import main as cli_main
from mm3.backends.cpu import build as cpu_build
from mm3.files.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
SONG = ["--caption", "a", "--lyrics", "b", "--duration", "2", "--steps", "2", "--seed", "1", "--lm-seed", "1",
        "--quiet", "--format", "wav16"]
needs_compiler = pytest.mark.skipif(cpu_build.build() is None,
                                    reason="the native integer kernel cannot be built here (no C compiler, or not x86-64)")


def run(args, cache, tmp_path, code=None):
    """The command line with arguments `args` (or the script `code` with them) with the cache folder
    `cache`, the CPU forms by rule (the native kernel built where it can be) and a temporary folder
    of its own."""
    env = {**os.environ, "MM3_CACHE_DIR": str(cache), "MM3_CPU_PRODUCT": "auto", "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "mm3", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def unusable_cache(tmp_path, how) -> Path:
    if how == "a file":
        (tmp_path / "cache").write_text("x")
        return tmp_path / "cache"
    if how == "below a file":
        (tmp_path / "file").write_text("x")
        return tmp_path / "file" / "cache"
    if how == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes in a read-only folder")
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        return tmp_path / "ro" / "cache"
    if not Path("/proc/self").is_dir():  # "cannot be made": a folder the system refuses
        pytest.skip("no /proc")
    return Path("/proc/mm3-cache")


# -- a cache folder that cannot be written ---------------------------------------------------------
@pytest.mark.parametrize("how", ["a file", "below a file", "read-only", "cannot be made"])
def test_a_cache_folder_that_cannot_be_written_never_fails_a_run(tiny, tmp_path, how):
    """The song is made (the kernel library built for this process alone, nothing measured kept),
    with one warning naming the folder; nothing is left in the temporary folder."""
    cache = unusable_cache(tmp_path, how)
    out = tmp_path / "out" / "song.wav"
    done = run(["generate", "--models", str(tiny.gguf), *SONG, "--out", str(out)], cache, tmp_path)
    assert done.returncode == 0, done.stderr
    assert out.is_file() and "Traceback" not in done.stderr
    warned = [line for line in done.stderr.splitlines() if "cache folder" in line]
    assert warned == [f"the cache folder {cache} cannot be written ({warned[0].split('(', 1)[1].split(';')[0]}; "
                      "MM3_CACHE_DIR names another): what this run measures or builds is not kept"], done.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


# -- damaged records and libraries -----------------------------------------------------------------
@needs_compiler
@pytest.mark.parametrize("damage", [b"", b"not a library"], ids=["zero bytes", "garbage"])
def test_a_damaged_cached_library_is_built_again(tmp_path, damage):
    """A cached kernel library emptied or overwritten is built again under its name; never the
    silent fall back to the one-thread build."""
    cache = tmp_path / "cache"
    built = run([], cache, tmp_path, "from mm3.backends.cpu import build as cpu_build; print(cpu_build.build())")
    path = Path(built.stdout.strip())
    assert built.returncode == 0 and path.parent == cache / "native"
    path.write_bytes(damage)
    aged(path)  # damaged some time ago (a library built just now that does not load is not built again)
    again = run([], cache, tmp_path, "from mm3.backends.cpu import native as cpu_native; print(cpu_native.available())")
    assert again.returncode == 0 and again.stdout.strip() == "True", again.stderr
    assert path.stat().st_size > 1000 and list((cache / "native").glob("*.so")) == [path]
    if damage:
        assert f"the CPU integer kernel {path} does not load" in again.stderr


def test_a_cache_record_that_is_a_folder_leaves_no_temporary(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    (tmp_path / RECORD_NAME).mkdir()
    with caplog.at_level(logging.WARNING, logger="mm3.cache_dir"):
        for _ in range(2):
            assert not remember("s", "k", {"form": "float32"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD_NAME]
    assert f"cannot write the record {tmp_path / RECORD_NAME} (not a file)" in caplog.text


# -- what a killed run leaves ------------------------------------------------------------------------
def aged(path: Path, seconds: float = 3600) -> Path:
    t = time.time() - seconds
    os.utime(path, (t, t))
    return path


def test_a_killed_writers_cache_temporaries_are_removed_by_the_next(tmp_path, monkeypatch):
    """Temporaries of the record older than any write takes are a killed process's: the next
    write removes them; a fresh one (a live writer's) stays."""
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path))
    old = tmp_path / f".{RECORD_NAME}.4242.tmp"
    old.write_text("{")
    aged(old)
    fresh = tmp_path / f".{RECORD_NAME}.4343.tmp"
    fresh.write_text("{")
    assert remember("s", "k", {"form": "float32"})
    assert not old.exists() and fresh.exists()
    assert recorded("s")["k"]["form"] == "float32"


@needs_compiler
def test_a_killed_builds_temporaries_are_removed_by_the_next_build(tmp_path):
    """A build killed mid-way leaves its `.tmp` beside the library (or its own folder in the
    temporary folder where the cache could not be written): the next build removes them."""
    cache = tmp_path / "cache"
    (cache / "native").mkdir(parents=True)
    (tmp_path / "tmp").mkdir()
    left = [cache / "native" / ".integer_product-0123.abcd.tmp", tmp_path / "tmp" / "mm3-native-dead"]
    left[0].write_bytes(b"\x7fELF")
    aged(left[0])
    left[1].mkdir()
    (left[1] / ".integer_product-0123.tmp").write_bytes(b"\x7fELF")
    aged(left[1])
    built = run([], cache, tmp_path, "from mm3.backends.cpu import native as cpu_native; print(cpu_native.available())")
    assert built.stdout.strip() == "True", built.stderr
    assert not any(p.exists() for p in left)
    assert [p.suffix for p in (cache / "native").iterdir()] == [".so"]


KILLED_AT_COMMIT = """
import os, sys
from mm3.synth import output
from mm3.commands.main import main
output.FileBatch.commit = lambda self: os.kill(os.getpid(), 9)  # killed with every file staged
sys.exit(main(sys.argv[1:]))
"""


def test_a_batch_killed_mid_write_leaves_nothing_after_the_next_run(tiny, tmp_path):
    """kill -9 with a batch's files written under temporary names: the next run into that folder
    removes them (their process is gone) and writes its own files."""
    out = tmp_path / "out"
    args = ["generate", "--models", str(tiny.gguf), *SONG, "--out", str(out / "song.wav")]
    killed = run(args, tmp_path / "cache", tmp_path, KILLED_AT_COMMIT)
    assert killed.returncode == -9
    assert len([p for p in out.iterdir() if p.name.endswith(".part")]) == 2  # the song and its replay JSON
    done = run(args, tmp_path / "cache", tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["song.json", "song.wav"]


# -- files that cannot be read -----------------------------------------------------------------------
@pytest.fixture
def denied(monkeypatch):
    """Opening the paths added to the returned set fails as a file without read permission does
    (as root a chmod cannot make a file unreadable)."""
    paths: set[str] = set()
    real = builtins.open

    def guarded(file, *a, **k):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) in paths:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded)
    return paths


def test_info_on_a_file_that_cannot_be_read_says_so(tiny, denied, capsys):
    path = tiny.file("mm3-vae")
    denied.add(os.path.abspath(path))
    assert cli_main(["info", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {path}: cannot be read (Permission denied)"]


def test_auto_warns_when_it_skips_a_file_that_cannot_be_read(tiny, tmp_path, denied, caplog):
    folder = tmp_path / "models"
    folder.mkdir()
    for p in tiny.gguf.glob("*.gguf"):
        (folder / p.name).symlink_to(p)
    (folder / "other-vocoder.gguf").write_bytes(tiny.file("mm3-vae").read_bytes())
    denied.add(str(folder / "other-vocoder.gguf"))
    with caplog.at_level(logging.WARNING, logger="mm3.files.registry"):
        chosen = Registry.scan(folder).resolve("vae", "auto")
    assert Path(chosen).name == tiny.file("mm3-vae").name
    assert (f"MM3: auto skips other-vocoder.gguf, as it cannot be read (Permission denied); using "
            f"{Path(chosen).name}") in caplog.text


# -- a model file changed while in use ---------------------------------------------------------------
CHANGED_IN_AR = """
import os, sys
from mm3.commands import jobs as jobs_cli
from mm3.commands.main import main

target, how = sys.argv[1], sys.argv[2]
real, done = jobs_cli.Console.on_progress, []

def on_progress(self, stage, *a):
    if stage == "ar" and not done:  # the LM's first frame planned: its file changes under the mapping
        done.append(stage)
        size = os.path.getsize(target)
        if how == "cut short":
            os.truncate(target, size // 2)
        elif how == "rewritten":
            with open(target, "r+b") as f:
                f.seek(size - 65536)
                f.write(bytes(65536))
        else:  # a new file renamed over it: the mapped one is intact
            with open(target, "rb") as f, open(target + ".new", "wb") as g:
                g.write(f.read())
            os.replace(target + ".new", target)
    real(self, stage, *a)

jobs_cli.Console.on_progress = on_progress
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("how", ["cut short", "rewritten", "replaced"])
def test_a_model_file_changed_in_place_while_in_use_is_an_error_for_the_run(tiny, tmp_path, how):
    """The LM's file cut short or rewritten in place during planning: the run stops with one line
    naming the file (it ended in SIGBUS, or went on over the changed weights), nothing written; a
    file replaced by a rename leaves the mapped one intact, and the run completes."""
    import shutil

    models = tmp_path / "models"
    models.mkdir()
    for p in tiny.gguf.glob("*.gguf"):
        shutil.copy(p, models)
    lm = next(models.glob("*language_model*.gguf"))
    size = lm.stat().st_size
    out = tmp_path / "out"
    done = run([str(lm), how, "generate", "--models", str(models), *SONG, "--out", str(out / "song.wav")],
               tmp_path / "cache", tmp_path, CHANGED_IN_AR)
    if how == "replaced":
        assert done.returncode == 0, done.stderr
        return
    what = f"was cut short while in use ({size} bytes, now {size // 2})" if how == "cut short" else \
        f"changed on disk while in use (still {size} bytes)"
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"error: {lm} {what}: the run stopped; write a new model file beside it and rename it over the old one, "
        "never into it; nothing was written")
    assert not out.exists() or list(out.iterdir()) == []


def test_a_kept_model_whose_file_changed_between_runs_is_an_error_then_read_again(tiny, tmp_path):
    """A pipeline keeping its models loaded (as ComfyUI does) whose DiT file is rewritten in place
    between runs: the next run stops before the DiT reads it, with every model released, and the run
    after reads the file anew."""
    import shutil

    from mm3.filewatch import FileChanged
    from mm3.song.pipeline import Pipeline
    from mm3.song.request import MM3Request

    models = tmp_path / "models"
    models.mkdir()
    for p in tiny.gguf.glob("*.gguf"):
        shutil.copy(p, models)
    dit = next(models.glob("*transformer*.gguf"))
    pipe = Pipeline(models, device="cpu", keep_loaded=True)
    req = MM3Request(caption="a", lyrics="b", duration=0.5, steps=2, seed=3, lm_seed=3)
    pipe.run(req)
    with open(dit, "r+b") as f:  # the same bytes written again: the file's time changes
        f.seek(-4096, os.SEEK_END)
        block = f.read()
        f.seek(-4096, os.SEEK_END)
        f.write(block)
    with pytest.raises(FileChanged, match=rf"^{dit} changed on disk while in use \(still \d+ bytes\)"):
        pipe.run(req)
    assert pipe.store.resident() == []
    assert pipe.run(req)[0].audio.shape[-1] > 0
