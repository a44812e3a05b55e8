"""ComfyUI entry point of the MiniMax Music 3 (GGUF) node pack.

The engine (`mm3/`) and the tools import without ComfyUI; the node layer is loaded only when this
file is imported by ComfyUI itself. The node layer imports the engine as `mm3`, the one name the
command line and the tests use too, so the pack's folder is made importable (appended to the
search path, after ComfyUI's own modules).
"""

import os
import sys

try:
    from comfy_api.latest import ComfyExtension  # noqa: F401  (present only inside ComfyUI)
except ImportError:
    comfy_entrypoint = None
else:
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if _HERE not in sys.path:
        sys.path.append(_HERE)
    import mm3 as _engine

    if os.path.dirname(os.path.abspath(_engine.__file__)) != os.path.join(_HERE, "mm3"):
        raise ImportError(f"another module named mm3 ({_engine.__file__}) shadows this pack's engine "
                          f"({os.path.join(_HERE, 'mm3')}); remove it from the Python path")
    from .nodes import comfy_entrypoint  # noqa: F401

WEB_DIRECTORY = "./web"
