"""The quantize tool: published mixes, metadata carried over with its types, clear refusals."""

import gguf
import numpy as np
import pytest

from tests.helpers.gguf_util import COND_KV, cond_tensors, write_gguf
from mm3.commands.main import main as cli_main
from mm3.formats.gguf import ComponentError, GGUFFile
from mm3.tools.quantize import quantize_file

Q = gguf.GGMLQuantizationType
LM_CONFIG = ('{"vocab_size": 48, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,'
             ' "num_key_value_heads": 1, "head_dim": 128, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,'
             ' "max_position_embeddings": 64, "rope_theta": 1000000.0}')


@pytest.fixture
def lm_file(tmp_path):
    rng = np.random.default_rng(3)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    tensors = {
        "model.embed_tokens.weight": f32(48, 256),
        "lm_head.weight": f32(48, 256),
        "model.norm.weight": f32(256),
        "model.layers.0.input_layernorm.weight": f32(256),
        "model.layers.0.self_attn.q_proj.weight": f32(256, 256),
        "model.layers.0.self_attn.v_proj.weight": f32(128, 256),
        "model.layers.0.mlp.up_proj.weight": f32(512, 256),
        "model.layers.0.mlp.down_proj.weight": f32(256, 512),
    }
    kv = {"mm3.config_json": LM_CONFIG, "tokenizer.ggml.model": "gpt2",
          "tokenizer.ggml.tokens": [f"t{i}" for i in range(40)] + ["é", "日本"] * 4,
          "tokenizer.ggml.merges": ["t 1", "t 2"]}
    return write_gguf(tmp_path / "lm-F32.gguf", "mm3-lm", kv, tensors)


