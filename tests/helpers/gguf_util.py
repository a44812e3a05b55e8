"""Writing small GGUF files for tests: new ones with gguf-py (the format's reference writer), and
rewritten copies of the tiny model's files with one thing changed."""

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np

from mm3.formats.gguf.reader import GGUFFile
from mm3.formats.gguf.writer import Writer, copy_metadata


def add_kv(w, key, value):
    """One metadata pair on a gguf-py-style writer: bool, int -> u32, float -> f32, str, list."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def write_gguf(path, arch, kv=None, tensors=None):
    """`kv`: key -> value (see `add_kv`); `tensors`: name -> float32 array or (qtype, array)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (kv or {}).items():
        add_kv(w, key, value)
    for name, value in (tensors or {}).items():
        if isinstance(value, tuple):
            qtype, arr = value
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


COND_KV = {
    "mm3-cond.condition_hidden_dim": 16, "mm3-cond.num_condition_layers": 8, "mm3-cond.out_dim": 8,
    "mm3-cond.input_sampling_rate": 24000, "mm3-cond.input_hop_length": 960,
    "mm3-cond.output_sampling_rate": 44100, "mm3-cond.output_hop_length": 512,
}


def cond_tensors(rng):
    return {
        "layer_weight_logits": rng.standard_normal(8).astype(np.float32),
        "layer_scale": rng.standard_normal(1).astype(np.float32),
        "proj.weight": rng.standard_normal((8, 16, 3)).astype(np.float32),
        "proj.bias": rng.standard_normal(8).astype(np.float32),
    }


def rewrite(src, dst, *, kv=None, drop=(), tensors=None):
    """Copy GGUF `src` to `dst` (same metadata and raw tensor bytes, through our writer) with
    metadata `kv` overridden, tensors in `drop` left out and `tensors` added: name -> float32
    array, or (GGML type, raw uint8 rows)."""
    kv, tensors = dict(kv or {}), dict(tensors or {})
    with GGUFFile(src) as f:
        w = Writer(str(dst), f.architecture)
        copy_metadata(w, f, skip=set(kv))
        for key, value in kv.items():
            add_kv(w, key, value)
        for name, t in f.tensors.items():
            if name in drop or name in tensors:
                continue
            raw = t.raw.numpy().copy()
            w.add_tensor(name, raw.reshape(*t.shape[:-1], -1), raw_dtype=t.qtype)  # rows of raw bytes
        for name, value in tensors.items():
            if isinstance(value, tuple):
                w.add_tensor(name, value[1], raw_dtype=value[0])
            else:
                w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return Path(dst)


# The tiny model's files by component (`python -m mm3 tiny` names them MiniMax-Music3-tiny-<subfolder>-F32.gguf).
TINY_FILES = {"lm": "language_model", "depth": "rvq_depth_decoder", "cond": "condition_encoder",
              "dit": "transformer", "vae": "vocoder"}


def tiny_file(folder, kind) -> Path:
    (p,) = Path(folder).glob(f"MiniMax-Music3-tiny-{TINY_FILES[kind]}-*.gguf")
    return p


def models_with(tiny, folder, kind=None, make=None) -> Path:
    """A models folder holding the tiny model's five files, the `kind` one replaced by `make(src, dst)`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for p in sorted(Path(tiny.gguf).glob("*.gguf")):
        if kind is not None and p == tiny_file(tiny.gguf, kind):
            make(p, folder / p.name)
        else:
            shutil.copy(p, folder / p.name)
    return folder


def models_with_truncated_dit(tiny, folder) -> tuple[str, Path]:
    """A models folder with the tiny model's five files and, beside its DiT, the first half of that
    DiT under the published Q8_0 DiT's name: (the good DiT's name, the truncated file)."""
    folder = models_with(tiny, folder)
    good = tiny.file("mm3-dit").name
    bad = folder / "MiniMax-Music3-transformer-Q8_0.gguf"
    bad.write_bytes((folder / good).read_bytes()[:(folder / good).stat().st_size // 2])
    return good, bad


def published_size_copy(src, dst, size: float, qtype=gguf.GGMLQuantizationType.F32) -> Path:
    """A copy of GGUF `src` as large as a published file (`size` bytes, within one block): its
    tensors plus one more of type `qtype` whose data is a hole at the end of a sparse file (no
    disk written, nothing read: header reads, the inventory and "auto" see a released-size file)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    with GGUFFile(src) as f:
        w = Writer(str(dst), f.architecture)
        copy_metadata(w, f)
        raws = []
        for name, t in f.tensors.items():
            raw = t.raw.numpy().copy().reshape(*t.shape[:-1], -1)
            w.add_tensor_info(name, raw.shape, raw.dtype, raw.nbytes, raw_dtype=t.qtype)
            raws.append(raw)
        header = sum(r.nbytes for r in raws) + 4096  # about what the rest of the file takes
        blocks = max(1, int(size - header) // nbytes)
        w.add_tensor_info("padding", (blocks * nbytes,), np.dtype(np.uint8), blocks * nbytes, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for raw in raws:
            w.write_tensor_data(raw)
        w.fout[0].flush()
        end = w.fout[0].tell()
        w.close()
    with open(dst, "r+b") as out:
        out.truncate(end + blocks * nbytes)
    return Path(dst)


# -- hostile files, byte by byte ------------------------------------------------------------------
def gguf_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def nested_array_gguf(depth: int, arch: str = "mm3-dit") -> bytes:
    """A GGUF header (no tensors) whose first metadata value nests arrays `depth` deep (each holding
    one array, the innermost an empty uint8 array), then `general.architecture`."""
    array, uint8, string = (int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.UINT8),
                            int(gguf.GGUFValueType.STRING))
    kv = gguf_string("junk.nested") + struct.pack("<I", array)
    kv += struct.pack("<IQ", array, 1) * (depth - 1) + struct.pack("<IQ", uint8, 0)
    kv += gguf_string("general.architecture") + struct.pack("<I", string) + gguf_string(arch)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv


def tensor_table(data: bytes) -> list[tuple[str, int, int]]:
    """Each tensor of GGUF bytes `data` as (name, position of its type id, position of its offset):
    where to patch a tensor table. Walks the metadata with the format's own value sizes."""
    pos = 8
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16

    def skip_string(p):
        return p + 8 + struct.unpack_from("<Q", data, p)[0]

    def skip_value(p, vtype):
        if vtype == gguf.GGUFValueType.STRING:
            return skip_string(p)
        if vtype == gguf.GGUFValueType.ARRAY:
            etype, count = struct.unpack_from("<IQ", data, p)
            p += 12
            for _ in range(count):
                p = skip_value(p, etype)
            return p
        return p + {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}[vtype]

    for _ in range(n_kv):
        pos = skip_string(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos = skip_value(pos + 4, vtype)
    out = []
    for _ in range(n_tensors):
        n = struct.unpack_from("<Q", data, pos)[0]
        name = data[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * n_dims
        out.append((name, pos, pos + 4))
        pos += 12
    return out


def write_safetensors(path, header, data: bytes = b"") -> Path:
    """A safetensors file from a header (any JSON value, or raw bytes) and data bytes, unchecked."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return Path(path)
