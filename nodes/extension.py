"""The ComfyUI extension: registers the models folder, the pack's routes and the node list."""

from __future__ import annotations

import logging

from comfy_api.latest import ComfyExtension, io

from . import comfy_models, node_options, routes
from .node_caption import NODES as CAPTION_NODES
from .node_files import NODES as FILE_NODES
from .node_generate import NODES as GENERATE_NODES
from .node_loaders import NODES as LOADER_NODES
from .node_lyrics import NODES as LYRICS_NODES
from .node_lora import NODES as LORA_NODES
from .node_options import NODES as OPTION_NODES
from .node_portable import NODES as PORTABLE_NODES
from .node_stages import NODES as STAGE_NODES

NODES: list[type[io.ComfyNode]] = (LOADER_NODES + LORA_NODES + STAGE_NODES + GENERATE_NODES + LYRICS_NODES
                                   + OPTION_NODES + FILE_NODES + CAPTION_NODES + PORTABLE_NODES)


class MM3Extension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES


_registered = False


def extension() -> MM3Extension:
    global _registered
    if not _registered:
        comfy_models.register_model_folder()
        routes.add_routes()
        node_options.add_prompt_upgrade()  # API prompts that set the moved knobs on AR Plan
        _registered = True
        logging.getLogger("mm3").info("MM3: %d nodes, models folder %s", len(NODES),
                                      comfy_models.folder_paths.get_folder_paths(comfy_models.FOLDER))
    return MM3Extension()
