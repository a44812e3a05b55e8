"""The DiT's attention over a whole window in bfloat16 on the CPU, by the kernel library.

Where the processor has bfloat16 dot products but no AMX, torch's flash attention multiplies its
blocks through a library call each and runs at about half the speed of the products around it;
`csrc/long_attention.c` lays out each head's keys and values once for the processor's bfloat16
dot-product instruction and computes the flash kernel's arithmetic (float32 scores and softmax,
the weights rounded to bfloat16 for the values' product), only the order of float32 additions
differing. With AMX torch's own kernel is the faster one, and no flag says which wins where: it
serves where a timing of both on the model's head shape, once per machine and kept in the cache
folder's record (`SECTION`), finds it faster by `PAYS`, so later runs compute the same audio.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from . import native as cpu_native, timings

TIMED_POSITIONS = 512  # positions of the timed attention: a DiT window's order (hundreds)
ROUNDS = 3  # each side timed this many times, alternating; the fastest counts
PAYS = 0.9  # the kernel serves where it takes at most this share of torch's time
MAX_HEAD_DIM = 256  # head sizes the kernel takes: multiples of 32 up to this
SECTION = "cpu-long-attention"  # the record's section of these timings

_MEMO: dict[str, dict] = {}  # this process's timings by key


def forget() -> None:
    """Drop this process's timings (the next question reads the record again)."""
    _MEMO.clear()


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel reads q, k, v as given: bfloat16 CPU tensors [B, S, heads, D] of one shape
    and one layout (each position's heads side by side), D a multiple of 32 up to `MAX_HEAD_DIM`."""
    if q.dim() != 4 or q.device.type != "cpu" or q.shape[1] == 0:
        return False
    d = q.shape[-1]
    return (d % 32 == 0 and d <= MAX_HEAD_DIM and
            all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.shape == q.shape and
                t.stride() == q.stride() and t.stride(3) == 1 and t.stride(2) == d for t in (q, k, v)))


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(D)) v for every position and head, q, k, v as `takes` reads them ->
    [B, S, heads * D] bfloat16, by the kernel whether or not it pays; None where there is no
    library or its build has no bfloat16 dot products."""
    lib = cpu_native.library()
    if lib is None or not takes(q, k, v):
        return None
    b, s, heads, d = q.shape
    out = torch.empty(b, s, heads * d, dtype=torch.bfloat16)
    status = lib.mm3_long_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), b, s, heads, d, q.stride(1),
                                    q.stride(0), 1.0 / math.sqrt(d), out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError(f"no memory for the attention's layout of {b} x {heads} heads of {s} positions")
    return out if status == 0 else None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """`run`'s result where the kernel takes these tensors and pays for their head shape here
    (`pays`), else None (torch's attention serves: also where a gradient is asked, which the
    kernel does not give)."""
    if torch.compiler.is_compiling() or not takes(q, k, v) or cpu_native.library() is None or \
            (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return None
    return run(q, k, v) if pays(q.shape[2], q.shape[3]) else None


def pays(heads: int, head_dim: int) -> bool:
    """Whether the kernel is faster than torch's attention by `PAYS` for `heads` heads of
    `head_dim` on this machine: timed once per processor, thread count, torch and head shape, and
    kept in the record."""
    def timed() -> dict:
        ms = time_both(heads, head_dim)
        return {"serves": ms["kernel"] <= PAYS * ms["torch"], "ms": {k: round(v, 3) for k, v in ms.items()}}

    key = timings.key("long attention", f"heads={heads}x{head_dim}")
    return timings.kept(SECTION, key, _MEMO, lambda known: isinstance(known.get("serves"), bool), timed)["serves"]


def time_both(heads: int, head_dim: int, positions: int = TIMED_POSITIONS) -> dict[str, float]:
    """Milliseconds of one attention of a CFG pair of `positions` by the kernel and by torch (as
    the DiT calls it: head views, the output's heads joined), each the fastest of `ROUNDS`,
    alternating; the kernel's time is infinite where it does not run."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, positions, heads, head_dim, generator=g).to(torch.bfloat16) for _ in range(3))

    def kernel():
        if run(q, k, v) is None:
            raise LookupError

    def torch_attention():
        heads_first = [t.permute(0, 2, 1, 3) for t in (q, k, v)]
        F.scaled_dot_product_attention(*heads_first).permute(0, 2, 1, 3).flatten(2, 3)

    best = {"kernel": math.inf, "torch": math.inf}
    sides = {"kernel": kernel, "torch": torch_attention}
    with torch.inference_mode():
        try:
            kernel()
        except LookupError:
            sides.pop("kernel")
        torch_attention()
        for _ in range(ROUNDS):
            for name, side in sides.items():
                start = time.perf_counter()
                side()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best
