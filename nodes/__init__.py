"""ComfyUI node layer (V3 API): thin wrappers that turn node inputs into engine calls.

Only the `node_*`, `common`, `comfy_models` and `extension` modules import ComfyUI, and only when
ComfyUI calls `comfy_entrypoint`; `handles`, `placement`, `logic` and `song_cards` import without
it (tests).
"""


async def comfy_entrypoint():
    from .extension import extension

    return extension()
