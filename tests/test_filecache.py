"""The one file cache: a value per file version, bounded, least recently used dropped first."""

import os

import pytest

from mm3.filecache import FileCache


def _touch(path, text, mtime_ns):
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_value_kept_until_the_file_changes(tmp_path):
    f = tmp_path / "a.bin"
    _touch(f, "one", 1_000_000_000)
    cache, calls = FileCache(4), []

    def read(st):
        calls.append(st.st_size)
        return f.read_text()

    assert cache.get(f, read) == "one"
    assert cache.get(str(f), read) == "one" and calls == [3]  # same file by another spelling: no read
    _touch(f, "three", 1_000_000_000)  # same mtime, other size
    assert cache.get(f, read) == "three"
    _touch(f, "other", 2_000_000_000)  # same size, other mtime
    assert cache.get(f, read) == "other" and calls == [3, 5, 5]


def test_extra_key_parts_are_separate_entries(tmp_path):
    f = tmp_path / "a.bin"
    f.write_text("x")
    cache = FileCache(4)
    assert cache.get(f, lambda st: "lm", "lm") == "lm"
    assert cache.get(f, lambda st: "dit", "dit") == "dit"
    assert cache.get(f, lambda st: "other", "lm") == "lm" and len(cache) == 2


def test_bounded_least_recently_used_dropped(tmp_path):
    paths = [tmp_path / f"{i}.bin" for i in range(3)]
    for p in paths:
        p.write_text(p.name)
    cache, calls = FileCache(2), []

    def read(p):
        return lambda st: calls.append(p.name) or p.name

    cache.get(paths[0], read(paths[0]))
    cache.get(paths[1], read(paths[1]))
    cache.get(paths[0], read(paths[0]))  # 0 used last: 1 is the one to drop
    cache.get(paths[2], read(paths[2]))
    assert len(cache) == 2
    cache.get(paths[0], read(paths[0]))
    cache.get(paths[1], read(paths[1]))
    assert calls == ["0.bin", "1.bin", "2.bin", "1.bin"]


def test_errors_are_not_stored_and_missing_files_raise(tmp_path):
    f = tmp_path / "a.bin"
    f.write_text("x")
    cache = FileCache(2)
    with pytest.raises(ValueError):
        cache.get(f, lambda st: (_ for _ in ()).throw(ValueError("bad")))
    assert len(cache) == 0 and cache.get(f, lambda st: "ok") == "ok"
    with pytest.raises(OSError):
        cache.get(tmp_path / "missing", lambda st: "never")
    with pytest.raises(ValueError, match="at least 1 entry, got 0"):
        FileCache(0)


def test_file_caches_are_bounded(tmp_path):
    """Every per-file cache of the engine is a bounded FileCache (the fingerprint and architecture
    caches grew without limit over a long run scanning many files)."""
    from mm3.formats import fingerprint
    from mm3.files import registry
    from mm3 import tokenizer
    from mm3.formats.gguf import reader

    for cache in (fingerprint._FINGERPRINTS, reader._ARCHITECTURES, registry._PROBLEMS, tokenizer._TOKENIZERS):
        assert isinstance(cache, FileCache) and cache.size >= 1
    for i in range(fingerprint._FINGERPRINTS.size + 5):
        p = tmp_path / f"{i}.bin"
        p.write_bytes(bytes([i % 256]))
        fingerprint.file_fingerprint(p)
    assert len(fingerprint._FINGERPRINTS) == fingerprint._FINGERPRINTS.size
