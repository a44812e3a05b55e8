"""Constants shared by the request, the output stage, the CLI and the nodes: one definition each.

Sizes of the models are never here: they come from each GGUF file's metadata.
"""

from __future__ import annotations

# Output stage (minimaxmusic.cpp's output formats and the request's defaults).
OUTPUT_FORMATS = ("mp3", "wav16", "wav24", "wav32")
FORMAT_EXTENSIONS = {"mp3": ".mp3", "wav16": ".wav", "wav24": ".wav", "wav32": ".wav"}
MP3_BITRATES = (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)  # MPEG-1 Layer III, 44.1 kHz CBR
DEFAULT_MP3_BITRATE = 128
DEFAULT_PEAK_CLIP = 10  # parts per million of |x| allowed above the normalisation level
MAX_PEAK_CLIP = 999

# Random streams of a render. "independent": the AR sampling draws from lm_seed + song, the DiT noise
# from seed + variation. "reference": one CPU generator seeded lm_seed + song drives the AR sampling
# and then the DiT noise, as the diffusers pipeline does.
RNG_MODES = ("independent", "reference")
DEFAULT_RNG = "independent"
