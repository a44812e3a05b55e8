"""The GGUF reader against gguf-py's reader, and its errors on bad files."""

import os

import gguf
import numpy as np
import pytest
import torch

from tests.helpers.gguf_util import COND_KV, cond_tensors, write_gguf
from mm3.components import check_compatible
from mm3.files.opener import open_component
from mm3.formats.gguf import ComponentError, GGUFFile, GGUFFormatError, read_architecture
from mm3.files.registry import Registry

Q = gguf.GGMLQuantizationType


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def mixed_file(tmp_path, rng):
    kv = {"mm3-dit.in_channels": 16, "tokenizer.ggml.tokens": ["a", "é", "<|x|>", ""] * 50,
          "mm3-vae.upsampling_ratios": [8, 8, 4, 2], "general.file_type": "Q8_0", "some.float": 1.5}
    tensors = {
        "a.weight": rng.standard_normal((3, 64)).astype(np.float32),
        "b.weight": (Q.Q8_0, rng.standard_normal((4, 64))),
        "c.weight": rng.standard_normal((2, 3, 5)).astype(np.float16),
        "d.bias": rng.standard_normal(7).astype(np.float32),
    }
    return write_gguf(tmp_path / "mixed.gguf", "mm3-dit", kv, tensors)


def test_metadata_and_tensors_match_gguf_py(mixed_file):
    ours = GGUFFile(mixed_file)
    ref = gguf.GGUFReader(str(mixed_file))
    assert ours.architecture == "mm3-dit"
    assert ours.metadata["mm3-dit.in_channels"] == 16
    assert ours.metadata["mm3-vae.upsampling_ratios"] == [8, 8, 4, 2]
    assert ours.metadata["general.file_type"] == "Q8_0"
    assert ours.metadata["some.float"] == 1.5
    field = ref.fields["tokenizer.ggml.tokens"]
    ref_tokens = [bytes(field.parts[i]).decode() for i in field.data]
    assert ours.strings("tokenizer.ggml.tokens") == ref_tokens
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for rt in ref.tensors:
        t = ours.tensors[rt.name]
        assert t.qtype == rt.tensor_type
        assert t.shape == tuple(int(x) for x in reversed(rt.shape))  # torch order
        assert np.array_equal(t.raw.numpy(), np.asarray(rt.data).reshape(-1).view(np.uint8))


def test_tensors_are_views_of_the_mapping(mixed_file):
    f = GGUFFile(mixed_file)
    t = f.tensors["a.weight"]
    assert t.raw.untyped_storage().nbytes() == os.path.getsize(mixed_file)  # no copy of the data
    w = t.raw.view(torch.float32).view(t.shape)
    assert w.shape == (3, 64)


def test_read_architecture_header_only(mixed_file):
    assert read_architecture(mixed_file) == "mm3-dit"


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFFormatError, match=r"x\.gguf: not a GGUF file \(magic b'PK"):
        GGUFFile(p)
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        read_architecture(p)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="too short"):
        GGUFFile(tmp_path / "empty.gguf")


def test_truncated_header(tmp_path, mixed_file):
    data = mixed_file.read_bytes()
    for cut in (30, 100, 600):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError, match=rf"cut{cut}\.gguf: truncated"):
            GGUFFile(p)


def test_truncated_tensor_data(tmp_path, mixed_file):
    data = mixed_file.read_bytes()
    p = tmp_path / "short.gguf"
    p.write_bytes(data[:-10])
    with pytest.raises(GGUFFormatError, match=r"short\.gguf: truncated: tensor d\.bias"):
        GGUFFile(p)


def test_unknown_quant_type(tmp_path, mixed_file):
    data = bytearray(mixed_file.read_bytes())
    f = GGUFFile(mixed_file)
    # Overwrite the type id of the last tensor info (4 bytes before its u64 offset) with 99.
    end = f.data_offset
    f.close()
    raw = bytes(data)
    name = b"d.bias"
    pos = raw.rindex(name, 0, end) + len(name) + 4 + 8  # n_dims u32, one dim u64
    data[pos:pos + 4] = (99).to_bytes(4, "little")
    p = tmp_path / "badtype.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match=r"tensor d\.bias has unknown GGML type 99"):
        GGUFFile(p)


