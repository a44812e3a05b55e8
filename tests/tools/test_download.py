"""The downloader (huggingface_hub underneath) against a local server that answers what the Hub
answers; every test also checks that nothing but 127.0.0.1 was contacted."""

import os
import socket

import pytest

from mm3.commands.main import main as cli_main
from mm3.errors import Cancelled
from mm3.tools import download as dl
from mm3.tools.download import DownloadError, download_set, file_names
from tests.helpers.fake_hub import COMMIT, FakeHub

hf_constants = pytest.importorskip("huggingface_hub.constants")


@pytest.fixture(autouse=True)
def only_loopback(monkeypatch, tmp_path_factory):
    """No host but 127.0.0.1 is looked up or connected to; huggingface_hub is online (whatever the
    environment says), sends no telemetry and finds no token stored on this machine."""
    contacted = []
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *a, **k):
        contacted.append(host)
        if host not in ("127.0.0.1", b"127.0.0.1"):
            raise OSError(f"test: lookup of {host!r} refused")
        return real_getaddrinfo(host, *a, **k)

    def connect(self, address):
        if isinstance(address, tuple):
            contacted.append(address[0])
            if address[0] != "127.0.0.1":
                raise OSError(f"test: connection to {address!r} refused")
        return real_connect(self, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    home = tmp_path_factory.mktemp("hf-home")
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(home / "token"), raising=False)
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"), raising=False)
    yield
    assert set(contacted) <= {"127.0.0.1", b"127.0.0.1"}, contacted


@pytest.fixture
def hub():
    files = {n: bytes([i]) * 1000 + n.encode() * 50 for i, n in enumerate(file_names("light"))}
    files["README.md"] = b"readme"
    h = FakeHub(files)
    yield h
    h.close()


def fetch(hub, folder, set_name="light", **kw):
    """download_set against the local hub, with an empty shared cache of its own."""
    kw.setdefault("cache_dir", folder.parent / "hf-cache")
    kw.setdefault("log", lambda m: None)
    return download_set(set_name, folder, endpoint=hub.endpoint, **kw)


def test_complete_download_into_the_folder(tmp_path, hub):
    seen = {}
    paths = fetch(hub, tmp_path / "mm3", progress=lambda n, done, total: seen.__setitem__(n, (done, total)))
    assert [p.name for p in paths] == file_names("light")
    assert sorted(p.name for p in (tmp_path / "mm3").iterdir()) == sorted(file_names("light"))  # final names only
    for p in paths:
        assert p.read_bytes() == hub.files[p.name]
        assert seen[p.name] == (len(hub.files[p.name]),) * 2
    # every file from the commit the listing named, through the redirect the hub answers
    resolves = [p for m, p, _ in hub.requests if "/resolve/" in p]
    assert len(resolves) == 5 and all(f"/resolve/{COMMIT}/" in p for p in resolves)
    assert len(hub.content_gets()) == 5
    agents = {h.get("User-Agent", "") for _, _, h in hub.requests}
    assert all("comfyui-mm3-gguf" in a for a in agents), agents
    hub.requests.clear()
    fetch(hub, tmp_path / "mm3")
    assert hub.content_gets() == []  # nothing fetched again


