"""The pack's HTTP routes (under / and /api, as ComfyUI serves every route), used by web/mm3.js.

- GET  /mm3/resident   our models ComfyUI holds loaded, per component (a debug view)
- POST /mm3/tokens     {"lm_model", "caption", "lyrics"} -> the prompt's token count, with that LM's
                       tokenizer ("auto" as the loaders resolve it), and the budget
- GET  /mm3/inventory  the component files in the mm3 folders and each published set's state
- POST /mm3/download   {"set"} starts fetching a published set into models/mm3 (resumable; through
                       huggingface_hub, so HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply)
- GET  /mm3/download   the download's state; POST /mm3/download/cancel stops it after the chunk in
                       hand (the .part is kept and the next start resumes it)

The work behind them is engine code (`mm3.prompt.count_tokens`, `mm3.inventory`,
`mm3.tools.download`); a download runs in one background thread, one set at a time.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from mm3.constants import MAX_PROMPT_TOKENS
from mm3.errors import MM3Error
from mm3.inventory import scan
from mm3.prompt import count_tokens
from mm3.tools.download import SETS, download_set

from . import comfy_models

log = logging.getLogger("mm3")


class Download:
    """The state of the one download that may run (a set into the first mm3 folder)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.state = {"state": "idle"}

    def status(self) -> dict:
        with self.lock:
            return dict(self.state)

    def _update(self, **changes):
        with self.lock:
            self.state.update(changes)

    def start(self, set_name: str, folder: str) -> dict:
        if set_name not in SETS:
            raise ValueError(f"unknown set {set_name!r} (expected one of {', '.join(SETS)})")
        with self.lock:
            if self.thread is not None and self.thread.is_alive():
                raise RuntimeError(f"the {self.state.get('set')} set is already downloading")
            self.stop.clear()
            self.state = {"state": "running", "set": set_name, "folder": folder, "file": None, "done": 0,
                          "total": 0, "started": time.time()}
            self.thread = threading.Thread(target=self._run, args=(set_name, folder), name="mm3-download",
                                           daemon=True)
            self.thread.start()
            return dict(self.state)

    def _run(self, set_name: str, folder: str):
        def progress(name, done, total):
            self._update(file=name, done=done, total=total)

        try:
            download_set(set_name, folder, progress=progress, log=lambda m: log.info("MM3 download: %s", m),
                         should_stop=self.stop.is_set, replace=tuple(scan(folder).unusable_in_set(set_name)))
        except MM3Error as e:
            cancelled = self.stop.is_set()
            self._update(state="cancelled" if cancelled else "failed", error=str(e))
            log.warning("MM3 download %s: %s", "cancelled" if cancelled else "failed", e)
        except Exception as e:  # a bug or an OS error: said, not swallowed
            self._update(state="failed", error=f"{type(e).__name__}: {e}")
            log.exception("MM3 download failed")
        else:
            self._update(state="done", file=None)
            log.info("MM3 download: the %s set is complete in %s", set_name, folder)


DOWNLOAD = Download()


def _folders() -> list[str]:
    return list(comfy_models.folder_paths.get_folder_paths(comfy_models.FOLDER))


def tokens(body: dict) -> dict:
    """The token count of a caption and lyrics with the tokenizer of the LM a loader names."""
    name = body.get("lm_model") or "auto"
    caption, lyrics = body.get("caption", ""), body.get("lyrics", "")
    if not isinstance(caption, str) or not isinstance(lyrics, str) or not isinstance(name, str):
        raise ValueError("lm_model, caption and lyrics must be strings")
    from mm3.tokenizer import MM3Tokenizer

    chosen = comfy_models.chosen_file("lm", name)
    tokenizer = MM3Tokenizer.from_gguf(comfy_models.full_path(chosen))
    n = count_tokens(tokenizer, caption, lyrics)
    return {"tokens": n, "limit": MAX_PROMPT_TOKENS, "over": n > MAX_PROMPT_TOKENS, "lm_model": chosen}


def add_routes() -> None:
    try:
        from aiohttp import web
        from server import PromptServer
    except ImportError:
        return
    if getattr(PromptServer, "instance", None) is None:
        return
    routes = PromptServer.instance.routes

    def refused(e: Exception, status: int = 400):
        return web.json_response({"error": str(e)}, status=status)

    @routes.get("/mm3/resident")
    async def resident(request):
        return web.json_response({"resident": comfy_models.resident()})

    @routes.post("/mm3/tokens")
    async def count(request):
        try:
            return web.json_response(tokens(await request.json()))
        except (ValueError, MM3Error, OSError) as e:
            return refused(e)

    @routes.get("/mm3/inventory")
    async def inventory(request):
        inv = scan(*_folders(), others=tuple(comfy_models.comfy_folder_dirs())).to_dict()  # ComfyUI's MM3 files too
        inv["download"] = DOWNLOAD.status()
        return web.json_response(inv)

    @routes.post("/mm3/download")
    async def download(request):
        try:
            body = await request.json()
            folders = _folders()
            folder = folders[0] if folders else os.path.join(comfy_models.folder_paths.models_dir, "mm3")
            return web.json_response(DOWNLOAD.start(body.get("set", ""), folder), status=202)
        except ValueError as e:
            return refused(e)
        except RuntimeError as e:
            return refused(e, 409)

    @routes.get("/mm3/download")
    async def download_status(request):
        return web.json_response(DOWNLOAD.status())

    @routes.post("/mm3/download/cancel")
    async def cancel(request):
        DOWNLOAD.stop.set()
        return web.json_response(DOWNLOAD.status())
