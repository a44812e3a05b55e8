"""Other tools' files: ComfyUI's repackaged safetensors (full and pruned text encoder, merged or
separate products, the DiT with the condition encoder folded in, the DAV), their int8 ConvRot
variant, ComfyUI-GGUF conversions (Q8_0 / Q4_0 / Q8_CR) and HOT-Step's GGUFs (five files, the legacy
synthesis bundle). Each is built from the same tiny checkpoint as our GGUFs; the engine must read
the same weights from it and make the same audio, and `convert --from` must write our files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mm3.files.opener import kinds_of, open_component
from mm3.dialects.comfy import hadamard
from mm3.formats.gguf.errors import ComponentError
from mm3.song.pipeline import Pipeline
from mm3.files.registry import Registry
from mm3.song.request import MM3Request
from tests.helpers import foreign_layouts as F

ROOT = Path(__file__).resolve().parents[2]
FOLDER_OF = {"lm": "language_model", "depth": "rvq_depth_decoder", "cond": "condition_encoder", "dit": "transformer",
             "vae": "vocoder"}
REQUEST = dict(caption="warm lo-fi, dusty drums", lyrics="[verse] rain on the window", duration=1.6, steps=2,
               lm_seed=5, seed=9)


@pytest.fixture(scope="module")
def layouts(tiny_foreign, tmp_path_factory):
    """{layout: models folder} of every foreign layout of the tiny checkpoint."""
    root, base = tiny_foreign.diffusers, tmp_path_factory.mktemp("foreign")
    out = {"comfy": base / "comfy", "comfy_pruned": base / "comfy_pruned"}
    F.comfy_files(root, out["comfy"])
    F.comfy_files(root, out["comfy_pruned"], pruned=True, merged=True)
    F.comfy_dav(root, out["comfy_pruned"] / "vae" / "minimax_music3_dav.safetensors", parametrizations=True)
    te = out["comfy_pruned"] / "text_encoders" / "minimax_music3_text_encoder_pruned_bf16.safetensors"
    dit = out["comfy"] / "diffusion_models" / "minimax_music3_dit_fp32.safetensors"
    vae = out["comfy"] / "vae" / "minimax_music3_dav.safetensors"
    out["int8"] = base / "int8"
    out["int8"].mkdir()
    F.int8_convrot(te, out["int8"] / "minimax_music3_text_encoder_pruned_int8_convrot.safetensors")
    F.int8_convrot(dit, out["int8"] / "minimax_music3_dit_int8_convrot.safetensors")
    shutil.copy(vae, out["int8"])
    out["gguf"] = base / "gguf"
    out["gguf"].mkdir()
    F.comfy_gguf(te, out["gguf"] / "minimax_music3_text_encoder_pruned_Q4_0.gguf", quant="Q4_0",
                 tokenizer_as_float=True)
    F.comfy_gguf(dit, out["gguf"] / "minimax_music3_dit_Q8_0.gguf", quant="Q8_0")
    F.comfy_gguf(vae, out["gguf"] / "minimax_music3_dav_F32.gguf")
    out["gguf_cr"] = base / "gguf_cr"
    out["gguf_cr"].mkdir()
    F.comfy_gguf(te, out["gguf_cr"] / "minimax_music3_text_encoder_pruned_Q8_CR.gguf", convrot=True)
    F.comfy_gguf(dit, out["gguf_cr"] / "minimax_music3_dit_Q8_CR.gguf", convrot=True)
    shutil.copy(vae, out["gguf_cr"])
    out["hotstep"] = base / "hotstep"
    F.hotstep_files(root, out["hotstep"])
    out["hotstep_bundle"] = base / "hotstep_bundle"
    F.hotstep_files(root, out["hotstep_bundle"], bundle=True)
    return out


def _render(models, rng="independent") -> torch.Tensor:
    tracks = Pipeline(str(models), device="cpu").run(MM3Request(**REQUEST, rng=rng))
    return tracks[0].audio


def _ours(tiny_foreign, kind):
    return open_component(tiny_foreign.file(f"mm3-{'vae' if kind == 'vae' else kind}"), kind)


# -- the same weights --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["comfy", "comfy_pruned", "hotstep", "hotstep_bundle"])
def test_same_tensors_as_our_files(layouts, tiny_foreign, layout):
    """Every tensor the engine reads from the foreign files has our GGUF's values and shape, the
    hyper-parameters are ours; a pruned LM's tables hold our rows where they have rows."""
    reg = Registry.scan(layouts[layout])
    for kind in FOLDER_OF:
        theirs, ours = open_component(reg.resolve(kind), kind), _ours(tiny_foreign, kind)
        extra = {"embed_rows", "head_start", "head_rows", "trained_lm_cfg"}
        # (the LM's config has only what the engine reads; ours is the whole config.json)
        assert {k: v for k, v in theirs.hparams.items() if k not in extra} == {
            k: v for k, v in ours.hparams.items() if kind != "lm" or k in theirs.hparams}
        names = {n for n in ours.tensors if not n.startswith("encoder.")}  # the DAV decodes only
        assert set(theirs.tensors) == names
        for name in names:
            a, b = theirs.tensors[name].dequantize(), ours.tensors[name].dequantize()
            if kind == "lm" and "head_start" in theirs.hparams and name == "lm_head.weight":
                start = theirs.hparams["head_start"]  # END's id: the rows are those of ids END ..
                code = theirs.hparams["embed_rows"] - 16384  # the code offset
                assert torch.equal(a[0], b[start]) and torch.equal(a[code - start:], b[code:start + a.shape[0]])
                assert not a[1:code - start].any()  # ids between END and the codes are never drawn
            elif kind == "lm" and name == "model.embed_tokens.weight" and a.shape != b.shape:
                assert torch.equal(a, b[:a.shape[0]])
            else:
                assert torch.equal(a, b), name