def big_first(hub, name):
    """Make `name` one transfer chunk and 5000 bytes long: huggingface_hub writes whole chunks, so
    only a cut after the first one leaves something to resume."""
    chunk = hf_constants.DOWNLOAD_CHUNK_SIZE
    hub.files[name] = bytes(range(256)) * (chunk // 256) + b"t" * 5000
    return chunk


def test_interrupted_download_resumes_next_run(tmp_path, hub):
    """The line drops mid-file and the hub then fails: the run stops keeping what arrived, never a
    truncated file under the final name; the next run asks only for the rest."""
    name = file_names("light")[0]
    chunk = big_first(hub, name)
    hub.plan[name] = [("cut", chunk + 700), ("status", 503)]
    with pytest.raises(DownloadError, match=rf"{name}: got {chunk} bytes, expected {chunk + 5000} \(.+\); "
                                            "run again to resume"):
        fetch(hub, tmp_path)
    assert (tmp_path / (name + ".part")).read_bytes() == hub.files[name][:chunk]
    assert not (tmp_path / name).exists()
    hub.plan[name] = []  # the versions that do not retry a cut body in the same run never asked twice
    hub.ranges.clear()
    fetch(hub, tmp_path)
    assert hub.ranges[0] == f"bytes={chunk}-"
    assert (tmp_path / name).read_bytes() == hub.files[name]
    assert not list(tmp_path.glob("*.part"))


def test_dropped_connection_is_resumed_with_a_range(tmp_path, hub):
    """A transfer cut once: huggingface_hub resumes it with a Range request in the same run (the
    versions that retry a dropped body do; the others leave the .part and the next run does)."""
    name = file_names("light")[2]
    chunk = big_first(hub, name)
    hub.cut_after[name] = chunk + 900
    try:
        fetch(hub, tmp_path)
    except DownloadError as e:
        assert "run again to resume" in str(e)
        fetch(hub, tmp_path)
    assert (tmp_path / name).read_bytes() == hub.files[name]
    assert hub.ranges.count(None) == 5 and f"bytes={chunk}-" in hub.ranges


def test_checksum_mismatch_is_refused_and_removed(tmp_path, hub):
    name = file_names("light")[1]
    hub.sha_override[name] = "0" * 64
    with pytest.raises(DownloadError, match=rf"{name}: SHA-256 [0-9a-f]{{64}} does not match the published 0{{64}}; "
                                            "the partial file was removed, run again"):
        fetch(hub, tmp_path)
    assert not (tmp_path / (name + ".part")).exists() and not (tmp_path / name).exists()


def test_missing_file_in_repository(tmp_path, hub):
    with pytest.raises(DownloadError, match=r"has no MiniMax-Music3-language_model-BF16\.gguf.*\(it has: Mini"):
        fetch(hub, tmp_path, "native")


def test_unknown_repository(tmp_path, hub):
    with pytest.raises(DownloadError, match=r"127\.0\.0\.1:\d+ has no nobody/nothing at revision 'main' \(HTTP 404\)"):
        fetch(hub, tmp_path, repo="nobody/nothing")


def test_offline_is_a_clear_message(tmp_path, capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    target = tmp_path / "mm3"
    code = cli_main(["download", "--set", "light", "--dir", str(target), "--endpoint", f"http://127.0.0.1:{port}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    assert f"cannot reach 127.0.0.1:{port}" in err and "copy the GGUF files" in err
    assert not target.exists()


def test_offline_mode_is_a_clear_message(tmp_path, hub, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DownloadError, match=r"offline mode is on \(HF_HUB_OFFLINE\): unset it.*copy the GGUF files"):
        fetch(hub, tmp_path / "mm3")
    assert hub.requests == [] and not (tmp_path / "mm3").exists()


def test_not_enough_free_space_is_refused_before_fetching(tmp_path, hub, monkeypatch):
    first = file_names("light")[0]
    (tmp_path / (first + ".part")).write_bytes(hub.files[first][:100])  # counted as already there
    real = dl.shutil.disk_usage
    need = sum(len(hub.files[n]) for n in file_names("light")) - 100
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    with pytest.raises(DownloadError, match=r"has 0\.0 GiB free, the set needs 0\.0 GiB more"):
        fetch(hub, tmp_path)
    assert hub.content_gets() == [] and sorted(p.name for p in tmp_path.iterdir()) == [first + ".part", "hf-cache"] \
        or sorted(p.name for p in tmp_path.iterdir()) == [first + ".part"]
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: real(p)._replace(free=need))
    fetch(hub, tmp_path)
    assert hub.ranges[0] == "bytes=100-" and (tmp_path / first).read_bytes() == hub.files[first]


def test_cancel_keeps_the_part_and_the_next_run_resumes(tmp_path):
    """A stop asked during a transfer ends it after the chunk in hand with Cancelled; the .part
    holds what arrived, the final name does not exist, and the next run asks only for the rest."""
    names = file_names("q8")
    big = 2 * hf_constants.DOWNLOAD_CHUNK_SIZE + 17
    files = {n: bytes([i + 1]) * (big if i == 0 else 1000) for i, n in enumerate(names)}
    hub = FakeHub(files)
    try:
        reported = []
        with pytest.raises(Cancelled, match="partial file is kept"):
            fetch(hub, tmp_path / "mm3", "q8", progress=lambda n, done, total: reported.append(done),
                  should_stop=lambda: bool(reported) and reported[-1] > 0)
        parts = list((tmp_path / "mm3").glob("*.part"))
        assert [p.name for p in parts] == [names[0] + ".part"]
        kept = parts[0].stat().st_size
        assert kept == reported[-1] and 0 < kept < big
        assert parts[0].read_bytes() == files[names[0]][:kept]
        assert not (tmp_path / "mm3" / names[0]).exists()
        hub.ranges.clear()
        fetch(hub, tmp_path / "mm3", "q8")
        assert hub.ranges[0] == f"bytes={kept}-"
        assert all((tmp_path / "mm3" / n).read_bytes() == d for n, d in files.items())
    finally:
        hub.close()


def test_token_is_sent_as_authorization_header(tmp_path, monkeypatch, capsys):
    files = {n: bytes([i]) * 500 for i, n in enumerate(file_names("light"))}
    hub = FakeHub(files, require_token="hf_local_test")
    try:
        with pytest.raises(DownloadError, match=r"refused .* \(HTTP 401\): it needs a token.*HF_TOKEN.*--token"):
            fetch(hub, tmp_path / "a")
        hub.requests.clear()
        fetch(hub, tmp_path / "a", token="hf_local_test")
        assert hub.requests and all(h.get("Authorization") == "Bearer hf_local_test" for _, _, h in hub.requests)
        monkeypatch.setenv("HF_TOKEN", "hf_local_test")  # the environment's token, implicitly
        fetch(hub, tmp_path / "b")
        assert (tmp_path / "b" / file_names("light")[0]).read_bytes() == files[file_names("light")[0]]
        monkeypatch.delenv("HF_TOKEN")
        code = cli_main(["download", "--set", "light", "--dir", str(tmp_path / "c"), "--endpoint", hub.endpoint,
                         "--token", "hf_local_test"])
        assert code == 0, capsys.readouterr().err
        assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(file_names("light"))
    finally:
        hub.close()


def test_a_file_in_the_shared_cache_is_not_downloaded_again(tmp_path, hub):
    """The cache's layout: snapshots/<commit>/<name> a link to blobs/<sha256>."""
    name = file_names("light")[3]
    repo_dir = tmp_path / "hf-cache" / ("models--" + dl.REPO.replace("/", "--"))
    blob = repo_dir / "blobs" / hub.sha256(name)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(hub.files[name])
    (repo_dir / "snapshots" / COMMIT).mkdir(parents=True)
    os.symlink(os.path.relpath(blob, repo_dir / "snapshots" / COMMIT), repo_dir / "snapshots" / COMMIT / name)
    logged = []
    fetch(hub, tmp_path / "mm3", log=logged.append)
    assert f"{name}: taken from the Hugging Face cache" in logged
    assert not any(name in p for p in hub.content_gets()) and len(hub.content_gets()) == 4
    dest = tmp_path / "mm3" / name
    assert dest.read_bytes() == hub.files[name] and not dest.is_symlink()
    assert os.path.samefile(dest, blob)  # a hard link: no second copy on disk


def test_a_cached_file_with_another_checksum_is_downloaded(tmp_path, hub):
    name = file_names("light")[3]
    snap = tmp_path / "hf-cache" / ("models--" + dl.REPO.replace("/", "--")) / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / name).write_bytes(b"\xff" * len(hub.files[name]))  # a cache without symlinks: hashed, refused
    fetch(hub, tmp_path / "mm3")
    assert (tmp_path / "mm3" / name).read_bytes() == hub.files[name]
    assert any(name in p for p in hub.content_gets())


def test_a_present_but_unusable_file_is_fetched_again(tmp_path, hub):
    """A file under a published name with the published size that cannot be used (the inventory
    names it) is replaced when the set is downloaded; without being named it stays, as present."""
    folder = tmp_path / "mm3"
    folder.mkdir()
    name = file_names("light")[0]
    (folder / name).write_bytes(b"\0" * len(hub.files[name]))
    fetch(hub, folder)
    assert (folder / name).read_bytes() == b"\0" * len(hub.files[name])
    said = []
    fetch(hub, folder, replace=(name,), log=said.append)
    assert (folder / name).read_bytes() == hub.files[name]
    assert f"{name}: present but unusable, fetching it again" in said


def test_a_second_download_into_the_same_folder_is_refused_clearly(tmp_path, hub):
    """Two downloads of one set into one folder at once (two commands, or the sidebar and a
    command): the second is refused with a message saying so, never a raw errno or a file both
    wrote into; the first completes with every file verified."""
    import threading

    name = file_names("light")[0]
    big_first(hub, name)
    started, release = threading.Event(), threading.Event()

    def hold(n, done, total):
        if n == name and done and not started.is_set():  # the first chunk written: wait here
            started.set()
            assert release.wait(30)

    first: dict = {}
    worker = threading.Thread(target=lambda: first.setdefault("paths", fetch(hub, tmp_path, progress=hold)))
    worker.start()
    try:
        assert started.wait(30)
        with pytest.raises(DownloadError, match=rf"^{name}: another download is fetching it into {tmp_path} now; "
                                                "let that one finish \\(or stop it\\), then run again$"):
            fetch(hub, tmp_path)
    finally:
        release.set()
        worker.join(30)
    assert [p.read_bytes() for p in first["paths"]] == [hub.files[n] for n in file_names("light")]
    assert not list(tmp_path.glob("*.part"))
