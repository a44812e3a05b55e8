"""The GPU steps' kernels checked once a process on each device before they serve.

A step's kernel (a norm, the rotation table, the LM's attention, the depth decoder's short
attention, an embedding lookup, a frame's feedback, a guided draw) is first run on small random
inputs of the shapes and dtype the step asks for, compiling the variant the step will use, and
compared with torch's arithmetic on the CPU (the operations the models run where no kernel serves).
A kernel that cannot run there, or computes wrongly, is reported once in a warning naming the
device, and its step declines (returns None) from then on, so the model's torch operations serve:
slower, never a wrong song. The products have their own check (`layout_kernels.works`).

Each check's bound is loose beside the kernel's own rounding (a few units in the last place, a
draw's index within float32's rounding of the best) and tight beside what a miscompiled or
misread kernel makes. While a CUDA graph is being captured nothing is run (a check must read its
results); a step asked first then serves, and the graph's own check compares it with the eager frame.
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from typing import Callable

import torch

from ...weights.binding import indexed_device

_CHECKED: dict[tuple, bool] = {}
_RETRY: dict[tuple, float] = {}  # keys whose check ran out of memory -> when to ask again (time.monotonic)
RETRY_S = 30.0
_RUNNING = [0]  # checks in progress (the kernel counter does not count their launches)
_ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def running() -> bool:
    """Whether a check is running (its launches are not a frame's)."""
    return _RUNNING[0] > 0


@contextmanager
def _quietly():
    _RUNNING[0] += 1
    try:
        with torch.no_grad():
            yield
    finally:
        _RUNNING[0] -= 1


def serves(step: str, device: torch.device, *key) -> bool:
    """Whether `step`'s kernel (a name of `CHECKS`) computes right on `device` for `key` (its dtype
    and the sizes that choose its compiled variant): checked the first time it is asked in a process,
    the answer kept."""
    asked = (step, device, *key)
    known = _CHECKED.get(asked)  # asked at every step of an eager frame: one lookup
    if known is not None:
        return known
    device = indexed_device(device)
    full = (step, device, *key)
    known = _CHECKED.get(full)
    if known is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return True  # nothing can be read back inside a capture: the graph's own check compares it
        if time.monotonic() < _RETRY.get(full, 0.0):
            return False
        known = _run(step, device, key)
        if known is None:  # out of memory for now: torch serves, and the check is asked again later
            _RETRY[full] = time.monotonic() + RETRY_S
            return False
        _CHECKED[full] = known
    _CHECKED[asked] = known
    return known


def _run(step: str, device: torch.device, key: tuple) -> bool | None:
    label = f"GPU {step} kernel"
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # an earlier launch's fault is not this kernel's (it raises here)
    failure = None
    with _quietly():
        try:
            worst, what = CHECKS[step](device, *key)
        except torch.cuda.OutOfMemoryError:
            if not any(k[:2] == (step, device) for k in _RETRY):
                warnings.warn(f"no memory on {device} to check the {label} ({_named(key)}): torch's operations "
                              f"serve it until the check runs (asked again after {RETRY_S:.0f} s)", stacklevel=4)
            return None
        except Exception as e:  # a compiler or driver that cannot build or run it
            failure = e
        finally:
            try:  # a kernel that failed may leave the split counters the products share (`counters`) set
                from .layout_kernels import counters

                counters(device, 1).zero_()
            except Exception:  # a faulted device: its own error is the one to report
                if failure is None:
                    raise
    if failure is not None:
        if _faulted(device):
            warnings.warn(f"the {label} faulted on {device} for ({_named(key)}) ({type(failure).__name__}: "
                          f"{failure}); the device may run nothing more in this process: restart with "
                          "MM3_KERNELS=off to leave the pack's GPU kernels out", stacklevel=4)
        else:
            warnings.warn(f"the {label} cannot run on {device} for ({_named(key)}) ({type(failure).__name__}: "
                          f"{failure}); torch's operations serve it instead", stacklevel=4)
        return False
    if not worst <= 1.0:  # NaN too
        warnings.warn(f"the {label} computes wrongly on {device} for ({_named(key)}) ({what}: {worst:.3g} times "
                      "its bound); torch's operations serve it instead", stacklevel=4)
        return False
    return True


def _faulted(device: torch.device) -> bool:
    """Whether a CUDA device is left unusable (a kernel's illegal access poisons its context: every
    later call fails), as against a kernel that merely could not be built or launched."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
    except Exception:
        return True
    return False


def _named(key: tuple) -> str:
    return ", ".join(str(k).removeprefix("torch.") for k in key)


def _near(dtype: torch.dtype) -> float:
    """A relative bound for values computed as torch computes them but for the order of a sum or a
    fused multiply-add: 4 units in the last place of a 16-bit dtype, 2^-17 for float32."""
    return 4 * _ULP[dtype] if dtype != torch.float32 else 2.0 ** -17


def _off(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> float:
    """The largest |got - want| / (atol + rtol |want|), in float64 on the CPU (NaN where got has one
    that want has not)."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if got.shape != want.shape:
        raise ValueError(f"a result of shape {tuple(got.shape)} where {tuple(want.shape)} was expected")
    if not got.numel():
        return 0.0
    same = (got == want) | (got.isnan() & want.isnan())
    off = ((got - want).abs() / (atol + rtol * want.abs())).masked_fill(same, 0.0)
    return float(off.max()) if not off.isnan().any() else float("nan")


def _random(g: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _normed(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's rows (the CPU, x's dtype) in the models' torch arithmetic."""
    from .layout_kernels import torch_rms_norm

    return torch_rms_norm(x, (w, eps))


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# -- the checks: each (device, *key) -> (the worst error over its bound, what it was) --------------------
def _norms(device, dtype, n):
    from . import norm_kernels

    g = torch.Generator().manual_seed(1)
    x, delta = _random(g, 2, 3, n, dtype=dtype), _random(g, 2, 3, n, dtype=dtype)  # rows as a batch of heads
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    eps, ulp, near = 1e-6, _ULP[dtype], _near(dtype)
    got = norm_kernels.rms_norm(x.to(device), w.to(device), eps)
    # heads of a fused q/k/v output's rows: three levels of strides (rows, positions, heads)
    wide = _random(g, 2, 5, 4 * n, dtype=dtype)

    def view(t):
        return t[:, :3, :2 * n].unflatten(-1, (2, n))
    strided = norm_kernels.rms_norm(view(wide.to(device)), w.to(device), eps)
    summed, normed = norm_kernels.add_rms_norm(x.to(device), delta.to(device), w.to(device), eps)
    want_sum = x + delta
    return max((_off(got, _normed(x, w, eps), near, 1e-6), "rms_norm"),
               (_off(strided, _normed(view(wide), w, eps), near, 1e-6), "rms_norm of strided rows"),
               (_off(summed, want_sum, ulp, 1e-6), "the residual sum"),
               (_off(normed, _normed(want_sum, w, eps), near, 1e-6), "the norm after the residual"))


def _rope(device, dtype, d):
    from . import attention_kernels

    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    position = 1234
    cos, sin = attention_kernels.rope_table(torch.tensor([position], device=device), inv_freq.to(device), dtype)
    angles = torch.tensor([float(position)]) * inv_freq
    angles = torch.cat((angles, angles))
    tol = max(_ULP[dtype], 2.0 ** -20)  # float32's cos of an angle near 1e3: a few units of 2^-23 apart
    return max((_off(cos.flatten(), angles.cos().to(dtype), 0.0, tol), "cos"),
               (_off(sin.flatten(), angles.sin().to(dtype), 0.0, tol), "sin"))


def _attention(device, dtype, heads, kv_heads, d, group, whole):
    """The LM's decode preparation (the q/k norms, the rotation, the cache write) and, with
    `whole`, its attention two ways (the whole step; the preparation, then the decode over the filled
    keys), over a cache of 16-bit values or (`group` > 0) int8 codes with a float32 scale a group,
    filled over three splits of keys, against torch's arithmetic: the rotated queries and the written
    key and value, then the float64 attention of the same values (the new key and value those the
    kernel wrote)."""
    from . import attention_kernels

    g = torch.Generator().manual_seed(2)
    # three splits of the keys, the last partly filled: the split combine runs as in a long song
    b, cap, eps, scale = 2, 2 * attention_kernels.SPLIT + 64, 1e-6, d ** -0.5
    pos = cap - 43
    group_of = heads // kv_heads if heads % kv_heads == 0 else 1
    q = _random(g, b, heads, d, dtype=dtype)
    # each key head's new key partly its first query head's (3 / sqrt(d) of it): a weight of a few
    # percent among the cached keys, so neither it nor they go unnoticed
    a = min(1.0, 3 * d ** -0.5)
    first = q.float()[:, ::group_of][:, :kv_heads] if kv_heads <= heads else torch.randn(b, kv_heads, d, generator=g)
    k = (a * first + (1 - a * a) ** 0.5 * torch.randn(b, kv_heads, d, generator=g)).to(dtype)
    v = _random(g, b, kv_heads, d, dtype=dtype)
    qkv = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=1)[:, None]
    q_norm, k_norm = ((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
    angles = torch.arange(d // 2, dtype=torch.float32) * 0.37 + 0.1
    angles = torch.cat((angles, angles))
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    if group:
        codes = [torch.randint(-127, 128, (b, kv_heads, cap, d), generator=g, dtype=torch.int8) for _ in range(2)]
        scales = [torch.rand(b, kv_heads, cap, d // group, generator=g) * 0.02 + 0.001 for _ in range(2)]
        caches, values = codes, [(c.float().unflatten(-1, (d // group, group)) * s[..., None]).flatten(-2)
                                 for c, s in zip(codes, scales)]
    else:
        caches = [_random(g, b, kv_heads, cap, d, dtype=dtype) for _ in range(2)]
        scales, values = None, [c.float() for c in caches]
    want_q, want_k = (_rotated(_normed(t, w, eps), cos, sin) for t, w in ((q, q_norm), (k, k_norm)))

    def on_device():
        return ([c.clone().to(device) for c in caches],
                None if scales is None else tuple(t.clone().to(device) for t in scales))

    pos_d, qkv_d = torch.tensor([pos], device=device), qkv.to(device)
    args = (q_norm.to(device), k_norm.to(device), eps, cos.to(device), sin.to(device))
    ulp, near = _ULP[dtype], _near(dtype)
    (ck, cv), sc = on_device()
    rotated = attention_kernels.prepare(qkv_d[:, 0, :heads * d], qkv_d[:, 0, heads * d:(heads + kv_heads) * d],
                                        qkv_d[:, 0, (heads + kv_heads) * d:], *args, ck, cv, pos_d, heads,
                                        kv_heads, d, sc)
    results = [(_off(rotated.reshape(b, heads, d), want_q, near, 1e-6), "the preparation's queries")]
    runs = [("the preparation", ck, cv, sc, None)]
    if whole:
        runs.append(("the preparation and decode", ck, cv, sc,
                     attention_kernels.decode(rotated, ck, cv, pos_d, cap, scale, scales=sc)))
        (ck2, cv2), sc2 = on_device()
        runs.append(("the whole step", ck2, cv2, sc2,
                     attention_kernels.step(qkv_d.view(b, -1), *args, ck2, cv2, pos_d, cap, scale, heads, sc2)))
    for name, ck_, cv_, sc_, out in runs:
        new_k, new_v = (_read_back(c, t, pos, group) for c, t in zip((ck_, cv_), sc_ or (None, None)))
        results.append((_written_off(new_k, want_k, group, dtype), f"{name}'s key written"))
        results.append((_written_off(new_v, v, group, dtype), f"{name}'s value written"))
        if out is None:
            continue
        keys = torch.cat((values[0][:, :, :pos], new_k.double()[:, :, None]), dim=2)
        vals = torch.cat((values[1][:, :, :pos], new_v.double()[:, :, None]), dim=2)
        want = _attend(want_q.double(), keys.double(), vals.double(), scale)
        # the output's own rounding (relative), the softmax weights rounded to the compute dtype for the
        # values (absolute: a quarter unit of the weights) and from an 8-bit cache the keys and values
        # too (half a unit); float32: the exponentials and the sums' order
        rounding = max(ulp / 4 + (ulp / 2 if group else 0.0), 2.0 ** -16)
        results.append((_off(out.reshape(b, heads, d), want, max(ulp, 2.0 ** -16),
                             float(rounding * vals.abs().mean())), f"{name}'s attention"))
    return max(results)


def _read_back(cache: torch.Tensor, scales: torch.Tensor | None, pos: int, group: int) -> torch.Tensor:
    """Position pos of every row and head of a cache [B, H, cap, D], as values (codes times scales)."""
    at = cache[:, :, pos].cpu()
    if scales is None:
        return at
    return (at.float().unflatten(-1, (-1, group)) * scales[:, :, pos].cpu()[..., None]).flatten(-2)


def _written_off(got: torch.Tensor, want: torch.Tensor, group: int, dtype: torch.dtype) -> float:
    """A written head against the torch arithmetic's (`_near`), or for an 8-bit cache within half a
    step of its group's scale (largest magnitude / 127) more."""
    near = _near(dtype)
    if not group:
        return _off(got, want, near, 1e-6)
    step = want.double().unflatten(-1, (-1, group)).abs().amax(-1, keepdim=True) / 127
    step = step.expand(*step.shape[:-1], group).flatten(-2)
    diff = (got.double() - want.double()).abs()
    return float((diff / (0.5 * step * (1 + 2 * near) + near * want.double().abs() + 1e-12)).max())


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, D] over keys, values [B, kv_heads, L, D] (query head h reads key head h // (heads
    / kv_heads)), in q's dtype."""
    b, heads, d = q.shape
    kv = keys.shape[1]
    scores = (q.reshape(b, kv, heads // kv, d) @ keys.transpose(-1, -2)) * scale
    return (scores.softmax(-1) @ values).reshape(b, heads, d)


def _short(device, dtype, heads, d, s, cap):
    """The depth decoder's attention of s new rows over a cache of `cap` positions written up to its
    end, causal among the new rows."""
    from . import attention_kernels

    g = torch.Generator().manual_seed(3)
    b, at, scale = 2, cap - s, d ** -0.5
    q, k, v = (_random(g, b, s, heads * d, dtype=dtype) for _ in range(3))
    ck, cv = (_random(g, b, heads, cap, d, dtype=dtype) for _ in range(2))
    ck_d, cv_d = ck.to(device), cv.to(device)
    out = attention_kernels.short(q.to(device), k.to(device), v.to(device), ck_d, cv_d, at, scale)
    keys, vals = ck.clone(), cv.clone()
    keys[:, :, at:] = k.view(b, s, heads, d).transpose(1, 2)
    vals[:, :, at:] = v.view(b, s, heads, d).transpose(1, 2)
    qd = q.view(b, s, heads, d).transpose(1, 2).double()
    scores = (qd @ keys.double().transpose(-1, -2)) * scale
    causal = torch.arange(cap)[None, :] <= (at + torch.arange(s))[:, None]
    want = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vals.double()).transpose(1, 2).reshape(b, s, -1)
    lo = max(_ULP[dtype], 2.0 ** -16)  # as `_attention`'s
    return max((_off(ck_d, keys, 0.0, 0.0), "the keys written"), (_off(cv_d, vals, 0.0, 0.0), "the values written"),
               (_off(out, want, lo, float(2 * lo * vals.abs().double().mean())), "the attention"))


def _table(qtype_name: str, rows: int, k: int, g: torch.Generator, device) -> tuple:
    """A random table of `qtype` [rows, k] as a step reads it (GGUF block rows, or floats) on
    `device`, its kind (type code, row stride) and its values."""
    from gguf import GGMLQuantizationType as QT

    from ...formats.gguf.quants import dequantize, random_blocks
    from .kernels import CODES, FLOAT_DTYPES

    qtype = QT[qtype_name]
    if qtype in FLOAT_DTYPES:
        table = _random(g, rows, k, dtype=FLOAT_DTYPES[qtype])
        values = table.float()
    else:
        table = random_blocks(qtype, rows, k, generator=g)
        values = dequantize(table, qtype, (rows, k))
    return table.to(device), (CODES[qtype], table.stride(0)), values


def _lookup(device, dtype, qtype_name, k, repeat, index_dtype):
    from . import lookup_kernels

    g = torch.Generator().manual_seed(4)
    table, kind, values = _table(qtype_name, 8, k, g, device)
    codes = torch.tensor([5, 1, 7, 3])
    got = lookup_kernels.rows(table, kind, codes.to(device, index_dtype), k, dtype, repeat=repeat, add=-1)
    want = values[codes - 1].repeat_interleave(repeat, dim=0).to(dtype)
    return _off(got, want, _ULP[dtype], 0.0), "the rows"


def _feedback(device, dtype, lm_name, audio_name, k, ncb, repeat, index_dtype):
    from . import lookup_kernels

    g = torch.Generator().manual_seed(5)
    offset, vocab, songs = 3, 6, 2
    lm, lm_kind, lm_values = _table(lm_name, offset + 8, k, g, device)
    audio, audio_kind, audio_values = _table(audio_name, (ncb - 1) * vocab, k, g, device)
    frame = torch.stack([torch.randint(0, 8, (songs,), generator=g)] +
                        [torch.randint(0, vocab, (songs,), generator=g) for _ in range(ncb - 1)], dim=1)
    got = lookup_kernels.feedback(lm, lm_kind, audio, audio_kind, frame.to(device, index_dtype), offset, vocab, k,
                                  dtype, repeat)
    rows = []
    for codes in frame:  # torch's arithmetic in dtype: the LM row, the acoustic rows summed in float32
        acc = sum(audio_values[int(c) + (j - 1) * vocab].to(dtype).float() for j, c in enumerate(codes[1:], 1))
        rows.append((lm_values[int(codes[0]) + offset].to(dtype) + acc.to(dtype)) * ncb ** -0.5)
    want = torch.stack(rows).repeat_interleave(repeat, dim=0)[:, None]
    return _off(got, want, _ULP[dtype], 0.0), "the frame's input"


def _draw(device, dtype, n, rows_per_song, gate, coded, excluded):
    """Guided top-k draws over n logits against the float64 chain, 64 songs (logits and exponentials
    read from rows wider than n, as the frame's are): the index drawn must have a ratio p / q within
    float32's rounding of the best (1e-5 relative); with `coded`, its code (clamped at 0) and END flag
    as `semantic_draw` makes them from such an index. Most songs' exponentials are tiny at one column
    a wrong kernel would draw, or a right one must: the excluded column a kernel ignoring exclusions
    would rank first, the one ranked top_k + 1, the best gated out, the one ranked top_k, the last
    conditional logit the gate keeps and the first it does not."""
    from . import draw_kernels

    g = torch.Generator().manual_seed(6)
    songs, cfg, top_k = 64, 1.7, max(1, min(50, n // 2))
    wide = (torch.randn(songs * rows_per_song, n + 3, generator=g) * 0.5).to(dtype)  # flat: every draw counts
    logits = wide[:, :n]
    mask = torch.zeros(n, dtype=torch.bool)
    if excluded:
        mask[torch.randperm(n, generator=g)[:max(1, n // 8)]] = True
    rows = logits.float().view(songs, rows_per_song, n)
    unguided = rows[:, 1] + (rows[:, 0] - rows[:, 1]) * cfg if rows_per_song == 2 else rows[:, 0]
    c = rows[:, 0].masked_fill(mask, float("-inf"))
    guided = rows[:, 1] + (c - rows[:, 1]) * cfg if rows_per_song == 2 else c
    gated_out = c < c.topk(top_k, dim=-1).values[:, -1:] if gate else torch.zeros_like(c, dtype=torch.bool)
    guided = guided.masked_fill(gated_out, float("-inf"))
    fill = float(draw_kernels.NAN_FILL.value)  # the reference's nan_to_num bounds
    guided = guided.masked_fill(mask, float("-inf")).nan_to_num(-fill, fill, -fill)
    p = guided.double().masked_fill(guided < guided.topk(top_k, dim=-1).values[:, -1:], float("-inf")).softmax(-1)
    q_wide = torch.empty(songs, n + 5).exponential_(1.0, generator=g)
    q = q_wide[:, :n]
    order = guided.argsort(dim=-1, descending=True, stable=True)
    for song in range(songs):
        traps = [order[song, top_k - 1]]  # ranked top_k: drawn (a kernel keeping top_k - 1 would not)
        if n > top_k:
            traps.append(order[song, top_k])  # ranked top_k + 1: kept only where it ties the k-th
        if excluded:
            traps.append(unguided[song].masked_fill(~mask, float("-inf")).argmax())
        if gate and gated_out[song].any():
            traps.append(unguided[song].masked_fill(~gated_out[song] | mask, float("-inf")).argmax())
            by_c = c[song].argsort(descending=True, stable=True)
            traps += [by_c[top_k - 1], by_c[top_k]]  # the last conditional logit the gate keeps, the first it does not
        if song % 5:  # one song in five keeps its plain exponentials
            q[song, traps[song % len(traps)]] = 1e-6
    start, offset, end_id = 2, 5, 9  # codes: the index - 3, at least 0; END: the index 7
    drawn = draw_kernels.draw(wide.to(device)[:, :n], rows_per_song, cfg, top_k, q_wide.to(device)[:, :n],
                              mask.to(device) if excluded else None, gate, (start, offset, end_id) if coded else None)
    ratio = p / q.double()
    best = ratio.max(-1).values
    fair = ratio >= best[:, None] * (1 - 1e-5)  # the indices a right kernel may draw: the best, to rounding
    if coded:
        codes, end = (t.cpu() for t in drawn)
        index = torch.arange(n)
        made = ((index + start - offset).clamp_min(0)[None, :] == codes[:, None]) & \
            ((index + start == end_id)[None, :] == end[:, None])
        return (0.0 if bool((made & fair).any(-1).all()) else float("inf")), "the codes and END flags drawn"
    got = drawn.cpu()
    if not bool(((got >= 0) & (got < n)).all()):
        return float("inf"), "the index drawn"
    at = ratio.gather(1, got[:, None])[:, 0]
    return float(((best - at) / (1e-5 * best)).max()), "the index drawn"


CHECKS: dict[str, Callable] = {"norms": _norms, "rope": _rope, "attention": _attention, "short": _short,
                               "lookup": _lookup, "feedback": _feedback, "draw": _draw}
