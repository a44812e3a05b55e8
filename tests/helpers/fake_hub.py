"""A local stand-in for the Hugging Face endpoints the downloader uses (on 127.0.0.1 only)."""

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mm3.tools.download import REPO


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
