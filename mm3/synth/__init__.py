"""The synthesis stage, codes to sound: the windowed flow-matching sampler (`flow`), vocoder windows
and their stitch (`audio`), peak normalisation and audio files (`output`), and a recording to
latents and back (`codec`)."""
