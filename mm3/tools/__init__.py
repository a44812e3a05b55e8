"""Tools around the engine: convert a checkpoint, quantize, build tiny test models, inspect files,
download the published sets. None of them is needed to generate a song."""
