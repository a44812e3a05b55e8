"""An adapter file read: its modules (which engine layers, the down and up factors, the scale).

A safetensors file of LoRA factors (`mm3.lora.keys` names them); every tensor must be one, or the
file is refused naming the first that matches no layer. Scale alpha / rank, alpha from (first
found): the module's `.alpha` scalar, the file's metadata (diffusers' `lora_adapter_metadata`
JSON, a bare `lora_alpha` / `alpha`, kohya's `ss_network_alpha`), PEFT's `adapter_config.json`
beside the file (`lora_alpha`, `alpha_pattern`, `use_rslora`: alpha / sqrt(rank)), else the rank
(scale 1, as SimpleTuner trains and HOT-Step, ComfyUI and diffusers read a file without one).
SimpleTuner marks a DiT adapter whose `ff_in` rows are gate first (`swiglu_gate_first`); its up
rows are swapped to the value-first order of the engine's `ff_in`.
"""

from __future__ import annotations

import math
import os
import re
import re._constants as sre_constants
import re._parser as sre_parse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..bounded import BoundError, loads, read_bytes
from ..errors import InputError
from ..filecache import FileCache
from ..formats.fingerprint import file_fingerprint
from ..formats.safetensors_raw import file_entries, read_metadata
from .keys import Target, group_of, split_key, target_of

SUFFIX = ".safetensors"
CONFIG_NAME = "adapter_config.json"  # where PEFT's save_pretrained puts the alpha
MAX_CONFIG_BYTES = 2**20  # PEFT writes a few hundred bytes


class AdapterError(InputError):
    """An adapter file that cannot be read or applied; the message names the file and the value."""


@dataclass(frozen=True, eq=False)
class Module:
    """One adapter module: `down` A [rank, in] and `up` B [rows, rank] in the file's dtype (rows:
    the target layers' together, in order), `scale` alpha / rank."""

    key: str
    target: Target
    down: torch.Tensor = field(repr=False)
    up: torch.Tensor = field(repr=False)
    alpha: float
    scale: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def kind(self) -> str:
        return self.target.kind


