"""Engine models under ComfyUI's memory manager, and the `models/mm3` folder.

Each component handle gets one `MM3Patcher`, a `ModelPatcher` sized by the weights' stored
(compressed) size, with the CPU as offload device. ComfyUI's own code moves the engine's leaf layers
(whole, or module by module under --lowvram / --novram); a layer left on the CPU fetches its weight
to the input's device for each use, and one moved back gets the view of the GGUF mapping it was built
on, so unloading copies nothing off the device. The AR group {LM, depth} and the synthesis group
{cond, DiT, vocoder} are never needed together by the stage nodes: loading one unloads the other's,
except keep_loaded ones; MM3 Generate loads all five at once where they fit (`load_together`).
A handle with adapters (MM3 Load LoRA) shares its base's patcher; `load` sets on the engine model
exactly the adapters of the handle being run. ComfyUI's own LoRA patches change float weights in
place, which the engine's compressed weights are not; side products set per run keep every other
branch of the graph on the plain model.
"""

from __future__ import annotations

import logging
import os
import weakref

import comfy.model_management as mm
import comfy.model_patcher
import folder_paths
import torch

from mm3.components import ARCH_OF, DESCRIPTIONS, GROUPS
from mm3.weights.copies import compressed_nbytes
from mm3.song.overlap import fits_together
from mm3.lora.adapter import adapter_kinds
from mm3.lora.attach import attach
from mm3.lora.keys import KINDS as LORA_KINDS
from mm3.files.registry import AUTO, MODEL_SUFFIXES, file_problem, pick_usable
from .handles import ComponentHandle, classify
from .lora_handles import adapters_of, base_of

log = logging.getLogger("mm3")
FOLDER = "mm3"  # models/mm3, plus any `mm3:` entry of extra_model_paths.yaml
OFFLOAD = torch.device("cpu")


# -- models folder ------------------------------------------------------------------------------
def register_model_folder() -> None:
    """`models/mm3` for `.gguf` (and other tools' `.safetensors`) files, merged with dirs an extra_model_paths.yaml already gave the
    key (that file is read before custom nodes load)."""
    base = os.path.join(folder_paths.models_dir, FOLDER)
    dirs, _ = folder_paths.folder_names_and_paths.get(FOLDER, ([], set()))
    merged = [base] + [d for d in dirs if os.path.abspath(d) != os.path.abspath(base)]
    folder_paths.folder_names_and_paths[FOLDER] = (merged, set(MODEL_SUFFIXES))  # other tools' files too


# ComfyUI's own model folders (models/text_encoders and models/clip, models/diffusion_models and
# models/unet, models/vae): their MiniMax Music 3 files are listed as "<folder>/<name>".
COMFY_FOLDERS = ("text_encoders", "diffusion_models", "vae")


def _comfy_dirs() -> list[tuple[str, str]]:
    """(folder key, directory) of ComfyUI's standard model folders that exist."""
    out = []
    for key in COMFY_FOLDERS:
        try:
            out += [(key, d) for d in folder_paths.get_folder_paths(key) if os.path.isdir(d)]
        except KeyError:
            continue
    return out


def comfy_folder_dirs() -> list[str]:
    """The directories of ComfyUI's standard model folders that may hold its MiniMax Music 3 files."""
    return [d for _, d in _comfy_dirs()]


def _comfy_files() -> list[tuple[str, str]]:
    """(listed name, path) of the GGUF and safetensors files in ComfyUI's standard folders (walked
    here: ComfyUI's own lists leave .gguf out)."""
    out, seen = [], set()
    for key, base in _comfy_dirs():
        for root, _, files in os.walk(base, followlinks=True):
            for f in sorted(files):
                if os.path.splitext(f)[1] not in MODEL_SUFFIXES:
                    continue
                path = os.path.join(root, f)
                name = f"{key}/" + os.path.relpath(path, base).replace(os.sep, "/")
                if name not in seen:  # the first folder wins, as in ComfyUI's lists
                    seen.add(name)
                    out.append((name, path))
    return sorted(out)


def files_of(kind: str, usable: bool = True) -> list[str]:
    """Names of the files holding component `kind`: the mm3 folders' files by name, then ComfyUI's
    own MiniMax Music 3 files as "<folder>/<name>" (headers read once, cached). `usable`: only
    those the component can use (`mm3.files.registry.file_problem`, as the model sidebar marks them):
    a truncated or unreadable file is not offered, and hides no other."""
    out = []
    for name in folder_paths.get_filename_list(FOLDER):
        path = folder_paths.get_full_path(FOLDER, name)
        if path and kind in classify(path) and not (usable and file_problem(path, kind)):
            out.append(name)
    out += [name for name, path in _comfy_files()
            if kind in classify(path) and not (usable and file_problem(path, kind))]
    return out


def full_path(name: str) -> str:
    head = name.split("/", 1)[0]
    if head in COMFY_FOLDERS and folder_paths.get_full_path(FOLDER, name) is None:
        for listed, path in _comfy_files():
            if listed == name:
                return path
        raise FileNotFoundError(f"{name} not found in ComfyUI's {head} folders")
    return folder_paths.get_full_path_or_raise(FOLDER, name)


