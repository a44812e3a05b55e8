"""The catalogue of published GGUF files: the sets, their file names and sizes, and the released
model's number of values per component (what the model panel, the download tool and `auto` file
choice compare local files with)."""

from __future__ import annotations

# The published sets: the type of each component file, by its diffusers folder name.
SETS = {
    "native": {"language_model": "BF16", "rvq_depth_decoder": "BF16", "condition_encoder": "F32",
               "transformer": "F32", "vocoder": "F32"},
    "q8": {"language_model": "Q8_0", "rvq_depth_decoder": "Q8_0", "condition_encoder": "F32",
           "transformer": "Q8_0", "vocoder": "F32"},
    "light": {"language_model": "Q5_K_M", "rvq_depth_decoder": "Q8_0", "condition_encoder": "F32",
              "transformer": "Q4_K_M", "vocoder": "F32"},
}
PART = ".part"  # suffix of a file still being downloaded, next to its final name


def published_name(component: str, file_type: str) -> str:
    """The published file name of a component (its diffusers folder name) in a file type."""
    return f"MiniMax-Music3-{component}-{file_type}.gguf"


# Sizes of the published files in bytes, by component kind and file type (the figures of the released
# model table, rounded as published: 17.2 GB, 0.69 GB, 101 MB, ...).
PUBLISHED_SIZES = {
    ("lm", "BF16"): 17.2e9, ("lm", "Q8_0"): 9.1e9, ("lm", "Q6_K"): 7.0e9, ("lm", "Q5_K_M"): 6.3e9,
    ("depth", "BF16"): 1.3e9, ("depth", "Q8_0"): 0.69e9,
    ("cond", "F32"): 101e6,
    ("dit", "F32"): 9.7e9, ("dit", "Q8_0"): 2.6e9, ("dit", "Q6_K"): 2.0e9, ("dit", "Q5_K_M"): 1.7e9,
    ("dit", "Q4_K_M"): 1.4e9,
    ("vae", "F32"): 306e6,
}
SIZE_TOLERANCE = 0.1  # a published file's size is its table figure within this share (the figures are rounded)
# Values (weights) of each released component, from its unquantized published file (BF16: 2 bytes, F32: 4).
RELEASED_VALUES = {"lm": 17.2e9 / 2, "depth": 1.3e9 / 2, "cond": 101e6 / 4, "dit": 9.7e9 / 4, "vae": 306e6 / 4}
FULL_SIZE_SHARE = 0.5  # a full-size file holds at least this share of them (a vocoder without its encoder: 0.7)


def matches_published(kind: str, file_type: str, size: int) -> bool:
    """Whether a file of `kind` and `file_type` has the size of the published file of that type."""
    want = PUBLISHED_SIZES.get((kind, file_type))
    return want is not None and abs(size - want) <= SIZE_TOLERANCE * want
