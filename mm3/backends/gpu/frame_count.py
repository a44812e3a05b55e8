"""The device kernels a piece of work launches on the GPU code path, counted by kind.

`KernelCounter` records, while active, every ATen operation (a `TorchDispatchMode`), every launch
of a Triton kernel (`kernel[grid](...)`) and every `F.scaled_dot_product_attention` call, and maps
each to the CUDA kernels it launches (`ATEN_KERNELS`, `SDPA_KERNELS`): a view that makes no new
storage and an allocation launch none, a Triton launch is one kernel whatever it runs inside (the
ATen operations the interpreter or a launch runs are not seen). It works over CUDA tensors (the
kernels themselves) and over CPU tensors under `emulation.emulated()` (Triton's interpreter), where
`fast_products` computes the layout products with torch instead of interpreting them, still
counting the launches `layout_kernels.linear` makes with its CUDA tiles (`DECODE`, an H100's
multiprocessors; `SUBSTITUTES`).

Each launch gets a kind (`KINDS`: from a Triton kernel's name prefix, else from the mm3 function on
the Python stack that issued it) and a part of the frame (`PARTS`: from the function or the
registered module on the stack), so the count of an AR frame reads per kind and per part.
"""

from __future__ import annotations

import importlib
import linecache
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from . import step_checks

KINDS = ("products", "norms", "rotation/cache", "attention", "draws", "embeddings", "other")
PARTS = ("lm_layer", "lm_step_fixed", "depth_pass", "sampling", "embeddings_feedback", "frame_glue")

# ATen operation (name, or name.overload) -> CUDA kernels it launches, where not 1. An operation
# whose output shares its input's storage (a view) launches none; so does one that only mutates
# metadata or allocates. Estimated from ATen's CUDA implementations.
ATEN_KERNELS = {
    "empty": 0, "empty_strided": 0, "empty_like": 0, "new_empty": 0, "new_empty_strided": 0,
    "resize_": 0, "set_": 0, "detach": 0, "lift_fresh": 0, "alias": 0,
    "masked_fill.Scalar": 2, "masked_fill.Tensor": 2,  # out of place: a copy, then the fill
    "topk": 2,  # a radix select, then a sort of the k kept
}
# F.scaled_dot_product_attention, by its mask: a boolean mask is converted (logical_not, where),
# then one attention kernel; an additive mask or none: the attention kernel alone.
SDPA_KERNELS = {"bool mask": 3, "float mask": 1, "no mask": 1}
SYNCS = {"_local_scalar_dense", "equal", "is_nonzero", "nonzero", "item"}  # the host waits for the device

# Triton kernel name prefixes -> kind (products keep their families' names).
KERNEL_PREFIXES = (("norm_", "norms"), ("rope_", "rotation/cache"), ("attn_prep_", "rotation/cache"),
                   ("attention_", "attention"), ("draw_", "draws"), ("lookup_", "embeddings"),
                   ("gemv", "products"), ("gemm", "products"), ("split_sum", "products"),
                   ("fused_linear", "products"))
PRODUCT_MODULES = ("mm3.backends.gpu.layout_triton", "mm3.backends.gpu.triton_gguf")

# The mm3 function on the stack that issued an ATen operation -> kind; the innermost match wins.
# A dotted key is a qualified name (Class.method), a plain one a function name in any mm3 module.
FUNCTION_KINDS = {
    "rms_norm": "norms", "Vector.forward": "norms",
    "rotate_half": "rotation/cache", "Qwen3LM.rope": "rotation/cache", "KVCache.positions": "rotation/cache",
    "KVCache.write": "rotation/cache", "KVCache.advance": "rotation/cache", "prepare_attention": "rotation/cache",
    "KVCache.attended": "attention", "one_query_attention": "attention", "short_attention": "attention",
    "FrameSampler._semantic": "draws", "_draw": "draws", "top_k_draw": "draws", "draw_from_raw": "draws",
    "Embedding.lookup": "embeddings", "Qwen3LM.embed": "embeddings", "RVQDepthDecoder.code_embedding": "embeddings",
    "lookup": "embeddings", "frame_feedback": "embeddings",
}
MODULE_KINDS = (("mm3.plan.sampling", "draws"), ("mm3.plan.shaping", "draws"),
                ("mm3.backends.gpu.layout_kernels", "products"), ("mm3.backends.gpu.kernels", "products"))
