"""The reference's recipe and the request's limits, shared by the engine, the CLI and the nodes:
one definition each. Sizes of the models are never here: they come from each GGUF file's metadata.
Values are diffusers 0.42.1's (`modular_pipelines/minimax_music3`) and minimaxmusic.cpp's server's.
"""

from __future__ import annotations

# Time: LM frames per second = the condition encoder's input rate / hop (24000 / 960 released).
FRAME_RATE = 24000 / 960
MAX_AUDIO_FRAMES = 9000  # the reference's cap on planned frames (encoders._MAX_AUDIO_FRAMES)
MAX_DURATION = MAX_AUDIO_FRAMES / FRAME_RATE  # 360 s
DEFAULT_DURATION = 60.0

# Prompt and AR sampling (encoders._MAX_PROMPT_TOKENS, _AR_CFG_SCALE, _AR_SAMPLING_TOP_K).
MAX_PROMPT_TOKENS = 5000
SEMANTIC_VOCAB_SIZE = 16384  # semantic codes above the code offset (encoders._SEMANTIC_VOCAB_SIZE)
DEFAULT_LM_CFG = 1.5
DEFAULT_TOP_K = 50

# Flow DiT sampling (the reference guider's guidance_scale and step count).
DEFAULT_STEPS = 30
DEFAULT_DIT_CFG = 1.7

# The ranges of the request's numbers beyond the reference server's own checks: those of the
# ComfyUI widgets, so a request file or a flag gets no more than a node does.
MAX_STEPS = 200
MAX_CFG = 10.0  # lm_cfg and dit_cfg, from 0

# Sizes of the text inputs read whole: a request file (its codes are ~0.5 MB at the longest song, and
# a replay file holds up to three lists of them) and a caption or lyrics file (the prompt's 5000
# tokens are far less).
MAX_REQUEST_BYTES = 16 * 2**20
MAX_TEXT_BYTES = 2 * 2**20

# Batches and seeds (the reference server's request limits).
MAX_SONGS = 16  # lm_batch_size: songs planned together, song i from lm_seed + i
MAX_VARIATIONS = 9  # synth_batch_size: renderings of one plan, variation j from seed + j
SEED_MAX = 2**32 - 1  # resolved random seeds are uint32, as the reference server's

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
