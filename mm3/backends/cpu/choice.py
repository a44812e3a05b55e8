"""The AR stage's CPU product forms and thread count, measured on the machine that runs them.

Which way of reading quantized weights is fastest (`mm3.backends.cpu.forms`: the int4 planes, the
integer kernel built on the machine, a dequantization per product, kept float copies; `F.linear` or
weight-major) and how many threads pay differ between processors and with what else the machine runs, and a product timed alone
with its weight hot in cache says little about a frame that reads every weight in turn. So at
the first plan on a machine every candidate (a form, a thread count) runs whole AR frames on
scratch state (its own KV cache and draws: the song is untouched), in turns of a few frames,
the candidates alternating; each frame's products are also timed per component, which proposes
one more candidate mixing the fastest form of the LM with that of the depth decoder. The fastest
whole frame wins (or one with fewer threads within 10 % of it: they stall less when the machine's
load rises). The choice is cached on disk (`cache_file`), keyed by the processor, its core
count, torch's version, the compute dtype, the thread setting and each component's weight types
and size, so later runs and the same seed get the same choice and the same audio.

`MM3_CPU_PRODUCT` names one form instead (no timing). A thread count the user set (through
`torch.set_num_threads`, `OMP_NUM_THREADS` or `MKL_NUM_THREADS`) is kept and only the forms are
timed; otherwise the chosen count serves the AR stage (`threads`) and is given back after it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from ... import switches
from ...bounded import MAX_RECORD_BYTES, loads, read_bytes
from ...cache_dir import cache_dir, clear_stale, writable
from ...progress import Cancelled, Progress
from ...weights.copies import cache_dequantized, put_back, set_aside
from ...weights.layers import FLOAT_TYPES, Linear, choose_products, fused_layers
from . import int4 as cpu_int4
from . import native as cpu_native
from .forms import DEFAULT, FORMS, PACKED, Clock, Serving, TooSlow, packed_kernel

log = logging.getLogger(__name__)

ENV_FORM = "MM3_CPU_PRODUCT"
CACHE_NAME = "cpu-products.json"
CACHE_VERSION = 1
COMPONENTS = ("lm", "depth")
ROUNDS = 3  # turns per candidate (the slow ones leave after the second: one turn may meet a burst of load)
PRUNE_AFTER = 2  # rounds every candidate runs
TURN_FRAMES = 3  # frames per turn; the first settles the switch and is not counted
KEEP_WITHIN = 1.25  # after PRUNE_AFTER rounds, candidates slower than this times the fastest leave
SLOW_LIMIT = 3.0  # a turn slower than this times the fastest is cut short
FEWER_THREADS = 1.1  # fewer threads win when within this factor of the fastest (they stall less when the load rises)
STALE_SECONDS = 60  # a cache temporary older than this was left by a killed process (writing takes milliseconds)
PACKED_BYTES_PER_VALUE = 1.25  # the most a packing for int4 or the native kernel takes (two int4 planes and their pairs)


def _one_packing_at_a_time(models: dict, forms: list[str], room: int) -> bool:
    """Whether the timing must hold one packing at a time: both packed forms are timed and a
    second packing of the weights the native kernel reads would not fit in `room` bytes (the
    weight budget less the copies kept for the `copy` forms). Each switch then packs again, in
    the turn's first frame, which is not counted."""
    if not {"int4", "native"} <= set(forms):
        return False
    cpu = torch.device("cpu")
    values = sum(layer.in_features * layer.out_features for m in models.values() for layer in _linears(m)
                 if cpu_native.serves(layer, layer.qtype("weight"), cpu))
    return PACKED_BYTES_PER_VALUE * values > room

STAGE = "cpu"  # the timing's progress stage (`mm3.progress.STAGES`)