@pytest.mark.parametrize("layout", ["comfy", "comfy_pruned", "hotstep", "hotstep_bundle"])
def test_same_audio_as_our_files(layouts, tiny_foreign, layout):
    """Bit-identical weights give bit-identical audio, in both RNG modes (the reference RNG draws the
    semantic code over all 200000 ids, so a pruned LM must keep that count)."""
    for rng in ("independent", "reference"):
        assert torch.equal(_render(layouts[layout], rng), _render(tiny_foreign.gguf, rng)), rng


def test_classified_by_tensor_names(layouts, tiny_foreign):
    te = layouts["comfy"] / "text_encoders" / "minimax_music3_text_encoder_bf16.safetensors"
    assert kinds_of(te) == ("lm", "depth")
    assert kinds_of(layouts["comfy"] / "diffusion_models" / "minimax_music3_dit_fp32.safetensors") == ("cond", "dit")
    assert kinds_of(layouts["hotstep_bundle"] / "mm3-synth-f32.gguf") == ("depth", "cond", "dit", "vae")
    # HOT-Step's mm3-dit has our architecture name but its own tensors; ours stays ours
    assert kinds_of(layouts["hotstep"] / "mm3-dit-f32.gguf") == ("dit",)
    assert open_component(layouts["hotstep"] / "mm3-dit-f32.gguf").file.dialect.startswith("HOT-Step")
    assert open_component(tiny_foreign.file("mm3-dit")).file.__class__.__name__ == "GGUFFile"
    # a diffusers safetensors is no component; asking a DiT file for the LM says what it holds
    assert kinds_of(tiny_foreign.diffusers / "transformer" / "diffusion_pytorch_model.safetensors") == ()
    dit = layouts["comfy"] / "diffusion_models" / "minimax_music3_dit_fp32.safetensors"
    with pytest.raises(ComponentError, match=r"DiT \(it holds the condition encoder and flow DiT\), expected mm3-lm"):
        open_component(dit, "lm")
    reg = Registry.scan(layouts["comfy"])
    assert reg.buckets["lm"] == reg.buckets["depth"] == ["text_encoders/minimax_music3_text_encoder_bf16.safetensors"]
    assert reg.foreign == []


# -- int8 ConvRot and ComfyUI-GGUF ----------------------------------------------------------------------
def test_hadamard_is_symmetric_orthogonal():
    for g in (4, 16, 64, 256):
        h = hadamard(g)
        assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(g), atol=1e-6)
    with pytest.raises(ComponentError, match="not a power of 4"):
        hadamard(32)


