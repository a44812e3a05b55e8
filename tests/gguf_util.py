"""Writing small GGUF files with gguf-py (the format's reference writer) for reader tests."""

import numpy as np
import gguf


def write_gguf(path, arch, kv=None, tensors=None):
    """`kv`: key -> value (int -> u32, str, list); `tensors`: name -> float32 array or (qtype, array)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (kv or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, value in (tensors or {}).items():
        if isinstance(value, tuple):
            qtype, arr = value
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


COND_KV = {
    "mm3-cond.condition_hidden_dim": 16, "mm3-cond.num_condition_layers": 8, "mm3-cond.out_dim": 8,
    "mm3-cond.input_sampling_rate": 24000, "mm3-cond.input_hop_length": 960,
    "mm3-cond.output_sampling_rate": 44100, "mm3-cond.output_hop_length": 512,
}


def cond_tensors(rng):
    return {
        "layer_weight_logits": rng.standard_normal(8).astype(np.float32),
        "layer_scale": rng.standard_normal(1).astype(np.float32),
        "proj.weight": rng.standard_normal((8, 16, 3)).astype(np.float32),
        "proj.bias": rng.standard_normal(8).astype(np.float32),
    }