CLASS_KINDS = (("mm3.weights.layers", ("Linear.", "Fused."), "products"),
               ("mm3.backends.products", ("LayoutProduct.", "LayoutSegments.", "LayoutSwiGLU.", "KernelProduct.", "FloatWeight.",
                                           "Split.", "Separate."),
                "products"),
               ("mm3.backends.gpu.custom_ops", ("layout_linear", "layout_segments", "layout_swiglu", "block_linear"),
                "products"))
# ... -> part of the frame (checked before the registered modules of the same frame).
FUNCTION_PARTS = {
    "FrameSampler._semantic": "sampling", "top_k_draw": "sampling", "_draw": "sampling",
    "Qwen3LM.embed": "embeddings_feedback", "RVQDepthDecoder.code_embedding": "embeddings_feedback",
    "frame_feedback": "embeddings_feedback",
    "Qwen3DecoderLayer.forward": "lm_layer", "lm_layer": "lm_layer",
    "Qwen3LM.forward": "lm_step_fixed", "RVQDepthDecoder.forward": "depth_pass", "depth_blocks": "depth_pass",
}
MODULE_PARTS = (("mm3.plan.sampling", "sampling"), ("mm3.plan.shaping", "sampling"))
# Lines of a function that does several things: (qualified name) -> ((text on the line, kind, part or None), ...).
LINE_RULES = {
    "Qwen3Attention.forward": (("rotate_half", "rotation/cache", None),),
    "FrameSampler.step": (("audio_heads", "draws", "sampling"), ("embed(", "embeddings", "embeddings_feedback"),
                          ("code_embedding", "embeddings", "embeddings_feedback")),
}


def _layout_linear(counter, x, weight, qtype, k, bias=None, config=None, norm=None, residual=None, add=None):
    return _layout_segments(counter, x, [(weight, qtype)], k, bias, config, norm=norm, residual=residual, add=add)


def _layout_segments(counter, x, segments, k, bias=None, config=None, norm=None, residual=None, add=None):
    from .layout_kernels import plus_rows, torch_rms_norm

    def plus(rows):  # `add`'s rows added to these, as the launch adds them
        return rows if add is None else plus_rows(rows.reshape(-1, rows.shape[-1]), add.reshape(-1, add.shape[-1])) \
            .view(rows.shape)

    weight = torch.cat([counter.float_weight(w, t, k, x.dtype) for w, t in segments])
    y = F.linear(torch_rms_norm(x if norm is None else plus(x), norm), weight, bias)
    return y if residual is None else plus(residual) + y


def _layout_swiglu(counter, x, weight, qtype, k, config=None, norm=None):
    from .layout_kernels import torch_rms_norm

    gate, up = F.linear(torch_rms_norm(x, norm), counter.float_weight(weight, qtype, k, x.dtype)).chunk(2, dim=-1)
    return F.silu(gate) * up


def _block_linear(counter, x, weight, qtype, bias=None):
    return F.linear(x, counter.float_weight(weight, qtype, x.shape[-1], x.dtype, blocks=True), bias)


# The product launchers `fast_products` runs without their kernels: (module, function, a torch
# computation of the same result, called with the counter first). A launcher's launches are
# recorded as its CUDA tiles make them; interpreting a released-size product would take minutes.
SUBSTITUTES = (("mm3.backends.gpu.layout_kernels", "linear", _layout_linear),
               ("mm3.backends.gpu.layout_kernels", "linear_segments", _layout_segments),
               ("mm3.backends.gpu.layout_kernels", "swiglu", _layout_swiglu),
               ("mm3.backends.gpu.kernels", "fused_linear", _block_linear))


