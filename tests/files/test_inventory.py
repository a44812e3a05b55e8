"""What a user has, and which file an unnamed model means: the inventory of model folders (component
files, each published set's present / partial / missing / unusable files) and the "auto" choice (a usable
file, full-size before tiny, the most precise that fits the device's memory)."""

import logging
import os
import shutil

import pytest
from gguf import GGMLQuantizationType

from mm3.components import BY_FOLDER
from mm3.formats.published import PUBLISHED_SIZES, SETS, published_name
from mm3.formats.gguf import ComponentError
from mm3.files.inventory import scan
from mm3.files.registry import AUTO, Registry, bits_per_weight, file_problem, pick_file
from mm3.tools.quantize import quantize_file
from tests.helpers.gguf_util import published_size_copy


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


ARCH = {"language_model": "mm3-lm", "rvq_depth_decoder": "mm3-depth", "condition_encoder": "mm3-cond",
        "transformer": "mm3-dit", "vocoder": "mm3-vae"}


def _set_folder(tiny, folder, set_name):
    """The files of `set_name` under their published names, types and sizes: the tiny model's
    files (quantized to the set's type) grown to the published size by a sparse hole."""
    folder.mkdir(parents=True, exist_ok=True)
    for component, file_type in SETS[set_name].items():
        kind, src = BY_FOLDER[component].kind, tiny.file(ARCH[component])
        if file_type != "F32":
            src = quantize_file(src, folder.parent / f"{component}-{file_type}.tmp.gguf", file_type)
        qtype = GGMLQuantizationType[file_type.split("_K")[0] + "_K" if "_K" in file_type else file_type]
        published_size_copy(src, folder / published_name(component, file_type), PUBLISHED_SIZES[kind, file_type], qtype)
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
    assert lm.file_type == "Q8_0" and 8 < lm.bits_per_weight < 9 and lm.size > 9e9
    assert len(inv.components["cond"]) == 2  # the copy under another name is a condition encoder too
    d = inv.to_dict()
    assert d["complete_sets"] == ["q8"] and set(d["sets"]) == set(SETS)


def test_tiny_files_are_no_set_members(tiny, tmp_path):
    """The tiny model's own files are components but no set's; under the published names (as a
    user may have put them) they are that set's unusable files, saying why, and complete no set."""
    folder = tmp_path / "mm3"
    folder.mkdir()
    for p in tiny.gguf.glob("*.gguf"):
        shutil.copy(p, folder / p.name)
    inv = scan(folder)
    assert inv.missing_kinds() == [] and inv.complete_sets() == []
    assert all(f.state == "missing" for files in inv.sets.values() for f in files)
    for component, file_type in SETS["q8"].items():
        shutil.copy(tiny.file(ARCH[component]), folder / published_name(component, file_type))
    inv = scan(folder)
    assert inv.complete_sets() == []
    files = {f.name: f for f in inv.sets["q8"]}
    cond = files[published_name("condition_encoder", "F32")]
    assert cond.state == "unusable" and "the published file 101.0 MB" in cond.problem, cond
    dit = files[published_name("transformer", "Q8_0")]
    assert dit.state == "unusable" and "its tensors are F32, the published file's Q8_0" in dit.problem, dit


def test_auto_prefers_a_full_size_model_whatever_its_precision(tiny, tmp_path):
    """A published-size Q8_0 DiT beside the tiny F32 one: "auto" takes the full-size model."""
    folder = tmp_path / "mm3"
    folder.mkdir()
    shutil.copy(tiny.file("mm3-dit"), folder / tiny.file("mm3-dit").name)
    q8 = quantize_file(tiny.file("mm3-dit"), tmp_path / "q8.gguf", "Q8_0")
    full = published_size_copy(q8, folder / published_name("transformer", "Q8_0"), PUBLISHED_SIZES["dit", "Q8_0"],
                               GGMLQuantizationType.Q8_0)
    reg = Registry.scan(folder)
    assert bits_per_weight(reg.paths[tiny.file("mm3-dit").name]) > bits_per_weight(full)
    assert reg.resolve("dit", AUTO) == str(full)


def test_auto_skips_an_unusable_file_with_one_warning(tiny, tmp_path, caplog):
    """A truncated DiT under a published name beside the tiny one: "auto" takes the good file, and
    says once which file it skipped and why; the inventory lists the bad file as unusable, not as a
    DiT. With only unusable files the error names each and its problem."""
    folder = tmp_path / "mm3"
    folder.mkdir()
    for p in tiny.gguf.glob("*.gguf"):
        shutil.copy(p, folder / p.name)
    good = folder / tiny.file("mm3-dit").name
    bad = folder / published_name("transformer", "Q8_0")
    bad.write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    reg = Registry.scan(folder)
    assert sorted(reg.buckets["dit"]) == sorted([good.name, bad.name])
    with caplog.at_level(logging.WARNING, logger="mm3"):
        assert reg.resolve("dit", AUTO) == str(good)
        assert reg.resolve("dit", "") == str(good)  # asked again: no second warning
    skips = [r.getMessage() for r in caplog.records if "skips" in r.getMessage()]
    assert len(skips) == 1 and bad.name in skips[0] and "truncated: tensor" in skips[0], skips
    assert file_problem(bad, "dit") and not file_problem(good, "dit")
    inv = scan(folder)
    assert [f.name for f in inv.components["dit"]] == [good.name]
    assert [f.name for f in inv.unusable] == [bad.name] and "truncated" in inv.unusable[0].problem
    good.unlink()
    with pytest.raises(ComponentError, match=rf"no usable mm3-dit \(flow DiT\) file: {bad.name}: truncated: tensor"):
        Registry.scan(folder).resolve("dit", AUTO)


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
