"""The one record of what the engine measured on a machine (`mm3.cache_dir.recorded`, `remember`): its
sections round-trip; a damaged one is ignored with a warning and written anew; a folder that cannot
be written keeps nothing, with one warning, and never fails; old records of the engine are removed,
other files left alone; a killed writer's temporaries go."""

import json
import logging
import os
import time

import pytest

from mm3.cache_dir import RECORD_NAME, record_path, recorded, remember


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MM3_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_sections_round_trip(cache):
    assert recorded("cpu-compute-dtype") == {}
    assert remember("cpu-compute-dtype", "machine a", {"form": "bfloat16", "ms": {"float32": 2.0}})
    assert remember("cpu-compute-dtype", "machine b", {"form": "float32"})
    assert remember("another", "k", {"value": 1})
    got = recorded("cpu-compute-dtype")
    assert set(got) == {"machine a", "machine b"} and got["machine a"]["form"] == "bfloat16"
    assert got["machine a"]["ms"] == {"float32": 2.0} and "date" in got["machine a"]
    assert recorded("another")["k"]["value"] == 1
    assert record_path() == cache / RECORD_NAME and sorted(p.name for p in cache.iterdir()) == [RECORD_NAME]


@pytest.mark.parametrize("damage, why", [
    (b"{not json", "Expecting property name"),
    (b"\xff\xfe", "Expecting value"),
    (b'{"version": ' + b"[" * 1000 + b"]" * 1000 + b"}", "the record nests 1001 levels deep"),
    (json.dumps({"version": 99, "sections": {}}).encode(), "not a record of version 1"),
    (json.dumps({"version": 1, "sections": {"s": [1]}}).encode(), "not a record of version 1"),
], ids=["malformed", "not text", "deep", "version", "section not an object"])
def test_a_damaged_record_is_ignored_with_a_warning_and_written_anew(cache, caplog, damage, why):
    cache.mkdir()
    record_path().write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="mm3.cache_dir"):
        assert recorded("s") == {}
    assert f"ignoring the record {record_path()}" in caplog.text and why in caplog.text
    assert remember("s", "k", {"form": "float32"})
    assert recorded("s")["k"]["form"] == "float32"


@pytest.mark.parametrize("how", ["a file", "read-only"])
def test_a_folder_that_cannot_be_written_keeps_nothing_with_one_warning(tmp_path, monkeypatch, caplog, how):
    if how == "a file":
        folder = tmp_path / "cache"
        folder.write_text("x")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes in a read-only folder")
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
    monkeypatch.setenv("MM3_CACHE_DIR", str(folder))
    with caplog.at_level(logging.WARNING, logger="mm3.cache_dir"):
        for _ in range(3):
            assert remember("s", "k", {"form": "float32"}) is False
            assert recorded("s") == {}
    assert len(caplog.records) == 1 and "cannot be written" in caplog.text


def test_a_record_that_is_a_folder_keeps_nothing_and_leaves_no_temporary(cache, caplog):
    (cache / RECORD_NAME).mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="mm3.cache_dir"):
        assert remember("s", "k", {}) is False
        assert remember("s", "k", {}) is False
    assert sorted(p.name for p in cache.iterdir()) == [RECORD_NAME]
    assert f"cannot write the record {cache / RECORD_NAME}" in caplog.text


def test_old_records_of_the_engine_are_removed_and_other_files_left(tmp_path, monkeypatch):
    ours = {"cpu-products.json": {"version": 1, "choices": {"cpu=x": {"forms": {"lm": "int4"}}}},
            "choices.json": {"NVIDIA H200 | driver 1 | torch 2 | triton 3": {"Q4_K/8x256": {"family": "layout"}}}}
    theirs = {"cpu-products.json": {"version": 1, "something": "else"}, "choices.json": {"a": 1}}
    for name, files in (("ours", ours), ("theirs", theirs)):
        folder = tmp_path / name
        folder.mkdir()
        for file, content in files.items():
            (folder / file).write_text(json.dumps(content))
        monkeypatch.setenv("MM3_CACHE_DIR", str(folder))
        assert recorded("s") == {}  # the old records are never read as the record
    assert list((tmp_path / "ours").iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "theirs").iterdir()) == ["choices.json", "cpu-products.json"]


def test_a_killed_writers_temporaries_are_removed_by_the_next(cache):
    cache.mkdir()
    old = cache / f".{RECORD_NAME}.4242.tmp"
    old.write_text("{")
    t = time.time() - 3600
    os.utime(old, (t, t))
    fresh = cache / f".{RECORD_NAME}.4343.tmp"
    fresh.write_text("{")
    assert remember("s", "k", {"form": "float32"})
    assert not old.exists() and fresh.exists() and recorded("s")["k"]["form"] == "float32"
