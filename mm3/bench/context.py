"""What the benchmark's measurements share: the checkpoint, our models and the reference's, loaded once."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..files.opener import open_component

class Context:
    def __init__(self, ckpt, device: torch.device, dtype: torch.dtype, have_reference: bool, repeat: int, seed: int):
        self.ckpt, self.device, self.dtype = ckpt, device, dtype
        self.have_reference, self.repeat, self.seed = have_reference, max(1, repeat), seed
        self.notes: list[str] = []
        self.compile = False  # torch.compile our AR frame step
        self.graphs: bool | None = None  # the AR frame step from CUDA graphs (None: the engine's default)
        self.roofline: dict = {}  # what the device measured: copy bandwidth, product throughput
        self.dtype_named = False  # the user named `dtype`: it is the DiT's too (else the engine picks)
        self.lora_rank = 0  # > 0: our LM and DiT carry a random adapter of this rank (`mm3.bench.lora`)
        self.light = ckpt.diffusers is None  # ours in its default mode only (released sizes off CUDA)
        self._ours: dict = {}
        self._ref: dict = {}

    # -- this engine -------------------------------------------------------------------------------
    def file(self, kind: str):
        for p in sorted(self.ckpt.models.glob("*.gguf")):
            c = open_component(p)
            if c.kind == kind:
                return c
            c.close()
        raise FileNotFoundError(f"no {kind} file in {self.ckpt.models}")

    def ours(self, kind: str, numerics: str = "fast"):
        key = kind if numerics == "fast" else f"{kind}:{numerics}"
        if key not in self._ours:
            from ..models import build_model

            self._ours[key] = build_model(self.file(kind), numerics=numerics).to(self.device)
            if self.lora_rank and kind in ("lm", "dit"):
                from .lora import attach_random

                attach_random(self._ours[key], kind, self.lora_rank, self.seed)
        return self._ours[key]

    def prompt(self):
        from ..plan.prompt import build_prompt
        from ..tokenizer import MM3Tokenizer
        from .checkpoints import CAPTION, LYRICS

        if "prompt" not in self._ours:

            self._ours["prompt"] = build_prompt(MM3Tokenizer.from_component(self.file("lm")), CAPTION, LYRICS)
        return self._ours["prompt"]

    # -- the reference -----------------------------------------------------------------------------
    def _gguf_floats(self, kind: str) -> dict:
        comp = self.file(kind)
        try:
            return {name: t.dequantize(torch.float32).clone() for name, t in comp.tensors.items()}  # F32: a view
        finally:
            comp.close()

    def reference(self, name: str):
        """language_model, rvq_depth_decoder, condition_encoder, transformer, vocoder, scheduler."""
        if name in self._ref:
            return self._ref[name]
        import warnings

        import diffusers
        from safetensors.torch import load_file

        c = self.ckpt
        if name == "language_model":
            from transformers import Qwen3Config, Qwen3ForCausalLM

            model = Qwen3ForCausalLM(Qwen3Config(**c.lm_cfg))
            model.load_state_dict(self._gguf_floats("lm"), strict=False)  # GGUF has no lm_head when tied
        elif name == "scheduler":
            from ..tools.tiny import SCHEDULER_CONFIG

            self._ref[name] = diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
            return self._ref[name]
        else:
            cls = {"rvq_depth_decoder": diffusers.MiniMaxMusic3RVQDepthDecoder,
                   "condition_encoder": diffusers.MiniMaxMusic3ConditionEncoder,
                   "transformer": diffusers.MiniMaxMusic3Transformer1DModel,
                   "vocoder": diffusers.MiniMaxMusic3Vocoder}[name]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's weight_norm deprecation
                model = cls(**c.cfgs[name])
            if name in ("rvq_depth_decoder", "transformer"):
                state = self._gguf_floats({"rvq_depth_decoder": "depth", "transformer": "dit"}[name])
            else:
                state = load_file(c.diffusers / name / "diffusion_pytorch_model.safetensors")
            model.load_state_dict(state)
        self._ref[name] = model.to(device=self.device, dtype=self.dtype).eval()
        return self._ref[name]

    @contextmanager
    def reference_constants(self):
        """The reference's token-id constants set to this checkpoint's (mm3.tools.tiny's small vocabulary
        moves them; for the released layout they are unchanged)."""
        from .reference import reference_token_constants

        ids = self.ckpt.special_ids
        values = {"_AUDIO_CFG_TOKEN_ID": ids["<|audio_cfg|>"], "_AUDIO_END_TOKEN_ID": ids["<|audio_end|>"],
                  "_AUDIO_CODE_OFFSET": self.ckpt.code_offset}
        with reference_token_constants(values) as enc:
            yield enc

    def release(self, *names: str):
        for n in names:
            for key in [k for k in self._ours if k == n or k.startswith(n + ":")]:
                self._ours.pop(key)
            self._ref.pop(n, None)
