"""The engine's modules stand in layers: each imports only its own layer or lower ones, and no
import (module-level or inside a function) closes a circle. The layer order, low to high:

base      the package root, errors, constants, the environment switches, the file cache, the cache
          folder, progress reports
formats   GGUF and safetensors reading and writing, quant types, the diffusers checkpoint's
          conventions, the published-set catalogue, file fingerprints, adapter (LoRA) files
weights   the layers whose weights stay compressed, and how they reach a back end (the binder)
backends  the back ends that multiply them: the rule table, the seam of whole steps, the CPU and
          GPU families, the device choice
table     the component table: kinds, hyper-parameters, the compatibility and loadability checks
dialects  other tools' file layouts, mapped onto the engine's tensor names
opener    which components a file holds, opening it, the tokenizer read from the LM file
models    the five networks, adapters set on them and their health check
files     models folders, the model inventory, the loaded-model store
plan      the AR stage: prompt, codes, draws, teacher forcing, the plan, takes, lyric timestamps
synth     the synthesis stage: flow matching, decoding and stitching, audio files, the codec
song      the song job: captions, the settings objects, the request, the stage results, the pipeline
tools     the command line and its tools (align, convert, quantize, download, info, tiny, demo, playback)
bench     the benchmark
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mm3"

LAYERS = (
    ("base", ("mm3", "mm3.errors", "mm3.constants", "mm3.filecache", "mm3.progress", "mm3.cache_dir", "mm3.switches",
              "mm3.filewatch", "mm3.fault_guard", "mm3.compiler", "mm3.tethered", "mm3.bounded")),
    ("formats", ("mm3.formats", "mm3.lora")),
    ("weights", ("mm3.weights",)),
    ("backends", ("mm3.backends",)),
    ("table", ("mm3.components",)),
    ("dialects", ("mm3.dialects",)),
    ("opener", ("mm3.files.opener", "mm3.tokenizer")),
    ("models", ("mm3.models", "mm3.lora.attach", "mm3.lora.health")),
    ("files", ("mm3.files",)),
    ("plan", ("mm3.plan",)),
    ("synth", ("mm3.synth",)),
    ("song", ("mm3.song",)),
    ("tools", ("mm3.tools", "mm3.commands", "mm3.__main__")),
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
    assert layer_of("mm3") == 0 and layer_of("mm3.unplaced") is None and layer_of("mm3.dialects.comfy") == 5


def test_the_walker_sees_function_level_imports():
    g = graph()
    assert "mm3.song.pipeline" in g["mm3.commands.jobs"]  # imported inside a function only
    assert "mm3.weights.layers" in g["mm3.models.lm"]  # `from ..weights import layers as default_ops`
