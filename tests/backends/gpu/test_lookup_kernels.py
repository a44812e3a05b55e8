"""Embedding rows on the GPU code path (`mm3.backends.gpu.lookup_kernels`, through the seam
`mm3.backends.steps`) against the torch dequantization: every type a table has in the published
mixes, float32 and bfloat16 rows bit for bit, ids read on the device, codes repeated per song with
an offset added in the kernel, and a frame's whole feedback equal to `mm3.plan.replay.frame_feedback`.
On a machine with CUDA natively; elsewhere through Triton's interpreter (`emulated`)."""

import os
import types

import gguf
import pytest
import torch

from mm3.backends import steps
from mm3.backends.gpu.emulation import on_gpu_path
from mm3.formats.gguf.quants import SCALE_OFFSETS, dequantize
from mm3.plan.replay import frame_feedback

pytest.importorskip("triton", reason="this torch installation has no Triton")

Q = gguf.GGMLQuantizationType
QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
FLOATS = {Q.F16: torch.float16, Q.BF16: torch.bfloat16, Q.F32: torch.float32}
NATIVE = torch.cuda.is_available()
DEVICE = torch.device("cuda" if NATIVE else "cpu")
K = 512


@pytest.fixture(scope="module", autouse=True)
def runnable():
    if not NATIVE and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the kernels cannot run here")


def table(qtype, rows, g):
    """(the table as held: block rows or floats, on DEVICE; its float32 values)."""
    if qtype in FLOATS:
        w = (torch.randn(rows, K, generator=g) * 3).to(FLOATS[qtype])
        return w.to(DEVICE), w.float()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (rows * K // block, size), dtype=torch.uint8, generator=g)
    for offset in SCALE_OFFSETS[qtype]:  # random scales of both signs, many magnitudes
        scale = (torch.randn(raw.shape[0], generator=g) * 10.0 ** torch.randint(-4, 1, (raw.shape[0],), generator=g))
        raw[:, offset:offset + 2] = scale.half().view(torch.uint8).view(-1, 2)
    raw = raw.reshape(rows, -1)
    return raw.to(DEVICE), dequantize(raw, qtype, (rows, K))


@pytest.mark.parametrize("qtype", QUANTS + list(FLOATS), ids=lambda t: t.name)
def test_rows_equal_the_torch_dequantization_bit_for_bit(qtype):
    g = torch.Generator().manual_seed(int(qtype))
    held, values = table(qtype, 12, g)
    ids = torch.tensor([11, 0, 5, 5, 3], device=DEVICE)
    with on_gpu_path(DEVICE):
        for dtype in (torch.float32, torch.bfloat16):
            rows = steps.lookup(held, qtype, ids, K, dtype)
            assert rows is not None and rows.dtype == dtype and rows.device == DEVICE
            assert torch.equal(rows.cpu(), values[ids.cpu()].to(dtype)), dtype


def test_codes_repeat_per_song_with_the_offset_added_on_the_device():
    g = torch.Generator().manual_seed(1)
    held, values = table(Q.Q6_K, 20, g)
    codes = torch.tensor([4, 0, 9], device=DEVICE)
    with on_gpu_path(DEVICE):
        rows = steps.code_rows(held, Q.Q6_K, codes, K, torch.bfloat16, repeat=2, add=7)
        one = steps.code_rows(held, Q.Q6_K, codes.int(), K, torch.float32, add=3)
    want = values[codes.cpu().repeat_interleave(2) + 7].to(torch.bfloat16)
    assert torch.equal(rows.cpu(), want)
    assert torch.equal(one.cpu(), values[codes.cpu() + 3])


def test_what_the_kernels_do_not_take_is_left_to_torch():
    g = torch.Generator().manual_seed(2)
    held, _ = table(Q.Q4_K, 4, g)
    ids = torch.tensor([1], device=DEVICE)
    with on_gpu_path(DEVICE):
        assert steps.lookup(held, Q.Q2_K, ids, K, torch.float32) is None  # a type they do not read
        assert steps.lookup(held, Q.Q4_K, ids, K + 256, torch.float32) is None  # rows of another width
        assert steps.lookup(held, Q.Q4_K, ids.float(), K, torch.float32) is None
    if not NATIVE:
        assert steps.code_rows(held, Q.Q4_K, ids, K, torch.float32) is None  # plain CPU tensors: the CPU path


@pytest.mark.parametrize("lm_type,audio_type", [(Q.Q6_K, Q.Q4_K), (Q.Q8_0, Q.Q8_0), (Q.BF16, Q.F32)],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_frame_feedback_is_one_kernel_with_torchs_numbers(lm_type, audio_type, dtype):
    g = torch.Generator().manual_seed(int(lm_type) * 7 + int(audio_type))
    vocab, ncb, offset, songs, repeat = 16, 8, 5, 2, 2
    lm_table, lm_values = table(lm_type, 40, g)
    audio_table, audio_values = table(audio_type, vocab * (ncb - 1), g)
    frame = torch.cat([torch.randint(0, 30, (songs, 1), generator=g),
                       torch.randint(0, vocab, (songs, ncb - 1), generator=g)], dim=1)
    lm = types.SimpleNamespace(embed=lambda ids, dt: lm_values[ids].to(dt))
    depth = types.SimpleNamespace(num_codebooks=ncb, audio_vocab=vocab, audio_embeddings=types.SimpleNamespace(
        lookup=lambda ids, dt: audio_values[ids].to(dt)))
    want = frame_feedback(lm, depth, frame.repeat_interleave(repeat, dim=0), offset, dtype)
    with on_gpu_path(DEVICE):
        got = steps.frame_feedback(lm_table, lm_type, audio_table, audio_type, frame.to(DEVICE), offset, vocab, K,
                                   dtype, repeat)
    assert got.shape == want.shape == (songs * repeat, 1, K) and got.dtype == dtype
    assert torch.equal(got.cpu(), want)
