"""Classifier-free guidance, top-k, and the reference's random draw (diffusers' `_sample_top_k`).

The reference draws `torch.multinomial(probs[1, N], 1, generator)`, which torch computes for one
sample as `argmax(probs / q)`, `q` = N Exponential(1) draws. `draw` takes those draws as a tensor
made on the CPU generator by the caller (`exponential_draws`, `exponential_tail`), so the generator
is consumed as the reference's (N numbers per call) and, with bit-identical probabilities, the same
index comes out; the division and argmax run on the probabilities' device, with no host copy.
"""

from __future__ import annotations

import secrets

import torch
import torch.nn.functional as F

from ..constants import SEED_MAX
from ..backends import steps

NAN_FILL = 1e9  # nan_to_num bounds used by the reference before top-k

_NEG_INF = -float("inf")


def make_generator(seed: int) -> torch.Generator:
    """CPU generator seeded like the reference (`torch.Generator("cpu").manual_seed(seed)`), so a
    seed gives the same draws on every device."""
    return torch.Generator("cpu").manual_seed(int(seed))


def resolve_seed(seed: int | None) -> int:
    """-1 / None -> a random seed in 0..SEED_MAX (what a replay request records); else `seed`. The
    one resolver of every random seed: the request's, the plan's, the takes'."""
    if seed is None or int(seed) < 0:
        return secrets.randbelow(SEED_MAX + 1)
    return int(seed)


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """`u + (c - u) * scale` (the reference's operation order)."""
    return uncond + (cond - uncond) * scale


def kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value along the last dim (k clipped to the size), keepdim."""
    return torch.topk(values, min(k, values.shape[-1]), dim=-1).values[..., -1, None]


def exponential_draws(n: int, generator: torch.Generator | None, device=None) -> torch.Tensor:
    """[1, n] float32 Exponential(1) draws, consumed from `generator` exactly as torch.multinomial
    consumes it for one sample from n categories."""
    dev = generator.device if generator is not None else device
    return torch.empty((1, n), dtype=torch.float32, device=dev).exponential_(1, generator=generator)


_SKIP_EXACT: dict[tuple[int, int], bool] = {}  # (n, start) -> the skip of exponential_tail checked exact


def skip_is_exact(n: int, start: int) -> bool:
    """Whether skipping `start` draws with int64 `random_` leaves a generator exactly where `start`
    Exponential draws leave it. CPU torch draws one 64-bit number per Exponential value (checked
    with torch 2.14); this is verified once per shape on a scratch generator rather than assumed."""
    key = (n, start)
    if key not in _SKIP_EXACT:
        a, b = torch.Generator("cpu").manual_seed(1), torch.Generator("cpu").manual_seed(1)
        full = exponential_draws(n, a)[:, start:]
        torch.empty(start, dtype=torch.int64).random_(generator=b)
        tail = exponential_draws(n - start, b)
        _SKIP_EXACT[key] = torch.equal(full, tail) and torch.equal(a.get_state(), b.get_state())
    return _SKIP_EXACT[key]


def skip_draws(n: int, start: int, generator: torch.Generator | None) -> bool:
    """Moves a CPU generator past the first `start` of n Exponential draws without making them,
    where that is exact for this shape (checked once: `skip_is_exact`): by the kernel library's
    twists of its state (`steps.skip_draws`), else with cheap 64-bit draws (much cheaper than
    Exponential ones). False, untouched, elsewhere."""
    if start <= 0 or generator is None or generator.device.type != "cpu" or not skip_is_exact(n, start):
        return False
    if not steps.skip_draws(generator, start):
        torch.empty(start, dtype=torch.int64).random_(generator=generator)
    return True


def exponential_tail(n: int, start: int, generator: torch.Generator) -> torch.Tensor:
    """`exponential_draws(n, generator)[:, start:]`, consuming the CPU generator identically but
    skipping the first `start` values where that is exact (`skip_draws`): the semantic draw runs
    over the whole LM vocabulary (200000) while the candidates are its last ~16400 ids."""
    if not skip_draws(n, start, generator):
        return exponential_draws(n, generator)[:, start:]
    return exponential_draws(n - start, generator)


def draw(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The reference's draw from probs [..., N] given its Exponential(1) draws q [..., N]: [...] int64."""
    return torch.argmax(probs / q, dim=-1)


def top_k_probs(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The reference's `_sample_top_k` up to the draw: float32, nan/inf bounded, everything below
    the k-th largest masked (ties kept), softmax, renormalised."""
    values = torch.nan_to_num(logits.float(), nan=-NAN_FILL, posinf=NAN_FILL, neginf=-NAN_FILL)
    values = values.masked_fill(values < kth_largest(values, top_k), _NEG_INF)
    probs = torch.nan_to_num(F.softmax(values, dim=-1), nan=0.0)
    return probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-12)
