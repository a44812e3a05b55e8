"""Fast paths of the engine, each checked against the plain path in tests/test_fastpath.py.

`linear`: decode-shaped products and `PackedWeight` (the rows of several GGUF layers as one matrix:
fused QKV, gate/up, LM-head candidates), kept compressed or dequantized within a memory budget
(`budget`). `frame`: the AR frame (head sampling, 7 depth steps, feedback, LM step) as one
function; `plan`: the host loop around it (draws, END read one frame late). `onednn`: large CPU
float32 products through oneDNN where that stays float32-accurate (the DiT). Pure torch throughout.
"""
