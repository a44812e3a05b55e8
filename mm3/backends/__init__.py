"""The back ends: how each layer's product is computed on its device.

`products` holds the products and the one rule table that binds them when a layer's weights,
numerics or device change; `device` chooses the compute device and dtype. One folder per device
family: `cpu` (the native integer kernel built on the machine, torch's int4 product, the whole-block
decode steps, the CPU forms by rule) and `gpu` (Triton kernels over the GGUF blocks or the device
layout, CUDA graphs of a frame, the kernel report). Without either, torch's own operations serve:
a dequantization per use and `F.linear`."""

from ..weights import binding
from .binder import Backends

binding.install(Backends())
