"""The layers whose weights stay as the file holds them (GGUF blocks or floats) until they are used:
`slots` (named weight slots: filled, moved, dequantized per use), `layers` (Linear, Fused, Embedding,
the convolutions, Vector, and the loading by tensor name) and
`copies` (what weights occupy, and the float copies kept of them). How a layer multiplies is its
product, bound by `mm3.backends`."""
