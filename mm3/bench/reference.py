"""Driving the diffusers 0.42.1 reference: the oracle of the tests and the other side of the benchmark
(optional; the engine never needs it).

Nothing in diffusers is edited. A small-vocabulary test model moves three token-id constants of its
encoders module (read at call time), which `reference_token_constants` sets for the duration of a
block; `run_ar` records each sampled frame by wrapping the module helper `_generate_depth_codes` for
the duration of one call; `run_song` chains the reference's own AR, denoise and decode blocks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch


@contextmanager
def reference_token_constants(values: dict):
    """Set token-id constants of diffusers' MiniMax Music 3 encoders module (`_AUDIO_CFG_TOKEN_ID`,
    `_AUDIO_END_TOKEN_ID`, `_AUDIO_CODE_OFFSET`; read at call time) and restore them afterwards.
    A small-vocabulary tiny model moves them; the released layout leaves them unchanged."""
    import diffusers.modular_pipelines.minimax_music3.encoders as enc

    saved = {k: getattr(enc, k) for k in values}
    try:
        for k, v in values.items():
            setattr(enc, k, v)
        yield enc
    finally:
        for k, v in saved.items():
            setattr(enc, k, v)


def _stage(block, components: dict):
    pipe = block.init_pipeline()
    pipe.update_components(**{k: v for k, v in components.items() if k in pipe._component_specs})
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def run_ar(language_model, rvq_depth_decoder, text_ids: torch.Tensor, duration: float, generator: torch.Generator,
           on_frame: Callable | None = None) -> torch.Tensor:
    """The reference's AR block once: frame hiddens [1, F, ncb * H]. `on_frame(last_hidden [2, H],
    codes [2, ncb], depth_hidden)` runs after every sampled frame (frame 0 included). Token-id
    constants a small vocabulary moves must be set around the call (`reference_token_constants`)."""
    import diffusers.modular_pipelines.minimax_music3.encoders as enc

    original = enc._generate_depth_codes

    def recording(lm, rvq, last_hidden, semantic_code, gen):
        codes, hidden = original(lm, rvq, last_hidden, semantic_code, gen)
        if on_frame is not None:
            on_frame(last_hidden, codes, hidden)
        return codes, hidden

    enc._generate_depth_codes = recording
    try:
        step = _stage(enc.MiniMaxMusic3AutoregressiveStep(),
                      {"language_model": language_model, "rvq_depth_decoder": rvq_depth_decoder})
        return step(text_ids=text_ids, audio_duration=duration, generator=generator, output="frame_hiddens")
    finally:
        enc._generate_depth_codes = original


@torch.no_grad()
def run_song(components: dict, text_ids: torch.Tensor, seconds: float, steps: int, generator: torch.Generator,
             on_stage: Callable[[str, Callable], object] | None = None) -> torch.Tensor:
    """The reference's AR, denoise and decode blocks as its pipeline chains them, one generator
    throughout: audio [1, 2, T]. `components`: language_model, rvq_depth_decoder, condition_encoder,
    transformer, vocoder, scheduler. `on_stage(name, run)` wraps each stage ("ar", "dit", "vae"; e.g.
    to time it) and must return run()."""
    from diffusers.modular_pipelines.minimax_music3.decoders import MiniMaxMusic3VocoderDecodeStep
    from diffusers.modular_pipelines.minimax_music3.encoders import MiniMaxMusic3AutoregressiveStep
    from diffusers.modular_pipelines.minimax_music3.modular_blocks_minimax_music3 import MiniMaxMusic3CoreDenoiseStep

    wrap = on_stage or (lambda name, run: run())
    fh = wrap("ar", lambda: _stage(MiniMaxMusic3AutoregressiveStep(), components)(
        text_ids=text_ids, audio_duration=seconds, generator=generator, output="frame_hiddens"))
    chunks = wrap("dit", lambda: _stage(MiniMaxMusic3CoreDenoiseStep(), components)(
        frame_hiddens=fh, num_inference_steps=steps, generator=generator, output="latent_chunks"))
    return wrap("vae", lambda: _stage(MiniMaxMusic3VocoderDecodeStep(), components)(
        latent_chunks=chunks, output_type="pt", output="audios"))