@dataclass
class Choice:
    """The form of each component's few-row products (`cpu_forms.FORMS` names), the thread count
    the AR stage runs at (None: whatever torch has), where it came from ("measured", "cached",
    "named") and, when measured, every candidate's ms per frame (`stopped`: the candidates cut
    short, whose figure is a lower bound)."""

    forms: dict[str, str]
    threads: int | None = None
    source: str = "measured"
    ms_per_frame: dict[str, float] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return _label(self.forms, self.threads)

    def line(self) -> str:
        """One line: which form serves and how fast each candidate was."""
        if not self.ms_per_frame:
            return f"CPU products of the AR stage: {self.label} ({self.source})"
        timed = ", ".join(f"{k} {'>' if k in self.stopped else ''}{v:.1f}"
                          for k, v in sorted(self.ms_per_frame.items(), key=lambda kv: kv[1]))
        return f"CPU products of the AR stage: {self.label} serves ({self.source}; ms per frame: {timed})"

    def to_json(self) -> dict:
        return {"forms": self.forms, "threads": self.threads, "ms_per_frame": self.ms_per_frame,
                "stopped": self.stopped}

    @classmethod
    def from_json(cls, d: dict, source: str = "cached") -> "Choice":
        forms = d["forms"]
        if not isinstance(forms, dict) or not forms or any(
                c not in COMPONENTS or f not in FORMS for c, f in forms.items()):
            raise ValueError(f"forms {forms!r}")
        threads = d.get("threads")
        most = max(usable_cores(), torch.get_num_threads())
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"threads {threads!r}: not a count")
        if threads is not None and threads > most:
            raise ValueError(f"threads {threads}: more than the {most} this process runs on")
        return cls(dict(forms), threads, source, {str(k): float(v) for k, v in d.get("ms_per_frame", {}).items()},
                   [str(k) for k in d.get("stopped", [])])


def _label(forms: dict[str, str], threads: int | None) -> str:
    names = set(forms.values())
    form = names.pop() if len(names) == 1 else " + ".join(f"{c} {forms[c]}" for c in COMPONENTS if c in forms)
    return form if threads is None else f"{form} x{threads}"


# -- the machine ----------------------------------------------------------------------------------
@functools.cache
def processor() -> str:
    """The processor's model name (Linux: /proc/cpuinfo; elsewhere what Python reports), read once."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """The logical CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def physical_cores() -> int:
    """The physical cores among `usable_cores` (Linux topology; elsewhere the logical count)."""
    try:
        cpus = os.sched_getaffinity(0)
        seen = set()
        for cpu in cpus:
            topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            seen.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        return len(seen) or usable_cores()
    except (AttributeError, OSError):
        return usable_cores()


def user_threads() -> int | None:
    """The thread count the user set, or None where torch runs at its default: a thread
    variable in the environment, or a count that is neither the physical nor the logical cores
    (what torch starts with). ComfyUI has no thread setting of its own; its users set these."""
    if any(os.environ.get(v, "").strip() for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return torch.get_num_threads()
    n = torch.get_num_threads()
    return None if n in (physical_cores(), usable_cores()) else n


def thread_counts() -> list[int]:
    """The thread counts to time: the user's, else 1, 2, 4, ... up to and with every physical core."""
    fixed = user_threads()
    if fixed is not None:
        return [fixed]
    cores = physical_cores()
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return counts + [cores]


# -- the cache ------------------------------------------------------------------------------------
def cache_file() -> Path:
    return cache_dir() / CACHE_NAME


def _linears(model) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear) and m.qtype("weight") is not None]


def weight_types(model) -> list[str]:
    """The weight types of a model's products, sorted."""
    return sorted({m.qtype("weight").name for m in _linears(model)})


def key(models: dict, dtype: torch.dtype, threads: int | None = None) -> str:
    """The cache key of a choice: processor, usable cores, torch, dtype, the thread setting
    (`user_threads`), per component its weight types and millions of weight values, and where a
    weight has a type the native kernel reads, that kernel's build (a compiler installed or
    removed times again)."""
    parts = [f"cpu={processor()}", f"cores={usable_cores()}", f"torch={torch.__version__}",
             f"dtype={str(dtype).removeprefix('torch.')}", f"threads={'auto' if threads is None else threads}"]
    for name in COMPONENTS:
        if name in models:
            values = sum(m.in_features * m.out_features for m in _linears(models[name]))
            parts.append(f"{name}={','.join(weight_types(models[name]))}:{values / 1e6:.1f}M")
    if any(m.qtype("weight") in cpu_native.TYPES for model in models.values() for m in _linears(model)):
        parts.append(f"native={cpu_native.vector_bits()}")  # the integer kernel, as built here (-1: none)
    return "; ".join(parts)


def _read() -> dict:
    path = cache_file()
    if not path.exists():
        return {}
    try:
        data = loads(read_bytes(path, MAX_RECORD_BYTES, "the cache record"), "the cache record")
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("choices"), dict):
            raise ValueError("not a cache of this version")
        return data["choices"]
    except (OSError, ValueError) as e:
        log.warning("ignoring the CPU product cache %s (%s); timing again", path, e)
        return {}


def cached_entry(cache_key: str):
    """The entry stored under `cache_key` in the CPU record (the forms' choices and the other CPU
    measurements, `mm3.backends.cpu.bf16`), None without one."""
    return _read().get(cache_key)


