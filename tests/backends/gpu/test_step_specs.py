"""The AR frame's draw, embedding and LM attention kernels compiled for sm_90 with Triton's bundled
compiler (no GPU; `python -m mm3 kernels --report --family steps`): every one builds at the released
sizes as it is launched and spills nothing; the decode attention multiplies on the tensor cores at
a few SASS instructions a key."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="this torch installation has no Triton")


def _report(types=None, arch: int = 90):
    from mm3.tools.kernels import report

    return report(arch, ("steps",), types, None)


def _spill_free(rows):
    assert rows
    for r in rows:
        assert r["spills"] == 0 and r["registers"] <= 128, r


def test_the_draws_and_the_feedback_compile_for_sm90_without_spills():
    rows = _report(["BF16", "Q6_K"])
    assert {r["name"] for r in rows} >= {"draw/semantic", "draw/acoustic", "lookup/rows/Q6_K",
                                         "lookup/feedback/Q6_K+Q4_K"}
    _spill_free(rows)


@pytest.mark.slow
def test_every_step_kernel_compiles_for_sm90_without_spills():
    rows = _report()
    assert len(rows) == 16
    _spill_free(rows)


@pytest.mark.parametrize("arch", [80, 90])
def test_the_decode_attention_costs_a_few_instructions_a_key(arch):
    """Each thread's SASS instructions a cached key in the attention's loop: at most 7 over a 16-bit
    cache (126 before its products went to `tl.dot`) and 20 over an 8-bit one (the codes widened and
    scaled: 2 values a key a thread), 16-byte loads of the cache, tensor-core products."""
    rows = {r["name"]: r for r in _report(["BF16", "I8"], arch) if r["name"].startswith("attention/")}
    assert set(rows) == {"attention/decode/BF16", "attention/decode/I8", "attention/step/BF16", "attention/step/I8"}
    for name, r in rows.items():
        bound = 7 if name.endswith("BF16") else 20
        assert 0 < r["instructions_per_weight"]["total"] <= bound, (name, r["instructions_per_weight"])
        assert r["wide_load_share"] == 1.0 and r["spills"] == 0, r
    code = ("from mm3.backends.gpu import kernel_report as k; from mm3.backends.gpu.step_specs import attention_specs; "
            "s = next(s for s in attention_specs() if s.name == 'attention/decode/BF16'); "
            f"print(k.sass(k.compile_cubin(s, {arch})).count('HMMA'))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # it compiles nothing
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                          check=False, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 16  # 8 a product per block of keys: q.k and p.v