@dataclass(frozen=True, eq=False)
class Adapter:
    """An adapter file: `modules` in file order, `layout` (the naming it uses), its fingerprint."""

    path: str
    layout: str
    modules: tuple[Module, ...] = field(repr=False)
    fingerprint: str
    problems: tuple[str, ...] = ()  # what makes it unusable: factors or alphas that are NaN or infinite

    def check_usable(self) -> None:
        """An AdapterError naming the file and its first problem, if it has one."""
        if self.problems:
            more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            raise AdapterError(f"{self.path}: {self.problems[0]}{more}")

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The components it changes ("lm", "dit"), in that order."""
        found = {m.kind for m in self.modules}
        return tuple(k for k in ("lm", "dit") if k in found)

    def of_kind(self, kind: str) -> list[Module]:
        return [m for m in self.modules if m.kind == kind]

    def groups(self, kind: str) -> tuple[str, ...]:
        """The strength groups its layers of `kind` fall in."""
        return tuple(sorted({group_of(layer) for m in self.of_kind(kind) for layer in m.target.layers}))

    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({m.rank for m in self.modules}))


_READ = FileCache(16)
_KINDS = FileCache(512)


def read_adapter(path: str | os.PathLike) -> Adapter:
    """The adapter file at `path` (cached while the file is unchanged)."""
    path = os.fspath(path)
    try:
        return _READ.get(path, lambda st: _read(path))
    except FileNotFoundError:
        raise AdapterError(f"LoRA file {path} not found") from None


def adapter_kinds(path: str | os.PathLike) -> tuple[str, ...]:
    """The components an adapter file changes, from its tensor names alone (header read, cached);
    () when it is no adapter of this model."""
    path = os.fspath(path)
    try:
        return _KINDS.get(path, lambda st: _kinds(path))
    except OSError:
        return ()


def _kinds(path: str) -> tuple[str, ...]:
    try:
        entries = _entries(path)
    except AdapterError:
        return ()
    found = set()
    for key in entries:
        split = split_key(key)
        target = split and target_of(split[0])
        if target is None:
            return ()
        found.add(target.kind)
    return tuple(k for k in ("lm", "dit") if k in found)


def _entries(path: str) -> dict:
    if not path.endswith(SUFFIX):
        raise AdapterError(f"{path}: a LoRA is read from a {SUFFIX} file (convert a .bin or .pt adapter with "
                           "safetensors first)")
    try:
        return file_entries(Path(path))
    except (ValueError, KeyError, OSError) as e:
        raise AdapterError(f"{path}: not a readable safetensors file ({str(e).removeprefix(f'{path}: ')})") from None


def _read(path: str) -> Adapter:
    entries = _entries(path)
    if not entries:
        raise AdapterError(f"{path}: holds no tensors (a LoRA holds lora_A / lora_B factors)")
    parts: dict[str, dict[str, object]] = {}
    for key, entry in entries.items():
        split = split_key(key)
        target = split and target_of(split[0])
        if target is None:
            raise AdapterError(f"{path}: tensor {key} matches no layer of the MiniMax Music 3 LM or DiT (expected "
                               "LoRA factors of their attention and MLP layers, named as PEFT / diffusers, ComfyUI, "
                               "kohya or SimpleTuner write them)")
        parts.setdefault(split[0], {"target": target})[split[1]] = entry
    config = _config(path)
    if config.get("use_dora"):
        raise AdapterError(f"{path}: a DoRA adapter (use_dora); only plain LoRA factors are supported")
    gate_first = str(config.get("swiglu_gate_first", "")).lower() in ("true", "1")
    patterns = _alpha_patterns(config, path)
    modules, seen = [], {}
    for key, p in parts.items():
        target = p["target"]
        if "down" not in p or "up" not in p:
            missing = "up (lora_B)" if "down" in p else "down (lora_A)"
            raise AdapterError(f"{path}: module {key} has no {missing} factor")
        down, up = _factor(p["down"], path), _factor(p["up"], path)
        if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0] or not down.numel() or not up.numel():
            raise AdapterError(f"{path}: module {key} has factors {list(down.shape)} and {list(up.shape)}; expected "
                               "down [rank, in] and up [out, rank], each with at least one value")
        for layer in target.layers:
            if layer in seen:
                raise AdapterError(f"{path}: modules {seen[layer]} and {key} both change {layer}")
            seen[layer] = key
        rank = down.shape[0]
        alpha = _alpha(p.get("alpha"), key, config, patterns, rank, path)
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        if gate_first and target.layers[-1].endswith(".ff_in"):
            half = up.shape[0] // 2
            up = torch.cat((up[half:], up[:half]))
        modules.append(Module(key, target, down, up, alpha, scale))
    layouts = sorted({m.target.layout for m in modules})
    return Adapter(path, " + ".join(layouts), tuple(modules), file_fingerprint(path), _problems(modules))


def _factor(entry, path: str) -> torch.Tensor:
    """A factor as a float tensor; another dtype (integers, 8-bit floats) is refused by name."""
    try:
        return entry.to_torch()
    except ValueError:
        raise AdapterError(f"{path}: tensor {entry.name} is {entry.dtype}; LoRA factors are read as F32, F16, BF16 "
                           "or F64") from None


def _problems(modules) -> tuple[str, ...]:
    """The modules whose alpha or factors hold NaN or infinite values (each makes every output NaN)."""
    out = []
    for m in modules:
        if not math.isfinite(m.alpha) or not math.isfinite(m.scale):
            out.append(f"module {m.key} has alpha {m.alpha:g} (scale {m.scale:g}), not a finite number")
        for name, factor in (("down (lora_A)", m.down), ("up (lora_B)", m.up)):
            bad = int((~torch.isfinite(factor)).sum())
            if bad:
                out.append(f"module {m.key}'s {name} factor holds {bad} NaN or infinite value(s)")
    return tuple(out)


def _alpha(entry, key: str, config: dict, patterns, rank: int, path: str) -> float:
    if entry is not None:
        value = _factor(entry, path)
        if value.numel() != 1:
            raise AdapterError(f"{path}: {key}.alpha holds {value.numel()} values, expected one")
        return float(value.reshape(()).item())
    for pattern, value in patterns:
        if pattern.match(key):
            return value
    alpha = config.get("lora_alpha")
    return float(rank) if alpha is None else float(alpha)


# A PEFT alpha_pattern is a regular expression from the file, matched against every module name. Python's
# `re` backtracks, so a pattern with nested repeats takes exponential time on a name it does not match:
# patterns are refused unless their work stays small (at most MAX_REPEATS repeats, none inside another,
# no alternation inside a repeat, no backreference or lookaround): polynomial of low degree in a name's
# length, which module names bound.
MAX_PATTERN_CHARS = 256
MAX_REPEATS = 2


def _alpha_patterns(config: dict, path: str) -> list[tuple[re.Pattern, float]]:
    raw = config.get("alpha_pattern") or {}
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: alpha_pattern must map patterns to numbers, got {type(raw).__name__}")
    out = []
    for pattern, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise AdapterError(f"{path}: alpha_pattern {pattern!r} has alpha {value!r}, expected a number")
        why = pattern_problem(pattern)
        if why:
            raise AdapterError(f"{path}: alpha_pattern {pattern!r} {why}")
        out.append((re.compile(_anchored(pattern)), float(value)))
    return out


def _anchored(pattern: str) -> str:
    """A pattern as PEFT matches it against a module name: the name's whole tail after a dot."""
    return rf"(.*\.)?({pattern})$"