def cached(cache_key: str) -> Choice | None:
    """The choice stored under `cache_key`, None without one (a damaged entry is warned about)."""
    entry = cached_entry(cache_key)
    if entry is None:
        return None
    try:
        return Choice.from_json(entry)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # AttributeError: a list where a mapping goes
        log.warning("ignoring the cached CPU product choice for this machine in %s (%s); timing again",
                    cache_file(), e)
        return None


def store(cache_key: str, choice: Choice) -> None:
    """Write `choice` under `cache_key` (`store_entry`)."""
    store_entry(cache_key, choice.to_json())


def store_entry(cache_key: str, entry: dict) -> None:
    """Write `entry`, dated, under `cache_key` in the CPU record (the forms' choices and the other
    CPU measurements, atomically; a folder or file that cannot be written is warned about, and no
    temporary is left)."""
    if writable() is None:  # warned once: the measurement holds for this process
        return
    path = cache_file()
    if path.exists() and not path.is_file():
        log.warning("cannot write the CPU record %s (not a file); the measurement holds for this process", path)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    clear_stale(path.parent, f".{path.name}.*.tmp", STALE_SECONDS)
    try:
        choices = _read()
        choices[cache_key] = {**entry, "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "choices": choices}, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write the CPU record %s (%s); the measurement holds for this process", path,
                    e.strerror or e)
        tmp.unlink(missing_ok=True)


_MEMO: dict[str, Choice] = {}  # this process's choices by key


def forget() -> None:
    """Drop this process's choices (the next plan reads the disk cache again)."""
    _MEMO.clear()


# -- applying a choice ----------------------------------------------------------------------------
def named_form() -> str | None:
    """The form `MM3_CPU_PRODUCT` names, None for "auto" or unset (an unknown name is warned about)."""
    value = switches.value(ENV_FORM)
    return None if value == "auto" else value


def apply(forms: dict[str, str], models: dict, clock: Clock | None = None, free: bool = True) -> None:
    """Give every product layer of each model its component's form (and `clock`, while timing).
    With `free`, the packings (`cpu_forms.PACKED`) that layers no longer read are freed."""
    for name, model in models.items():
        form = FORMS[forms.get(name, DEFAULT.name)]
        for layer in _linears(model):
            now = layer.cpu_form
            if now is None or now.form != form or now.component != name or now.clock is not clock:
                layer.cpu_form = Serving(form, name, clock)
        if free:
            _free_packings(model)


def _free_packings(model) -> None:
    """Free the packings the model's layers (and fused layers) do not read in their forms."""
    cpu = torch.device("cpu")
    for layer in _linears(model):
        layer.drop_packing(keep=packed_kernel(layer, layer.qtype("weight"), cpu))
    for fused in fused_layers(model):
        first = fused.parts[0]
        fused.drop_packing(keep=packed_kernel(first, first.qtype("weight"), cpu))


def threads(choice: Choice | None):
    """The block at the choice's thread count (torch's count restored after)."""
    return at_threads(None if choice is None else choice.threads)


@contextmanager
def at_threads(count: int | None):
    """The block at `count` torch threads (None: as it is), torch's count restored after."""
    before = torch.get_num_threads()
    if count is not None and count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def applies(models: dict, device: torch.device) -> bool:
    """Whether the models take CPU forms: on the CPU, in the fast numerics."""
    return torch.device(device).type == "cpu" and all(getattr(m, "numerics", "fast") == "fast" for m in models.values())


def serve(models: dict, dtype: torch.dtype, device: torch.device, frames: Callable[[], "FrameRunner"], *,
          budget: int, progress: Progress | None = None, fresh: bool = False) -> Choice | None:
    """The choice for these models (`MM3_CPU_PRODUCT`, this process's, the disk cache's, or
    measured now with the scratch frames `frames()` makes, then stored), applied to them; None
    where no CPU form applies. `fresh`: measured now whatever is cached, and kept for this
    process only (the benchmark)."""
    if not applies(models, device):
        return None
    named = named_form()
    if named is not None:
        choice = Choice({name: named for name in models}, None, "named")
    else:
        cache_key = key(models, dtype, user_threads())
        choice = None if fresh else _MEMO.get(cache_key) or cached(cache_key)
        if choice is None:
            choice = measure(models, frames(), dtype, budget=budget, threads=thread_counts(), progress=progress)
            log.info("%s", choice.line())
            if not fresh:
                store(cache_key, choice)
        _MEMO[cache_key] = choice
    apply(choice.forms, models)
    return choice


# -- measuring ------------------------------------------------------------------------------------
class FrameRunner(Protocol):
    """What `measure` times: `run(n)` runs n whole AR frames on scratch state (`mm3.plan.ar.ScratchFrames`)
    and returns each one's seconds."""

    def run(self, n: int) -> list[float]: ...


