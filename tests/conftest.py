"""Shared fixtures: tiny random MiniMax Music 3 models, built once per test session."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Without a CUDA device the fused kernels run under Triton's interpreter (tests/backends/gpu/test_kernels.py). It
# is chosen when Triton is first imported, so it is set here, before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Whether the DiT computes in bfloat16 on the CPU depends on the processor (mm3.backends.cpu.bf16); the
# parity tests compare float32 runs, so the suite pins it off and tests/backends/cpu/test_cpu_bf16.py turns it on.
os.environ["MM3_CPU_BF16"] = "off"

# The CPU product form of the AR stage (mm3.backends.cpu.choice: by rule, the native kernel where it builds)
# decides the fast numerics' rounding; the suite names one and keeps its cache out of the user's folder.
os.environ["MM3_CPU_PRODUCT"] = "int4"
os.environ["MM3_CACHE_DIR"] = tempfile.mkdtemp(prefix="mm3-test-cache-")
# The GPU decode tile, its inputs' rounding and the KV cache are the defaults' unless a test sets them.
for _switch in ("MM3_GPU_DECODE_ROWS", "MM3_GPU_INT8_INPUTS", "MM3_GPU_INT8_KV_CACHE"):
    os.environ.pop(_switch, None)
atexit.register(shutil.rmtree, os.environ["MM3_CACHE_DIR"], True)

SHARED = Path(__file__).resolve().parents[2] / "shared"
CORPUS = SHARED / "corpus" / "demo_prompts"


def _build(tmp_path_factory, vocab):
    from mm3.tools.tiny import build_tiny

    out = tmp_path_factory.mktemp(f"tiny_{vocab}")
    build_tiny(out, seed=0, vocab=vocab)
    return Tiny(out)


class Tiny:
    """Paths of a built tiny model: `diffusers` (reference layout), `gguf` (the folder of the five files)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.diffusers = self.root / "diffusers"
        self.gguf = self.root

    def file(self, arch: str) -> Path:
        from mm3.formats.gguf import read_architecture

        for p in sorted(self.gguf.glob("*.gguf")):
            if read_architecture(p) == arch:
                return p
        raise FileNotFoundError(f"no {arch} file in {self.gguf}")


@pytest.fixture(scope="module")
def one_thread():
    """One CPU thread for the module: the reference goldens are bit-exact at a fixed thread count."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Small-vocabulary tiny model (specials at 256..265, code offset 266); fast."""
    return _build(tmp_path_factory, "small")


@pytest.fixture(scope="session")
def tiny_foreign(tmp_path_factory):
    """Tiny model with the sizes other tools' layouts cannot record (ComfyUI's fixed 16 depth heads,
    64-wide DiT heads and 200000-row LM vocabulary); our five GGUFs in `gguf/`."""
    from mm3.tools.tiny import build_tiny
    from tests.helpers.foreign_layouts import FOREIGN_SIZES, FOREIGN_VOCAB

    out = tmp_path_factory.mktemp("tiny_foreign")
    build_tiny(out / "gguf", seed=1, lm_vocab_size=FOREIGN_VOCAB, sizes=FOREIGN_SIZES)
    t = Tiny(out / "gguf")
    t.diffusers = out / "gguf" / "diffusers"
    return t


@pytest.fixture(scope="session")
def tiny_real_ids(tmp_path_factory):
    """Tiny model whose special tokens sit at the released ids (vocab 151675 + codes)."""
    return _build(tmp_path_factory, "real")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """Tiny model carrying the real Qwen3 vocabulary and merges."""
    pytest.importorskip("tokenizers")
    return _build(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def corpus():
    """The demo prompt requests (caption, lyrics, duration), or a skip where the folder is absent."""
    import json

    if not CORPUS.is_dir():
        pytest.skip(f"demo prompt corpus not found at {CORPUS}")
    return {p.stem: json.loads(p.read_text()) for p in sorted(CORPUS.glob("*.json"))}


@pytest.fixture(scope="module")
def comfy():
    """A real ComfyUI (COMFYUI_PATH, its interpreter COMFYUI_PYTHON) on 127.0.0.1 with this pack in its
    custom_nodes and the tiny models in models/mm3, for one test module; `files` maps each
    architecture to its file name."""
    from tests.helpers.comfy_server import ComfyServer
    from tests.helpers.comfyui import COMFYUI_PATH

    if not COMFYUI_PATH:
        pytest.skip("COMFYUI_PATH is not set (a ComfyUI checkout to run)")
    server = ComfyServer(COMFYUI_PATH, os.environ.get("COMFYUI_PYTHON")).start()
    from mm3.formats.gguf import read_architecture

    server.files = {read_architecture(server.base / "models" / "mm3" / n): n for n in server.model_names}
    yield server
    server.stop()
