"""The kernel counter (`mm3.backends.gpu.frame_count`) on a hand-made function whose launches are
known, and the count of one AR frame of the bench's medium config on the GPU code path
(`python -m mm3 kernels --frame`), held under a bound that only goes down."""

import os

import pytest
import torch
import torch.nn.functional as F

NATIVE = torch.cuda.is_available()
# Kernels of one AR frame, medium config, Q4_K_M (`python -m mm3 kernels --frame --config medium`).
MEDIUM_Q4_K_M_BOUND = 224


@pytest.fixture(scope="module", autouse=True)
def _needs_triton():
    pytest.importorskip("triton")
    if not NATIVE and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the kernels cannot run here")


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def norm_twice_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok)
        tl.store(y_ptr + offs, x * 2.0, mask=ok)

    return norm_twice_kernel


def test_known_launches_are_counted_each_as_its_kernels():
    from mm3.backends.gpu.frame_count import KernelCounter
    from mm3.models.lm import rms_norm, rotate_half

    kernel = _kernel()
    device = "cuda" if NATIVE else "cpu"
    x = torch.randn(8, device=device)
    h = torch.randn(2, 16, device=device, dtype=torch.bfloat16)
    w = torch.ones(16, device=device, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 1, 16, device=device)
    keys = torch.randn(1, 2, 4, 16, device=device)
    with KernelCounter() as counter:
        y = torch.empty_like(x)  # an allocation: 0
        kernel[(1,)](x, y, 8, BLOCK=8)  # a Triton launch: 1, whatever it runs
        a = y.view(2, 4) + 1  # a view: 0; add: 1
        b = a.masked_fill(a > 0, 0.0)  # gt: 1; masked_fill out of place: 2
        torch.topk(b.flatten(), 2)  # topk: 2 (flatten of a contiguous tensor: a view)
        mask = torch.ones(1, 1, 1, 4, dtype=torch.bool, device=device)  # 1
        F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask)  # a boolean mask: 3
        F.scaled_dot_product_attention(q, keys, keys)  # 1
        rms_norm(h, w, 1e-6)  # float, pow, mean, add, rsqrt, mul, to, mul: 8
        rotate_half(h)  # neg, cat: 2 (the halves are views)
    assert torch.equal(y, x * 2)  # the kernel ran
    assert [(launch.source, launch.name) for launch in counter.launches if launch.source != "aten"] == [
        ("triton", "norm_twice_kernel"), ("sdpa", "scaled_dot_product_attention (bool mask)"),
        ("sdpa", "scaled_dot_product_attention (no mask)")]
    kinds = counter.by_kind()
    assert kinds["norms"] == 1 + 8  # the kernel by its name, the norm by the function that issued it
    assert kinds["rotation/cache"] == 2
    assert kinds["attention"] == 3 + 1
    assert kinds["other"] == 1 + 1 + 2 + 2 + 1
    assert counter.total() == 22 == sum(kinds.values())


def test_a_substituted_product_counts_its_cuda_launches_and_computes_the_product():
    """`fast_products`: a layout product's result from torch, its launches those of the CUDA tiles
    (a 4096 x 4096 Q4_K weight for 2 rows fills 132 multiprocessors unsplit: one launch), not the
    interpreter's wider tiles (which would split K and add a sum)."""
    from gguf import GGMLQuantizationType as QT

    from mm3.backends.gpu import device_layout as dl
    from mm3.backends.gpu import layout_kernels
    from mm3.backends.gpu.frame_count import KernelCounter
    from mm3.formats.gguf.quants import dequantize, random_blocks

    n = k = 4096
    sms = layout_kernels.REFERENCE_SMS
    assert layout_kernels.decode_grid(2, n, k, sms)[4] == 1
    assert layout_kernels.decode_grid(2, n, k, sms, layout_kernels.INTERPRETED[0])[4] == 2
    raw = random_blocks(QT.Q4_K, n, k, generator=torch.Generator().manual_seed(0))
    planes = dl.to_planes(raw, QT.Q4_K, k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1))
    with KernelCounter(fast_products=True) as counter:
        y = layout_kernels.linear(x, planes, QT.Q4_K, k)
    launched = [(launch.name, launch.kind) for launch in counter.launches if launch.kernels]
    assert launched == [("gemv_kernel", "products")]
    want = x @ dequantize(raw, QT.Q4_K, (n, k)).T
    assert float((y - want).norm() / want.norm()) < 1e-5
    assert layout_kernels.linear.__name__ == "linear"  # restored on leaving


