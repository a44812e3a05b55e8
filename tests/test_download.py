"""The downloader against a local HTTP server that speaks the Hugging Face endpoints we use."""

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mm3.cli import main as cli_main
from mm3.tools.download import REPO, DownloadError, download_set, file_names


class FakeHub:
    """Serves `/api/models/<repo>/tree/main` and `/<repo>/resolve/main/<file>` with Range support.
    `cut_after[name] = n` makes the next transfer of that file stop after n bytes (a dropped line)."""

    def __init__(self, files: dict[str, bytes], sha_override=None):
        self.files, self.sha_override = files, sha_override or {}
        self.cut_after: dict[str, int] = {}
        self.ranges: list[str | None] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path == f"/api/models/{REPO}/tree/main":
                    body = json.dumps([
                        {"type": "file", "path": n, "size": 134,
                         "lfs": {"oid": hub.sha_override.get(n, hashlib.sha256(d).hexdigest()), "size": len(d)}}
                        for n, d in hub.files.items()] + [{"type": "directory", "path": "docs"}]).encode()
                    self._send(200, body, {})
                    return
                prefix = f"/{REPO}/resolve/main/"
                name = self.path[len(prefix):] if self.path.startswith(prefix) else None
                if name not in hub.files:
                    self._send(404, b"not found", {})
                    return
                data = hub.files[name]
                rng = self.headers.get("Range")
                hub.ranges.append(rng)
                start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                status = 206 if rng else 200
                body = data[start:]
                headers = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"} if rng else {}
                cut = hub.cut_after.pop(name, None)
                self._send(status, body, headers, cut)

            def _send(self, status, body, headers, cut=None):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body if cut is None else body[:cut])
                if cut is not None:
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


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