def chosen_file(kind: str, name: str) -> str:
    """The file a loader's name means: itself, or for "auto" a usable file of `kind`, full-size
    before tiny, the most precise that fits the memory of the device its model runs on
    (`mm3.files.registry.pick_usable`: an unusable file is skipped with one warning)."""
    if name != AUTO:
        return name
    names = files_of(kind, usable=False)
    if not names:
        folders = ", ".join(folder_paths.get_folder_paths(FOLDER))
        raise ValueError(f"no {ARCH_OF[kind]} ({DESCRIPTIONS[kind]}) file in {folders}: download a set with "
                         "`python -m mm3 download --set q8 --dir <ComfyUI>/models/mm3` (see the pack's README)")
    device = load_device(kind)
    memory = None if mm.is_device_cpu(device) else int(mm.get_total_memory(device))
    by_path = {full_path(n): n for n in names}
    return by_path[pick_usable(list(by_path), memory, kind, by_path)]


LORA_FOLDER = "loras"  # ComfyUI's models/loras


def lora_files(kinds=LORA_KINDS) -> list[str]:
    """Names in ComfyUI's loras folder of the LoRA files of this model that change one of `kinds`
    (their tensor names read once per file version, cached)."""
    out = []
    for name in folder_paths.get_filename_list(LORA_FOLDER):
        path = folder_paths.get_full_path(LORA_FOLDER, name)
        if path and set(adapter_kinds(path)) & set(kinds):
            out.append(name)
    return out


def lora_path(name: str) -> str:
    return folder_paths.get_full_path_or_raise(LORA_FOLDER, name)


# -- devices and dtype --------------------------------------------------------------------------
def load_device(kind: str) -> torch.device:
    # The vocoder follows ComfyUI's VAE device (--cpu-vae); everything else the main device.
    return mm.vae_device() if kind == "vae" else mm.get_torch_device()


def compute_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where ComfyUI says the device computes it well, float32 otherwise (always on CPU)."""
    return torch.bfloat16 if mm.should_use_bf16(device) else torch.float32


def dit_compute_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The DiT forward's dtype: `dtype` where ComfyUI was told to keep float32 (--force-fp32,
    --fp32-unet), else None: the engine decides (bfloat16 on a CPU whose bfloat16 products pay)."""
    from comfy.cli_args import args

    return dtype if getattr(args, "force_fp32", False) or getattr(args, "fp32_unet", False) else None


# -- the patcher --------------------------------------------------------------------------------
class MM3Module(torch.nn.Module):
    """What ModelPatcher holds: the engine model plus the plain attributes ComfyUI sets on the model
    it manages (device, loaded bytes, ...), which stay off the engine's own modules."""

    def __init__(self, engine: torch.nn.Module, kind: str, name: str):
        super().__init__()
        self.engine = engine
        self.device = OFFLOAD
        self.mm3_kind, self.mm3_name = kind, name


class MM3Patcher(comfy.model_patcher.ModelPatcher):
    """ComfyUI's ModelPatcher over an engine model (see the module docstring). What it adds:
    - a subclass stays on ComfyUI's classic loading path (newer ComfyUI's dynamic VRAM manages
      `comfy.ops` layers, which the engine's layers are not);
    - the bytes really resident: ComfyUI counts only its cast layers as partly loaded, and a layer
      of ours that did not fit stays on the CPU and streams per use;
    - no pinning of offloaded weights: they are views of the GGUF file's mapping."""

    def __init__(self, model, load_device, offload_device, size=0, *args, handle=None, **kwargs):
        super().__init__(model, load_device, offload_device, size, *args, **kwargs)
        self.mm3_handle = weakref.ref(handle) if handle is not None else (lambda: None)

    def clone(self, *args, **kwargs):
        n = super().clone(*args, **kwargs)
        n.mm3_handle = self.mm3_handle
        return n

    @property
    def keep_loaded(self) -> bool:
        h = self.mm3_handle()
        return bool(h and h.keep_loaded)

    def _account(self) -> None:
        m = self.model
        m.model_loaded_weight_memory = compressed_nbytes(m, m.device)
        m.model_lowvram = m.model_loaded_weight_memory < self.model_size()

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        super().load(device_to, lowvram_model_memory, force_patch_weights, full_load, **kwargs)
        self._account()
        m = self.model
        if m.model_lowvram:
            log.info("MM3 %s: %.1f MB on %s, %.1f MB streamed per use", m.mm3_name,
                     m.model_loaded_weight_memory / 2**20, m.device,
                     (self.model_size() - m.model_loaded_weight_memory) / 2**20)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False, **kwargs):
        before = self.model.model_loaded_weight_memory
        super().partially_unload(device_to, memory_to_free, force_patch_weights, **kwargs)
        self._account()
        return before - self.model.model_loaded_weight_memory

    def pin_weight_to_device(self, key, *args, **kwargs):
        return None


# One subclass per component, so ComfyUI's log ("Requested to load ...") says which model moves.
MODULE_CLASSES = {kind: type(f"MM3{name}", (MM3Module,), {"__module__": __name__}) for kind, name in
                  (("lm", "LanguageModel"), ("depth", "DepthDecoder"), ("cond", "ConditionEncoder"), ("dit", "DiT"),
                   ("vae", "Vocoder"))}


