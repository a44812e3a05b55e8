"""Property-based fuzz of every reader of outside data: GGUF headers and tensor tables, safetensors
headers (and the adapter files read from them), request JSON and the cache record of the CPU product
choice. Whatever bytes a file holds, a reader gives a valid object or the engine's own error (never
another exception), within bounded time and memory (`bounded`: the allocation peak that
tracemalloc sees and the wall time of one example).

Inputs come three ways: raw random bytes; structured values of the format (metadata, nested arrays,
tensor tables, JSON objects with the request's field names) with hostile numbers, types and depths;
and a valid file with random bytes changed or cut short. Hypothesis derandomized, so each run checks
the same examples; `MM3_FUZZ_EXAMPLES` (default 300 per reader) fuzzes longer.
"""

import itertools
import json
import os
import struct
import time
import tracemalloc
from contextlib import contextmanager

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mm3.cache_dir import record_path, recorded
from mm3.errors import InputError
from mm3.formats.safetensors_raw import file_entries
from mm3.formats.gguf import GGUFFile, GGUFFormatError, read_architecture
from mm3.lora.adapter import AdapterError, read_adapter
from mm3.song.request import MM3Request
from tests.helpers.gguf_util import gguf_string, write_gguf, write_safetensors

EXAMPLES = int(os.environ.get("MM3_FUZZ_EXAMPLES", "300"))
SECONDS = 2.0  # one example: a few ms for any input a bounded reader takes
MEGABYTES = 64
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_NAMES = itertools.count()


