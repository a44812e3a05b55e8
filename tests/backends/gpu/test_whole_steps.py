"""The GPU back end's whole decode steps (`mm3.backends.gpu.steps.lm_layer`, `depth_blocks`) on the
GPU code path (`emulated()`: Triton's interpreter over CPU tensors), over random Q4_K_M files small
enough to interpret (q/k in Q4_K and v in Q6_K: the two-type product): five launches a layer, with
the norms, the residual adds, the attention's preparation and SwiGLU inside (and the depth
passes' position embeddings inside the first block's products), against the models'
chained path (`MM3_GPU_LAYERS=chained`: each norm with its residual add its own launch): the same
bits in float16, the KV caches included; where the device layout does not hold a layer's products,
the chained path. On a CUDA device the same steps run natively in bfloat16 (`.ci/gpu`), within
bfloat16's rounding: there the norm's sums of squares run in another order in each kernel."""


import os
from collections import Counter

import pytest
import torch

from mm3.backends import products
from mm3.backends.gpu import layout_kernels
from mm3.backends.gpu.emulation import emulated, on_gpu_path
from mm3.backends.gpu.frame_count import KernelCounter

pytest.importorskip("triton", reason="this torch installation has no Triton")

NATIVE = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
pytestmark = pytest.mark.skipif(not NATIVE and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a CUDA device or Triton's interpreter")
DEVICE = torch.device("cuda" if NATIVE else "cpu")
# The interpreter rounds float32 to float16 as a GPU does (bfloat16 it truncates); a GPU runs bfloat16.
DTYPE = torch.bfloat16 if NATIVE else torch.float16


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    """An LM of 1 layer and a depth decoder of 1 block, hidden 256 (heads of 128), in Q4_K_M."""
    from mm3.bench.checkpoints import COMPONENTS
    from mm3.bench.random_models import write_random_models
    from mm3.formats.diffusers import DIFFUSERS_DEFAULTS
    from mm3.tools.tiny import RELEASED_LM_CONFIG, build_tokenizer

    tokenizer, special, code_offset = build_tokenizer("small")
    lm_cfg = {**RELEASED_LM_CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "vocab_size": code_offset + 64}
    cfgs = {c: dict(DIFFUSERS_DEFAULTS[c]) for c in COMPONENTS}
    cfgs["rvq_depth_decoder"].update(hidden_size=256, num_layers=1, num_attention_heads=2, intermediate_size=512)
    folder = tmp_path_factory.mktemp("small-q4km")
    write_random_models(folder, lm_cfg, cfgs, "Q4_K_M", tokenizer, special["<|audio_end|>"],
                        ("language_model", "rvq_depth_decoder"))
    return folder


def _steps(folder, whole: bool, monkeypatch, int8_cache: bool = False):
    """An LM decode step at a device position (the captured form: bucket set, the host count not
    read) and two depth passes (2 positions, then 1): (outputs, caches, Triton launches, torch's
    operations). `int8_cache`: the LM's KV cache in 8 bits (`MM3_GPU_INT8_KV_CACHE`)."""
    from mm3.bench.frame_kernels import _load

    monkeypatch.setenv("MM3_GPU_LAYERS", "whole" if whole else "chained")
    monkeypatch.setenv("MM3_GPU_INT8_KV_CACHE", "on" if int8_cache else "off")
    g = torch.Generator().manual_seed(0)

    def rows(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, DTYPE)

    with on_gpu_path(DEVICE), torch.inference_mode():
        lm, depth, _ = _load(folder)
        lm, depth = lm.to(DEVICE), depth.to(DEVICE)
        for block in (*lm.model.layers, *depth.layers):  # the kernels' self-checks, made once, not counted
            for layer in block.products():
                for part in getattr(layer, "parts", [layer]):
                    layout_kernels.fused_works("norm", part.qtype("weight"), DTYPE, DEVICE)
        cache = lm.new_cache(2, 40, DTYPE, DEVICE)
        lm(rows(2, 3, lm.hidden_size), cache)
        cache.bucket, cache.host_counting = 16, False
        depth_cache = depth.new_cache(2, DTYPE, DEVICE)
        with KernelCounter() as counter:
            out = [lm(rows(2, 1, lm.hidden_size), cache), depth(rows(2, 2, depth.hidden_size), depth_cache),
                   depth(rows(2, 1, depth.hidden_size), depth_cache)]
    monkeypatch.undo()
    launches = Counter(launch.name for launch in counter.launches if launch.source == "triton")
    torch_ops = Counter(launch.name for launch in counter.launches if launch.source == "aten")
    lm_caches = [cache.k, cache.v] + ([cache.k_scales, cache.v_scales] if cache.quantized else [])
    return out, lm_caches + [depth_cache.k, depth_cache.v], launches, torch_ops


def test_whole_steps_are_the_chained_path(small_models, monkeypatch):
    whole, whole_caches, launches, torch_ops = _steps(small_models, True, monkeypatch)
    chained, chained_caches, chained_launches, _ = _steps(small_models, False, monkeypatch)
    for got, want in zip(whole + whole_caches, chained + chained_caches):
        if NATIVE:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        else:
            assert torch.equal(got, want)
    # LM: 1 layer of q/k/v (two types), attention, out, gate/up, down; its tables and final norm.
    # Depth: 2 passes of 1 block (q/k/v, attention, out, gate/up, down) and the final norm; its
    # position table expanded at the first pass.
    assert launches == Counter({"gemv_kernel": 3 + 2 * 4, "gemv_segments_kernel": 1, "attention_step_kernel": 1,
                                "rope_table_kernel": 1, "norm_rms_kernel": 1 + 2, "attention_short_kernel": 2,
                                "lookup_rows_kernel": 1})
    # the depth passes' position embeddings added inside the first block's q/k/v and out: no add of their own
    assert "add" not in torch_ops, torch_ops
    # chained: the norms with their residual adds apart (the attention in one launch either way)
    assert chained_launches["attention_step_kernel"] == 1
    assert sum(chained_launches.values()) == sum(launches.values()) + 2 + 2 * 2


def test_whole_steps_over_the_8_bit_cache(small_models, monkeypatch):
    """With `MM3_GPU_INT8_KV_CACHE`: the LM's cache holds int8 codes and float32 scales; whole steps are
    the chained path's (codes and scales included) in as many launches as over the 16-bit cache;
    the step's output stays within 2 % of the 16-bit cache's (its keys and values to 1/254 of each
    group's largest)."""
    whole, whole_caches, launches, _ = _steps(small_models, True, monkeypatch, int8_cache=True)
    chained, chained_caches, _, _ = _steps(small_models, False, monkeypatch, int8_cache=True)
    full, _, full_launches, _ = _steps(small_models, True, monkeypatch)
    assert whole_caches[0].dtype == torch.int8 and whole_caches[2].dtype == torch.float32
    assert launches == full_launches
    for got, want in zip(whole + whole_caches, chained + chained_caches):
        if not NATIVE:
            assert torch.equal(got, want)
        elif got.is_floating_point():
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        else:  # the codes of keys the two paths' norms may round a bfloat16 step apart
            assert int((got.int() - want.int()).abs().max()) <= 1
    error = (whole[0].float() - full[0].float()).norm() / full[0].float().norm()
    assert 0 < error < 0.02, error  # 0.4 % measured under the interpreter


@pytest.mark.skipif(NATIVE, reason="the emulated CPU path's products")
def test_layers_the_device_layout_does_not_hold_take_the_chained_path(tiny):
    """The tiny files' float32 weights multiply with torch on the CPU: no whole step is offered."""
    from mm3.files.opener import open_component
    from mm3.models.lm import Qwen3LM

    component = open_component(tiny.file("mm3-lm"), expect="lm")
    try:
        with emulated():
            lm = Qwen3LM.load(component)
            layer = lm.model.layers[0]
            assert products.layout_block(layer.products(), torch.float32, torch.device("cpu")) is None
    finally:
        component.close()


def test_a_layers_whole_step_products_are_looked_up_once_then_again_only_after_a_change(small_models, monkeypatch):
    """The seam asks `products.layout_block` at a layer's (a depth decoder's) first whole step and
    holds the answer, weakly: a later step asks nothing; a move, a rebound product, another dtype
    are seen at the next step, and so is `MM3_GPU_LAYERS`. The kernels themselves are not run
    (the GPU steps stand in, counted)."""
    import gc
    import weakref

    from mm3.backends import steps
    from mm3.backends.gpu import steps as gpu_steps
    from mm3.bench.frame_kernels import _load

    looked, whole = [], []
    lookup = products.layout_block
    monkeypatch.setattr(products, "layout_block", lambda *a: looked.append(1) or lookup(*a))
    monkeypatch.setattr(gpu_steps, "lm_layer", lambda parts, x, *a: whole.append(parts) or x)
    monkeypatch.setattr(gpu_steps, "depth_blocks", lambda parts, x, *a: whole.append(parts) or x)
    monkeypatch.setattr(layout_kernels, "works", lambda *a: True)  # no self-checks: no kernel runs
    monkeypatch.setattr(layout_kernels, "fused_works", lambda *a: True)
    monkeypatch.setenv("MM3_GPU_LAYERS", "whole")
    with on_gpu_path(DEVICE), torch.inference_mode():
        lm, depth, _ = _load(small_models)
        lm, depth = lm.to(DEVICE), depth.to(DEVICE)
        layer = lm.model.layers[0]
        cache = lm.new_cache(2, 40, DTYPE, DEVICE)
        cache.bucket, cache.host_counting = 16, False

        def step(dtype=DTYPE):
            """(layout_block calls, whole steps) of one LM layer step."""
            looked.clear(), whole.clear()
            steps.lm_layer(layer, torch.zeros(2, 1, lm.hidden_size, dtype=dtype, device=DEVICE), None, None, cache,
                           0, None)
            return len(looked), len(whole)

        assert step() == (1, 1)
        assert step() == (0, 1) and step() == (0, 1)
        out = weakref.ref(layer.self_attn.o_proj.chosen_product())
        layer.to(DEVICE)  # a move: every weight settled again, every product chosen again
        whole.clear()
        gc.collect()
        assert out() is None  # the held answer keeps no product alive
        assert step() == (1, 1) and step() == (0, 1)
        layer.mlp.down_proj.fused_kernels = False  # rebound: torch's product, no whole step
        assert step() == (1, 0) and step() == (0, 0)
        layer.mlp.down_proj.fused_kernels = True
        assert step() == (1, 1)
        assert step(torch.float32) == (1, 1) and step(torch.float32) == (0, 1)
        monkeypatch.setenv("MM3_GPU_LAYERS", "chained")
        assert step(torch.float32) == (0, 0)
        monkeypatch.setenv("MM3_GPU_LAYERS", "whole")
        assert step(torch.float32) == (0, 1)

        depth_cache = depth.new_cache(2, DTYPE, DEVICE)
        inputs = torch.zeros(2, 1, depth.hidden_size, dtype=DTYPE, device=DEVICE)
        positions = torch.zeros(1, 1, depth.hidden_size, dtype=DTYPE, device=DEVICE)
        for asked in (len(depth.layers), 0):
            looked.clear(), whole.clear()
            steps.depth_blocks(depth, inputs, positions, depth_cache, 1e-6)
            assert (len(looked), len(whole)) == (asked, 1)