def patcher(handle: ComponentHandle) -> MM3Patcher:
    """The handle's patcher, built once (the engine model is built on the CPU over the file's mmap);
    a handle with adapters shares its base handle's."""
    handle = base_of(handle)
    if handle.patcher is None:
        module = MODULE_CLASSES[handle.kind](handle.model(), handle.kind, handle.name)
        handle.patcher = MM3Patcher(module, load_device(handle.kind), OFFLOAD, size=handle.nbytes(), handle=handle)
    return handle.patcher


def _ours() -> list:
    return [lm for lm in mm.current_loaded_models if isinstance(lm.model, MM3Patcher)]


def unload_group(group: str) -> list[str]:
    """Unload our loaded models of `group` that were not asked to stay; returns their names."""
    gone = []
    for i in range(len(mm.current_loaded_models) - 1, -1, -1):
        loaded = mm.current_loaded_models[i]
        p = loaded.model
        if not isinstance(p, MM3Patcher) or p.keep_loaded or p.model.mm3_kind not in GROUPS[group]:
            continue
        loaded.model_unload()
        mm.current_loaded_models.pop(i)
        gone.append(p.model.mm3_name)
    if gone:
        mm.soft_empty_cache()
    return gone


def load(handles: list[ComponentHandle], memory_required: int = 0) -> list[torch.nn.Module]:
    """Build (once) and load the models of `handles` (one group) on their device, after unloading the
    other group's models that were not asked to stay. Returns the engine models."""
    groups = {h.group for h in handles}
    if len(groups) != 1:
        raise ValueError(f"one group at a time, got {sorted(groups)}")
    group = groups.pop()
    for other in GROUPS:
        if other != group:
            gone = unload_group(other)
            if gone:
                log.info("MM3: unloaded %s before loading the %s group", ", ".join(gone), group)
    return _loaded(handles, memory_required)


def _loaded(handles: list[ComponentHandle], memory_required: int) -> list[torch.nn.Module]:
    """One request to ComfyUI's manager for `handles` and their adapters; each engine model then
    carries exactly its handle's adapters (none for a loader's own)."""
    patchers = [patcher(h) for h in handles]
    mm.load_models_gpu(patchers, memory_required=memory_required + _adapter_bytes(handles))
    models = [p.model.engine for p in patchers]
    for h, model in zip(handles, models):
        if h.kind in LORA_KINDS:
            attach(model, adapters_of(h))
    return models


def _adapter_bytes(handles: list[ComponentHandle]) -> int:
    return sum(h.adapter_nbytes() for h in handles if adapters_of(h))


def fit_together(handles: list[ComponentHandle], memory_required: int = 0) -> bool:
    """Whether every model of `handles` (both groups) can be resident at once with `memory_required`
    bytes of activations: on the CPU the engine's rule (`mm3.song.overlap.fits_together`, free RAM), on a
    device its total memory (ComfyUI unloads other models to make room) less what it keeps free."""
    device = load_device(handles[0].kind)
    if any(load_device(h.kind) != device for h in handles):
        return False  # the vocoder on its own device (--cpu-vae): one group at a time
    weights = sum(patcher(h).model_size() for h in handles) + _adapter_bytes(handles)
    if mm.is_device_cpu(device):
        return fits_together(weights + memory_required, device)
    return weights + memory_required + mm.minimum_inference_memory() <= mm.get_total_memory(device)


def load_together(handles: list[ComponentHandle], memory_required: int = 0) -> list[torch.nn.Module]:
    """Build (once) and load the models of `handles`, of both groups, in one request to ComfyUI's
    manager (planning and synthesis overlapped; `fit_together` says when). Returns the engine models."""
    return _loaded(handles, memory_required)


def spare_bytes(handles: list[ComponentHandle], need: int = 0) -> int | None:
    """Device memory ComfyUI can spare for the engine's dequantized weight copies once `need` bytes
    of activations are set aside (the engine's own rule would look at the device alone): None on the
    CPU (the engine's rule: RAM is not ComfyUI's concern there), 0 while a model streams (copies of
    weights that are not resident would be dropped at once)."""
    ps = [patcher(h) for h in handles]
    if any(p.model.model_lowvram for p in ps):
        return 0
    device = ps[0].load_device
    if mm.is_device_cpu(device):
        return None
    return max(0, int(mm.get_free_memory(device) - mm.minimum_inference_memory() - need))


def resident() -> list[dict]:
    """Our models in ComfyUI's loaded list (what the memory manager holds), for the debug route."""
    out = []
    for lm in _ours():
        m = lm.model.model
        out.append({"kind": m.mm3_kind, "file": m.mm3_name, "device": str(m.device),
                    "loaded_bytes": int(lm.model.loaded_size()), "size_bytes": int(lm.model.model_size()),
                    "keep_loaded": lm.model.keep_loaded, "streaming": bool(m.model_lowvram),
                    "pinned": len(getattr(lm.model, "pinned", ()))})
    return out
