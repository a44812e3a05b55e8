"""The bench's roofline pieces that run without a GPU: the DiT's operations per step counted from
its layers, the weight bytes a forward reads (kept copies instead of the blocks they stand for),
the ceilings left out off CUDA, and --direct refused for other configs."""

import argparse

import pytest
import torch

from mm3.bench import cli as bench_cli
from mm3.bench.measure import copy_bandwidth, matmul_tflops, read_bytes
from mm3.bench.synth import dit_flops
from mm3.weights.copies import cache_dequantized, compressed_nbytes, release_dequantized
from mm3.models import build_model
from mm3.files.opener import open_component


@pytest.fixture(scope="module")
def dit(tiny):
    comp = open_component(tiny.file("mm3-dit"), expect="dit")
    yield build_model(comp)
    comp.close()


def test_dit_operations_per_step(dit):
    """2 x tokens x in x out per linear layer plus the attention's two products per block, for the
    CFG pair of a window of L latents (L + 1 tokens with the time token)."""
    from mm3.weights.layers import Linear

    hp, L = dit.hp, 10
    tokens = 2 * (L + 1)
    linears = [m for m in dit.modules() if isinstance(m, Linear)]
    inner = int(hp["num_attention_heads"]) * int(hp["attention_head_dim"])
    want = sum(2 * tokens * m.in_features * m.out_features for m in linears) + \
        int(hp["num_layers"]) * 4 * 2 * (L + 1) ** 2 * inner
    assert dit_flops(dit, L) == want and len(linears) >= 4 * int(hp["num_layers"])


def test_read_bytes_count_kept_copies_instead_of_the_weights(dit):
    stored = read_bytes(dit)
    assert stored == compressed_nbytes(dit)
    kept = cache_dequantized(dit, torch.bfloat16)
    try:
        assert kept > 0 and read_bytes(dit) != stored
    finally:
        release_dequantized(dit)
    assert read_bytes(dit) == stored


def test_ceilings_are_measured_on_cuda_only():
    cpu = torch.device("cpu")
    assert copy_bandwidth(cpu) is None and matmul_tflops(cpu, torch.float32) is None


def test_direct_is_for_the_released_sizes(tmp_path):
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    args = p.parse_args(["--config", "tiny", "--direct", "--work", str(tmp_path)])
    with pytest.raises(SystemExit, match="--direct writes the released sizes"):
        bench_cli.run(args)