@dataclass
class Candidate:
    forms: dict[str, str]
    threads: int
    turns: list[float] = field(default_factory=list)  # seconds per frame of each turn
    parts: list[dict[str, float]] = field(default_factory=list)  # per turn: seconds per frame of each component's products
    cut: list[bool] = field(default_factory=list)  # per turn: ran past SLOW_LIMIT times the fastest (a lower bound)

    @property
    def label(self) -> str:
        return _label(self.forms, self.threads)

    @property
    def best(self) -> float:
        return min(self.turns) if self.turns else float("inf")

    @property
    def best_parts(self) -> dict[str, float] | None:
        """Seconds per frame of each component's products in the best turn not cut short."""
        whole = [(t, p) for t, p, cut in zip(self.turns, self.parts, self.cut) if not cut]
        return min(whole, key=lambda tp: tp[0])[1] if whole else None

    @property
    def stopped(self) -> bool:
        """Whether the best figure is a lower bound (every turn was cut short)."""
        return bool(self.cut) and all(self.cut)


def candidate_forms(models: dict, dtype: torch.dtype, budget: int) -> list[str]:
    """The forms that differ for these models: int4 and the native kernel where a weight type has
    them, copies where a weight needs converting and memory allows, dequantization (or the
    floats as they are) always."""
    layers = [layer for m in models.values() for layer in _linears(m)]
    cpu = torch.device("cpu")
    int4 = any(cpu_int4.serves(layer, layer.qtype("weight"), cpu) for layer in layers)
    native = any(cpu_native.serves(layer, layer.qtype("weight"), cpu) for layer in layers)  # builds it at most once
    converts = any(not (layer.qtype("weight") in FLOAT_TYPES and FLOAT_TYPES[layer.qtype("weight")] == dtype)
                   for layer in layers)
    out = (["int4"] if int4 else []) + (["native"] if native else [])
    out += ["dequant-linear", "dequant-weight-major"]
    if converts and budget > 0:
        out += ["copy-linear", "copy-weight-major"]
    return out


@torch.inference_mode()
def measure(models: dict, frames: FrameRunner, dtype: torch.dtype, *, budget: int, threads: list[int],
            forms: list[str] | None = None, rounds: int = ROUNDS, turn_frames: int = TURN_FRAMES,
            progress: Progress | None = None) -> Choice:
    """Time every (form, thread count) in whole frames, in alternating turns, and return the
    fastest (`Choice.ms_per_frame`: every candidate's best turn). Copies for the `copy` forms are
    made once within `budget` bytes and set aside while other forms run; a turn that runs past
    SLOW_LIMIT times the fastest is cut short. The models are left with the chosen forms; the
    thread count is given back."""
    progress = progress or Progress()
    forms = forms or candidate_forms(models, dtype, budget)
    modules = [models[name] for name in ("depth", "lm") if name in models]  # the depth decoder's copies first
    candidates = [Candidate({name: f for name in models}, t) for f in forms for t in threads]
    everyone = list(candidates)
    before = torch.get_num_threads()
    outside = set_aside(modules)  # copies someone else keeps: back after the timing
    copies: dict[str, list] = {}  # per component, the copies its `copy` forms read
    done, total = 0, rounds * len(candidates) * turn_frames

    def tick(n: int):
        nonlocal done
        if progress.should_stop():
            raise Cancelled("cancelled while timing the CPU products")
        done += n
        progress.on_progress(STAGE, min(done, total), total, {})

    try:
        kept = 0
        if any(FORMS[f].holds == "copy" for f in forms):
            apply({name: "copy-linear" for name in models}, models, free=False)
            kept = cache_dequantized(modules, dtype, budget)
            copies = {name: set_aside([model]) for name, model in models.items()}
        single = _one_packing_at_a_time(models, forms, budget - kept)
        torch.set_num_threads(max(threads))
        if not single:  # every packing made once, not timed (one at a time: each turn packs its own)
            packed_forms = [f for f in forms if FORMS[f].holds in PACKED]
            total += len(packed_forms)
            for f in packed_forms:
                _use(models, {name: f for name in models}, copies, None, single)
                frames.run(1)
                tick(1)
        held: tuple = ()
        for r in range(rounds):
            shift = r % len(candidates)
            order = candidates[shift:] + candidates[:shift]
            for c in _grouped(order, held) if single else order:
                _turn(c, models, frames, copies, turn_frames, min(x.best for x in everyone), dtype, single)
                held = _packings(c) or held
                tick(turn_frames)
            if r == PRUNE_AFTER - 1:
                candidates = _pruned(candidates, models)
                everyone += [c for c in candidates if not c.turns]
        progress.on_progress(STAGE, total, total, {})
        best = _fastest(candidates)
    finally:
        _stop_clocks(models)
        set_aside(modules)
        del copies
        put_back(outside)
        torch.set_num_threads(before)
    apply(best.forms, models)
    timed = {c.label: round(c.best * 1e3, 1) for c in everyone if c.turns}
    return Choice(dict(best.forms), best.threads, "measured", timed, [c.label for c in everyone if c.stopped])


