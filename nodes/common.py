"""Socket types, the category, and the bridge from engine progress/cancellation to ComfyUI."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import comfy.model_management as mm
import comfy.utils
from comfy_api.latest import io

from mm3.progress import STAGES, Cancelled, Progress
from .live import SUBFOLDER, WindowPreview

CATEGORY = "MiniMax Music 3 (GGUF)"

# One socket type per component, so a DiT cannot be wired where the LM goes.
LM = io.Custom("MM3_LM")
DEPTH = io.Custom("MM3_DEPTH")
COND = io.Custom("MM3_COND")
DIT = io.Custom("MM3_DIT")
VAE = io.Custom("MM3_VAE")
COMPONENT_TYPES = {"lm": LM, "depth": DEPTH, "cond": COND, "dit": DIT, "vae": VAE}

PROMPT = io.Custom("MM3_PROMPT")
AUDIO_CODES = io.Custom("AUDIO_CODES")
CONDITION = io.Custom("MM3_CONDITION")
LATENTS = io.Custom("MM3_LATENTS")
AUDIO_WINDOWS = io.Custom("MM3_AUDIO_WINDOWS")

ADVANCED = {"advanced": True}  # newer frontends fold these widgets away (an unknown key elsewhere)


def _send_text(text: str):
    """Text on the running node, for the client that queued the prompt only (a broadcast would show
    it on whatever node has the same id in every other open tab)."""
    try:
        from comfy_execution.utils import get_executing_context
        from server import PromptServer

        ctx, server = get_executing_context(), PromptServer.instance
        if ctx is not None and server is not None and server.client_id is not None:
            server.send_progress_text(text, ctx.node_id, server.client_id)
    except Exception:  # progress text is a nicety; never fail a run over it
        pass


def window_preview(duration: float | None = None, noise: bool = False) -> WindowPreview | None:
    """The running node's window sender (`live.WindowPreview`), whose messages go to the client that
    queued the prompt only; None without one (a prompt queued with no client id). `noise`: the
    vocoder is a tiny test model (`ComponentHandle.is_tiny`)."""
    try:
        import folder_paths
        from comfy_execution.utils import get_executing_context
        from server import PromptServer

        ctx, server = get_executing_context(), PromptServer.instance
        client = server.client_id if server is not None else None
        if ctx is None or client is None:
            return None
        folder = Path(folder_paths.get_temp_directory()) / SUBFOLDER
    except Exception:  # the preview is a nicety; never fail a run over it
        return None

    def send(event: str, data: dict) -> None:
        try:
            server.send_sync(event, data, client)
        except Exception:
            pass

    return WindowPreview(send, folder, ctx.node_id, ctx.prompt_id, song=ctx.list_index or 0, duration=duration,
                         noise=noise)


def show_warnings(warnings: list[str]) -> None:
    """Warnings of a stage (files that differ from those a replay file records) as the node's text;
    they are also in the server log."""
    if warnings:
        _send_text("\n".join(f"warning: {w}" for w in warnings))


def node_progress(text_every: float = 0.5) -> Progress:
    """Engine progress on the running node's bar (one bar per stage, reset when the stage changes)
    and as node text; `should_stop` polls ComfyUI's interrupt flag."""
    bar = comfy.utils.ProgressBar(1)
    state = {"stage": None, "sent": 0.0}

    def on_progress(stage: str, done: int, total: int, info: dict):
        if stage != state["stage"]:
            state["stage"] = stage
            state["sent"] = 0.0
        bar.update_absolute(done, total)  # the hook also raises on interrupt
        now = time.monotonic()
        if done >= total or now - state["sent"] >= text_every:
            state["sent"] = now
            known = STAGES.get(stage)
            _send_text(f"{known.label}: {known.unit} {done}/{total}" if known else f"{stage}: {done}/{total}")

    return Progress(on_progress=on_progress, should_stop=mm.processing_interrupted)


@contextlib.contextmanager
def interruptible():
    """Turn the engine's `Cancelled` into ComfyUI's interrupt, clearing the flag as ComfyUI does."""
    try:
        yield
    except Cancelled:
        mm.throw_exception_if_processing_interrupted()
        raise mm.InterruptProcessingException()
