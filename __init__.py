"""ComfyUI entry point of the MiniMax Music 3 (GGUF) node pack.

The engine (`mm3/`) and the tools import without ComfyUI; the node layer is loaded only when this
file is imported by ComfyUI itself.
"""

try:
    from comfy_api.latest import ComfyExtension  # noqa: F401  (present only inside ComfyUI)
except ImportError:
    comfy_entrypoint = None
else:
    from .nodes import comfy_entrypoint  # noqa: F401

WEB_DIRECTORY = "./web"