def pattern_problem(pattern: str) -> str:
    """Why a PEFT alpha_pattern is refused ("" when it is matched): not a regular expression, too
    long, or one whose matching can take more than a small polynomial in the name's length."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"is {len(pattern)} characters long (at most {MAX_PATTERN_CHARS})"
    try:
        sre_parse.parse(pattern)
        parsed = sre_parse.parse(_anchored(pattern))  # as PEFT matches it; "(?i)x" parses alone only
    except (re.error, RecursionError, OverflowError) as e:
        return f"is not a regular expression ({e})"
    try:
        repeats = _repeats(parsed, inside=False) - 1  # the prefix's own .*
    except ValueError as e:
        return str(e)
    if repeats > MAX_REPEATS:
        return f"has {repeats} repeats (at most {MAX_REPEATS}: more can take minutes on a name it does not match)"
    return ""


def _repeats(items, inside: bool) -> int:
    """Unbounded-width repeats in a parsed pattern; a ValueError for a construct that backtracks
    without bound (a repeat or alternation inside a repeat, a backreference, a lookaround)."""
    count = 0
    for op, av in items:
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT):
            _, hi, sub = av
            many = hi > 1
            if many and inside:
                raise ValueError("has a repeat inside a repeat (its matching can take exponential time)")
            count += many + _repeats(sub, inside or many)
        elif op == sre_constants.SUBPATTERN:
            count += _repeats(av[-1], inside)
        elif op == sre_constants.ATOMIC_GROUP:
            count += _repeats(av, inside)
        elif op == sre_constants.BRANCH:
            if inside:
                raise ValueError("has an alternation inside a repeat (its matching can take exponential time)")
            count += sum(_repeats(branch, inside) for branch in av[1])
        elif op in (sre_constants.GROUPREF, sre_constants.GROUPREF_EXISTS):
            raise ValueError("has a backreference (not matched here: its matching can take exponential time)")
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            raise ValueError("has a lookaround (not matched here: its work is unbounded)")
    return count


def _config(path: str) -> dict:
    """The adapter's settings: its metadata, else PEFT's adapter_config.json beside it."""
    meta = read_metadata(path)
    found: dict = {}
    raw = meta.get("lora_adapter_metadata")
    if raw:
        try:
            data = loads(raw, "lora_adapter_metadata")
        except ValueError as e:
            raise AdapterError(f"{path}: its lora_adapter_metadata is not JSON ({e})") from None
        if not isinstance(data, dict):
            raise AdapterError(f"{path}: its lora_adapter_metadata is a JSON {type(data).__name__}, expected an object")
        # diffusers' pipelines prefix each setting with the component ("transformer.lora_alpha").
        found = {k.rsplit(".", 1)[-1] if k.rsplit(".", 1)[-1] in _SETTINGS else k: v for k, v in data.items()}
    for key, name in (("lora_alpha", "lora_alpha"), ("alpha", "lora_alpha"), ("ss_network_alpha", "lora_alpha"),
                      ("swiglu_gate_first", "swiglu_gate_first"),
                      ("transformer.swiglu_gate_first", "swiglu_gate_first")):
        if key in meta and name not in found:
            found[name] = meta[key]
    if "lora_alpha" not in found:
        beside = Path(path).with_name(CONFIG_NAME)
        if beside.is_file():
            try:
                data = loads(read_bytes(beside, MAX_CONFIG_BYTES, "the adapter config"), "the adapter config")
            except BoundError as e:
                raise AdapterError(str(e)) from None
            except ValueError as e:
                raise AdapterError(f"{beside}: not JSON ({e})") from None
            except OSError as e:
                raise AdapterError(f"{beside}: cannot be read ({e.strerror or e})") from None
            if not isinstance(data, dict):
                raise AdapterError(f"{beside}: a JSON {type(data).__name__}, expected an object")
            found = {**data, **found}
    if found.get("lora_alpha") is not None:
        try:
            found["lora_alpha"] = float(found["lora_alpha"])
        except (TypeError, ValueError):
            raise AdapterError(f"{path}: lora_alpha {found['lora_alpha']!r} is not a number") from None
    return found


_SETTINGS = ("lora_alpha", "r", "alpha_pattern", "rank_pattern", "use_rslora", "use_dora", "target_modules")
