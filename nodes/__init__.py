"""ComfyUI node layer (V3 API): thin wrappers that turn node inputs into engine calls.

Only this package imports ComfyUI. The node classes arrive with the node-pack work; until then the
extension registers no nodes, so loading the pack in ComfyUI is harmless.
"""

from comfy_api.latest import ComfyExtension


class MM3Extension(ComfyExtension):
    async def get_node_list(self):
        return []


async def comfy_entrypoint() -> ComfyExtension:
    return MM3Extension()
