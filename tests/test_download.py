"""The downloader against a local HTTP server that speaks the Hugging Face endpoints we use."""

import socket

import pytest

from mm3.cli import main as cli_main
from mm3.tools.download import DownloadError, download_set, file_names
from tests.helpers.fake_hub import FakeHub


@pytest.fixture
def hub():
    files = {n: bytes([i]) * 1000 + n.encode() * 50 for i, n in enumerate(file_names("light"))}
    files["README.md"] = b"readme"
    h = FakeHub(files)
    yield h
    h.close()


def quiet(_msg):
    pass


def test_download_verifies_and_skips_present_files(tmp_path, hub):
    paths = download_set("light", tmp_path / "mm3", endpoint=hub.endpoint, log=quiet)
    assert [p.name for p in paths] == file_names("light")
    for p in paths:
        assert p.read_bytes() == hub.files[p.name]
    assert not list((tmp_path / "mm3").glob("*.part"))
    hub.ranges.clear()
    download_set("light", tmp_path / "mm3", endpoint=hub.endpoint, log=quiet)
    assert hub.ranges == []  # nothing fetched again


def test_interrupted_download_resumes(tmp_path, hub):
    name = file_names("light")[0]
    hub.cut_after[name] = 700
    with pytest.raises(DownloadError, match=rf"{name}: got 700 bytes, expected \d+; run again to resume"):
        download_set("light", tmp_path, endpoint=hub.endpoint, log=quiet)
    assert (tmp_path / (name + ".part")).stat().st_size == 700
    assert not (tmp_path / name).exists()  # never a truncated file under the final name
    hub.ranges.clear()
    download_set("light", tmp_path, endpoint=hub.endpoint, log=quiet)
    assert hub.ranges[0] == "bytes=700-"
    assert (tmp_path / name).read_bytes() == hub.files[name]


def test_checksum_mismatch_removes_the_partial_file(tmp_path, hub):
    name = file_names("light")[1]
    hub.sha_override[name] = "0" * 64
    with pytest.raises(DownloadError, match=rf"{name}: SHA-256 [0-9a-f]{{64}} does not match the published 0{{64}}"):
        download_set("light", tmp_path, endpoint=hub.endpoint, log=quiet)
    assert not (tmp_path / (name + ".part")).exists() and not (tmp_path / name).exists()


def test_missing_file_in_repository(tmp_path, hub):
    with pytest.raises(DownloadError, match=r"has no MiniMax-Music3-language_model-BF16\.gguf.*\(it has: Mini"):
        download_set("native", tmp_path, endpoint=hub.endpoint, log=quiet)


def test_offline_is_a_clear_message(tmp_path, capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    code = cli_main(["download", "--set", "light", "--dir", str(tmp_path), "--endpoint", f"http://127.0.0.1:{port}"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot reach 127.0.0.1:{port}" in err and "copy the GGUF files" in err
    assert list(tmp_path.iterdir()) == []


def test_stop_keeps_the_part_and_the_next_run_resumes(tmp_path):
    """A download stopped between blocks raises Cancelled and keeps what arrived; the next run
    asks only for the rest."""
    from mm3.errors import Cancelled
    from mm3.tools import download as dl

    names = file_names("q8")
    files = {n: bytes([i]) * (3 * dl.CHUNK + 17) for i, n in enumerate(names)}
    hub = FakeHub(files)
    try:
        calls = []
        with pytest.raises(Cancelled, match="partial file is kept"):
            download_set("q8", tmp_path, endpoint=hub.endpoint, log=lambda m: None,
                         should_stop=lambda: calls.append(1) or len(calls) >= 2)
        parts = list(tmp_path.glob("*.part"))
        assert len(parts) == 1 and parts[0].stat().st_size == 2 * dl.CHUNK
        download_set("q8", tmp_path, endpoint=hub.endpoint, log=lambda m: None)
        assert all((tmp_path / n).read_bytes() == d for n, d in files.items())
        assert f"bytes={2 * dl.CHUNK}-" in hub.ranges
    finally:
        hub.close()