@contextmanager
def bounded():
    """The block must end within SECONDS and allocate at most MEGABYTES at its peak."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert took < SECONDS, f"{took:.2f} s"
        assert peak < MEGABYTES * 2**20, f"{peak / 2**20:.0f} MiB"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _file(folder, suffix: str, data: bytes):
    path = folder / f"{next(_NAMES)}{suffix}"  # a new name each time: no cached header is reused
    path.write_bytes(data)
    return path


# -- JSON values with hostile numbers, nesting and types ---------------------------------------------
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=20)


def _deep(depth: int, opener: str = "[") -> str:
    closer = {"[": "]", "{": "}"}[opener]
    inner = '"a": ' if opener == "{" else ""
    return (opener + inner) * depth + "1" + closer * depth


HOSTILE_TEXT = st.one_of(
    st.binary(max_size=300),
    st.builds(_deep, st.integers(1, 20000), st.sampled_from("[{")),
    st.builds(lambda n: "9" * n, st.integers(1, 6000)),
)


# -- GGUF -------------------------------------------------------------------------------------------------
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}


def _scalar(vtype: int, n: int) -> bytes:
    """A well-formed value of type id `vtype` (a string, a scalar), else `n` zero bytes."""
    if vtype == gguf.GGUFValueType.STRING:
        return gguf_string("x" * n)
    return struct.pack(_SCALAR_FORMATS[vtype], 0) if vtype in _SCALAR_FORMATS else bytes(n)


def _nested(depth: int, etype: int, count: int) -> bytes:
    """Arrays nested `depth` deep, the innermost holding `count` values of type id `etype`."""
    array = int(gguf.GGUFValueType.ARRAY)
    return struct.pack("<IQ", array, 1) * depth + struct.pack("<IQ", etype, count) + _scalar(etype, 1) * count


VALUE_TYPES = st.one_of(st.sampled_from([int(t) for t in gguf.GGUFValueType]), st.integers(0, 2**32 - 1))
METADATA = st.lists(st.one_of(  # (key, type id, the value's bytes)
    st.tuples(st.text(max_size=12), VALUE_TYPES, st.binary(max_size=16)),
    st.tuples(st.text(max_size=12), VALUE_TYPES, st.builds(_scalar, VALUE_TYPES, st.integers(0, 4))),
    st.tuples(st.text(max_size=12), st.just(int(gguf.GGUFValueType.ARRAY)),
              st.builds(_nested, st.integers(0, 3000), VALUE_TYPES, st.integers(0, 3))),
    st.tuples(st.just("general.architecture"), st.just(int(gguf.GGUFValueType.STRING)), st.just(gguf_string("mm3-dit"))),
), max_size=4)
DIMS = st.lists(st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)), max_size=10)
TENSORS = st.lists(st.tuples(st.text(max_size=8), DIMS, st.one_of(st.sampled_from([0, 1, 8, 30]),
                                                                  st.integers(0, 2**32 - 1)),
                             st.one_of(st.sampled_from([0, 32, 64, 256]), st.integers(0, 2**64 - 1))), max_size=4)


def _gguf_bytes(metadata, tensors, version: int, data: bytes) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, vtype, value in metadata:
        out += gguf_string(key) + struct.pack("<I", vtype) + value
    for name, dims, qtype, offset in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", qtype, offset)
    return out + bytes(-len(out) % 32) + data


def _read_gguf(path):
    with bounded():
        for header_only in (True, False):
            try:
                with GGUFFile(path, header_only=header_only) as f:
                    for t in f.tensors.values():
                        assert t.nbytes >= 0
            except GGUFFormatError as e:
                assert str(e)
        try:
            read_architecture(path)
        except GGUFFormatError as e:
            assert str(e)


@FUZZ
@given(metadata=METADATA, tensors=TENSORS, version=st.sampled_from([2, 3, 3, 4]), data=st.binary(max_size=512))
def test_gguf_structured(folder, metadata, tensors, version, data):
    _read_gguf(_file(folder, ".gguf", _gguf_bytes(metadata, tensors, version, data)))


@pytest.fixture(scope="module")
def valid_gguf(folder):
    """A small valid GGUF: scalars, strings, arrays and string arrays, F32, F16 and Q8_0 tensors."""
    rng = np.random.default_rng(0)
    path = write_gguf(folder / "valid.gguf", "mm3-dit", kv={"a.count": 3, "a.name": "x", "a.list": [1, 2, 3],
                                                           "a.words": ["p", "q"], "a.ratio": 0.5, "a.flag": True},
                      tensors={"w": rng.standard_normal((4, 32)).astype(np.float32),
                               "h": rng.standard_normal((2, 32)).astype(np.float16),
                               "q": (gguf.GGMLQuantizationType.Q8_0, rng.standard_normal((2, 64)))})
    data = path.read_bytes()
    with GGUFFile(path) as f:
        return data, f.data_offset


@FUZZ
@given(changes=st.lists(st.tuples(st.integers(4, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.one_of(st.none(), st.integers(0, 10**6)))
def test_gguf_mutated(folder, valid_gguf, changes, cut):
    data, header_end = valid_gguf
    b = bytearray(data)
    for at, byte in changes:
        b[at % header_end] = byte  # inside the header and the tensor table
    _read_gguf(_file(folder, ".gguf", bytes(b[:cut % (len(b) + 1)] if cut is not None else b)))


@FUZZ
@given(tail=st.binary(max_size=400), version=st.sampled_from([2, 3]))
def test_gguf_raw_bytes(folder, tail, version):
    _read_gguf(_file(folder, ".gguf", b"GGUF" + struct.pack("<I", version) + tail))


# -- safetensors headers and the adapters read from them ------------------------------------------------------
DTYPES = st.one_of(st.sampled_from(["F32", "F16", "BF16", "I32", "F8_E4M3", "U8", "F4", ""]), JSON)
SHAPES = st.one_of(st.lists(st.one_of(st.integers(0, 64), st.integers(-2, 2**65)), max_size=3), JSON)
ENTRY = st.one_of(st.fixed_dictionaries({"dtype": DTYPES, "shape": SHAPES, "data_offsets": st.one_of(
    st.lists(st.integers(0, 600), min_size=2, max_size=2), JSON)}), JSON)
NAMES = st.one_of(st.sampled_from([f"transformer.proj_in.lora_{x}.weight" for x in "AB"] + [
    "transformer.proj_in.alpha", "__metadata__"]), st.text(max_size=10))
HEADERS = st.one_of(st.dictionaries(NAMES, ENTRY, max_size=4), JSON)


def _read_safetensors(path):
    with bounded():
        try:
            file_entries(path)
        except ValueError as e:
            assert str(e)
        try:
            read_adapter(path)
        except AdapterError as e:
            assert str(e)


@FUZZ
@given(header=HEADERS, data=st.binary(max_size=600))
def test_safetensors_structured(folder, header, data):
    try:
        raw = json.dumps(header).encode()
    except ValueError:
        raw = b"{}"
    _read_safetensors(_file(folder, ".safetensors", struct.pack("<Q", len(raw)) + raw + data))


@FUZZ
@given(header=HOSTILE_TEXT, data=st.binary(max_size=64), length=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_safetensors_raw_bytes(folder, header, data, length):
    raw = header.encode() if isinstance(header, str) else header
    path = write_safetensors(folder / f"{next(_NAMES)}.safetensors", raw, data)
    if length is not None:
        b = bytearray(path.read_bytes())
        struct.pack_into("<Q", b, 0, length)
        path.write_bytes(bytes(b))
    _read_safetensors(path)


# -- request JSON ------------------------------------------------------------------------------------------------
FIELDS = ["caption", "lyrics", "duration", "steps", "seed", "lm_seed", "lm_cfg", "lm_top_k", "lm_batch_size",
          "synth_batch_size", "dit_cfg", "peak_clip", "output_format", "mp3_bitrate", "audio_codes", "rng",
          "model_fingerprints", "lm_temperature", "lm_top_p", "lm_penalty", "lm_penalty_window", "takes",
          "ending_rounds", "dit_shift", "continue_codes", "repaint_start", "repaint_end", "repaint_fade",
          "source_codes", "lrc_heads", "lrc_lead", "loras"]
REQUESTS = st.dictionaries(st.sampled_from(FIELDS), st.one_of(JSON, st.just("a"), st.integers(-3, 300)), max_size=8)


def _read_request(text):
    with bounded():
        try:
            MM3Request.from_json(text).validate()
        except InputError as e:
            assert str(e)


@FUZZ
@given(fields=REQUESTS)
def test_request_structured(fields):
    _read_request(json.dumps({"caption": "a", "lyrics": "b", **fields}))


@FUZZ
@given(text=HOSTILE_TEXT)
def test_request_raw(text):
    _read_request(text)


# -- the cache record ------------------------------------------------------------------------------------------------
@settings(FUZZ, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(record=st.one_of(HOSTILE_TEXT, st.builds(lambda sections: json.dumps({"version": 1, "sections": sections}),
                                                st.dictionaries(st.sampled_from(["k", "x"]), JSON, max_size=2))))
def test_cache_record(folder, monkeypatch, record):
    monkeypatch.setenv("MM3_CACHE_DIR", str(folder / "cache"))  # the same for every example
    path = record_path()
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(record.encode() if isinstance(record, str) else record)
    with bounded():
        section = recorded("k")  # a damaged record: {} (warned), measured again
    assert isinstance(section, dict)
