"""Classifier-free guidance, top-k, and the reference's random draw (SPEC section 4, Sampling).

The reference samples with `torch.multinomial(probs[1, N], 1, generator)`; for one sample torch
computes that as `argmax(probs / q)` with `q` = N Exponential(1) draws from the generator
(`at::native::multinomial`). `draw_index` does the same with the draws made explicitly on the
generator's device, so the generator is consumed identically (N numbers per call, whatever the
number of candidates) and, with bit-identical probabilities, the same index comes out. The division
and argmax then run on the probabilities' device: nothing waits for a host copy of them.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

NAN_FILL = 1e9  # nan_to_num bounds used by the reference before top-k

_NEG_INF = -float("inf")


def make_generator(seed: int) -> torch.Generator:
    """CPU generator seeded like the reference (`torch.Generator("cpu").manual_seed(seed)`), so a
    seed gives the same draws on every device."""
    return torch.Generator("cpu").manual_seed(int(seed))


def resolve_seed(seed: int | None) -> int:
    """-1 / None -> a random non-negative seed (what the request writes back); else `seed`."""
    if seed is None or int(seed) < 0:
        return random.SystemRandom().randrange(2 ** 32)
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


def _skip_is_exact(n: int, start: int) -> bool:
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


def exponential_tail(n: int, start: int, generator: torch.Generator) -> torch.Tensor:
    """`exponential_draws(n, generator)[:, start:]`, consuming the CPU generator identically, but
    skipping the first `start` values with cheap 64-bit draws (~6x faster than Exponential ones)
    where that is exact: the semantic draw runs over the whole LM vocabulary (200000) while the
    candidates are its last ~16400 ids."""
    if start <= 0 or generator is None or generator.device.type != "cpu" or not _skip_is_exact(n, start):
        return exponential_draws(n, generator)[:, start:]
    torch.empty(start, dtype=torch.int64).random_(generator=generator)
    return exponential_draws(n - start, generator)


def draw_index(probs: torch.Tensor, generator: torch.Generator | None,
               columns: torch.Tensor | None = None, n: int | None = None) -> torch.Tensor:
    """One index into `probs` [1, N] (float32, sums to 1) drawn as `torch.multinomial(probs, 1,
    generator)` draws it. With `columns` (CPU int64 [N]: the ids of `probs`' columns in a space of
    `n` categories, ascending, `probs` zero elsewhere) the generator still draws `n` numbers, as the
    reference does over the whole space; the result is then a position in `columns`."""
    total = probs.shape[-1] if n is None else n
    if columns is not None and generator is not None and generator.device.type == "cpu":
        start = int(columns[0])  # ascending: the first candidate; nothing below it is needed
        q = exponential_tail(total, start, generator)[:, columns - start]
    else:
        q = exponential_draws(total, generator, probs.device)
        if columns is not None:
            q = q[:, columns.to(q.device)]
    if q.device != probs.device:
        if probs.device.type == "cuda":
            q = q.pin_memory()  # so the copy below does not wait for the device
        q = q.to(probs.device, non_blocking=True)
    return torch.argmax(probs / q, dim=-1)


def top_k_probs(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The reference's `_sample_top_k` up to the draw: float32, nan/inf bounded, everything below
    the k-th largest masked (ties kept), softmax, renormalised."""
    values = torch.nan_to_num(logits.float(), nan=-NAN_FILL, posinf=NAN_FILL, neginf=-NAN_FILL)
    values = values.masked_fill(values < kth_largest(values, top_k), _NEG_INF)
    probs = torch.nan_to_num(F.softmax(values, dim=-1), nan=0.0)
    return probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-12)


def sample_top_k(logits: torch.Tensor, top_k: int, generator: torch.Generator | None,
                 columns: torch.Tensor | None = None, n: int | None = None) -> torch.Tensor:
    """Sample one index from `logits` [1, N] restricted to its top-k (see `draw_index` for
    `columns` / `n`). Returns a [1] int64 tensor (a position in `logits`) on the logits' device."""
    return draw_index(top_k_probs(logits, top_k), generator, columns, n)


def semantic_logits(cond: torch.Tensor, uncond: torch.Tensor, mask: torch.Tensor | None, cfg: float,
                    top_k: int) -> torch.Tensor:
    """Guided semantic logits [1, N] (float32) kept only where the *conditional* logit reaches its
    top-k threshold (ties kept). `mask` (bool [N], True = not a candidate) is applied to both rows
    first and to the result again (guidance of two -inf values is NaN)."""
    cond, uncond = cond.float(), uncond.float()
    if mask is not None:
        cond, uncond = cond.masked_fill(mask, _NEG_INF), uncond.masked_fill(mask, _NEG_INF)
    guided = guide(cond, uncond, cfg)
    guided = guided.masked_fill(cond < kth_largest(cond, top_k), _NEG_INF)
    if mask is not None:
        guided = guided.masked_fill(mask[None], _NEG_INF)
    return guided
