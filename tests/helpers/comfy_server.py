"""A real ComfyUI for the node tests: started in a temporary base directory with this pack linked
into its custom_nodes and tiny GGUFs in its models/mm3, plus small stdlib HTTP and WebSocket
clients (the tests may not assume `requests` or `websocket-client`).

`python tests/helpers/comfy_server.py` starts one by hand (COMFYUI_PATH, COMFYUI_PYTHON) and prints its URL.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK_DIR_NAME = "ComfyUI-MM3-GGUF"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_models(dest: Path) -> list[str]:
    """The five tiny GGUFs of `python -m mm3 tiny` in `dest`; returns their names."""
    work = Path(tempfile.mkdtemp(prefix="mm3tiny_"))
    try:
        subprocess.run([sys.executable, "-m", "mm3", "tiny", str(work)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        dest.mkdir(parents=True, exist_ok=True)
        names = []
        for p in sorted(work.glob("*.gguf")):
            shutil.move(str(p), dest / p.name)
            names.append(p.name)
        return names
    finally:
        shutil.rmtree(work, ignore_errors=True)


class ComfyServer:
    """One ComfyUI process; `base` holds its custom_nodes, models, input, output, temp and user."""

    def __init__(self, comfy_path: str, python: str | None = None, extra_args: tuple[str, ...] = (),
                 env: dict | None = None, models: Path | None = None, own_group: bool = False):
        """`models`: a folder of tiny GGUFs to hard-link into models/mm3 instead of building them;
        `own_group`: the process leads a process group of its own, which `stop` ends whole."""
        self.models, self.own_group = models, own_group
        self.comfy_path = Path(comfy_path)
        self.python = python or sys.executable
        self.extra_args = extra_args
        self.base = Path(tempfile.mkdtemp(prefix="mm3comfy_"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.base / "comfyui.log"
        self.proc: subprocess.Popen | None = None
        self.client_id = uuid.uuid4().hex
        self.env = {**os.environ, **(env or {})}

    def start(self, timeout: float = 300.0) -> "ComfyServer":
        return self.launch().wait_ready(timeout)

    def launch(self) -> "ComfyServer":
        """Start the process without waiting for it to answer (several start side by side)."""
        for d in ("custom_nodes", "input", "output", "temp", "user"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        os.symlink(ROOT, self.base / "custom_nodes" / PACK_DIR_NAME)
        if self.models is None:
            self.model_names = build_tiny_models(self.base / "models" / "mm3")
        else:
            (self.base / "models" / "mm3").mkdir(parents=True)
            self.model_names = sorted(p.name for p in Path(self.models).glob("*.gguf"))
            for name in self.model_names:
                os.link(Path(self.models) / name, self.base / "models" / "mm3" / name)
        cmd = [self.python, str(self.comfy_path / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port",
               str(self.port), "--disable-auto-launch", "--base-directory", str(self.base),
               "--database-url", f"sqlite:///{self.base / 'user' / 'comfyui.db'}", *self.extra_args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.base, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=self.own_group)
        return self

    def wait_ready(self, timeout: float = 300.0) -> "ComfyServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.get("/system_stats", timeout=2)
                return self
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self):
        if self.own_group and self.proc is not None:
            self._end_group()
        elif self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self.base, ignore_errors=True)

    def _end_group(self):
        """SIGTERM to the process group (the server and anything it started), SIGKILL to what is
        left after 20 s."""
        import signal

        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if not self.group_alive():
                break

    def group_alive(self) -> bool:
        """Whether any process of the server's own group still runs (own_group only)."""
        if self.proc is None:
            return False
        self.proc.poll()  # reap the leader if it ended
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # -- HTTP -----------------------------------------------------------------------------------
    def request(self, method: str, path: str, body=None, timeout: float = 60):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return json.loads(raw) if r.headers.get_content_type() == "application/json" else raw

    def get(self, path: str, timeout: float = 60):
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body, timeout: float = 60):
        return self.request("POST", path, body, timeout=timeout)

    def queue(self, prompt: dict) -> str:
        """POST /prompt; returns the prompt id (validation errors raise with the server's answer)."""
        try:
            return self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})["prompt_id"]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"/prompt refused the workflow: {e.read().decode(errors='replace')}") from None

    def history(self, prompt_id: str) -> dict | None:
        return self.get(f"/history/{prompt_id}").get(prompt_id)

    def wait(self, prompt_id: str, timeout: float = 120) -> dict:
        """Poll /history until the prompt finished (success, error or interrupt)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.history(prompt_id)
            if h is not None and h.get("status", {}).get("completed") is not None:
                if h["status"]["completed"] or h["status"].get("status_str") == "error":
                    return h
            time.sleep(0.2)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout} s:\n{self.log_tail()}")

    def view(self, entry: dict) -> bytes:
        """The bytes of a file a node wrote (an entry of a node's ui output)."""
        q = urllib.parse.urlencode({k: entry[k] for k in ("filename", "subfolder", "type")})
        with urllib.request.urlopen(f"{self.url}/view?{q}", timeout=60) as r:
            return r.read()

    def ws(self) -> "WebSocket":
        return WebSocket("127.0.0.1", self.port, f"/ws?clientId={self.client_id}")


class WebSocket:
    """Enough of RFC 6455 to read ComfyUI's event stream: text frames as JSON, binary frames as
    bytes; answers pings; never sends data."""

    def __init__(self, host: str, port: int, path: str, timeout: float = 30):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                           ).encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("websocket handshake: connection closed")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"websocket handshake refused: {head[:200]!r}")

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("websocket closed")
            buf += chunk
        return buf

    def _send(self, opcode: int, payload: bytes = b""):
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked)

    def recv(self, timeout: float | None = None):
        """The next message: a dict for text (JSON), bytes for binary."""
        if timeout is not None:
            self.sock.settimeout(timeout)
        while True:
            b0, b1 = self._exact(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            payload = self._exact(n)
            if opcode == 1:
                return json.loads(payload)
            if opcode == 2:
                return payload
            if opcode == 8:
                raise ConnectionError("websocket closed by the server")
            if opcode == 9:
                self._send(10, payload[:125])

    def events(self, prompt_id: str, timeout: float = 120, until=("execution_success", "execution_error",
                                                                    "execution_interrupted")):
        """Every JSON event of `prompt_id` up to and including its final one."""
        deadline = time.monotonic() + timeout
        out = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no final event for {prompt_id} in {timeout} s; got {[e['type'] for e in out]}")
            msg = self.recv(timeout=left)
            if isinstance(msg, bytes):  # binary events: node text (type 3) becomes a "progress_text" event
                text = progress_text(msg)
                if text is not None:
                    out.append({"type": "progress_text", "data": text})
                continue
            data = msg.get("data") or {}
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            if data.get("prompt_id") is None and msg["type"] != "executing":
                continue
            out.append(msg)
            if msg["type"] in until and data.get("prompt_id") == prompt_id:
                return out

    def close(self):
        try:
            self._send(8)
        except OSError:
            pass
        self.sock.close()


TEXT_EVENT = 3  # ComfyUI's BinaryEventTypes.TEXT: what send_progress_text sends


def progress_text(frame: bytes) -> dict | None:
    """{"node", "text"} of a binary node-text frame (event type, node id length, node id, text)."""
    if len(frame) < 8 or struct.unpack(">I", frame[:4])[0] != TEXT_EVENT:
        return None
    n = struct.unpack(">I", frame[4:8])[0]
    return {"node": frame[8:8 + n].decode("utf-8"), "text": frame[8 + n:].decode("utf-8", "replace")}


def executed_nodes(events: list[dict]) -> list[str]:
    """Node ids the prompt executed (the `executing` events, without the final null)."""
    return [e["data"]["node"] for e in events if e["type"] == "executing" and e["data"].get("node") is not None]


def cached_nodes(events: list[dict]) -> list[str]:
    return [n for e in events if e["type"] == "execution_cached" for n in e["data"]["nodes"]]


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description="Start a ComfyUI with this pack and the tiny models (COMFYUI_PATH, "
                                         "COMFYUI_PYTHON) and print its URL").parse_args(argv)
    server = ComfyServer(os.environ["COMFYUI_PATH"], os.environ.get("COMFYUI_PYTHON")).start()
    print(f"{server.url} (base {server.base}); Ctrl-C stops it", flush=True)
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
