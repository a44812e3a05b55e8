"""Errors raised while reading GGUF component files; messages name the file and the value."""

from ...errors import InputError


class GGUFFormatError(InputError):
    """The file is not a readable GGUF: bad magic, truncated, corrupt header, unknown type."""


class ComponentError(InputError):
    """A readable GGUF that is not the component asked for: wrong architecture, missing or
    mis-shaped tensor, missing hyper-parameter, components that do not fit together."""
