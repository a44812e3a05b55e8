"""pyproject.toml as the Comfy registry reads it: a node id without "ComfyUI" that follows its
naming rules, the Repository URL it requires, the ComfyUI versions the pack runs on, and the
dependencies requirements.txt installs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[1]


def _meta() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_node_id_follows_the_registry_rules():
    name = _meta()["project"]["name"]
    assert "comfyui" not in name.lower() and len(name) < 100
    assert re.fullmatch(r"[A-Za-z](?:[A-Za-z0-9]|[-_.](?=[A-Za-z0-9]))*", name), name  # no leading/consecutive specials


def test_repository_and_comfyui_versions_are_declared():
    meta = _meta()
    assert meta["project"]["urls"]["Repository"].startswith("https://")
    comfy = meta["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    assert re.fullmatch(r">=\d+\.\d+\.\d+", comfy["requires-comfyui"]), comfy  # the V3 node API: 0.8.0 and later


def test_dependencies_are_requirements_txt():
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    assert sorted(_meta()["project"]["dependencies"]) == sorted(line for line in lines if line)
