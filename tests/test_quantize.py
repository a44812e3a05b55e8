"""The quantize tool: published mixes, metadata carried over with its types, clear refusals."""

import gguf
import numpy as np
import pytest

from tests.helpers.gguf_util import COND_KV, cond_tensors, write_gguf
from mm3.cli import main as cli_main
from mm3.gguf import ComponentError, GGUFFile
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


def test_tiny_lm_with_empty_merges_quantizes(tiny, tmp_path):
    """The byte-level tiny LM has an empty merges array; it must survive the copy."""
    src = tiny.file("mm3-lm")
    out = quantize_file(src, tmp_path / "lm-Q8_0.gguf", "Q8_0")
    a, b = GGUFFile(src), GGUFFile(out)
    assert b.strings("tokenizer.ggml.merges") == [] == a.strings("tokenizer.ggml.merges")
    assert b.strings("tokenizer.ggml.tokens") == a.strings("tokenizer.ggml.tokens")
    assert b.tensors["lm_head.weight"].qtype == Q.Q8_0
