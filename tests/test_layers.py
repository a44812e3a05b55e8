"""The engine's modules stand in layers: each imports only its own layer or lower ones, and no
import (module-level or inside a function) closes a circle. The layer order, low to high:

base      the package root, errors, constants, the file cache, progress reports
formats   GGUF and safetensors reading and writing, quant types, the diffusers checkpoint's
          conventions, the published-set catalogue, file fingerprints, adapter (LoRA) files
numerics  matrix products, device and dtype choice, the GGUF layers and kernels, sampling, shaping
table     the component table: kinds, hyper-parameters, the compatibility and loadability checks
dialects  other tools' file layouts, mapped onto the engine's tensor names
opener    which components a file holds, opening it, the tokenizer read from the LM file
models    the five networks, adapters set on them and their health check
files     models folders, the model inventory, the loaded-model store
stages    prompt, lyric timestamps, codes, the CPU product choice, teacher forcing, the AR plan, flow
          matching, decoding, takes, captions, audio output, the numerics choice, the settings of the
          synthesis and the output
front     the request, the typed stage results, planning and synthesis overlapped, the pipeline, the codec
tools     the command line and its tools (align, convert, quantize, download, info, tiny, demo, playback)
bench     the benchmark
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mm3"

LAYERS = (
    ("base", ("mm3", "mm3.errors", "mm3.constants", "mm3.filecache", "mm3.progress", "mm3.cache_dir", "mm3.bounded")),
    ("formats", ("mm3.formats", "mm3.formats.gguf", "mm3.formats.gguf.errors", "mm3.formats.gguf.reader", "mm3.formats.gguf.writer",
                 "mm3.formats.gguf.quants", "mm3.formats.gguf.encode", "mm3.formats.fingerprint", "mm3.lora")),
    ("numerics", ("mm3.backends.cpu.matmul", "mm3.backends.cpu.bf16", "mm3.backends.device", "mm3.backends.gpu.kernels", "mm3.backends.gpu.triton_gguf",
                  "mm3.backends.cpu.int4", "mm3.backends.cpu.native", "mm3.backends.cpu.steps", "mm3.backends.cpu.forms", "mm3.backends.gpu.custom_ops", "mm3.backends.gpu.device_layout", "mm3.backends.gpu.kernel_choice", "mm3.backends.gpu.kernel_report", "mm3.backends.gpu.layout_kernels",
                  "mm3.backends.gpu.layout_triton", "mm3.backends.gpu.placement", "mm3.weights.layers", "mm3.backends.products", "mm3.weights.copies", "mm3.plan.sampling",
                  "mm3.plan.shaping")),
    ("table", ("mm3.components",)),
    ("dialects", ("mm3.dialects",)),
    ("opener", ("mm3.files.opener", "mm3.tokenizer")),
    ("models", ("mm3.models", "mm3.lora.attach", "mm3.lora.health")),
    ("files", ("mm3.files.registry", "mm3.files.inventory", "mm3.files.store")),
    ("stages", ("mm3.plan.prompt", "mm3.plan.lyrics_align", "mm3.plan.codes", "mm3.backends.cpu.choice", "mm3.backends.gpu.frame_graphs", "mm3.plan.replay", "mm3.plan.ar", "mm3.synth.flow",
                "mm3.synth.audio", "mm3.plan.takes", "mm3.song.captions",
                "mm3.synth.output", "mm3.song.numerics", "mm3.song.settings")),
    ("front", ("mm3.song.request", "mm3.song.stages", "mm3.song.overlap", "mm3.song.pipeline", "mm3.synth.codec")),
    ("tools", ("mm3.tools", "mm3.commands.main", "mm3.commands.jobs", "mm3.commands.align", "mm3.commands.playback", "mm3.commands.demo", "mm3.__main__")),
    ("bench", ("mm3.bench",)),
)


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("mm3",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, modules) -> set[str]:
    """The modules of mm3 that `name` imports anywhere in its source (`from X import y` names the
    module X.y when there is one, else X)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "mm3")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mm3":
                continue
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules}
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(target)
    found = {m for m in found if m in modules}
    found.discard(name)
    return found


def layer_of(name: str) -> int:
    """The layer of a module: the longest listed name it is or lies under (the package root
    itself only by its own name, so a new module must be placed)."""
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or (p != "mm3" and name.startswith(p + "."))) and len(p) > best:
                best, level = len(p), i
    return level


def graph():
    modules = module_names()
    return {name: imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    assert [m for m in sorted(graph()) if layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    bad = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
           for a, deps in sorted(graph().items()) for b in sorted(deps) if layer_of(b) > layer_of(a)]
    assert bad == []


def test_no_import_circle():
    g = graph()
    state, circles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                circles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_a_new_module_needs_a_layer():
    assert layer_of("mm3") == 0 and layer_of("mm3.unplaced") is None and layer_of("mm3.dialects.comfy") == 4


def test_the_walker_sees_function_level_imports():
    g = graph()
    assert "mm3.song.pipeline" in g["mm3.commands.jobs"]  # imported inside a function only
    assert "mm3.weights.layers" in g["mm3.models.lm"]  # `from ..gguf import ops as default_ops`
