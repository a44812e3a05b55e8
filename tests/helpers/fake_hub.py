"""A local stand-in for the Hugging Face endpoints that `huggingface_hub` calls (on 127.0.0.1 only).

- GET  /api/models/<repo>/revision/<rev>[?blobs=true]: the model info, `sha` (the commit) and
  `siblings` with each file's size and LFS SHA-256 (what `HfApi.model_info(files_metadata=True)` reads)
- HEAD/GET /<repo>/resolve/<rev>/<file>: as the hub answers for an LFS file, a 302 to a content URL
  (here /cdn/<sha256>/<file> on the same server) with ETag, X-Repo-Commit, X-Linked-Etag and
  X-Linked-Size; the content URL honours `Range: bytes=N-` (206 + Content-Range)
`<rev>` is "main" or the commit. Every request is recorded (method, path, headers) in `requests`;
the Range header of each content GET in `ranges`.
"""

import hashlib
import json
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mm3.tools.download import REPO

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """`plan[name]` is a list of what the next transfers of that file do, one item per transfer:
    ("cut", n) sends n bytes of the body and drops the connection; ("status", code) answers that
    HTTP status. `cut_after[name] = n` is the same as a plan of one ("cut", n). `pace[name] = s`
    sends that file's content 1 MiB at a time, s seconds apart (a slow line). `sha_override`
    publishes a wrong SHA-256 for a file; `require_token` answers 401 to requests without
    `Authorization: Bearer <it>`."""

    def __init__(self, files: dict[str, bytes], sha_override=None, require_token: str | None = None):
        self.files, self.sha_override, self.require_token = files, dict(sha_override or {}), require_token
        self.plan: dict[str, list[tuple[str, int]]] = {}
        self.cut_after: dict[str, int] = {}
        self.pace: dict[str, float] = {}
        self.ranges: list[str | None] = []
        self.requests: list[tuple[str, str, object]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self._answer(head=True)

            def do_GET(self):
                self._answer(head=False)

            def _answer(self, head):
                hub.requests.append((self.command, self.path, self.headers))  # .get ignores case
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                if hub.require_token and self.headers.get("Authorization") != f"Bearer {hub.require_token}":
                    self._send(401, b'{"error": "Invalid credentials"}', {"Content-Type": "application/json"}, head)
                    return
                for rev in ("main", COMMIT):
                    if path == f"/api/models/{REPO}/revision/{rev}":
                        self._send(200, hub.model_info(), {"Content-Type": "application/json"}, head)
                        return
                    prefix = f"/{REPO}/resolve/{rev}/"
                    if path.startswith(prefix) and path[len(prefix):] in hub.files:
                        name = path[len(prefix):]
                        sha = hub.sha256(name)
                        self._send(302, b"", {
                            "Location": f"/cdn/{sha}/{urllib.parse.quote(name)}", "ETag": f'"{hub.git_oid(name)}"',
                            "X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{sha}"',
                            "X-Linked-Size": str(len(hub.files[name])), "Content-Length": "0"}, head)
                        return
                name = path.rsplit("/", 1)[-1]
                if path.startswith("/cdn/") and name in hub.files:
                    self._content(name, head)
                    return
                if path.startswith(f"/{REPO}/resolve/"):
                    self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"}, head)
                    return
                self._send(404, b"Repository not found", {"X-Error-Code": "RepoNotFound"}, head)

            def _content(self, name, head):
                data = hub.files[name]
                rng = self.headers.get("Range")
                headers = {"ETag": f'"{hub.sha256(name)}"', "Accept-Ranges": "bytes"}
                if head:
                    self._send(200, data, headers, head)
                    return
                hub.ranges.append(rng)
                step = hub._next_step(name)
                if step and step[0] == "status":
                    self._send(step[1], b"unavailable", {}, head)
                    return
                start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                if rng:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                self._send(206 if rng else 200, data[start:], headers, head, step[1] if step else None,
                           hub.pace.get(name))

            def _send(self, status, body, headers, head, cut=None, pace=None):
                self.send_response(status)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if head:
                    return
                body = body if cut is None else body[:cut]
                if pace:
                    for i in range(0, len(body), 1 << 20):
                        self.wfile.write(body[i:i + (1 << 20)])
                        self.wfile.flush()
                        time.sleep(pace)
                else:
                    self.wfile.write(body)
                if cut is not None:  # a dropped line: the promised length never arrives
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sha256(self, name: str) -> str:
        return self.sha_override.get(name) or hashlib.sha256(self.files[name]).hexdigest()

    def git_oid(self, name: str) -> str:
        return hashlib.sha1(b"pointer " + name.encode()).hexdigest()

    def model_info(self) -> bytes:
        return json.dumps({
            "id": REPO, "sha": COMMIT, "private": False,
            "siblings": [{"rfilename": n, "size": len(d), "blobId": self.git_oid(n),
                          "lfs": {"size": len(d), "sha256": self.sha256(n), "pointerSize": 134}}
                         for n, d in self.files.items()]}).encode()

    def _next_step(self, name):
        if name in self.cut_after:
            return ("cut", self.cut_after.pop(name))
        steps = self.plan.get(name)
        return steps.pop(0) if steps else None

    def content_gets(self) -> list[str]:
        """The paths of the file transfers asked for (content GETs, not the metadata calls)."""
        return [p for m, p, _ in self.requests if m == "GET" and p.startswith("/cdn/")]

    def close(self):
        self.server.shutdown()
        self.server.server_close()