def _packings(c: Candidate) -> tuple:
    """The packings `c`'s forms read: (component, kernel) pairs; () for forms that read none."""
    return tuple(sorted((name, FORMS[f].holds) for name, f in c.forms.items() if FORMS[f].holds in PACKED))


def _grouped(order: list[Candidate], held: tuple) -> list[Candidate]:
    """`order` with the candidates that read the same packings side by side, those that read the
    `held` ones first, the other groups where their first one came (those that read none switch
    nothing). One packing at a time, each switch packs every weight again (minutes at the
    released sizes): a round then switches once per packing instead of at nearly every turn."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in order:
        groups.setdefault(_packings(c), []).append(c)
    first = [held] if held and held in groups else []
    return [c for key in first + [k for k in groups if k not in first] for c in groups[key]]


def _fastest(candidates: list[Candidate]) -> Candidate:
    """The fastest candidate, or one with fewer threads within FEWER_THREADS of it."""
    fastest = min(c.best for c in candidates)
    near = [c for c in candidates if c.best <= FEWER_THREADS * fastest]
    return min(near, key=lambda c: (c.threads, c.best))


def _turn(c: Candidate, models: dict, frames: FrameRunner, copies: dict, turn_frames: int, fastest: float,
          dtype: torch.dtype = torch.float32, single: bool = False) -> None:
    """One turn of `c`: a frame that settles the switch, then `turn_frames - 1` timed ones, cut
    short past SLOW_LIMIT times the `fastest` seconds per frame so far (`single`: see `_use`). A
    packing the form reads is made before the turn's clock starts: packed again at every switch
    (`single`), a released-size model's would take longer than a slow candidate's whole turn."""
    clock = Clock()
    _use(models, c.forms, copies, clock, single)
    torch.set_num_threads(c.threads)
    choose_products(list(models.values()), dtype, torch.device("cpu"))
    start = time.perf_counter()
    if fastest < float("inf"):
        clock.deadline = start + SLOW_LIMIT * fastest * turn_frames
    try:
        frames.run(1)
        clock.seconds.clear()
        seconds = frames.run(turn_frames - 1)
    except TooSlow:
        c.turns.append((time.perf_counter() - start) / turn_frames)
        c.parts.append({})
        c.cut.append(True)
        return
    c.turns.append(sum(seconds) / len(seconds))
    c.parts.append({k: v / len(seconds) for k, v in clock.seconds.items()})
    c.cut.append(False)


def _use(models: dict, forms: dict[str, str], copies: dict, clock: Clock | None, single: bool = False) -> None:
    """The models in `forms` (their packings kept for later turns; with `single`, a component
    whose form reads a packing keeps that one alone), each component's copies in use where its
    form reads them."""
    if copies:
        set_aside(list(models.values()))
        for name, kept in copies.items():
            if FORMS[forms[name]].holds == "copy":
                put_back(kept)
    apply(forms, models, clock, free=False)
    if single:
        for name, model in models.items():
            if FORMS[forms[name]].holds in PACKED:
                _free_packings(model)


def _stop_clocks(models: dict) -> None:
    for model in models.values():
        for layer in _linears(model):
            if layer.cpu_form is not None and layer.cpu_form.clock is not None:
                layer.cpu_form = Serving(layer.cpu_form.form, layer.cpu_form.component)


def _pruned(candidates: list[Candidate], models: dict) -> list[Candidate]:
    """The candidates within KEEP_WITHIN of the fastest, and one mixing each component's fastest
    form at the fastest thread count when that differs from every candidate."""
    lead = min(candidates, key=lambda c: c.best)
    kept = [c for c in candidates if c.best <= KEEP_WITHIN * lead.best]
    same_threads = [c for c in candidates if c.threads == lead.threads and c.best_parts]
    mixed = {}
    for name in models:
        timed = [c for c in same_threads if name in c.best_parts]
        if timed:
            mixed[name] = min(timed, key=lambda c: c.best_parts[name]).forms[name]
    if len(mixed) == len(models) and all(c.forms != mixed or c.threads != lead.threads for c in candidates):
        kept.append(Candidate(mixed, lead.threads))
    return kept
