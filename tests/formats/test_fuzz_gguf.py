"""Fuzz: damaged copies of the tiny model's five GGUF files must fail with our clear errors only.

Each mutant is one real tiny file with random bytes changed in its header (the metadata and the
tensor table, where every length, count, type id and offset lives) or cut short at a random point.
It then goes the whole way a models folder goes: the folder scan, the header-only preflight
(`read_component` + `check_loadable`), `ModelStore.model` (open, check, build) and, for the LM,
the tokenizer. The only acceptable outcomes are success (a harmless change, such as a byte of a
name) or `GGUFFormatError` / `ComponentError`; any other exception fails the test and names the
mutation, and a mutant that takes more than a few seconds counts as a hang (SIGALRM).

Seeded, so every run checks the same mutants; `MM3_FUZZ_MUTANTS=2000` (per file) fuzzes longer and
`MM3_FUZZ_SEED` picks another set.
"""

import os
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from mm3.components import check_loadable
from mm3.files.opener import read_component
from mm3.formats.gguf import ComponentError, GGUFFile, GGUFFormatError
from mm3.files.registry import Registry
from mm3.files.store import ModelStore

pytestmark = pytest.mark.usefixtures("one_thread")

MUTANTS = int(os.environ.get("MM3_FUZZ_MUTANTS", "60"))  # per file and kind of damage
SEED = int(os.environ.get("MM3_FUZZ_SEED", "0"))
HANG_SECONDS = 10  # far above a tiny file's ~10 ms load, far below "hung"
KINDS = ("lm", "depth", "cond", "dit", "vae")
ARCH = {"lm": "mm3-lm", "depth": "mm3-depth", "cond": "mm3-cond", "dit": "mm3-dit", "vae": "mm3-vae"}


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds):
    def on_alarm(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def load_everything(folder, kind):
    """What a run does with a models folder, as far as reading and building the `kind` model."""
    reg = Registry.scan(folder)
    path = reg.resolve(kind)
    check_loadable(read_component(path, kind))
    store = ModelStore(reg, torch.device("cpu"))
    if kind == "lm":
        store.tokenizer()
    store.model(kind)
    store.release_all()


def header_flips(data: bytes, header_end: int, rng) -> list[tuple[str, bytes]]:
    """`MUTANTS` copies with 1 to 4 header bytes changed: a random byte, a flipped bit, or 0xFF
    (which turns a small count or length into a huge one)."""
    out = []
    for _ in range(MUTANTS):
        b = bytearray(data)
        where = []
        for _ in range(int(rng.integers(1, 5))):
            i = int(rng.integers(4, header_end))  # keep the magic: its loss is the plain "not a GGUF" case
            how = int(rng.integers(3))
            b[i] = int(rng.integers(256)) if how == 0 else b[i] ^ (1 << int(rng.integers(8))) if how == 1 else 0xFF
            where.append(i)
        out.append((f"bytes {where} changed", bytes(b)))
    return out


def truncations(data: bytes, header_end: int, rng) -> list[tuple[str, bytes]]:
    """`MUTANTS` copies cut short: half inside the header, half inside the tensor data."""
    cuts = list(rng.integers(0, header_end, MUTANTS // 2)) + list(rng.integers(header_end, len(data), MUTANTS // 2))
    return [(f"cut at byte {int(c)} of {len(data)}", data[:int(c)]) for c in cuts]


@pytest.mark.parametrize("damage", [header_flips, truncations])
@pytest.mark.parametrize("kind", KINDS)
def test_damaged_files_give_clear_errors(tiny, tmp_path, kind, damage):
    src = tiny.file(ARCH[kind])
    data = src.read_bytes()
    with GGUFFile(src) as f:
        header_end = f.data_offset
    rng = np.random.default_rng([SEED, KINDS.index(kind), damage is truncations])
    folder = tmp_path / "models"
    folder.mkdir()
    target = folder / src.name
    outcomes = {"loaded": 0, "GGUFFormatError": 0, "ComponentError": 0}
    start = time.perf_counter()
    for what, mutant in damage(data, header_end, rng):
        target.write_bytes(mutant)
        os.utime(target, ns=(time.time_ns(), time.time_ns()))  # a new mtime: no cached header is reused
        try:
            with deadline(HANG_SECONDS):
                load_everything(folder, kind)
            outcomes["loaded"] += 1
        except (GGUFFormatError, ComponentError) as e:
            assert str(e), what
            outcomes[type(e).__name__] += 1
        except Exception as e:
            raise AssertionError(f"{src.name}, {what}: {type(e).__name__}: {e}") from e
    # Most header damage must be noticed, and every truncation is (a file cut anywhere is unusable).
    assert outcomes["GGUFFormatError"] + outcomes["ComponentError"] >= (MUTANTS if damage is truncations else 1)
    assert time.perf_counter() - start < HANG_SECONDS * 3
