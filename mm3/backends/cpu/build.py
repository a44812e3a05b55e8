"""The C library of the CPU kernels (`mm3.backends.cpu.native`), built on the machine that runs it.

The C files (`csrc/`: the products and repacking, `integer_product.c`; a decode step's small
operations, `decode_steps.c`; the DiT's attention in bfloat16, `long_attention.c`) are compiled once per machine into one library with the system's C
compiler (`CC`, else `cc`, `gcc` or `clang`; `-O3 -march=native`, with OpenMP where the compiler
has it) in the cache folder (`mm3.cache_dir`), keyed by the sources, the compiler and the
processor, and loaded with ctypes. The compiler runs tied to this process (`mm3.compiler.run`): a
build cut short by this process's death or the time limit leaves no compiler running. Whether a loaded
library computes what it should is `native`'s question (its probe).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ... import compiler
from ...cache_dir import cache_dir, clear_stale, writable

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("integer_product.c", "decode_steps.c", "long_attention.c"))
BUILD_SECONDS = 120
STALE_SECONDS = 2 * BUILD_SECONDS  # a build's temporary older than this was left by a killed process
TEMP_PREFIX = "mm3-native-"  # a build's own folder where the cache folder cannot be written


def machine() -> str:
    """What the compiled code depends on besides its source: the processor and its features."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")


