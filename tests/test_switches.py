"""The environment switches: declared and parsed in one module, read nowhere else."""

import re
from pathlib import Path

import pytest

from mm3 import switches
from mm3.backends.cpu.forms import FORMS

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_but_the_switches_reads_an_mm3_variable():
    readers = []
    for path in sorted((ROOT / "mm3").rglob("*.py")):
        if path.name == "switches.py":
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if re.search(r"environ[^#]*[\"']MM3_", line):
                readers.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert readers == []


def test_every_switch_the_engine_names_is_declared():
    named = set()
    for path in (ROOT / "mm3").rglob("*.py"):
        named |= set(re.findall(r"switches\.(?:value|on)\([\"'](MM3_[A-Z0-9_]+)", path.read_text(encoding="utf-8")))
    named |= {"MM3_CPU_NATIVE", "MM3_CPU_PRODUCT"}  # read through the modules' ENV_* names
    assert named == set(switches.SWITCHES)


def test_the_cpu_forms_named_are_the_back_ends_forms():
    assert set(switches.CPU_FORMS) == set(FORMS)


@pytest.mark.parametrize("raw, expected", [("", "on"), ("1", "on"), ("Yes", "on"), (" off ", "off"), ("0", "off"),
                                           ("FALSE", "off")])
def test_a_flag_takes_every_spelling_of_on_and_off(monkeypatch, raw, expected):
    monkeypatch.setenv("MM3_CUDA_GRAPHS", raw)
    assert switches.value("MM3_CUDA_GRAPHS") == expected


def test_an_unknown_value_is_warned_about_and_the_default_taken(monkeypatch):
    monkeypatch.setenv("MM3_KERNELS", "fastest")
    with pytest.warns(UserWarning, match="MM3_KERNELS='fastest' is not one of auto, off, triton, layout; using auto"):
        assert switches.value("MM3_KERNELS") == "auto"


def test_a_folder_is_taken_as_written(monkeypatch, tmp_path):
    monkeypatch.setenv("MM3_CACHE_DIR", f"  {tmp_path}  ")
    assert switches.value("MM3_CACHE_DIR") == str(tmp_path)
