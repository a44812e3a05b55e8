"""Load: twenty back-to-back generations in one process through the command line's own entry point
(a new Pipeline each time, strict memory mode: every model loaded and released per run, files
written). Same seeds must give the same bytes every time, and resident memory must stay flat.

Run alone to see the numbers: `python -m pytest -q -s tests/commands/test_soak.py` prints the RSS after
runs 1, 10 and 20.
"""

import gc

import psutil
import pytest

from mm3.commands.main import main as cli_main

pytestmark = [pytest.mark.usefixtures("one_thread"),  # thread count: stable timing on a shared CPU
              pytest.mark.slow]

RUNS = 20
SEEDS = (5, 6)  # alternated: run k uses SEEDS[k % 2], so every output has 9 twins to match
# Allowed growth of resident memory from run 10 to run 20. The allocator keeps some freed pages,
# so "flat" is a bound, not zero; a leak of the tiny models (~2 MB per run) or of an output buffer
# would cross it within ten runs.
MAX_GROWTH_MB = 12


def rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def test_twenty_generations_same_output_flat_memory(tiny, tmp_path, capsys):
    outputs, rss = {}, {}
    for k in range(RUNS):
        seed = SEEDS[k % 2]
        out = tmp_path / f"run{k:02d}.wav"
        rc = cli_main(["generate", "--models", str(tiny.gguf), "--caption", "dark synth pop", "--lyrics",
                       "[verse]\nneon lights", "--duration", "0.5", "--steps", "2", "--seed", str(seed),
                       "--lm-seed", str(seed), "--out", str(out), "--quiet"])
        assert rc == 0, capsys.readouterr().err
        outputs.setdefault(seed, set()).add(out.read_bytes())
        out.unlink()
        out.with_suffix(".json").unlink()
        if k + 1 in (1, 10, 20):
            rss[k + 1] = rss_mb()
    assert all(len(v) == 1 for v in outputs.values())  # bit-identical for the same seeds ...
    assert outputs[SEEDS[0]] != outputs[SEEDS[1]]  # ... and the seeds matter
    assert list(tmp_path.iterdir()) == []  # no stray temporaries
    with capsys.disabled():
        print(f"\nRSS after run 1: {rss[1]:.1f} MiB, run 10: {rss[10]:.1f} MiB, run 20: {rss[20]:.1f} MiB")
    assert rss[20] - rss[10] < MAX_GROWTH_MB, rss
