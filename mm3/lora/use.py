"""How an adapter is used on one component, as a replay request records it (its `loras` field).

One entry per adapter and component: `{"file", "fingerprint", "component": "lm" | "dit",
"strength", "groups": {"attn_qk", "attn_vo", "mlp"}}`. The layer's scale is the file's alpha /
rank times `strength` times its group's strength (the DiT's other layers: `strength` alone). A
request written by hand may leave out `fingerprint`, `component` (then every component the file
changes), `strength` (1) and any group (1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..formats.fingerprint import is_fingerprint
from .keys import GROUPS, KINDS, NAMES, group_of

ENTRY_KEYS = ("file", "fingerprint", "component", "strength", "groups")
PLAIN = tuple((g, 1.0) for g in GROUPS)


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {json.dumps(value) if _jsonable(value) else value!r}")
    return float(value)


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class LoraUse:
    """One adapter on one component: `file` as named (a path on the command line, a name in
    ComfyUI's models/loras), its fingerprint, the strength and the group strengths."""

    file: str
    fingerprint: str
    component: str
    strength: float = 1.0
    groups: tuple[tuple[str, float], ...] = PLAIN

    def scale(self, layer: str) -> float:
        """The multiplier of the file's own scale on engine layer `layer`."""
        group = group_of(layer)
        return self.strength * dict(self.groups).get(group, 1.0)

    def to_dict(self) -> dict:
        return {"file": self.file, "fingerprint": self.fingerprint, "component": self.component,
                "strength": self.strength, "groups": dict(self.groups)}

    def describe(self) -> str:
        parts = ", ".join(f"{g} {v:g}" for g, v in self.groups if v != 1.0)
        return f"{self.file} ({self.component}, strength {self.strength:g}{', ' + parts if parts else ''})"


def check_entry(entry, where: str = "loras") -> dict:
    """A request's `loras` item checked and completed (strength, every group); ValueError naming
    the field otherwise. `fingerprint` and `component` stay absent when not given."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object like {{\"file\": \"style.safetensors\", \"strength\": 1}}, "
                         f"got {json.dumps(entry) if _jsonable(entry) else entry!r}")
    unknown = [k for k in entry if k not in ENTRY_KEYS]
    if unknown:
        raise ValueError(f"{where} has an unknown key {json.dumps(unknown[0])} (expected {', '.join(ENTRY_KEYS)})")
    name = entry.get("file")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}.file must name the LoRA file, got {json.dumps(name) if _jsonable(name) else name!r}")
    out = {"file": name}
    for key in ("fingerprint", "component"):
        value = entry.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise ValueError(f"{where}.{key} must be a string, got {json.dumps(value)}")
        if key == "fingerprint" and not is_fingerprint(value):
            raise ValueError(f"{where}.fingerprint must be \"<size>-<16 hex digits>\", got {json.dumps(value)}")
        if key == "component" and value not in KINDS:
            raise ValueError(f"{where}.component must be one of {', '.join(KINDS)}, got {json.dumps(value)}")
        out[key] = value
    out["strength"] = _number(entry.get("strength", 1.0), f"{where}.strength")
    groups = entry.get("groups", {})
    if not isinstance(groups, dict):
        raise ValueError(f"{where}.groups must be an object of {', '.join(GROUPS)}, got {json.dumps(groups)}")
    for g in groups:
        if g not in GROUPS:
            raise ValueError(f"{where}.groups has an unknown group {json.dumps(g)} (expected {', '.join(GROUPS)})")
    out["groups"] = {g: _number(groups.get(g, 1.0), f"{where}.groups.{g}") for g in GROUPS}
    return out


def check_entries(value) -> list[dict]:
    """A request's whole `loras` field checked (`check_entry` for each)."""
    if not isinstance(value, list):
        raise ValueError(f"loras must be a list of objects, got {json.dumps(value) if _jsonable(value) else value!r}")
    return [check_entry(e, f"loras[{i}]") for i, e in enumerate(value)]


def use_of(entry: dict, component: str, fingerprint: str) -> LoraUse:
    """The `LoraUse` of a checked entry on `component`, with the file's fingerprint."""
    groups = tuple((g, float(entry["groups"][g])) for g in GROUPS)
    return LoraUse(entry["file"], fingerprint, component, float(entry["strength"]), groups)


def recorded_uses(entries: list, component: str) -> list[dict]:
    """The checked entries of `component` among a request's `loras` (those without one count for
    every component)."""
    return [e for e in check_entries(entries) if e.get("component", component) == component]


def lora_mismatch(recorded: list, component: str, uses) -> str | None:
    """Why the adapters `uses` on `component` may not be those a replay request records, or None.
    Compared by fingerprint (else file name), strength and group strengths."""
    want = recorded_uses(recorded, component)

    def same(e, u: LoraUse) -> bool:
        named = e.get("fingerprint") == u.fingerprint if e.get("fingerprint") else e["file"] == u.file
        return named and e["strength"] == u.strength and all(e["groups"][g] == v for g, v in u.groups)

    if len(want) == len(uses) and all(same(e, u) for e, u in zip(want, uses)):
        return None
    had = ", ".join(use_of(e, component, e.get("fingerprint", "")).describe() for e in want) or "none"
    now = ", ".join(u.describe() for u in uses) or "none"
    return f"LoRAs on the {NAMES[component]}: this song was made with {had}, this run uses {now}; the audio can differ"


def parse_flag(text: str) -> dict:
    """`PATH[:STRENGTH[:QK,VO,MLP]]` (the command line's --lora) as a request entry."""
    path, strength, groups = text, 1.0, None
    head, _, last = text.rpartition(":")
    if head and _is_groups(last):
        groups, text = last, head
        head, _, last = text.rpartition(":")
    if head and _is_float(last):
        path, strength = head, float(last)
    elif groups is not None:
        raise ValueError(f"--lora {text}:{groups}: group strengths follow a strength (PATH:STRENGTH:QK,VO,MLP)")
    else:
        path = text
    entry = {"file": path, "strength": strength}
    if groups is not None:
        values = [float(v) for v in groups.split(",")]
        entry["groups"] = dict(zip(GROUPS, values))
    if not math.isfinite(strength):
        raise ValueError(f"--lora {text}: the strength must be a finite number")
    return entry


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _is_groups(text: str) -> bool:
    values = text.split(",")
    return len(values) == len(GROUPS) and all(_is_float(v) for v in values)
