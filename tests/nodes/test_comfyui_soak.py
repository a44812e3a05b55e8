"""Load through a real ComfyUI: ten generations of text_to_song, queued one after another with the
same seeds. Each must run the whole chain again (not come from ComfyUI's node cache), give the same
bytes as run 1, and leave the server's resident memory flat.

ComfyUI would answer an identical prompt from its cache, so between runs the test posts
`/free {"unload_models": true, "free_memory": true}`: the server unloads every model and resets its
executor (cache included), and the next prompt is the same one, run from scratch.

Needs COMFYUI_PATH (and COMFYUI_PYTHON) like tests/nodes/test_comfyui_nodes.py; run alone with `-s` to see
the server's RSS after runs 1, 5 and 10.
"""

from __future__ import annotations

import time

import psutil
import pytest

from tests.helpers.comfy_server import cached_nodes, executed_nodes
from tests.helpers.comfyui import CAPTION, LYRICS, audio_entries, needs_comfy, read_wav, run, tiny_workflow

pytestmark = pytest.mark.slow
RUNS = 10
MEASURE_AT = (1, 5, 10)
# Allowed growth of the server's RSS from run 1 to run 10. Run 1 already paid for imports, the
# model files and the allocator's first pools; what the allocator keeps after that is noise of a
# few MiB, a leaked copy of the tiny models or of the outputs each run would add up past this.
MAX_GROWTH_MB = 150


def free_all(server, timeout: float = 30.0):
    """POST /free (unload models, reset the executor and its cache) and wait until the worker did
    it: our models leave ComfyUI's loaded list, then a moment for the reset and gc that follow."""
    server.post("/free", {"unload_models": True, "free_memory": True})
    deadline = time.monotonic() + timeout
    while server.get("/mm3/resident")["resident"]:
        assert time.monotonic() < deadline, f"/free did not unload our models in {timeout} s:\n{server.log_tail()}"
        time.sleep(0.1)
    time.sleep(0.5)


def server_rss_mb(server) -> float:
    return psutil.Process(server.proc.pid).memory_info().rss / 2**20


@needs_comfy
def test_ten_generations_same_output_flat_memory(comfy, capsys):
    wf = tiny_workflow(comfy, "text_to_song", duration=0.8, steps=2, fmt="wav16",
                       **{"2": {"caption": CAPTION, "lyrics": LYRICS}, "3": {"lm_seed": 314},
                          "5": {"seed": 27}, "8": {"filename_prefix": "mm3/soak"}})
    free_all(comfy)  # a clean executor even if the module's server ran other prompts first
    first, rss, started = None, {}, time.monotonic()
    for k in range(1, RUNS + 1):
        entry, events = run(comfy, wf)
        assert sorted(executed_nodes(events), key=int) == sorted(wf, key=int), f"run {k}: not every node ran"
        assert cached_nodes(events) == [], f"run {k}: answered from the cache"
        files = audio_entries(entry, "8")
        assert len(files) == 1
        data = comfy.view(files[0])
        if first is None:
            first = data
            assert read_wav(data)[:3] == (2, 44100, 16)
        assert data == first, f"run {k} ({files[0]['filename']}) differs from run 1"
        free_all(comfy)
        if k in MEASURE_AT:
            rss[k] = server_rss_mb(comfy)
    with capsys.disabled():
        print(f"\nComfyUI RSS after run 1: {rss[1]:.1f} MiB, run 5: {rss[5]:.1f} MiB, run 10: {rss[10]:.1f} MiB "
              f"({RUNS} runs in {time.monotonic() - started:.1f} s)")
    assert rss[10] - rss[1] < MAX_GROWTH_MB, rss