@dataclass(frozen=True)
class Launch:
    """One recorded launch: `source` "aten", "triton" or "sdpa", its name, the CUDA kernels it
    stands for, its kind and part, and the LM layer it ran in (None outside one)."""

    source: str
    name: str
    kernels: int
    kind: str
    part: str
    layer: int | None = None


def aten_kernels(func, args, kwargs, out) -> int:
    """The CUDA kernels ATen operation `func` launches, given its arguments and output."""
    name = func._overloadpacket.__name__
    full = f"{name}.{func._overloadname}" if func._overloadname else name
    if full in ATEN_KERNELS:
        return ATEN_KERNELS[full]
    if name in ATEN_KERNELS:
        return ATEN_KERNELS[name]
    if name in SYNCS or func._schema.is_mutable:
        return 1
    outs = _tensors(out)
    if not outs:
        return 0
    held = {s for s in (_storage(t) for t in _tensors(args) + _tensors(kwargs)) if s}
    if held and all(_storage(t) in held for t in outs):
        return 0  # a view
    return 1


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage
        return 0


def triton_kind(name: str, module: str) -> str | None:
    """The kind of a Triton kernel from its name (or its module, for the product families)."""
    for prefix, kind in KERNEL_PREFIXES:
        if name.startswith(prefix):
            return kind
    return "products" if module in PRODUCT_MODULES else None