def build(flags: tuple[str, ...] = FLAGS, openmp: bool = True, again: bool = False) -> Path | None:
    """The compiled library in the cache folder, built now with `flags` (and OpenMP: without it
    the kernel runs on one thread) if it is not there (or `again`: the one there did not load); None
    where it cannot be (no compiler, not x86-64, a failed build), with one log line. Where the
    cache folder cannot be written it is built in a folder of its own (`TEMP_PREFIX`), which the
    caller removes once it is loaded (`load_built`)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or os.name != "posix":
        return None
    cc = compiler.find()
    if cc is None:
        log.info("no C compiler found (set CC to name one): the CPU products use torch's kernels alone")
        return None
    try:
        done = compiler.run([cc, "--version"], BUILD_SECONDS)
        if done.returncode != 0:
            raise OSError((done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1])
        version = done.stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.info("the C compiler %s does not run (%s): the CPU products use torch's kernels alone", cc, e)
        return None
    flags = (*flags, "-fopenmp") if openmp else tuple(flags)
    digest = hashlib.sha256(b"\0".join([*(source.read_bytes() for source in SOURCES), version.encode(),
                                         " ".join(flags).encode(),
                                         machine().encode()])).hexdigest()[:20]
    name = f"integer_product-{digest}.so"
    cached = cache_dir() / "native" / name
    if not again and _whole(cached):
        return cached
    clear_stale(Path(tempfile.gettempdir()), f"{TEMP_PREFIX}*", STALE_SECONDS)
    folder = writable("native")
    if folder is None:
        try:
            folder = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
        except OSError as e:
            log.warning("cannot build the CPU integer kernel: no folder to build it in (%s)", e)
            return None
    else:
        clear_stale(folder, ".integer_product-*.tmp", STALE_SECONDS)
    out = folder / name
    try:
        handle, tmp = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".tmp", dir=folder)
        os.close(handle)
    except OSError as e:
        why, tmp = str(e), None
    else:
        try:
            done = compiler.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], BUILD_SECONDS)
            if done.returncode == 0:
                os.replace(tmp, out)
                log.info("built the CPU integer kernel with %s%s", Path(cc).name, "" if openmp else " (one thread)")
                return out
            why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
        finally:
            Path(tmp).unlink(missing_ok=True)
    _remove_own_folder(out)
    log.info("cannot build the CPU integer kernel with %s%s (%s)", cc, "" if openmp else " without OpenMP", why)
    return None


def _whole(path: Path) -> bool:
    """Whether a built library is there and not empty (a zero-byte one is built again)."""
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def _remove_own_folder(path: Path) -> None:
    """Remove the folder of its own a library was built in (`TEMP_PREFIX`), if it was."""
    if path.parent.name.startswith(TEMP_PREFIX):
        shutil.rmtree(path.parent, ignore_errors=True)


def load(path: Path):
    """The library at `path` with its functions' signatures set (ctypes; OSError if it cannot load)."""
    lib = ctypes.CDLL(str(path))
    lib.mm3_integer_product.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 5
    lib.mm3_integer_product.restype = ctypes.c_int
    lib.mm3_integer_vector_bits.restype = ctypes.c_int
    lib.mm3_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_float]
    lib.mm3_rms_norm.restype = None
    lib.mm3_dequantize_rows.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 3 + [ctypes.c_void_p,
                                                                                                ctypes.c_int64,
                                                                                                ctypes.c_void_p]
    lib.mm3_dequantize_rows.restype = ctypes.c_int
    lib.mm3_integer_nibble_quads.restype = ctypes.c_int
    lib.mm3_attend.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + \
        [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_void_p]
    lib.mm3_attend.restype = ctypes.c_int
    lib.mm3_repack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_int]
    lib.mm3_repack.restype = ctypes.c_int
    lib.mm3_top_k_draw.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int64,
                                                                              ctypes.c_void_p, ctypes.c_int,
                                                                              ctypes.c_void_p, ctypes.c_void_p,
                                                                              ctypes.c_int64, ctypes.c_void_p]
    lib.mm3_top_k_draw.restype = ctypes.c_int
    lib.mm3_depth_layers.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_float] + \
        [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    lib.mm3_depth_layers.restype = ctypes.c_int
    lib.mm3_generator_skip.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.mm3_generator_skip.restype = None
    lib.mm3_lm_enter.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_float,
                                                                           ctypes.c_void_p, ctypes.c_void_p] + \
        [ctypes.c_void_p] * 2 + [ctypes.c_float] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + \
        [ctypes.c_int, ctypes.c_void_p]
    lib.mm3_lm_enter.restype = ctypes.c_int
    lib.mm3_lm_leave.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_float] + \
        [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p]
    lib.mm3_lm_leave.restype = ctypes.c_int
    lib.mm3_draw_from_raw.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_void_p]
    lib.mm3_draw_from_raw.restype = None
    lib.mm3_exponentials.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.mm3_exponentials.restype = None
    lib.mm3_decode_prepare.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + \
        [ctypes.c_void_p] * 2 + [ctypes.c_float] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_void_p]
    lib.mm3_decode_prepare.restype = ctypes.c_int
    lib.mm3_long_attention.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p,
                                                                                     ctypes.c_int]
    lib.mm3_long_attention.restype = ctypes.c_int
    return lib


def load_built(openmp: bool):
    """The library built with or without OpenMP and loaded, or None; a cached one that does not load (cut
    short, damaged) is built again once, with a warning, before the build without OpenMP (one
    thread) is tried."""
    start = time.time()
    path = build(openmp=openmp)
    if path is None:
        return None
    try:
        return _load_once(path)
    except OSError as e:
        if _built_since(path, start):  # built just now: building again would not help
            log.info("cannot load the CPU integer kernel %s (%s)", path.name, e)
            return None
        log.warning("the CPU integer kernel %s does not load (%s): building it again", path, e)
    path = build(openmp=openmp, again=True)
    if path is None:
        return None
    try:
        return _load_once(path)
    except OSError as e:
        log.warning("cannot load the CPU integer kernel %s (%s)", path, e)
        return None


def _built_since(path: Path, start: float) -> bool:
    try:
        return path.stat().st_mtime >= start - 1
    except OSError:
        return True


def _load_once(path: Path):
    """`load(path)`; a library built in a folder of its own is removed once loaded (or not)."""
    try:
        return load(path)
    finally:
        _remove_own_folder(path)
