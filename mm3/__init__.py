"""MiniMax Music 3 inference engine from GGUF component files (torch, numpy, gguf; no ComfyUI)."""

__version__ = "0.1.0"