@pytest.mark.parametrize("layout", ["int8", "gguf_cr"])
def test_int8_convrot_weights_are_the_documented_dequantization(layouts, tiny_foreign, layout):
    """An int8 weight reads as ((q * scale) per group) @ H (float32, comfy-kitchen's reference):
    within int8 error of the original, and equal to that formula computed independently in float64."""
    reg = Registry.scan(layouts[layout])
    te = open_component(reg.resolve("lm"), "lm")
    ours = _ours(tiny_foreign, "lm")
    w = te.tensors["model.layers.0.mlp.gate_proj.weight"].dequantize()
    orig = ours.tensors["model.layers.0.mlp.gate_proj.weight"].dequantize()
    n = w.shape[0]
    assert te.tensors["model.layers.0.mlp.gate_proj.weight"].qtype.name == "F32"
    assert (w - orig).abs().max() <= 0.01 * orig.abs().max()
    fused = torch.cat([orig, ours.tensors["model.layers.0.mlp.up_proj.weight"].dequantize()])
    q, scale, g = F.convrot_quantize(fused)
    k = fused.shape[1]
    want = ((q.double() * scale.double()).reshape(2 * n, k // g, g) @ hadamard(g).double()).reshape(2 * n, k)
    assert torch.allclose(w.double(), want[:n], rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", ["int8", "gguf", "gguf_cr"])
def test_convert_from_comfy_gives_files_of_the_same_audio(layouts, tmp_path, layout):
    """`python -m mm3 convert --from comfy` writes our five... files (here four: ComfyUI has no
    encoder in its DAV) holding what the engine reads from the originals: the same audio."""
    out = tmp_path / "ours"
    r = subprocess.run([sys.executable, "-m", "mm3", "convert", "--from", "comfy", str(layouts[layout]), str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    written = sorted(p.name for p in out.glob("*.gguf"))
    assert len(written) == 5 and all(n.startswith("MiniMax-Music3-") for n in written)
    for kind in FOLDER_OF:
        a, b = open_component(Registry.scan(layouts[layout]).resolve(kind), kind), open_component(
            Registry.scan(out).resolve(kind), kind)
        for name, t in b.tensors.items():
            src = a.tensors[name]
            if src.shape == t.shape and kind not in ("cond", "vae"):
                assert src.qtype == t.qtype and torch.equal(src.raw, t.raw), name  # blocks kept as they are
    assert torch.equal(_render(layouts[layout]), _render(out))


def test_convert_writes_the_contract(layouts, tiny_foreign, tmp_path):
    """From the full ComfyUI files the DiT, condition encoder and depth decoder come out
    byte-identical to our converter's files of the same checkpoint; a pruned LM is written at the
    whole vocabulary (the contract has no pruned form)."""
    from mm3.tools.convert_foreign import convert_foreign

    for layout in ("comfy", "comfy_pruned"):
        out = tmp_path / layout
        convert_foreign(layouts[layout], out, "comfy")
        for kind in ("depth", "cond", "dit"):
            ours = tiny_foreign.file(f"mm3-{kind}")
            assert (out / ours.name.replace("-tiny-", "-")).read_bytes() == ours.read_bytes(), (layout, kind)
        lm = open_component(next(out.glob("*language_model*")), "lm")
        assert lm.tensors["lm_head.weight"].shape == (F.FOREIGN_VOCAB, 64)
        assert "head_start" not in lm.hparams
    assert torch.equal(_render(tmp_path / "comfy_pruned"), _render(tiny_foreign.gguf))


def test_convert_from_hotstep(layouts, tiny_foreign, tmp_path):
    from mm3.tools.convert_foreign import convert_foreign

    convert_foreign(layouts["hotstep_bundle"], tmp_path, "hotstep")
    for kind in ("depth", "cond", "dit"):
        ours = tiny_foreign.file(f"mm3-{kind}")
        assert (tmp_path / ours.name.replace("-tiny-", "-")).read_bytes() == ours.read_bytes(), kind
    with pytest.raises(ComponentError, match="no ComfyUI MiniMax Music 3 file"):
        convert_foreign(layouts["hotstep"], tmp_path / "x", "comfy")


# -- refusals ------------------------------------------------------------------------------------------
def test_unknown_int8_format_is_refused_by_name(layouts, tmp_path):
    from safetensors.torch import load_file, save_file

    src = next((layouts["int8"]).glob("*dit*"))
    sd = load_file(src)
    key = next(k for k in sd if k.endswith(".comfy_quant"))
    sd[key] = torch.frombuffer(bytearray(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    bad = tmp_path / "dit_fp8.safetensors"
    save_file(sd, bad)
    with pytest.raises(ComponentError, match="'float8_e4m3fn' format.*int8_tensorwise"):
        open_component(bad, "dit")
    del sd[key.replace(".comfy_quant", ".weight_scale")]
    sd[key] = torch.frombuffer(bytearray(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8)
    save_file(sd, bad)
    with pytest.raises(ComponentError, match="int8 without the scale"):
        open_component(bad, "dit")


def test_text_encoder_without_tokenizer_is_refused(layouts, tmp_path):
    from safetensors.torch import load_file, save_file

    sd = load_file(next((layouts["comfy"] / "text_encoders").glob("*.safetensors")))
    del sd["tokenizer_json"]
    bad = tmp_path / "te.safetensors"
    save_file(sd, bad)
    assert kinds_of(bad) == ("lm", "depth")
    with pytest.raises(ComponentError, match="no tokenizer_json"):
        open_component(bad, "lm")
    open_component(bad, "depth")  # the depth decoder needs no tokenizer


def test_composer_lm_says_its_guidance(tiny_foreign, tmp_path, caplog):
    """A HOT-Step LM made for lm_cfg 1.0 (guidance distilled) carries that value; a request with another
    guidance runs, with a warning naming both."""
    files = F.hotstep_files(tiny_foreign.diffusers, tmp_path, lm_cfg=1.0)
    assert open_component(files["lm"], "lm").hparams["trained_lm_cfg"] == 1.0
    with caplog.at_level("WARNING", logger="mm3.song.pipeline"):
        Pipeline(str(tmp_path), device="cpu").run(MM3Request(**{**REQUEST, "duration": 0.8}))
    assert "was made for lm_cfg 1 " in caplog.text and "asks for 1.5" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mm3.song.pipeline"):
        Pipeline(str(tmp_path), device="cpu").run(MM3Request(**{**REQUEST, "duration": 0.8, "lm_cfg": 1.0}))
    assert "was made for" not in caplog.text


def test_info_describes_each_component_of_a_file(layouts, capsys):
    import json

    from mm3.commands.main import main as cli_main

    te = layouts["comfy_pruned"] / "text_encoders" / "minimax_music3_text_encoder_pruned_bf16.safetensors"
    assert cli_main(["info", str(te), str(layouts["hotstep_bundle"] / "mm3-synth-f32.gguf"), "--json"]) == 0
    got = [(d["component"], d["layout"]) for d in json.loads(capsys.readouterr().out)]
    assert got == [("lm", "ComfyUI MiniMax Music 3 text encoder"), ("depth", "ComfyUI MiniMax Music 3 text encoder")] + [
        (k, "HOT-Step MiniMax Music 3 synthesis bundle") for k in ("depth", "cond", "dit", "vae")]


def test_unaligned_safetensors_parts_copy_only_themselves(layouts):
    """A fused tensor that is not 64-byte aligned in the file: each part is copied alone (aligned),
    not the whole fused tensor once per part."""
    te = open_component(layouts["comfy_pruned"] / "text_encoders" / "minimax_music3_text_encoder_pruned_bf16.safetensors",
                        "lm")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.mlp.up_proj.weight"):
        raw = te.tensors[name].raw
        assert raw.data_ptr() % 64 == 0 and raw.untyped_storage().nbytes() == raw.numel(), name


def test_incomplete_files_are_component_errors(layouts, tmp_path):
    from safetensors.torch import load_file, save_file

    from mm3.files.opener import read_component
    from mm3.files.inventory import scan

    sd = load_file(layouts["comfy"] / "diffusion_models" / "minimax_music3_dit_fp32.safetensors")
    del sd["cond_layer_scale"]
    (tmp_path / "dit").mkdir()
    save_file(sd, tmp_path / "dit" / "dit.safetensors")
    with pytest.raises(ComponentError, match="missing tensor cond_layer_scale"):
        read_component(tmp_path / "dit" / "dit.safetensors", "cond")
    inv = scan(tmp_path / "dit")  # listed as unusable, not a crash
    assert [f.name for f in inv.unusable] == ["dit.safetensors"] and "cond_layer_scale" in inv.unusable[0].problem
    # ComfyUI's folders hold other models: those are not listed at all
    (tmp_path / "other").mkdir()
    save_file({"x.weight": torch.zeros(2, 2)}, tmp_path / "other" / "t5.safetensors")
    assert scan(others=(tmp_path / "other",)).unusable == []


def test_int8_with_one_scale_for_the_tensor(layouts, tmp_path):
    from safetensors.torch import load_file, save_file

    src = next(layouts["int8"].glob("*dit*"))
    sd = load_file(src)
    name = "diffusion_transformer.transformer.layers.0.ff.ff.2.weight"
    q, scale = sd[name], sd[name + "_scale"]
    sd[name + "_scale"] = scale.max().reshape(())  # one scale: int8_tensorwise in its plain form
    save_file(sd, tmp_path / "dit.safetensors")
    w = open_component(tmp_path / "dit.safetensors", "dit").tensors["transformer_blocks.0.ff_out.weight"].dequantize()
    n, k = q.shape
    g = 64
    want = ((q.float() * scale.max()).reshape(n, k // g, g) @ hadamard(g).T).reshape(n, k)
    assert torch.equal(w, want)
