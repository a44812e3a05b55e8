"""LoRA adapters on the LM and the DiT (`mm3.lora`, `mm3.backends.products`).

The oracle for the runtime application is the same change merged into the checkpoint offline and
converted with `mm3 convert` (float32, within 1e-5), or on a quantized base the dequantized weights
plus the change; for the reference numerics, the diffusers pipeline with PEFT's own merge. Random
adapters are written in each tool's spelling (`tests.helpers.lora_files`).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mm3.commands.main import main as cli_main
from mm3.weights import layers as ops
from mm3.backends.products import ByRows, LowRank, Separate, Split, WithLowRank
from mm3.lora.adapter import AdapterError, read_adapter
from mm3.lora.attach import Applied, attach
from mm3.lora.health import group_changes
from mm3.lora.keys import group_of, target_of
from mm3.lora.use import LoraUse, check_entry, parse_flag
from mm3.models import build_model
from mm3.files.opener import open_component
from tests.helpers.lora_files import dit_modules, lm_modules, merged, write_lora

Q = gguf.GGMLQuantizationType


# -- names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, kind, layers", [
    ("base_model.model.model.layers.3.self_attn.q_proj", "lm", ["model.layers.3.self_attn.q_proj"]),
    ("language_model.model.layers.0.mlp.down_proj", "lm", ["model.layers.0.mlp.down_proj"]),
    ("text_encoders.model.layers.1.self_attn.qkv_proj", "lm",
     ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"]),
    ("lora_te_model_layers_2_mlp_gate_up_proj", "lm", ["model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj"]),
    ("transformer.transformer_blocks.5.attn.to_out.0", "dit", ["transformer_blocks.5.attn.to_out.0"]),
    ("diffusion_model.diffusion_transformer.transformer.layers.7.self_attn.to_qkv", "dit",
     ["transformer_blocks.7.attn.to_q", "transformer_blocks.7.attn.to_k", "transformer_blocks.7.attn.to_v"]),
    ("diffusion_model.diffusion_transformer.transformer.layers.0.ff.ff.0.proj", "dit", ["transformer_blocks.0.ff_in"]),
    ("lora_unet_diffusion_transformer_transformer_layers_1_ff_ff_2", "dit", ["transformer_blocks.1.ff_out"]),
    ("lora_unet_transformer_blocks_0_attn_to_v", "dit", ["transformer_blocks.0.attn.to_v"]),
    ("model.diffusion_model.diffusion_transformer.transformer.project_in", "dit", ["proj_in"]),
])
def test_every_spelling_names_the_engines_layers(key, kind, layers):
    t = target_of(key)
    assert (t.kind, list(t.layers)) == (kind, layers)


def test_names_of_no_layer_and_the_groups():
    for key in ("model.audio_decoder.layers.0.self_attn.q_proj", "transformer.model.layers.0.self_attn.q_proj",
                "diffusion_model.latent_conditioners.0", "model.embed_tokens", "lm_head"):
        assert target_of(key) is None, key
    assert [group_of(n) for n in ("model.layers.0.self_attn.k_proj", "transformer_blocks.0.attn.to_out.0",
                                  "model.layers.0.mlp.up_proj", "transformer_blocks.1.ff_out", "proj_in")] == [
        "attn_qk", "attn_vo", "mlp", "mlp", "other"]


def test_flag_and_entry_checks():
    assert parse_flag("a/b.safetensors") == {"file": "a/b.safetensors", "strength": 1.0}
    assert parse_flag("C:\\x\\b.safetensors:0.5") == {"file": "C:\\x\\b.safetensors", "strength": 0.5}
    assert parse_flag("b.safetensors:1:0,1,0.5")["groups"] == {"attn_qk": 0.0, "attn_vo": 1.0, "mlp": 0.5}
    with pytest.raises(ValueError, match="group strengths follow a strength"):
        parse_flag("b.safetensors:0,1,1")
    assert check_entry({"file": "x.safetensors"})["groups"] == {"attn_qk": 1.0, "attn_vo": 1.0, "mlp": 1.0}
    for bad, said in (({"file": ""}, "loras.file must name"), ({"file": "x", "strength": float("nan")}, "finite"),
                      ({"file": "x", "groups": {"attn": 1}}, "unknown group \"attn\""),
                      ({"file": "x", "component": "vae"}, "component must be one of lm, dit"),
                      ({"file": "x", "fingerprint": "abc"}, "fingerprint must be"), ({"file": "x", "scale": 1},
                                                                                      "unknown key \"scale\"")):
        with pytest.raises(ValueError, match=said):
            check_entry(bad)


# -- one layer, every product -------------------------------------------------------------------
def _quantized(qtype, n, k, seed):
    from mm3.bench.random_models import random_tensor
    from mm3.formats.gguf.quants import dequantize

    g = torch.Generator().manual_seed(seed)
    raw = torch.from_numpy(random_tensor("w", (n, k), qtype, g))
    return raw, dequantize(raw.reshape(-1), qtype, (n, k))


def _layer(qtype, n, k, seed, *, fast=True):
    layer = ops.Linear(k, n, bias=False)
    if qtype == Q.F32:
        values = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / math.sqrt(k)
        layer.set_float("weight", values)
    else:
        raw, values = _quantized(qtype, n, k, seed)
        layer.set_stored("weight", qtype, raw)
    layer.decode_products = layer.fused_kernels = fast
    return layer, values


def _terms(n, k, seed, adapters=2):
    g = torch.Generator().manual_seed(100 + seed)
    return tuple((torch.randn(r, k, generator=g) * 0.1, torch.randn(n, r, generator=g) * 0.1, s)
                 for r, s in ((4, 0.5), (2, -1.25))[:adapters])


def _delta(terms):
    return sum(s * (u @ d) for d, u, s in terms)


@pytest.fixture
def triton_kernels():
    from mm3.backends.gpu import kernels

    kernels.configure("triton")
    yield
    kernels.configure()


@pytest.mark.parametrize("case", ["float", "per_use", "kept_copy", "int4", "kernel"])
def test_a_layers_adapters_sit_beside_whatever_product_serves_its_weight(case, request):
    """Two adapters on one layer add sum s B A x to its product, whatever product that is; detached,
    the layer gives its plain product bit for bit."""
    from mm3.backends.cpu import int4 as cpu_int4
    from mm3.backends.gpu import kernels
    from mm3.weights.copies import cache_dequantized

    if case == "kernel":
        request.getfixturevalue("triton_kernels")
        if not kernels.available("cpu"):
            pytest.skip("the Triton interpreter is not available")
    if case == "int4" and not cpu_int4.available():
        pytest.skip("this torch has no CPU int4 product")
    qtype = {"float": Q.F32, "per_use": Q.Q8_0, "kept_copy": Q.Q8_0, "int4": Q.Q4_K, "kernel": Q.Q8_0}[case]
    layer, values = _layer(qtype, 48, 256, 1, fast=case in ("int4", "kernel"))
    if case == "kept_copy":
        cache_dequantized(layer, torch.float32)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    plain = layer(x)
    base_kind = type(layer.chosen_product()).__name__
    terms = _terms(48, 256, 1)
    layer.set_low_rank(LowRank(terms))
    y = layer(x)
    product = layer.chosen_product()
    assert isinstance(product, WithLowRank) and type(product.base).__name__ == base_kind
    expected = {"float": "FloatWeight", "per_use": "FloatWeight", "kept_copy": "FloatWeight", "int4": "ByRows",
                "kernel": "KernelProduct"}[case]
    assert base_kind == expected
    side = F.linear(x, _delta(terms))
    torch.testing.assert_close(y - plain, side, rtol=1e-5, atol=1e-5)
    if case != "int4":  # the int4 product's own rounding (bfloat16 activations) is larger
        torch.testing.assert_close(y, F.linear(x, values + _delta(terms)), rtol=1e-5, atol=1e-5)
    layer.set_low_rank(None)
    assert torch.equal(layer(x), plain)


def test_a_merged_adapter_is_the_float_weight_plus_its_terms():
    layer, values = _layer(Q.Q8_0, 48, 256, 3, fast=False)
    terms = _terms(48, 256, 3)
    layer.set_low_rank(LowRank(terms, merge=True))
    x = torch.randn(3, 256)
    weight = values.clone()
    for d, u, s in terms:  # term by term, as PEFT merges
        weight += (u @ d) * s
    assert torch.equal(layer(x), F.linear(x, weight))


@pytest.mark.parametrize("case", ["stacked", "int4", "mixed", "separate", "kernel"])
def test_fused_parts_carry_their_own_adapters(case, request):
    """q, k, v as one product: each part's adapters added to its own output (here only k and v
    have any), through the stacked float product, the int4 one, parts of mixed types, unfused
    parts, or the kernel."""
    from mm3.backends.cpu import int4 as cpu_int4
    from mm3.backends.gpu import kernels

    if case == "kernel":
        request.getfixturevalue("triton_kernels")
        if not kernels.available("cpu"):
            pytest.skip("the Triton interpreter is not available")
    if case in ("int4", "mixed") and not cpu_int4.available():
        pytest.skip("this torch has no CPU int4 product")
    types = {"stacked": (Q.F32,) * 3, "int4": (Q.Q4_K,) * 3, "mixed": (Q.Q4_K, Q.Q4_K, Q.Q6_K),
             "separate": (Q.Q8_0,) * 3, "kernel": (Q.Q8_0,) * 3}[case]
    parts = [_layer(t, n, 256, 10 + i, fast=case in ("int4", "mixed", "kernel")) for i, (t, n) in
             enumerate(zip(types, (64, 32, 32)))]
    fused = ops.Fused([p for p, _ in parts], fuse=case != "separate")
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    plain = [y.clone() for y in fused(x)]
    terms = {1: _terms(32, 256, 1), 2: _terms(32, 256, 2, adapters=1)}
    for i, t in terms.items():
        parts[i][0].set_low_rank(LowRank(t))
    ys = fused(x)
    chosen = fused.chosen_product()
    if case == "separate":
        assert chosen is None  # each part its own product
    elif case == "mixed":
        assert isinstance(chosen, ByRows) and isinstance(chosen.decode, Separate)
        assert isinstance(chosen.wide.product, WithLowRank)
    elif case == "int4":
        assert isinstance(chosen, ByRows) and isinstance(chosen.decode, Split)
        assert isinstance(chosen.decode.product, WithLowRank)
    else:
        assert isinstance(chosen, Split) and isinstance(chosen.product, WithLowRank)
    assert torch.equal(ys[0], plain[0])
    for i, t in terms.items():
        torch.testing.assert_close(ys[i] - plain[i], F.linear(x, _delta(t)), rtol=1e-5, atol=1e-5)
    wide = torch.randn(40, 256, generator=torch.Generator().manual_seed(5))  # a prefill: the stacked float product
    for (layer, values), y in zip(parts, fused(wide)):
        want = values + (_delta(layer.low_rank.terms) if layer.low_rank else 0)
        torch.testing.assert_close(y, F.linear(wide, want), rtol=1e-5, atol=1e-5)
    for layer, _ in parts:
        layer.set_low_rank(None)
    assert all(torch.equal(a, b) for a, b in zip(fused(x), plain))


# -- whole models against the change merged offline ----------------------------------------------
def _lm_out(model) -> torch.Tensor:
    """Hidden states of a 6-token prefill and one decode step (the fast numerics' fused products)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 6), generator=g)
    cache = model.new_cache(2, 16, torch.float32, "cpu")
    first = model(model.embed(ids, torch.float32), cache)
    step = model(model.embed(ids[:, :1], torch.float32), cache)
    return torch.cat([first, step], dim=1)


def _dit_out(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    hp = model.hp
    x = torch.randn(2, int(hp["in_channels"]), 12, generator=g)
    cond = torch.randn(2, 12, int(hp["condition_dim"]), generator=g)
    return model(x, torch.tensor([0.3, 0.7]), cond)


OUT = {"lm": _lm_out, "dit": _dit_out}
FOLDER = {"lm": "language_model", "dit": "transformer"}
WEIGHTS = {"lm": "model.safetensors", "dit": "diffusion_pytorch_model.safetensors"}


def _model(path, *, plain_products: bool = False):
    comp = open_component(path)
    model = build_model(comp, numerics="fast")
    if plain_products:  # dequantize per use: the products the "dequantized base" comparison computes
        for m in model.modules():
            if isinstance(m, ops.Linear):
                m.fused_kernels = False
    return model


def _converted(diffusers: Path, kind: str, state: dict, out: Path) -> Path:
    """`state` written as the `kind` component of a copy of the diffusers checkpoint, then `mm3 convert`."""
    src = out / "src"
    folder = src / FOLDER[kind]
    folder.mkdir(parents=True)
    shutil.copy(diffusers / FOLDER[kind] / "config.json", folder / "config.json")
    if kind == "lm":
        shutil.copytree(diffusers / "tokenizer", src / "tokenizer")
    save_file({k: v.contiguous() for k, v in state.items()}, folder / WEIGHTS[kind])
    assert cli_main(["convert", str(src), str(out / "gguf"), "--only", FOLDER[kind]]) == 0
    (path,) = (out / "gguf").glob("*.gguf")
    return path


def _applied(path, kind, strength=1.0, groups=None):
    adapter = read_adapter(path)
    use = LoraUse(str(path), adapter.fingerprint, kind, strength,
                  tuple(groups.items()) if groups else LoraUse.__dataclass_fields__["groups"].default)
    return Applied(adapter, use)


@pytest.mark.parametrize("kind, fmt", [(k, f) for k in ("lm", "dit") for f in ("peft", "diffusers", "kohya")]
                         + [("lm", "simpletuner")])  # SimpleTuner's LM spelling: HOT-Step's LM adapters
def test_runtime_equals_the_change_merged_and_converted(tiny, tmp_path, kind, fmt):
    state = load_file(tiny.diffusers / FOLDER[kind] / WEIGHTS[kind])
    modules = lm_modules(state) if kind == "lm" else dit_modules(state)
    (tmp_path / "lora").mkdir()
    lora = tmp_path / "lora" / "adapter_model.safetensors"
    deltas = write_lora(lora, state, modules, fmt, kind, seed=3)
    reference = OUT[kind](_model(_converted(tiny.diffusers, kind, merged(state, (deltas, 0.7)), tmp_path)))
    model = _model(tiny.file(f"mm3-{kind}"))
    plain = OUT[kind](model)
    assert attach(model, [_applied(lora, kind, 0.7)]) == len(modules)
    ours = OUT[kind](model)
    assert float((ours - plain).abs().max()) > 1e-3  # the adapter changes the output
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    attach(model, [])
    assert torch.equal(OUT[kind](model), plain)


@pytest.mark.parametrize("kind", ["lm", "dit"])
def test_comfyui_spelled_adapters_equal_the_change_merged_into_comfyuis_file(tiny_foreign, tmp_path, kind):
    """A ComfyUI-named LoRA (fused to_qkv / qkv_proj / gate_up_proj) merged into ComfyUI's own file,
    converted with `mm3 convert --from comfy`: the runtime split of its rows is the converter's."""
    from tests.helpers.foreign_layouts import comfy_dit, comfy_text_encoder

    root = tiny_foreign.diffusers
    source = tmp_path / "comfy.safetensors"
    (comfy_text_encoder(root, source, merged=True) if kind == "lm" else comfy_dit(root, source))
    state = load_file(source)
    modules = lm_modules(state, merged=True) if kind == "lm" else dit_modules(state, comfy=True)
    lora = tmp_path / "lora.safetensors"
    deltas = write_lora(lora, state, modules, "comfy", kind, seed=5)
    merged_file = tmp_path / "in" / "merged.safetensors"
    merged_file.parent.mkdir()
    save_file({k: v.contiguous() for k, v in merged(state, (deltas, 1.0)).items()}, merged_file)
    assert cli_main(["convert", str(merged_file.parent), str(tmp_path / "out"), "--from", "comfy", "--only",
                     FOLDER[kind]]) == 0
    (converted,) = (tmp_path / "out").glob("*.gguf")
    model = _model(tiny_foreign.file(f"mm3-{kind}"))
    attach(model, [_applied(lora, kind)])
    assert read_adapter(lora).layout == "ComfyUI"
    torch.testing.assert_close(OUT[kind](model), OUT[kind](_model(converted)), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_wide(tmp_path_factory):
    """A tiny model whose LM and DiT layers are 256 wide (Q4_K blocks), converted and quantized
    to Q4_K_M; and the small tiny's LM and DiT in Q8_0."""
    from mm3.tools.tiny import build_tiny

    out = tmp_path_factory.mktemp("tiny_wide")
    sizes = {"language_model": dict(hidden_size=256, intermediate_size=256, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64),
             "transformer": dict(num_attention_heads=4, attention_head_dim=64, ff_inner_dim=256)}
    r = build_tiny(out, seed=2, sizes=sizes)
    files = {}
    for kind, folder in FOLDER.items():
        files[kind] = out / f"{kind}-Q4_K_M.gguf"
        assert cli_main(["quantize", str(r["files"][folder]), str(files[kind]), "--type", "Q4_K_M"]) == 0
    return out, files


def _dequantized_plus(model, changes: dict[str, torch.Tensor]):
    """Every quantized weight of `model` replaced by its float32 values, plus `changes` by layer."""
    for name, m in model.named_modules():
        if isinstance(m, ops.Linear):
            w = m.get("weight", torch.float32).clone()
            m.set_float("weight", w + changes.get(name, 0))
    return model


@pytest.mark.parametrize("base", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("kind", ["lm", "dit"])
def test_on_a_quantized_base_the_weights_stay_quantized(tiny, tiny_wide, tmp_path, kind, base):
    """Against the dequantized base plus the change; the base keeps its blocks (its product reads them)."""
    if base == "Q8_0":
        path = tmp_path / "q8.gguf"
        assert cli_main(["quantize", str(tiny.file(f"mm3-{kind}")), str(path), "--type", "Q8_0"]) == 0
    else:
        path = tiny_wide[1][kind]
    reader = gguf.GGUFReader(str(path))
    shapes = {t.name: torch.empty(tuple(int(d) for d in reversed(t.shape.tolist())), device="meta")
              for t in reader.tensors}
    types = {t.name: t.tensor_type for t in reader.tensors}
    del reader
    modules = lm_modules(shapes) if kind == "lm" else dit_modules(shapes)
    assert any(types[m + ".weight"] in (Q.Q8_0, Q.Q4_K, Q.Q6_K) for m in modules)
    lora = tmp_path / "lora.safetensors"
    deltas = write_lora(lora, shapes, modules, "diffusers", kind, seed=7)
    model = _model(path, plain_products=True)
    attach(model, [_applied(lora, kind)])
    assert all(model.get_submodule(m).qtype("weight") == types[m + ".weight"] for m in modules)
    reference = _dequantized_plus(_model(path, plain_products=True), {k[:-len(".weight")]: d for k, d in deltas.items()})
    torch.testing.assert_close(OUT[kind](model), OUT[kind](reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["lm", "dit"])
def test_strength_zero_is_the_plain_model_bit_for_bit(tiny, tmp_path, kind):
    state = load_file(tiny.diffusers / FOLDER[kind] / WEIGHTS[kind])
    lora = tmp_path / "lora.safetensors"
    write_lora(lora, state, lm_modules(state) if kind == "lm" else dit_modules(state), "kohya", kind)
    model = _model(tiny.file(f"mm3-{kind}"))
    plain = OUT[kind](model)
    assert attach(model, [_applied(lora, kind, 0.0)]) == 0
    assert torch.equal(OUT[kind](model), plain)
    groups = {"attn_qk": 0.0, "attn_vo": 0.0, "mlp": 0.0}
    attach(model, [_applied(lora, kind, 1.0, groups)])  # the DiT's other layers keep the strength
    if kind == "lm":
        assert torch.equal(OUT[kind](model), plain)
    assert all(group_of(n) == "other" for n, m in model.named_modules()
               if isinstance(m, ops.Linear) and m.low_rank is not None)


@pytest.mark.parametrize("kind", ["lm", "dit"])
def test_two_stacked_adapters_equal_their_sum_merged(tiny, tmp_path, kind):
    state = load_file(tiny.diffusers / FOLDER[kind] / WEIGHTS[kind])
    modules = lm_modules(state) if kind == "lm" else dit_modules(state)
    (tmp_path / "a").mkdir()
    first = write_lora(tmp_path / "a" / "one.safetensors", state, modules, "peft", kind, seed=1)
    second = write_lora(tmp_path / "two.safetensors", state, modules[::2], "kohya", kind, seed=2, rank=2, alpha=1.0)
    reference = _model(_converted(tiny.diffusers, kind, merged(state, (first, 1.0), (second, -0.5)), tmp_path))
    model = _model(tiny.file(f"mm3-{kind}"))
    attach(model, [_applied(tmp_path / "a" / "one.safetensors", kind), _applied(tmp_path / "two.safetensors", kind,
                                                                                -0.5)])
    torch.testing.assert_close(OUT[kind](model), OUT[kind](reference), rtol=1e-5, atol=1e-5)


def test_health_figures_against_numpy(tiny, tmp_path):
    """Each group's relative change against numpy: the explicit [out, in] change of every layer and
    the base weights dequantized by gguf-py (a Q8_0 file)."""
    from gguf.quants import dequantize as gguf_dequantize

    base = tmp_path / "q8.gguf"
    assert cli_main(["quantize", str(tiny.file("mm3-dit")), str(base), "--type", "Q8_0"]) == 0
    state = load_file(tiny.diffusers / "transformer" / WEIGHTS["dit"])
    modules = dit_modules(state)
    lora = tmp_path / "lora.safetensors"
    write_lora(lora, state, modules, "kohya", "dit", seed=9, alpha=16.0)
    groups = {"attn_qk": 0.5, "attn_vo": 1.0, "mlp": 2.0}
    applied = _applied(lora, "dit", 0.8, groups)
    comp = open_component(base)
    changes = {c.group: c for c in group_changes([applied], comp)}
    comp.close()
    adapter = read_adapter(lora)
    reader = gguf.GGUFReader(str(base))
    weights = {t.name[:-len(".weight")]: gguf_dequantize(t.data, t.tensor_type).astype(np.float64)
               for t in reader.tensors}
    sums: dict[str, list] = {}
    for m in adapter.modules:
        (layer,) = m.target.layers
        a, b = m.down.double().numpy(), m.up.double().numpy()
        scale = m.scale * 0.8 * groups.get(group_of(layer), 1.0)
        delta = scale * (b @ a)
        w = weights[layer].reshape(delta.shape)
        s = sums.setdefault(group_of(layer), [0.0, 0.0, []])
        s[0] += np.sum(delta ** 2)
        s[1] += np.sum(w ** 2)
        s[2].append(np.linalg.norm(delta) / np.linalg.norm(w))
    assert set(changes) == set(sums) == {"attn_qk", "attn_vo", "mlp", "other"}
    for group, (d2, w2, each) in sums.items():
        assert changes[group].relative == pytest.approx(math.sqrt(d2 / w2), rel=1e-6)
        assert changes[group].worst == pytest.approx(max(each), rel=1e-6)
        assert changes[group].layers == len(each)


def test_refusals_name_the_file_and_the_value(tiny, tmp_path):
    state = load_file(tiny.diffusers / "transformer" / WEIGHTS["dit"])
    good = tmp_path / "good.safetensors"
    write_lora(good, state, dit_modules(state), "diffusers", "dit")
    tensors = load_file(good)
    cases = {
        "extra": ({**tensors, "transformer.preprocess_conv.lora_A.weight": torch.zeros(2, 2)},
                  "tensor transformer.preprocess_conv.lora_A.weight matches no layer"),
        "unpaired": ({k: v for k, v in tensors.items() if not k.endswith("proj_in.lora_B.weight")},
                     "module transformer.proj_in has no up \\(lora_B\\) factor"),
        "empty": ({}, "holds no tensors"),
    }
    for name, (content, said) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(content, path) if content else path.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
        with pytest.raises(AdapterError, match=said):
            read_adapter(path)
    (tmp_path / "x.bin").write_bytes(b"\0" * 16)
    with pytest.raises(AdapterError, match="from a .safetensors file"):
        read_adapter(tmp_path / "x.bin")
    wide = {k: torch.empty(v.shape[0], 2 * v.shape[1]) if v.dim() == 2 else v for k, v in state.items()}
    other = tmp_path / "other_size.safetensors"
    write_lora(other, wide, dit_modules(wide), "diffusers", "dit")
    with pytest.raises(AdapterError, match="for another model size"):
        attach(_model(tiny.file("mm3-dit")), [_applied(other, "dit")])


def test_the_reference_pipeline_with_peft_merged_adapters_gives_our_codes_and_audio(tiny, one_thread, tmp_path):
    """PEFT loads our PEFT-format files into the diffusers reference (its LM and its DiT) and merges
    them; our reference numerics with the same files give the same frame hiddens (so the same codes)
    and the same audio."""
    pytest.importorskip("peft")
    from diffusers import ModularPipeline
    from peft import PeftModel

    from mm3.song.pipeline import Pipeline
    from mm3.song.request import MM3Request
    from tests.helpers.reference_ar import patched_constants

    caption, lyrics, seed, duration, steps = "dark synth pop", "[verse]\nneon lights", 4, 3.0, 3
    files = {}
    for kind in ("lm", "dit"):
        state = load_file(tiny.diffusers / FOLDER[kind] / WEIGHTS[kind])
        (tmp_path / kind).mkdir()
        files[kind] = tmp_path / kind / "adapter_model.safetensors"
        write_lora(files[kind], state, lm_modules(state) if kind == "lm" else dit_modules(state), "peft", kind,
                   seed=11, magnitude=0.1)
    ref_pipe = ModularPipeline.from_pretrained(str(tiny.diffusers))
    ref_pipe.load_components(dtype=torch.float32)
    PeftModel.from_pretrained(ref_pipe.language_model, files["lm"].parent).merge_and_unload()
    PeftModel.from_pretrained(ref_pipe.transformer, files["dit"].parent).merge_and_unload()
    with patched_constants(tiny.diffusers):
        ref = ref_pipe(prompt=caption, lyrics=lyrics, audio_duration=duration, num_inference_steps=steps,
                       generator=torch.Generator().manual_seed(seed), output_type="pt",
                       output=["frame_hiddens", "audios"])
    ours = Pipeline(tiny.gguf, device="cpu", dtype="float32")
    req = MM3Request(caption=caption, lyrics=lyrics, duration=duration, steps=steps, lm_seed=seed, seed=0,
                     loras=[{"file": str(files["lm"])}, {"file": str(files["dit"])}])
    (track,) = ours.run(req, rng="reference")
    (plain,) = ours.run(MM3Request(caption=caption, lyrics=lyrics, duration=duration, steps=steps, lm_seed=seed,
                                   seed=0), rng="reference")
    hiddens = track.codes.frame_hiddens
    assert torch.equal(hiddens.reshape(-1), ref["frame_hiddens"].reshape(-1).to(hiddens.dtype))
    assert not torch.equal(plain.codes.codes, track.codes.codes)  # the LM adapter changed the song
    assert float((track.audio - ref["audios"][0]).abs().max()) <= 1e-5
    assert [e["component"] for e in track.request.loras] == ["lm", "dit"]
