"""What a user has, and which file an unnamed model means: the inventory of model folders (component
files, each published set's present / partial / missing / unusable files) and the "auto" choice (the
most precise file that fits the device's memory)."""

import os
import shutil

import pytest

from mm3.inventory import scan
from mm3.registry import AUTO, Registry, bits_per_weight, pick_file
from mm3.tools.download import SETS, published_name
from mm3.tools.quantize import quantize_file


@pytest.fixture(scope="module")
def dits(tiny, tmp_path_factory):
    """The tiny DiT as F32 and as Q8_0 (a smaller, less precise file of the same component)."""
    folder = tmp_path_factory.mktemp("dits")
    f32 = folder / "MiniMax-Music3-transformer-F32.gguf"
    shutil.copy(tiny.file("mm3-dit"), f32)
    q8 = quantize_file(f32, folder / "MiniMax-Music3-transformer-Q8_0.gguf", "Q8_0")
    return folder, str(f32), str(q8)


def test_auto_picks_the_most_precise_file_that_fits(dits):
    folder, f32, q8 = dits
    assert bits_per_weight(f32) == pytest.approx(32.0) and 8 < bits_per_weight(q8) < 32
    assert pick_file([q8, f32]) == f32  # no limit: the most precise
    assert pick_file([f32, q8], memory=os.path.getsize(f32)) == f32
    assert pick_file([f32, q8], memory=os.path.getsize(f32) - 1) == q8  # the F32 one does not fit
    assert pick_file([f32, q8], memory=1) == q8  # nothing fits: the smallest
    reg = Registry.scan(folder)
    assert reg.resolve("dit", "") == reg.resolve("dit", AUTO) == f32
    reg.memory = os.path.getsize(q8)
    assert reg.resolve("dit", AUTO) == q8


def _set_folder(tiny, folder, set_name):
    """The tiny model's five files under the published names of `set_name`."""
    folder.mkdir(parents=True, exist_ok=True)
    arch = {"language_model": "mm3-lm", "rvq_depth_decoder": "mm3-depth", "condition_encoder": "mm3-cond",
            "transformer": "mm3-dit", "vocoder": "mm3-vae"}
    for component, file_type in SETS[set_name].items():
        shutil.copy(tiny.file(arch[component]), folder / published_name(component, file_type))
    return folder


def test_inventory_of_sets_and_components(tiny, tmp_path):
    folder = _set_folder(tiny, tmp_path / "mm3", "q8")
    light = SETS["light"]
    (folder / (published_name("language_model", light["language_model"]) + ".part")).write_bytes(b"x" * 1000)
    (folder / published_name("transformer", light["transformer"])).write_bytes(b"not a gguf at all")
    shutil.copy(tiny.file("mm3-cond"), folder / published_name("vocoder", "F32").replace("vocoder", "vocoder-copy"))
    inv = scan(folder)
    assert inv.complete_sets() == ["q8"] and inv.missing_kinds() == []
    states = {f.name: f.state for f in inv.sets["light"]}
    assert states[published_name("language_model", light["language_model"])] == "partial"
    assert states[published_name("transformer", light["transformer"])] == "unusable"
    assert states[published_name("rvq_depth_decoder", light["rvq_depth_decoder"])] == "present"  # shared with q8
    partial = next(f for f in inv.sets["light"] if f.state == "partial")
    assert partial.size == 1000
    assert [f.name for f in inv.unusable] == [published_name("transformer", light["transformer"])]
    assert "not a GGUF" in inv.unusable[0].problem or "magic" in inv.unusable[0].problem
    lm = inv.components["lm"][0]
    assert lm.file_type == "F32" and lm.bits_per_weight == pytest.approx(32.0) and lm.size > 0
    assert len(inv.components["cond"]) == 2  # the copy under another name is a condition encoder too
    d = inv.to_dict()
    assert d["complete_sets"] == ["q8"] and set(d["sets"]) == set(SETS)


def test_inventory_of_an_empty_or_missing_folder(tmp_path):
    inv = scan(tmp_path / "nothing")
    assert inv.missing_kinds() == ["lm", "depth", "cond", "dit", "vae"]
    assert all(f.state == "missing" for files in inv.sets.values() for f in files)


def test_each_set_says_what_it_costs_and_the_free_space(tmp_path):
    """Before a download: each set's published size (native about 29 GB), what is still to fetch (a
    partial file resumes, an unusable one is fetched again) and the free space where it goes."""
    folder = tmp_path / "mm3"
    folder.mkdir()
    inv = scan(folder)
    sizes = inv.set_sizes()
    assert {s: round(v["total"] / 1e9, 1) for s, v in sizes.items()} == {"native": 28.6, "q8": 12.8, "light": 8.8}
    assert all(v["to_fetch"] == v["total"] for v in sizes.values())
    assert inv.free == shutil.disk_usage(folder).free or abs(inv.free - shutil.disk_usage(folder).free) < 2**30
    assert scan(tmp_path / "not-yet" / "mm3").free is not None  # the nearest existing parent's disk
    lm = published_name("language_model", SETS["light"]["language_model"])
    (folder / (lm + ".part")).write_bytes(b"x" * 1000)
    bad = published_name("vocoder", "F32")
    (folder / bad).write_bytes(b"not a gguf" * 100)
    inv = scan(folder)
    light = inv.set_sizes()["light"]
    assert light["to_fetch"] == light["total"] - 1000
    assert inv.unusable_in_set("light") == [bad] and inv.to_dict()["set_sizes"]["light"] == light