def _relative_error(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def test_q5_k_m_mix_and_metadata(tmp_path, lm_file):
    out = quantize_file(lm_file, tmp_path / "lm-Q5_K_M.gguf", "Q5_K_M")
    src, dst = GGUFFile(lm_file), GGUFFile(out)
    types = {n: t.qtype for n, t in dst.tensors.items()}
    assert types == {
        "model.embed_tokens.weight": Q.Q6_K, "lm_head.weight": Q.Q5_K, "model.norm.weight": Q.F32,
        "model.layers.0.input_layernorm.weight": Q.F32, "model.layers.0.self_attn.q_proj.weight": Q.Q5_K,
        "model.layers.0.self_attn.v_proj.weight": Q.Q6_K, "model.layers.0.mlp.up_proj.weight": Q.Q5_K,
        "model.layers.0.mlp.down_proj.weight": Q.Q6_K,
    }
    assert dst.metadata["general.file_type"] == "Q5_K_M"
    assert dst.metadata["general.quantization_version"] == 2
    assert dst.metadata["mm3.config_json"] == src.metadata["mm3.config_json"]
    assert dst.strings("tokenizer.ggml.tokens") == src.strings("tokenizer.ggml.tokens")
    assert dst.strings("tokenizer.ggml.merges") == ["t 1", "t 2"]
    # The values, dequantized by gguf-py, stay close to the source.
    ref = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    for name, t in src.tensors.items():
        values = gguf.quants.dequantize(np.asarray(ref[name].data), ref[name].tensor_type).reshape(t.shape)
        err = _relative_error(values, t.dequantize().numpy())
        assert err <= (0.0 if types[name] == Q.F32 else 0.08), (name, err)


def test_q8_0_dit_keeps_partial_rows_f32(tmp_path):
    rng = np.random.default_rng(4)
    kv = {f"mm3-dit.{k}": 1 for k in ("in_channels", "condition_dim", "num_layers", "num_attention_heads",
                                      "attention_head_dim", "ff_inner_dim", "rotary_dim", "fourier_embedding_dim")}
    kv["mm3-vae.upsampling_ratios"] = [8, 8, 4, 2]  # an int32 array must stay int32
    src = write_gguf(tmp_path / "dit.gguf", "mm3-dit", kv, {
        "time_proj.weight": rng.standard_normal((16, 1)).astype(np.float32),
        "preprocess_conv.weight": rng.standard_normal((48, 48, 1)).astype(np.float32),
        "proj_in.weight": rng.standard_normal((32, 64)).astype(np.float32),
    })
    out = quantize_file(src, tmp_path / "dit-Q8_0.gguf", "Q8_0")
    f = GGUFFile(out)
    assert {n: t.qtype for n, t in f.tensors.items()} == {
        "time_proj.weight": Q.F32, "preprocess_conv.weight": Q.F32, "proj_in.weight": Q.Q8_0}
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["mm3-vae.upsampling_ratios"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert fields["mm3-dit.in_channels"].types == [gguf.GGUFValueType.UINT32]


def test_refusals(tmp_path, lm_file):
    cond = write_gguf(tmp_path / "cond.gguf", "mm3-cond", COND_KV, cond_tensors(np.random.default_rng(0)))
    with pytest.raises(ComponentError, match=r"condition encoder \(mm3-cond\) is never quantized"):
        quantize_file(cond, tmp_path / "c.gguf", "Q8_0")
    q8 = quantize_file(lm_file, tmp_path / "q8.gguf", "Q8_0")
    with pytest.raises(ComponentError, match=r"q8\.gguf is already quantized \(Q8_0\)"):
        quantize_file(q8, tmp_path / "again.gguf", "Q4_K_M")
    with pytest.raises(FileExistsError, match="already exists"):
        quantize_file(lm_file, q8, "Q8_0")
    with pytest.raises(ValueError, match=r"unknown quant type 'Q3_X'"):
        quantize_file(lm_file, tmp_path / "x.gguf", "Q3_X")
    assert not list(tmp_path.glob("*.part"))


def test_cli_quantize_and_info(tmp_path, lm_file, capsys):
    out = tmp_path / "lm-Q8_0.gguf"
    assert cli_main(["quantize", str(lm_file), str(out), "--type", "Q8_0"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["info", str(out), "--json"]) == 0
    import json

    info = json.loads(capsys.readouterr().out)[0]
    assert info["architecture"] == "mm3-lm" and info["file_type"] == "Q8_0"
    assert info["quant_types"] == {"F32": 2, "Q8_0": 6}
    assert cli_main(["quantize", str(lm_file), str(out), "--type", "Q8_0"]) == 2  # exists: clear error, no traceback


def test_tiny_lm_without_merges_quantizes(tiny, tmp_path):
    """The byte-level tiny LM has no merges (its file has no merges key, as the port writes it);
    the copy has none either and its tokenizer still loads, encoding as the source's does."""
    from mm3.tokenizer import MM3Tokenizer

    src = tiny.file("mm3-lm")
    out = quantize_file(src, tmp_path / "lm-Q8_0.gguf", "Q8_0")
    a, b = GGUFFile(src), GGUFFile(out)
    assert "tokenizer.ggml.merges" not in a.metadata and "tokenizer.ggml.merges" not in b.metadata
    text = "dark synth, 120 bpm [verse] hello"
    assert MM3Tokenizer.from_gguf(out).encode(text) == MM3Tokenizer.from_gguf(src).encode(text)
    assert b.strings("tokenizer.ggml.tokens") == a.strings("tokenizer.ggml.tokens")
    assert b.tensors["lm_head.weight"].qtype == Q.Q8_0


def test_empty_merges_array_survives_the_copy(tmp_path):
    """A file from an earlier convert (empty merges array written) keeps its empty typed array."""
    from mm3.formats.gguf.writer import Writer

    path = tmp_path / "lm.gguf"
    w = Writer(str(path), "mm3-lm")
    w.add_key_value("tokenizer.ggml.merges", [], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    w.add_tensor("lm_head.weight", np.ones((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = GGUFFile(quantize_file(path, tmp_path / "q.gguf", "Q8_0"))
    assert out.strings("tokenizer.ggml.merges") == []
    assert out.value_types["tokenizer.ggml.merges"] == (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)


# ------------------------------------------------------------------------------------------------
# The port's rules (minimaxmusic.cpp tools/quantize.cpp), from its documented behaviour.


def _bf16(a):
    return (Q.BF16, a.astype(np.float32))


def test_partial_block_rows_keep_the_source_type(tmp_path):
    """Rows that are not whole blocks of the target are copied in their source type (BF16 stays
    BF16, byte for byte); vectors are promoted to F32; a [1, N] tensor counts as a vector (ggml's
    n_dims) and is written with one dimension."""
    rng = np.random.default_rng(7)
    src = write_gguf(tmp_path / "lm-BF16.gguf", "mm3-lm", {"mm3.config_json": LM_CONFIG}, {
        "model.norm.weight": _bf16(rng.standard_normal(96)),
        "model.layers.0.self_attn.q_proj.weight": _bf16(rng.standard_normal((8, 96))),  # 96: not 256
        "model.layers.0.self_attn.v_proj.weight": _bf16(rng.standard_normal((4, 128))),  # raised, 128
        "model.layers.0.mlp.up_proj.weight": _bf16(rng.standard_normal((4, 256))),
        "row.weight": _bf16(rng.standard_normal((1, 256))),
    })
    source = GGUFFile(src)
    for mix, want in {
        "Q4_K_M": {"model.norm.weight": Q.F32, "model.layers.0.self_attn.q_proj.weight": Q.BF16,
                   "model.layers.0.self_attn.v_proj.weight": Q.BF16, "model.layers.0.mlp.up_proj.weight": Q.Q4_K,
                   "row.weight": Q.F32},
        "Q8_0": {"model.norm.weight": Q.F32, "model.layers.0.self_attn.q_proj.weight": Q.Q8_0,
                 "model.layers.0.self_attn.v_proj.weight": Q.Q8_0, "model.layers.0.mlp.up_proj.weight": Q.Q8_0,
                 "row.weight": Q.F32},
    }.items():
        out = GGUFFile(quantize_file(src, tmp_path / f"lm-{mix}.gguf", mix))
        assert {n: t.qtype for n, t in out.tensors.items()} == want, mix
        for name, qtype in want.items():
            if qtype == Q.BF16:
                assert bytes(out.tensors[name].raw.numpy()) == bytes(source.tensors[name].raw.numpy()), name
            if qtype == Q.F32:
                assert np.array_equal(out.tensors[name].dequantize().numpy().reshape(-1),
                                      source.tensors[name].dequantize().numpy().reshape(-1)), name
        assert out.tensors["row.weight"].shape == (256,)
        assert out.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (8, 96)


def test_m_mixes_raise_the_depth_decoders_down_proj(tmp_path):
    """The port's rule matches any name containing `down_proj.weight` / `v_proj.weight` with a
    `layers.N` index, so the depth decoder's down_proj is raised too (its to_v is not a v_proj)."""
    rng = np.random.default_rng(8)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    src = write_gguf(tmp_path / "depth.gguf", "mm3-depth", {"mm3-depth.num_layers": 1}, {
        "audio_embeddings.weight": f32(8, 256),
        "layers.0.attn.to_v.weight": f32(256, 256),
        "layers.0.gate_proj.weight": f32(512, 256),
        "layers.0.down_proj.weight": f32(256, 512),
        "layers.0.input_layernorm.weight": f32(256),
    })
    base = {"audio_embeddings.weight", "layers.0.attn.to_v.weight", "layers.0.gate_proj.weight"}
    for mix, (btype, down) in {"Q4_K_M": (Q.Q4_K, Q.Q6_K), "Q5_K_M": (Q.Q5_K, Q.Q6_K),
                               "Q6_K": (Q.Q6_K, Q.Q6_K), "Q8_0": (Q.Q8_0, Q.Q8_0)}.items():
        types = {n: t.qtype for n, t in GGUFFile(quantize_file(src, tmp_path / f"d-{mix}.gguf", mix)).tensors.items()}
        assert types == {**{n: btype for n in base}, "layers.0.down_proj.weight": down,
                         "layers.0.input_layernorm.weight": Q.F32}, mix


def test_choose_type_follows_the_port():
    from mm3.tools.quantize import choose_type, ggml_n_dims

    lm = lambda name, mix, **kw: choose_type("lm", name, (4096, 4096), mix, Q.BF16, **kw)  # noqa: E731
    assert lm("model.embed_tokens.weight", "Q4_K_M") == Q.Q6_K == lm("model.embed_tokens.weight", "Q6_K")
    assert lm("model.embed_tokens.weight", "Q8_0") == Q.Q8_0 == lm("model.layers.3.mlp.down_proj.weight", "Q8_0")
    assert lm("model.layers.35.mlp.down_proj.weight", "Q5_K_M") == Q.Q6_K  # every layer: no block_count key
    assert lm("model.layers.35.mlp.gate_proj.weight", "Q5_K_M") == Q.Q5_K
    assert lm("lm_head.weight", "Q4_K_M") == Q.Q4_K
    assert lm("down_proj.weight", "Q4_K_M") == Q.Q4_K  # no `layers.N`: not raised
    # With `<arch>.block_count` (36): layers < 36//9, >= 36 - 36//7 and every third are raised.
    raised = [i for i in range(36)
              if lm(f"model.layers.{i}.self_attn.v_proj.weight", "Q4_K_M", block_count=36) == Q.Q6_K]
    assert raised == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]
    assert choose_type("dit", "time_proj.weight", (128, 1), "Q8_0", Q.F32) == Q.F32  # ne0 = 1: kept
    assert choose_type("dit", "proj_in.weight", (2048, 2304), "Q4_K_M", Q.BF16) == Q.Q4_K  # 2304 = 9 * 256
    assert choose_type("dit", "x.scale_shift_table", (6, 2048), "Q8_0", Q.BF16) == Q.BF16  # never quantized
    assert choose_type("lm", "model.norm.weight", (4096,), "Q8_0", Q.BF16) == Q.F32
    assert choose_type("lm", "model.norm.weight", (4096,), "Q8_0", Q.F32) == Q.F32
    assert [ggml_n_dims(s) for s in [(4096,), (1, 4096), (4096, 1), (1, 1), (2, 1, 3), (1, 1, 3)]] == [1, 1, 2, 1, 3, 1]


def test_file_layout_is_the_ports(tmp_path):
    """Tensors in the source order at 32-byte aligned offsets, the two added keys last, and no
    padding after the last tensor's data (the port pads before each tensor, gguf-py after each)."""
    rng = np.random.default_rng(9)
    path = write_gguf(tmp_path / "lm.gguf", "mm3-lm", {"mm3.config_json": LM_CONFIG, "general.file_type": 1}, {
        "lm_head.weight": rng.standard_normal((3, 256)).astype(np.float32),
        "model.embed_tokens.weight": rng.standard_normal((3, 256)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(255).astype(np.float32),  # 1020 bytes, last
    })
    out = quantize_file(path, tmp_path / "q.gguf", "Q4_K_M")
    src, dst = GGUFFile(path), GGUFFile(out)
    assert list(dst.tensors) == list(src.tensors)
    assert list(dst.metadata)[-2:] == ["general.quantization_version", "general.file_type"]
    reader = gguf.GGUFReader(str(out))
    offsets = [t.data_offset for t in reader.tensors]
    assert all(o % 32 == 0 for o in offsets) and offsets == sorted(offsets)
    last = reader.tensors[-1]
    assert last.n_bytes == 1020 and out.stat().st_size == last.data_offset + last.n_bytes
    assert path.stat().st_size % 32 == 0  # gguf-py's source file: padded after its last tensor
