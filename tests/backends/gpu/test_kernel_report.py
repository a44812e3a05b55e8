"""The static kernel report (`mm3.backends.gpu.kernel_report`, `python -m mm3 kernels --report`): its PTX
reading on hand-written PTX, and the kernels themselves compiled for sm_80 / sm_89 / sm_90 with
Triton's bundled compilers (no GPU): the decode kernels over the device layout load at least 90 % of
the weight's bytes with 8-byte or wider loads, spill nothing and fill at least two waves at the
released decode shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mm3.backends.gpu.kernel_report import LoadFacts, global_loads, occupancy

PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u64 .ptr .global .align 1 k_param_1,
	.param .u32 k_param_2
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b64 	%rd2, [k_param_1];
	ld.param.b32 	%r1, [k_param_2];
	mov.u32 	%r2, %tid.x;
	mul.wide.s32 	%rd3, %r2, 16;
	add.s64 	%rd4, %rd1, %rd3;
$L__BB0_1:
	@%p1 ld.global.v4.b32 { %r3, %r4, %r5, %r6 }, [ %rd4 + 0 ];
	add.s64 	%rd4, %rd4, 64;
	ld.global.b16 { %rs1 }, [ %rd5 + 0 ];
	ld.global.nc.b8 { %rs2 }, [ %rd6 + 0 ];
	cvt.u64.u32 	%rd7, %r3;
	add.s64 	%rd8, %rd2, %rd7;
	ld.global.v2.b32 { %r7, %r8 }, [ %rd8 + 0 ];
	cp.async.cg.shared.global [ %r9 + 0 ], [ %rd4 + 0 ], 0x10, %r10;
	@%p2 bra 	$L__BB0_1;
	add.s64 	%rd5, %rd1, 2;
	mov.b64 	%rd6, %rd5;
	ret;
}
"""

REPO = str(Path(__file__).resolve().parents[3])


def test_loads_are_traced_to_their_pointer_parameters():
    """Address chains through moves, arithmetic and a loop's reassignments reach the weight's
    parameter (0); a register loaded from memory starts no chain (%r3 is data, so the v2 load is
    the other pointer's); cp.async counts by its copy size."""
    facts = global_loads(PTX, {0})
    assert facts.weight == {16: 2, 2: 1, 1: 1}
    assert facts.every == {16: 2, 2: 1, 1: 1, 8: 1}
    assert global_loads(PTX, {1}).weight == {8: 1}
    shares = facts.weight_bytes_by_width()
    assert shares == {1: 1 / 35, 2: 2 / 35, 16: 32 / 35}
    assert facts.wide_share(8) == pytest.approx(32 / 35)
    assert LoadFacts({}, {}).wide_share() == 0


def test_occupancy_follows_the_tightest_limit():
    assert occupancy(32, 0, 4, 90) == 16  # warps: 64 / 4
    assert occupancy(128, 0, 4, 90) == 4  # registers: 65536 / (128 * 128)
    assert occupancy(32, 64 * 1024, 4, 90) == 3  # shared memory: 228 KB / 64 KB
    assert occupancy(32, 0, 4, 89) == 12  # 48 warps on sm_89


def test_the_command_refuses_an_unknown_architecture():
    done = subprocess.run([sys.executable, "-m", "mm3", "kernels", "--report", "--arch", "75"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2 and "--arch 75: expected one of 80, 89, 90" in done.stderr


LAYOUT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]


def _report(arch, types=None, shapes=None):
    pytest.importorskip("triton", reason="this torch installation has no Triton")
    from mm3.tools.kernels import report

    return report(arch, ("layout",), types, shapes)


def _meets_the_targets(rows):
    """Decode: at least 90 % of the weight's bytes by 8-byte or wider loads, at least two waves at
    every released decode shape; every kernel: no spills."""
    assert rows
    for r in rows:
        assert set(r) >= {"name", "weight_type", "shape", "weight_load_bytes_by_width", "spills"}
        assert r["spills"] == 0, r
        shares = r["weight_load_bytes_by_width"]
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3) and r["wide_load_share"] == pytest.approx(
            sum(v for w, v in shares.items() if int(w) >= 8), abs=1e-3)
        if r["shape"] == "decode":
            assert r["wide_load_share"] >= 0.9, r
            assert r["min_waves"] >= 2 and all(g["waves"] >= 2 for g in r["grids"]), r
            assert len(r["grids"]) >= 10  # every released decode product


def test_decode_kernels_on_the_device_layout_load_wide_for_sm90():
    """The common types' decode kernels for sm_90 (the full matrix is the slow test below)."""
    _meets_the_targets(_report(90, ["Q8_0", "Q4_K", "Q5_K", "Q6_K"], ["decode"]))


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 89, 90])
def test_every_layout_kernel_meets_the_targets(arch):
    rows = _report(arch)
    assert {(r["weight_type"], r["shape"]) for r in rows} == {(t, s) for t in LAYOUT_TYPES for s in ("decode", "prefill")}
    _meets_the_targets(rows)


def test_the_command_prints_json():
    done = subprocess.run([sys.executable, "-m", "mm3", "kernels", "--report", "--arch", "90", "--family", "layout",
                           "--types", "Q8_0", "--shape", "decode", "--json", "-"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))), timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(done.stdout)
    assert row["name"] == "layout/Q8_0/decode" and row["weight_load_bytes_by_width"] == {"16": 1.0}