def test_component_classification_and_hparams(tmp_path, rng):
    p = write_gguf(tmp_path / "cond.gguf", "mm3-cond", COND_KV, cond_tensors(rng))
    c = open_component(p)
    assert c.kind == "cond"
    assert c.hparams["out_dim"] == 8 and c.hparams["output_hop_length"] == 512
    assert c.quant_counts() == {"F32": 4}
    with pytest.raises(ComponentError, match=r"cond\.gguf is mm3-cond, expected mm3-dit"):
        open_component(p, expect="dit")


def test_unknown_architecture_and_missing_hparam(tmp_path, rng):
    p = write_gguf(tmp_path / "llama.gguf", "llama", {}, {"w": rng.standard_normal(4).astype(np.float32)})
    with pytest.raises(ComponentError, match=r"llama\.gguf: unknown architecture 'llama'"):
        open_component(p)
    kv = dict(COND_KV)
    del kv["mm3-cond.out_dim"]
    p = write_gguf(tmp_path / "c2.gguf", "mm3-cond", kv, cond_tensors(rng))
    with pytest.raises(ComponentError, match=r"c2\.gguf: missing metadata mm3-cond\.out_dim"):
        open_component(p)


def test_lm_config_json(tmp_path, rng):
    cfg = ('{"vocab_size": 330, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,'
           ' "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,'
           ' "max_position_embeddings": 128, "rope_parameters": {"rope_theta": 1000000.0}}')
    p = write_gguf(tmp_path / "lm.gguf", "mm3-lm", {"mm3.config_json": cfg}, {})
    c = open_component(p)
    assert c.hparams["rope_theta"] == 1e6 and c.hparams["tie_word_embeddings"] is False
    p = write_gguf(tmp_path / "lm2.gguf", "mm3-lm", {"mm3.config_json": "{not json"}, {})
    with pytest.raises(ComponentError, match=r"lm2\.gguf: mm3\.config_json is not valid JSON"):
        open_component(p)


def test_compatibility_check(tmp_path, rng):
    cond = open_component(write_gguf(tmp_path / "cond.gguf", "mm3-cond", COND_KV, cond_tensors(rng)))
    dit_kv = {f"mm3-dit.{k}": v for k, v in dict(
        in_channels=16, condition_dim=12, num_layers=1, num_attention_heads=1, attention_head_dim=8,
        ff_inner_dim=8, rotary_dim=4, fourier_embedding_dim=8).items()}
    dit = open_component(write_gguf(tmp_path / "dit.gguf", "mm3-dit", dit_kv, {}))
    with pytest.raises(ComponentError, match=r"condition encoder and DiT do not fit together: "
                                             r"cond\.gguf has out_dim 8, dit\.gguf has condition_dim 12"):
        check_compatible({"cond": cond, "dit": dit})


def test_registry_buckets_sorting_and_foreign(tmp_path, rng):
    m = tmp_path / "models"
    (m / "sub").mkdir(parents=True)
    write_gguf(m / "MiniMax-Music3-condition_encoder-Q8_0.gguf", "mm3-cond", COND_KV, cond_tensors(rng))
    write_gguf(m / "MiniMax-Music3-condition_encoder-F32.gguf", "mm3-cond", COND_KV, cond_tensors(rng))
    write_gguf(m / "sub" / "other.gguf", "mm3-cond", COND_KV, cond_tensors(rng))
    write_gguf(m / "flux.gguf", "flux", {}, {})
    (m / "broken.gguf").write_bytes(b"nope" * 10)
    (m / "notes.txt").write_text("ignored: not a .gguf")
    reg = Registry.scan(m)
    assert reg.buckets["cond"] == ["MiniMax-Music3-condition_encoder-F32.gguf",
                                   "MiniMax-Music3-condition_encoder-Q8_0.gguf", "sub/other.gguf"]
    assert reg.buckets["lm"] == []
    foreign = dict(reg.foreign)
    assert foreign["flux.gguf"] == "architecture 'flux'"
    assert "not a GGUF" in foreign["broken.gguf"]
    assert reg.resolve("cond").endswith("condition_encoder-F32.gguf")
    assert reg.resolve("cond", "other.gguf").endswith(os.path.join("sub", "other.gguf"))
    with pytest.raises(ComponentError, match=r"unknown mm3-cond model 'x\.gguf' .*available: MiniMax"):
        reg.resolve("cond", "x.gguf")
    with pytest.raises(ComponentError, match=r"no mm3-lm \(language model \(Qwen3\)\) file in"):
        reg.resolve("lm")
    assert "skipped    flux.gguf" in reg.report()
