"""GGUF component files: reading, dequantization, and the layers that keep weights compressed."""

from .errors import ComponentError, GGUFFormatError
from .reader import CompressedTensor, GGUFFile, read_architecture

__all__ = ["ComponentError", "CompressedTensor", "GGUFFile", "GGUFFormatError", "read_architecture"]
