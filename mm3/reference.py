"""Driving the diffusers reference (optional: benchmarks and tests only; the engine never needs it)."""

from __future__ import annotations

from contextlib import contextmanager


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
