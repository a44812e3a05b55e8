"""Format knowledge below the component table: safetensors reading, the diffusers checkpoint's
tokenizer and name conventions, and the catalogue of published files. Imports nothing above it."""