class _Recorder(TorchDispatchMode):
    def __init__(self, counter: KernelCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counter
        if c.recording and not c.paused_depth and not step_checks.running():
            n = aten_kernels(func, args, kwargs, out)
            name = func._overloadpacket.__name__
            if name in SYNCS:
                c.syncs.append(name)
            if n:
                kind, part, layer = c.where()
                if kind != "products" and func._schema.is_mutable and c.writes_cache(args):
                    kind = "rotation/cache"
                c.launches.append(Launch("aten", name, n, kind, part, layer))
        return out


class KernelCounter:
    """While active (`with counter:`), records the launches of the work run inside; `recording`
    may be turned off for work that must not count (a warm-up). `modules` maps modules to their
    part of a frame ("lm_layer" modules with their layer index as (part, index)); `caches` are the
    KV buffers whose writes are the rotation/cache kind; `fast_products` (over CPU tensors under
    emulation) computes the layout products with torch, counting the kernels they launch."""

    def __init__(self, modules: dict | None = None, caches=(), fast_products: bool = False,
                 roots: tuple[str, ...] = ("mm3.",)):
        self.module_parts = {id(m): p for m, p in (modules or {}).items()}
        self._keep = list((modules or {}).keys())
        self.cache_storages = {_storage(t) for t in caches}
        self.fast_products = fast_products
        self.roots = roots
        self.launches: list[Launch] = []
        self.syncs: list[str] = []
        self.recording = True
        self.paused_depth = 0
        self.dry = 0
        self._weights: dict = {}
        self._undo: list = []

    # -- where an operation came from -----------------------------------------------------------
    def where(self) -> tuple[str, str, int | None]:
        """(kind, part, LM layer) of the operation being recorded, from the Python stack."""
        kind = part = None
        layer = None
        f = sys._getframe(2)
        while f is not None and (kind is None or part is None or (part == "lm_layer" and layer is None)):
            module = f.f_globals.get("__name__", "")
            if module.startswith(self.roots) and module != __name__:
                code = f.f_code
                qual, name = code.co_qualname, code.co_name
                lines = LINE_RULES.get(qual)
                if lines:
                    text = linecache.getline(code.co_filename, f.f_lineno)
                    for what, line_kind, line_part in lines:
                        if what in text:
                            kind = kind or line_kind
                            part = part or line_part
                            break
                if kind is None:
                    kind = FUNCTION_KINDS.get(qual) or FUNCTION_KINDS.get(name)
                    if kind is None:
                        kind = next((k for m, k in MODULE_KINDS if module == m), None)
                    if kind is None:
                        kind = next((k for m, prefixes, k in CLASS_KINDS if module == m and qual.startswith(prefixes)),
                                    None)
                if part is None:
                    part = FUNCTION_PARTS.get(qual) or FUNCTION_PARTS.get(name)
                    if part is None:
                        part = next((p for m, p in MODULE_PARTS if module == m), None)
                    if part is None and self.module_parts:
                        me = f.f_locals.get("self")
                        found = self.module_parts.get(id(me)) if me is not None else None
                        if found is not None:
                            part = found
                    if isinstance(part, tuple):
                        part, layer = part
                if part == "lm_layer" and layer is None:  # the layer's index: here, or in a caller's frame
                    layer = next((v for v in (f.f_locals.get("layer"), f.f_locals.get("index"))
                                  if isinstance(v, int) and not isinstance(v, bool)), None)
            f = f.f_back
        return kind or "other", part or "frame_glue", layer

    def writes_cache(self, args) -> bool:
        return bool(self.cache_storages) and bool(args) and isinstance(args[0], torch.Tensor) and \
            _storage(args[0]) in self.cache_storages

    # -- what is not counted -------------------------------------------------------------------
    @contextmanager
    def paused(self):
        """Nothing run inside is recorded (a launch's own work, a substitute's computation)."""
        self.paused_depth += 1
        try:
            yield
        finally:
            self.paused_depth -= 1

    # -- the hooks -----------------------------------------------------------------------------
    def _record_triton(self, kernel) -> None:
        base = kernel
        while hasattr(base, "fn"):
            base = base.fn
        name, module = getattr(base, "__name__", "kernel"), getattr(base, "__module__", "")
        if not self.recording or self.paused_depth or step_checks.running():  # a step's check is not the work
            return
        kind = triton_kind(name, module)
        where_kind, part, layer = self.where()
        self.launches.append(Launch("triton", name, 1, kind or where_kind, part, layer))

    def _sdpa(self, original):
        counter = self

        def scaled_dot_product_attention(query, key, value, attn_mask=None, *args, **kwargs):
            if counter.recording and not counter.paused_depth and not step_checks.running():
                what = "no mask" if attn_mask is None else \
                    "bool mask" if attn_mask.dtype == torch.bool else "float mask"
                _, part, layer = counter.where()
                counter.launches.append(Launch("sdpa", f"scaled_dot_product_attention ({what})",
                                               SDPA_KERNELS[what], "attention", part, layer))
            with counter.paused():
                return original(query, key, value, attn_mask, *args, **kwargs)

        return scaled_dot_product_attention

    def float_weight(self, weight: torch.Tensor, qtype, k: int, dtype: torch.dtype, blocks: bool = False):
        """A weight in the device layout (or as GGUF `blocks`, or floats) as a float tensor of `dtype`,
        made once a weight."""
        from ...formats.gguf.quants import dequantize
        from . import device_layout as dl
        from .kernels import FLOAT_DTYPES

        key = (weight.data_ptr(), tuple(weight.shape), int(qtype), dtype, blocks)
        w = self._weights.get(key)
        if w is None:
            if qtype in FLOAT_DTYPES:
                w = weight.to(dtype)
            elif blocks:
                w = dequantize(weight, qtype, (weight.shape[0], k), torch.float32).to(dtype)
            else:
                w = dl.dequantize(weight, qtype, k, torch.float32).to(dtype)
            self._weights[key] = w
        return w

    def _substitute(self, module, original, compute):
        """`original` with its launches recorded but not run (its module's `interpreted` answering
        False: the CUDA tiles and grids), returning `compute`'s result, which is not recorded."""
        counter = self

        def substituted(*args, **kwargs):
            counter.dry += 1
            interpreted = getattr(module, "interpreted", None)
            if interpreted is not None:
                module.interpreted = lambda: False
            try:
                original(*args, **kwargs)
            finally:
                if interpreted is not None:
                    module.interpreted = interpreted
                counter.dry -= 1
            with counter.paused():
                return compute(counter, *args, **kwargs)

        return substituted

    def __enter__(self):
        from triton.runtime.jit import KernelInterface

        counter = self
        getitem = KernelInterface.__getitem__

        def launch(kernel, grid):
            run = getitem(kernel, grid)

            def counted(*args, **kwargs):
                counter._record_triton(kernel)
                if counter.dry:
                    return None
                with counter.paused():
                    return run(*args, **kwargs)

            return counted

        KernelInterface.__getitem__ = launch
        self._undo.append(lambda: setattr(KernelInterface, "__getitem__", getitem))
        sdpa = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._sdpa(sdpa)
        self._undo.append(lambda: setattr(F, "scaled_dot_product_attention", sdpa))
        for name, attr, compute in (SUBSTITUTES if self.fast_products else ()):
            module = importlib.import_module(name)
            original = getattr(module, attr)
            setattr(module, attr, self._substitute(module, original, compute))
            self._undo.append(lambda m=module, a=attr, o=original: setattr(m, a, o))
        self._mode = _Recorder(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        while self._undo:
            self._undo.pop()()
        return False

    # -- the results ---------------------------------------------------------------------------
    def total(self) -> int:
        return sum(launch.kernels for launch in self.launches)

    def by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for launch in self.launches:
            out[launch.kind] = out.get(launch.kind, 0) + launch.kernels
        return out

    def summary(self, layers_counted: int | None = None, layers_scaled: int | None = None) -> dict:
        """The count as a JSON-ready dict: `total`, `by_kind`, `by_part`, the kernels of each LM layer,
        the Triton launches and ATen operations by name; with `layers_scaled`, every LM layer's launches
        scaled from the `layers_counted` run to that many layers (the first as counted, each later one as
        the later ones counted)."""
        per_layer = Counter()
        for launch in self.launches:
            if launch.part == "lm_layer":
                per_layer[launch.layer] += launch.kernels
        counted = layers_counted or len(per_layer) or 1
        first = min((i for i in per_layer if i is not None), default=None)  # the detail shows one LM layer
        # The first LM layer may differ from the rest (no residual handed into its norm): it stands
        # for itself, the others for every later layer.
        target = layers_scaled or counted
        first_weight, later_weight = (target, target) if counted == 1 else (1, (target - 1) / (counted - 1))
        kinds, parts = dict.fromkeys(KINDS, 0.0), dict.fromkeys(PARTS, 0.0)
        for launch in self.launches:
            weight = 1 if launch.part != "lm_layer" else first_weight if launch.layer == first else later_weight
            w = launch.kernels * weight
            kinds[launch.kind] = kinds.get(launch.kind, 0.0) + w
            parts[launch.part] = parts.get(launch.part, 0.0) + w
        triton, aten, detail = Counter(), Counter(), {}
        for launch in self.launches:
            (triton if launch.source == "triton" else aten)[launch.name] += launch.kernels
            if launch.part != "lm_layer" or launch.layer == first:
                where = detail.setdefault(launch.part, Counter())
                where[f"{launch.kind}: {launch.name}"] += launch.kernels
        kinds = {k: round(v) for k, v in kinds.items()}
        return {
            "total": sum(kinds.values()),
            "by_kind": kinds,
            "by_part": {k: round(v) for k, v in parts.items()},
            "layers_counted": counted,
            "layers_scaled": layers_scaled or counted,
            "lm_layer_kernels": sorted(set(per_layer.values())),
            "unscaled_total": self.total(),
            "triton_launches": dict(triton.most_common()),
            "aten_kernels": dict(aten.most_common()),
            "host_syncs": len(self.syncs),
            "by_part_detail": {part: dict(sorted(c.items())) for part, c in detail.items()},
            "multipliers": {"aten": {**ATEN_KERNELS, "a view (output on an input's storage)": 0, "any other": 1},
                            "scaled_dot_product_attention": SDPA_KERNELS, "a Triton launch": 1},
        }
