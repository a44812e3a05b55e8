"""The files a request names, for the job (`mm3.song.pipeline.Pipeline`, whose base this is):
each model resolved in the models folder and checked before any is loaded (`preflight`), a replay
request pinned to and reconciled with the files at hand (`pin_models`, `match_models`,
`match_loras`), the adapters it sets (`loras`), and what a stage records of a file (`model_file`).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..components import ARCH_OF, KINDS, check_compatible, check_loadable
from ..files.opener import open_component, read_component
from ..formats.fingerprint import file_fingerprint
from ..lora.adapter import read_adapter
from ..lora.attach import Applied, attach, layer_terms
from ..lora.files import find_lora
from ..lora.health import base_shapes, group_changes, warnings_of
from ..lora.keys import KINDS as LORA_KINDS, NAMES as LORA_NAMES
from ..lora.use import check_entries, use_of
from ..plan.ar import max_frames_for
from ..plan.codes import REQUEST_CODES_PER_FRAME, AudioCodesError, parse_audio_codes
from ..plan.lyrics_align import LyricHeads
from ..plan.prompt import Prompt, PromptError, build_prompt
from .numerics import Numerics
from .request import MODEL_FIELDS, MM3Request, RequestError, model_mismatch
from .stages import ModelFile

log = logging.getLogger(__name__)


def _warn_lora_health(applied, path: str, kind: str) -> None:
    """The health warnings of the adapters on one model (`mm3.lora.health`): the weights read once."""
    comp = open_component(path, kind)
    try:
        changes = group_changes(applied, comp)
    finally:
        comp.close()
    what = applied[0].adapter.name if len(applied) == 1 else f"the {len(applied)} LoRAs together"
    for w in warnings_of(changes, what):
        log.warning("%s", w)


class RequestedFiles:
    """The model and adapter files of requests, over the `registry` (the models folder), the
    `store` (its tokenizer) and the `lora_folders` its subclass sets."""

    # -- checks before any model is loaded -----------------------------------------------------------
    def preflight(self, request: MM3Request, kinds: tuple[str, ...] = KINDS,
                  lyric_heads: LyricHeads | None = None) -> Prompt:
        """Everything that can be refused without loading a model: the model names, each file's
        header and tensor table (readable, not truncated, supported tensor types, plausible sizes),
        that the files fit together, the prompt (tokenizer only), the duration against the LM
        context, `audio_codes` against the code ranges, and `lyric_heads` against the LM. Returns
        the prompt. Missing or mis-shaped tensors are found when the model is built."""
        comps = {}
        for kind in kinds:
            comps[kind] = read_component(self.registry.resolve(kind, getattr(request, MODEL_FIELDS[kind])), kind)
            check_loadable(comps[kind])
        check_compatible(comps)
        if lyric_heads is not None and "lm" in comps:
            lyric_heads.resolve(comps["lm"].hparams)
        for kind in LORA_KINDS:  # each adapter fits its model's layers (header shapes), and is warned about
            if kind in comps:  # as `info --base` and the Load LoRA node warn
                applied = self.loras(request, kind)
                layer_terms(applied, base_shapes(comps[kind]))
                if applied:
                    _warn_lora_health(applied, comps[kind].path, kind)
        prompt = self.prompt(request)
        context = comps["lm"].hparams["max_position_embeddings"] if "lm" in comps else None
        if request.audio_codes:
            depth = comps.get("depth")
            if depth is not None and depth.hparams["num_codebooks"] != REQUEST_CODES_PER_FRAME:
                raise RequestError(f"{depth.name} makes {depth.hparams['num_codebooks']} codes per frame; "
                                   f"request audio_codes hold {REQUEST_CODES_PER_FRAME}")
            vocab = depth.hparams["audio_vocab_size"] if depth is not None else 1 << 62
            try:
                codes = parse_audio_codes(request.audio_codes, prompt.codes.num_semantic, vocab)
            except AudioCodesError as e:
                raise RequestError(str(e)) from None
            frames = codes.shape[0] - 1
            for text in (request.source_codes, request.continue_codes):
                if text:
                    try:
                        parse_audio_codes(text, prompt.codes.num_semantic, vocab)
                    except AudioCodesError as e:
                        raise RequestError(str(e)) from None
            if context is not None and prompt.num_tokens + frames > context:
                raise RequestError(f"audio_codes hold {frames} frames; after the {prompt.num_tokens}-token prompt the "
                                   f"LM context of {context} positions leaves room for {context - prompt.num_tokens}")
        elif context is not None:
            try:
                max_frames_for(request.duration, prompt.num_tokens, context)
                if request.continue_codes:
                    depth = comps.get("depth")
                    vocab = depth.hparams["audio_vocab_size"] if depth is not None else 1 << 62
                    parse_audio_codes(request.continue_codes, prompt.codes.num_semantic, vocab)
            except (ValueError, AudioCodesError) as e:
                raise RequestError(str(e)) from None
        return prompt

    def pin_models(self, request: MM3Request, kinds: tuple[str, ...] = KINDS) -> MM3Request:
        """`request` naming the file each of `kinds` resolves to (its name in the models folder)
        with that file's fingerprint, as a replay request records them, and its adapters one entry
        per component with their files' fingerprints."""
        files = [self.model_file(kind, request) for kind in kinds]
        prints = dict(request.model_fingerprints) | {f.request_field: f.fingerprint for f in files}
        loras = [a.use.to_dict() for kind in LORA_KINDS for a in self.loras(request, kind)]
        return replace(request, **{f.request_field: f.name for f in files}, model_fingerprints=prints, loras=loras)

    # -- adapters ---------------------------------------------------------------------------------
    def loras(self, request: MM3Request, kind: str) -> list[Applied]:
        """The adapters `request` sets on the `kind` model, in order: each entry's file (found by
        `mm3.lora.files.find_lora` in `lora_folders`) on the components its entry names, else on
        every one it changes."""
        if kind not in LORA_KINDS:
            return []
        try:
            entries = check_entries(request.loras)
        except ValueError as e:
            raise RequestError(str(e)) from None
        out = []
        for entry in entries:
            path, _ = find_lora(entry["file"], entry.get("fingerprint"), self.lora_folders)
            if path is None:
                raise RequestError(f"LoRA {entry['file']} not found (also looked in {', '.join(self.lora_folders)})")
            adapter = read_adapter(path)
            adapter.check_usable()
            if "component" in entry and entry["component"] not in adapter.kinds:
                held = " and ".join(LORA_NAMES[k] for k in adapter.kinds)
                raise RequestError(f"LoRA {entry['file']} changes the {held}, not the {LORA_NAMES[entry['component']]} "
                                   "its entry names")
            if entry.get("component", kind) == kind and kind in adapter.kinds:
                out.append(Applied(adapter, use_of(entry, kind, adapter.fingerprint)))
        return out

    def match_loras(self, request: MM3Request, *, strict: bool = False) -> tuple[MM3Request, list[str]]:
        """Reconcile the adapters a replay request records with the files at hand: one found elsewhere
        by name or fingerprint is used from there; a missing one is left out; one whose fingerprint
        differs is used as it is. Each such case is a warning, or with `strict` a `RequestError`."""
        try:
            entries = check_entries(request.loras)
        except ValueError as e:
            raise RequestError(str(e)) from None
        kept, warnings = [], []
        for entry in entries:
            path, how = find_lora(entry["file"], entry.get("fingerprint"), self.lora_folders)
            if path is None:
                warnings.append(f"LoRA {entry['file']} is not found (looked in {', '.join(self.lora_folders)}); "
                                "rendering without it, so the audio can differ")
                continue
            found = file_fingerprint(path)
            if how == "fingerprint":
                warnings.append(f"LoRA {entry['file']} is not found; using {path}, which has the same fingerprint")
            elif entry.get("fingerprint") and found != entry["fingerprint"]:
                warnings.append(f"LoRA {entry['file']}: {path} (fingerprint {found}) is not the file that made this "
                                f"song (fingerprint {entry['fingerprint']}); the audio can differ")
            kept.append({**entry, "file": path if how != "path" else entry["file"]})
        if strict and warnings:
            raise RequestError(warnings[0] + " (refused with --strict)")
        return replace(request, loras=kept), warnings

    def _adapted(self, model, kind: str, request: MM3Request, numerics: Numerics):
        """`model` with the request's adapters set (merged as PEFT merges them in the reference
        numerics, beside the weights in the fast ones)."""
        attach(model, self.loras(request, kind), merge=numerics.reference)
        return model

    def match_models(self, request: MM3Request, *, recorded: tuple[str, ...] = tuple(MODEL_FIELDS.values()),
                     strict: bool = False, kinds: tuple[str, ...] = KINDS,
                     loras_recorded: bool = False) -> tuple[MM3Request, list[str]]:
        """Reconcile the files a replay request names with the models folder.

        For each `*_model` field in `recorded` (names read from a request file, not typed by the
        user): a named file that is missing is looked for by its fingerprint (a renamed copy), else
        replaced by the file an empty name picks; a file whose fingerprint differs from the recorded
        one is used as it is. `loras_recorded`: the adapters too (`match_loras`). Each such case is a
        warning, or with `strict` a `RequestError`. Returns the request pinned to the files that
        will be used, and the warnings."""
        warnings, names = [], {}
        if loras_recorded:
            request, warnings = self.match_loras(request)
        for kind in kinds:
            field = MODEL_FIELDS[kind]
            name, want = getattr(request, field), request.model_fingerprints.get(field)
            if field not in recorded or not name or self.registry.find(kind, name) is not None:
                names[field] = name
                if want and field in recorded and name:
                    problem = model_mismatch(request, field, name, file_fingerprint(self.registry.resolve(kind, name)))
                    warnings += [problem] if problem else []
                continue
            same = [n for n in self.registry.buckets[kind] if want and file_fingerprint(self.registry.paths[n]) == want]
            if same:
                names[field] = same[0]
                warnings.append(f"{field} {name} is not in {self._folders()}; using {same[0]}, which has the same "
                                "fingerprint")
                continue
            fallback = self.registry.name_of(self.registry.resolve(kind, ""))
            names[field] = fallback
            warnings.append(f"{field} {name} is not in {self._folders()}; using {fallback} instead, so the audio can "
                            f"differ ({ARCH_OF[kind]} files there: {', '.join(self.registry.buckets[kind])})")
        if strict and warnings:
            raise RequestError(warnings[0] + " (refused with --strict)")
        return self.pin_models(replace(request, **names), kinds), warnings

    def _folders(self) -> str:
        return ", ".join(self.registry.folders)

    def prompt(self, request: MM3Request) -> Prompt:
        """The request's prompt, by the tokenizer of the LM file it names (a `RequestError` where the
        caption or lyrics cannot be sent)."""
        tokenizer = self.store.tokenizer(request.lm_model)
        try:
            return build_prompt(tokenizer, request.caption, request.lyrics)
        except PromptError as e:
            raise RequestError(str(e)) from None

    def model_file(self, kind: str, request: MM3Request) -> ModelFile:
        """The file `request` names for `kind`, as a stage records it."""
        path = self.registry.resolve(kind, getattr(request, MODEL_FIELDS[kind]))
        return ModelFile(kind, self.registry.name_of(path), file_fingerprint(path), read_component(path, kind).hparams,
                         tuple(a.use for a in self.loras(request, kind)))
