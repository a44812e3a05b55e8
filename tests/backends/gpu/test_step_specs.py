"""The AR frame's draw and embedding kernels compiled for sm_90 with Triton's bundled compiler (no
GPU; `python -m mm3 kernels --report --family steps`): every one builds at the released sizes as
it is launched and spills nothing."""

import pytest

pytest.importorskip("triton", reason="this torch installation has no Triton")


def _report(types=None):
    from mm3.tools.kernels import report

    return report(90, ("steps",), types, None)


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
    assert len(rows) == 12
    _spill_free(rows)