def test_paused_and_not_recording_count_nothing():
    from mm3.backends.gpu.frame_count import KernelCounter

    x = torch.randn(4)
    with KernelCounter() as counter:
        counter.recording = False
        x + 1
        counter.recording = True
        with counter.paused():
            x * 2
        x - 1
    assert [launch.name for launch in counter.launches] == ["sub"]


def test_a_tiny_frame_is_counted_by_kind_and_part(tmp_path):
    """The whole count (`count_frame`) over the tiny config, in this process: every product a
    launch, the same kernels in every LM layer after the first, kinds and parts adding up to the total."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the emulated GPU code path needs Triton's interpreter")
    from mm3.bench.checkpoints import CONFIGS
    from mm3.bench.frame_kernels import count_frame

    report = count_frame("tiny", "Q4_K_M", tmp_path)
    kinds, parts = report["by_kind"], report["by_part"]
    assert report["total"] == sum(kinds.values()) == sum(parts.values()) == report["unscaled_total"]
    assert report["layers_counted"] == 2
    layer = report["by_part_detail"]["lm_layer"]
    assert sum(n for name, n in layer.items() if name.startswith("attention:")) >= 1
    depth_layers = CONFIGS["tiny"]["rvq_depth_decoder"]["num_layers"]
    assert kinds["products"] >= 2 * 4 + 7 * (depth_layers * 4 + 1) + 1 + 7  # LM and depth layers, heads
    assert report["triton_launches"]  # the tiny weights' products are Triton launches too
    assert parts["sampling"] > 0 and parts["embeddings_feedback"] > 0 and parts["lm_step_fixed"] > 0
    assert report["host_syncs"] == 0


@pytest.mark.slow
def test_a_medium_frame_launches_at_most_the_bound(tmp_path):
    """One AR frame of the medium config in Q4_K_M on the GPU code path, counted on the CPU."""
    from mm3.tools.kernels import frame_count

    report = frame_count("medium", "Q4_K_M", work=str(tmp_path))
    assert report["config"] == "medium" and report["quant"] == "Q4_K_M"
    assert report["layers_counted"] == report["layers_scaled"] == 8
    kinds, parts = report["by_kind"], report["by_part"]
    assert report["total"] == sum(kinds.values()) == sum(parts.values())
    # every product is at least one launch: 8 LM layers of at least 4, 7 depth passes of 4 layers of 4
    assert kinds["products"] >= 8 * 4 + 7 * 4 * 4
    assert all(kinds[k] > 0 for k in ("norms", "attention", "draws", "embeddings"))
    assert report["lm_layer_kernels"] == [5]  # every LM layer: q/k/v, attention, out, gate/up, down
    assert report["host_syncs"] == 0
    assert report["total"] <= MEDIUM_Q4_K_M_BOUND, f"{report['total']} kernels a frame, bound {MEDIUM_Q4_K_M_BOUND}"


def test_a_frame_on_a_device_is_counted_beside_the_profile(tiny):
    """`on_device` (the bench's count on CUDA) over the tiny model on the CPU: the eager frame's
    launches counted by kind, the profile taken (no device kernels on the CPU), no graph."""
    from mm3.bench.frame_kernels import on_device
    from mm3.files.opener import open_component
    from mm3.models.depth import RVQDepthDecoder
    from mm3.models.lm import Qwen3LM
    from mm3.tokenizer import MM3Tokenizer

    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    try:
        lm, depth = Qwen3LM.load(lm_c), RVQDepthDecoder.load(d_c)
        out = on_device(lm, depth, MM3Tokenizer.from_component(lm_c).codes, torch.bfloat16, torch.device("cpu"))
    finally:
        lm_c.close()
        d_c.close()
    kinds = out["counted_by_kind"]
    assert out["counted"] == sum(kinds.values())
    assert kinds["products"] >= len(lm.model.layers) * 4 and kinds["norms"] > 0 and kinds["draws"] > 0
    assert out["host_syncs"] == 0
    assert out["profiled_eager"] == {"kernels": 0, "memory_operations": 0} and out["profiled_graph"] is None


def test_the_bench_summary_shows_the_counted_and_profiled_kernels():
    from mm3.bench.cli import summary

    machine = {"device": "cuda", "gpu": {"name": "a GPU"}, "cpu": "a CPU", "threads": 16, "torch": "2"}
    ar = {"ours_ms_per_frame": 5.0, "diffusers_ms_per_frame": None, "ratio": None,
          "frame_kernels": {"counted": 3578, "profiled_eager": {"kernels": 3577}, "profiled_graph": {"kernels": 3579}}}
    report = {"config": "real", "quant": "Q4_K_M", "dtype": "bfloat16", "date": "today", "machine": machine,
              "notes": [], "ar": ar}
    assert "kernels a frame: 3578 counted (eager), profiled 3577 eager, 3579 in a graph replay" in summary(report)
    ar["frame_kernels"] = {"error": "RuntimeError: no"}
    assert "kernels a frame: not counted (RuntimeError: no)" in summary(report)


def test_a_frame_after_many_positions_is_timed_beside_an_early_one(tiny):
    """`position_cost` (the bench's late frames on CUDA) over the tiny model on the CPU: ms per
    frame after each count of filled KV positions, clamped to what the LM holds, and their ratio."""
    from mm3.bench.frame_kernels import position_cost
    from mm3.files.opener import open_component
    from mm3.models.depth import RVQDepthDecoder
    from mm3.models.lm import Qwen3LM
    from mm3.tokenizer import MM3Tokenizer

    lm_c, d_c = open_component(tiny.file("mm3-lm"), expect="lm"), open_component(tiny.file("mm3-depth"), expect="depth")
    try:
        lm, depth = Qwen3LM.load(lm_c), RVQDepthDecoder.load(d_c)
        out = position_cost(lm, depth, MM3Tokenizer.from_component(lm_c).codes, torch.float32, torch.device("cpu"),
                            positions=(8, 10 ** 6), frames=2)
    finally:
        lm_c.close()
        d_c.close()
    late = str(lm.max_positions - 2 - 2)
    assert list(out["ms_per_frame_at"]) == ["8", late] and out["frames"] == 2
    assert all(ms > 0 for ms in out["ms_per_frame_at"].values())
    assert out["late_over_first"] == round(out["ms_per_frame_at"][late] / out["ms_per_frame_at"]["8"], 3)


def test_the_bench_summary_shows_a_late_frame_beside_an_early_one():
    from mm3.bench.cli import summary

    machine = {"device": "cuda", "gpu": {"name": "a GPU"}, "cpu": "a CPU", "threads": 16, "torch": "2"}
    ar = {"ours_ms_per_frame": 5.0, "diffusers_ms_per_frame": None, "ratio": None,
          "positions": {"ms_per_frame_at": {"64": 5.0, "9000": 6.5}, "frames": 20, "late_over_first": 1.3}}
    report = {"config": "real", "quant": "Q4_K_M", "dtype": "bfloat16", "date": "today", "machine": machine,
              "notes": [], "ar": ar}
    assert "a frame as the song grows: 5.00 ms after 64 positions, 6.50 ms after 9000 positions (1.3x)" in \
        summary(report)
    ar["positions"] = {"error": "RuntimeError: no"}
    assert "late frames: not timed (RuntimeError: no)" in summary(report)
