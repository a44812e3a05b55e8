"""The editor's download routes (nodes/routes.py) over the downloader, in a real ComfyUI: progress
while a set downloads, a cancel that keeps a resumable .part the inventory shows as partial, and a
second start that fetches only the rest."""

import os
import time

from mm3.formats.published import SETS, published_name
from mm3.tools.download import file_names
from tests.helpers.comfyui import COMFYUI_PATH, needs_comfy
from tests.helpers.fake_hub import FakeHub

CHUNK = 10 * 1024 * 1024  # huggingface_hub's transfer chunk: progress and cancel come once per chunk


def wait_while_running(server, until=None, timeout=60):
    deadline = time.monotonic() + timeout
    while (status := server.get("/mm3/download"))["state"] == "running":
        if until is not None and until(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    return status


@needs_comfy
def test_cancel_keeps_a_partial_that_the_next_start_resumes():
    from tests.helpers.comfy_server import ComfyServer

    big = published_name("language_model", SETS["light"]["language_model"])
    files = {n: bytes([i + 1]) * 1000 for i, n in enumerate(file_names("light"))}
    files[big] = bytes(range(256)) * (3 * CHUNK // 256) + b"x" * 17
    hub = FakeHub(files)
    hub.pace[big] = 0.2  # seconds per MiB: one chunk every 2 s
    server = ComfyServer(COMFYUI_PATH, os.environ.get("COMFYUI_PYTHON"),
                         env={"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"})
    try:
        server.start()
        folder = server.base / "models" / "mm3"
        assert server.post("/mm3/download", {"set": "light"})["state"] == "running"
        status = wait_while_running(server, until=lambda s: s["file"] == big and s["done"] >= CHUNK)
        assert status["state"] == "running" and status["total"] == len(files[big]), status
        server.post("/mm3/download/cancel", {})
        status = wait_while_running(server)
        assert status["state"] == "cancelled" and "partial file is kept" in status["error"], status
        part = folder / (big + ".part")
        kept = part.stat().st_size
        assert 0 < kept < len(files[big]) and kept % CHUNK == 0 and not (folder / big).exists()
        entry = {f["name"]: f for f in server.get("/mm3/inventory")["sets"]["light"]}[big]
        assert entry["state"] == "partial" and entry["size"] == kept, entry
        hub.ranges.clear()
        assert server.post("/mm3/download", {"set": "light"})["state"] == "running"
        status = wait_while_running(server)
        assert status["state"] == "done", status
        assert hub.ranges[0] == f"bytes={kept}-"
        assert all((folder / n).read_bytes() == d for n, d in files.items())
        assert not list(folder.glob("*.part"))
    finally:
        server.stop()
        hub.close()
