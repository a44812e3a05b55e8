"""Guided top-k draws on the GPU code path (`mm3.backends.gpu.draw_kernels`, through the seam
`mm3.backends.steps`) against the torch operations `mm3.plan.ar.FrameSampler` runs: random logits
of both gate modes, guidance 1 and above, one or two rows a song, excluded columns or none, ties at
the k-th value, float32 and bfloat16 logits read in their own dtype; the LM's draw with its code and
END flag made in the same kernel; a whole tiny frame step under `emulated()` with the codes of the
torch path. On a machine with CUDA natively; elsewhere through Triton's interpreter."""

import os

import pytest
import torch

from mm3.backends import steps
from mm3.backends.gpu import steps as gpu_steps
from mm3.backends.gpu.emulation import on_gpu_path
from mm3.plan.sampling import draw, guide, kth_largest, top_k_probs

pytest.importorskip("triton", reason="this torch installation has no Triton")

NATIVE = torch.cuda.is_available()
DEVICE = torch.device("cuda" if NATIVE else "cpu")
NEG = -float("inf")


@pytest.fixture(scope="module", autouse=True)
def runnable():
    if not NATIVE and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the kernels cannot run here")


def torch_draw(logits, r, cfg, k, q, excluded, gate):
    """`FrameSampler._semantic` (gate) or its acoustic draw, in torch's operations."""
    logits = logits.float()
    c, u = (logits[0::2], logits[1::2]) if r == 2 else (logits, logits)
    if excluded is not None:
        c, u = c.masked_fill(excluded, NEG), u.masked_fill(excluded, NEG)
    guided = guide(c, u, cfg) if r == 2 else c
    if gate:
        guided = guided.masked_fill(c < kth_largest(c, k), NEG)
        if excluded is not None:
            guided = guided.masked_fill(excluded, NEG)
    return draw(top_k_probs(guided, k), q)


def case(seed):
    """Random logits of a case chosen by the seed: (logits, r, cfg, k, q, excluded, gate)."""
    g = torch.Generator().manual_seed(seed)
    songs, n = 2, (37, 300, 1024)[seed % 3]
    r, gate, cfg = 1 + seed % 2, bool(seed // 2 % 2), (1.0, 1.5, 3.0)[seed // 3 % 3]
    k = (1, 5, 50, n + 3)[seed // 4 % 4]
    logits = torch.randn(songs * r, n, generator=g) * 3
    if seed % 5 == 0:  # many equal values: ties at the k-th
        logits = logits.round()
    logits = logits.to((torch.float32, torch.bfloat16)[seed // 6 % 2])
    q = torch.empty(songs, n).exponential_(generator=g)
    excluded = torch.rand(n, generator=g) < 0.2 if seed % 3 != 2 else None
    return logits, r, cfg, k, q, excluded, gate


@pytest.mark.parametrize("seeds", [range(0, 16), range(16, 32), range(32, 48)], ids=("a", "b", "c"))
def test_the_draw_is_torchs(seeds):
    with on_gpu_path(DEVICE):
        for seed in seeds:
            logits, r, cfg, k, q, excluded, gate = case(seed)
            want = torch_draw(logits, r, cfg, k, q, excluded, gate)
            dev = None if excluded is None else excluded.to(DEVICE)
            got = steps.top_k_draw(logits.to(DEVICE), r, cfg, k, q.to(DEVICE), dev, gate)
            assert got is not None and got.dtype == torch.int64
            assert torch.equal(got.cpu(), want), (seed, got, want)


@pytest.mark.parametrize("gate,dtype", [(True, torch.bfloat16), (False, torch.bfloat16), (True, torch.float32)],
                         ids=("gated-bf16", "plain-bf16", "gated-f32"))
def test_rows_longer_than_a_block_draw_as_torch(gate, dtype):
    """Columns past one program's block (4096): every pass of the kernel loops over several."""
    g = torch.Generator().manual_seed(7 + gate)
    n = 9001
    logits = (torch.randn(4, n, generator=g) * 4).to(dtype)
    logits[:, 8990:] = 12.0  # the largest values in the last, partial block, tied
    q = torch.empty(2, n).exponential_(generator=g)
    excluded = torch.rand(n, generator=g) < 0.1
    excluded[8995] = True
    want = torch_draw(logits, 2, 1.5, 50, q, excluded, gate)
    with on_gpu_path(DEVICE):
        got = steps.top_k_draw(logits.to(DEVICE), 2, 1.5, 50, q.to(DEVICE), excluded.to(DEVICE), gate)
    assert torch.equal(got.cpu(), want)


def test_ties_at_the_kth_value_are_kept():
    """Six columns share the 3rd largest value: a top-3 keeps all eight; the draws favour the tied
    columns, so the index is one of them only if they are kept."""
    logits = torch.full((1, 64), -5.0)
    logits[0, 10], logits[0, 20] = 4.0, 3.0
    logits[0, 30:36] = 2.0
    q = torch.full((1, 64), 100.0)
    q[0, 33] = 1e-3
    with on_gpu_path(DEVICE):
        for gate in (False, True):
            got = steps.top_k_draw(logits.to(DEVICE), 1, 1.0, 3, q.to(DEVICE), None, gate)
            assert got.item() == 33 == torch_draw(logits, 1, 1.0, 3, q, None, gate).item()
        q[0, 33], q[0, 40] = 100.0, 1e-9  # below the k-th value: never drawn, however favoured
        assert steps.top_k_draw(logits.to(DEVICE), 1, 1.0, 3, q.to(DEVICE)).item() == 10


def test_the_lm_draw_gives_its_code_and_end_flag():
    g = torch.Generator().manual_seed(5)
    n, start, offset, end_id = 300, 1000, 1005, 1002
    logits = torch.randn(4, n, generator=g).to(torch.bfloat16)
    logits[0, end_id - start] = logits[1, end_id - start] = 30.0  # song 0 ends
    q = torch.empty(2, n).exponential_(generator=g)
    excluded = torch.zeros(n, dtype=torch.bool)
    excluded[:2] = True
    with on_gpu_path(DEVICE):
        codes, end = steps.semantic_draw(logits.to(DEVICE), 2, 1.5, 20, q.to(DEVICE), excluded.to(DEVICE), start,
                                         offset, end_id)
    token = torch_draw(logits, 2, 1.5, 20, q, excluded, True) + start
    assert end.dtype == torch.bool and codes.dtype == torch.int64
    assert end.tolist() == [True, False] and end.tolist() == (token == end_id).tolist()
    assert torch.equal(codes.cpu(), (token - offset).clamp_min(0))


def test_what_the_kernel_does_not_take_is_left_to_torch():
    logits, q = torch.randn(2, 8, device=DEVICE), torch.rand(1, 8, device=DEVICE) + 0.5
    with on_gpu_path(DEVICE):
        assert steps.top_k_draw(logits, 2, 1.5, 3, q.double()) is None
        assert steps.top_k_draw(logits, 3, 1.5, 3, q) is None
        assert steps.top_k_draw(logits, 2, 1.5, 3, q, torch.zeros(7, dtype=torch.bool, device=DEVICE)) is None
        assert steps.top_k_draw(logits, 2, 1.5, 3, torch.zeros(1, 8, dtype=torch.int64, device=DEVICE)) is None
    if not NATIVE:
        assert steps.semantic_draw(logits, 2, 1.5, 3, q, None, 0, 0, 1) is None  # plain CPU tensors: the CPU path
    assert gpu_steps.top_k_draw(logits, 2, 1.5, 0, q) is None
