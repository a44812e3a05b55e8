"""The pack's HTTP routes (under / and /api, as ComfyUI serves every route), used by web/mm3.js.

- GET  /mm3/resident   our models ComfyUI holds loaded, per component (a debug view)
- POST /mm3/tokens     {"lm_model", "caption", "lyrics"} -> the prompt's token count and the budget
- GET  /mm3/inventory  the component files in the mm3 folders and each published set's state
- POST /mm3/download   {"set"} starts fetching a published set into models/mm3, in a background thread
- GET  /mm3/download   its state; POST /mm3/download/cancel stops it (the .part is kept and resumed)
Nothing slow runs on the event loop; a bad body is a 400 with the reason, one past the limit a 413.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from mm3.constants import MAX_PROMPT_TOKENS
from mm3.errors import MM3Error
from mm3.files.inventory import scan
from mm3.plan.prompt import count_tokens, text_problem
from mm3.formats.published import SETS
from mm3.tools.download import download_set

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


# Body limits. A 5000-token prompt is a few tens of KiB of JSON even with every character escaped
# (\uXXXX, six bytes for what is often one token): 256 KiB is room for several times that. A
# download names a set in a few bytes.
TOKENS_BODY_LIMIT = 256 * 1024
SMALL_BODY_LIMIT = 4 * 1024
TOKENS_WAITING = 4  # token counts queued behind the one running; more are refused (503)

_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


class BodyError(ValueError):
    """A request body the route refuses, with its HTTP status (400 or 413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


async def read_json(request, limit: int) -> dict:
    """The request's body as a JSON object, read `limit` bytes at most: a Content-Length over the
    limit is refused before anything is read, a body without one once it passes the limit."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError(f"{request.path}: the body is {declared} bytes, over the {limit} byte limit", 413)
    data = bytearray()
    while chunk := await request.content.readany():
        data += chunk
        if len(data) > limit:
            raise BodyError(f"{request.path}: the body is over the {limit} byte limit", 413)
    try:
        body = json.loads(bytes(data)) if data.strip() else {}
    except RecursionError:
        raise BodyError(f"{request.path}: the body is not JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise BodyError(f"{request.path}: the body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise BodyError(f"{request.path}: the body must be a JSON object, got {json_type(body)}")
    return body


def string_field(body: dict, name: str, default: str = "") -> str:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise BodyError(f"{name} must be a string, got {json_type(value)}")
    return value


def token_request(body: dict) -> tuple[str, str, str]:
    """(lm_model, caption, lyrics) of a token-count body; refuses text the MM3 Prompt node refuses
    (control characters, unpaired surrogates), so the live count says so where it is typed."""
    name = string_field(body, "lm_model") or "auto"
    caption, lyrics = string_field(body, "caption"), string_field(body, "lyrics")
    for field, text in (("caption", caption), ("lyrics", lyrics)):
        problem = text_problem(field, text)
        if problem:
            raise BodyError(problem)
    return name, caption, lyrics


def tokens(name: str, caption: str, lyrics: str) -> dict:
    """The token count of a caption and lyrics with the tokenizer of the LM a loader names."""
    from mm3.tokenizer import MM3Tokenizer

    chosen = comfy_models.chosen_file("lm", name)
    tokenizer = MM3Tokenizer.from_gguf(comfy_models.full_path(chosen))
    n = count_tokens(tokenizer, caption, lyrics)
    return {"tokens": n, "limit": MAX_PROMPT_TOKENS, "over": n > MAX_PROMPT_TOKENS, "lm_model": chosen}


class Counter:
    """Token counts on one worker thread, so a long text never holds up the server's event loop;
    at most `waiting` counts wait behind the running one (the editor recounts as one types, and
    only the last count matters)."""

    def __init__(self, waiting: int = TOKENS_WAITING):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mm3-tokens")
        self.waiting = waiting
        self.lock = threading.Lock()
        self.queued = 0  # submitted and not yet finished, counted down by the worker itself

    def _run(self, *args) -> dict:
        try:
            return tokens(*args)
        finally:
            with self.lock:
                self.queued -= 1

    async def count(self, name: str, caption: str, lyrics: str) -> dict:
        with self.lock:
            if self.queued > self.waiting:
                raise RuntimeError(f"the token counter is busy ({self.queued} counts in hand); try again")
            self.queued += 1
        try:
            future = self.pool.submit(self._run, name, caption, lyrics)
        except BaseException:
            with self.lock:
                self.queued -= 1
            raise
        return await asyncio.wrap_future(future)


COUNTER = Counter()


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
        return web.json_response({"error": str(e)}, status=getattr(e, "status", status))

    @routes.get("/mm3/resident")
    async def resident(request):
        return web.json_response({"resident": comfy_models.resident()})

    @routes.post("/mm3/tokens")
    async def count(request):
        try:
            return web.json_response(await COUNTER.count(*token_request(await read_json(request, TOKENS_BODY_LIMIT))))
        except (ValueError, MM3Error, OSError) as e:
            return refused(e)
        except RuntimeError as e:
            return refused(e, 503)

    @routes.get("/mm3/inventory")
    async def inventory(request):
        def scan_folders():  # ComfyUI's own MM3 files too
            return scan(*_folders(), others=tuple(comfy_models.comfy_folder_dirs())).to_dict()

        inv = await asyncio.get_running_loop().run_in_executor(None, scan_folders)
        inv["download"] = DOWNLOAD.status()
        return web.json_response(inv)

    @routes.post("/mm3/download")
    async def download(request):
        try:
            set_name = string_field(await read_json(request, SMALL_BODY_LIMIT), "set")
            folders = _folders()
            folder = folders[0] if folders else os.path.join(comfy_models.folder_paths.models_dir, "mm3")
            return web.json_response(DOWNLOAD.start(set_name, folder), status=202)
        except ValueError as e:
            return refused(e)
        except RuntimeError as e:
            return refused(e, 409)

    @routes.get("/mm3/download")
    async def download_status(request):
        return web.json_response(DOWNLOAD.status())

    @routes.post("/mm3/download/cancel")
    async def cancel(request):  # the body, if any, is not read (aiohttp discards it)
        DOWNLOAD.stop.set()
        return web.json_response(DOWNLOAD.status())
