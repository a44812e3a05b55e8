"""Oracle helpers for the AR tests: the diffusers 0.42.1 reference, driven from a tiny model's
`diffusers/` folder, with its AR step recorded (codes, LM hiddens, depth hiddens) frame by frame.

A small-vocabulary tiny model needs three module constants of
`diffusers.modular_pipelines.minimax_music3.encoders` patched (they are read at call time); the
values are in `diffusers/test_constants.json`. Nothing in diffusers is edited: the recording wraps
the module-level helper `_generate_depth_codes` for the duration of one call.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import diffusers  # noqa: F401  (the oracle; without it this module must not import, so its tests skip)

import torch

from mm3.bench.reference import reference_token_constants, run_ar


@contextmanager
def patched_constants(diffusers_dir):
    """Set the token-id constants of the reference's encoders module from test_constants.json
    (if the folder has one) and restore them afterwards."""
    path = Path(diffusers_dir) / "test_constants.json"
    values = json.loads(path.read_text()) if path.is_file() else {}
    with reference_token_constants(values) as enc:
        yield enc


@dataclass
class Reference:
    tokenizer: object
    language_model: object
    rvq_depth_decoder: object
    folder: Path


def load_reference(diffusers_dir) -> Reference:
    """The reference's tokenizer, LM and depth decoder from a diffusers-layout folder, float32."""
    from transformers import Qwen2Tokenizer, Qwen3ForCausalLM

    from diffusers import MiniMaxMusic3RVQDepthDecoder

    d = Path(diffusers_dir)
    tok = Qwen2Tokenizer.from_pretrained(d / "tokenizer")
    lm = Qwen3ForCausalLM.from_pretrained(d / "language_model", dtype=torch.float32).eval()
    depth = MiniMaxMusic3RVQDepthDecoder.from_pretrained(d / "rvq_depth_decoder", torch_dtype=torch.float32).eval()
    return Reference(tok, lm, depth, d)


def reference_text_ids(ref: Reference, caption: str, lyrics: str) -> torch.Tensor:
    """[2, S] ids from the reference's tokenize block."""
    from diffusers.modular_pipelines.minimax_music3.encoders import MiniMaxMusic3TokenizeStep

    with patched_constants(ref.folder):
        step = MiniMaxMusic3TokenizeStep().init_pipeline()
        step.update_components(tokenizer=ref.tokenizer)
        return step(prompt=caption, lyrics=lyrics, output="text_ids")


@dataclass
class ReferenceRun:
    codes: torch.Tensor  # [F + 1, ncb], row 0 = frame 0
    lm_last: torch.Tensor  # [F + 1, 2, H] LM hidden ([cond, uncond]) before each sampled frame
    depth_hidden: torch.Tensor  # [F + 1, ncb - 1, H] conditional depth hiddens
    frame_hiddens: torch.Tensor  # [F, ncb, H]
    generator_state: torch.Tensor  # after the stage


def run_reference_ar(ref: Reference, text_ids: torch.Tensor, duration: float,
                     generator: torch.Generator) -> ReferenceRun:
    """Run the reference's AR block once and record every frame it sampled."""
    calls = []

    def on_frame(last_hidden, codes, hidden):
        calls.append((last_hidden.clone(), codes[0].clone(), hidden.clone()))

    with patched_constants(ref.folder):
        fh = run_ar(ref.language_model, ref.rvq_depth_decoder, text_ids, duration, generator, on_frame)
    h = ref.language_model.config.hidden_size
    return ReferenceRun(
        codes=torch.stack([c[1] for c in calls]),
        lm_last=torch.stack([c[0] for c in calls]),
        depth_hidden=torch.stack([c[2][0].view(-1, h) for c in calls]),
        frame_hiddens=fh[0].view(fh.shape[1], -1, h),
        generator_state=generator.get_state(),
    )
