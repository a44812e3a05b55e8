"""AR milliseconds per frame: this engine against diffusers 0.42.1 in the same process, same weights.

    python -m mm3.bench_ar [--config tiny medium] [--frames 100] [--threads 1]

Builds random-weight models in memory (transformers `Qwen3ForCausalLM` + diffusers
`MiniMaxMusic3RVQDepthDecoder`), wraps the same tensors for this engine, runs the reference's AR
block and `mm3.ar.plan` (both numerics modes) on the same prompt and seed, checks that the codes
agree, and prints ms per frame (the stage's wall time, prefill included, over emitted frames).
Needs diffusers and transformers (the reference); the engine itself does not.

Configs: `tiny` = the test model (hidden 64, 2 layers, 330-token vocabulary, 64 codes); `medium` =
hidden 512, 4 LM layers, the released vocabulary layout (151675 text tokens + 16384 codes) and
released depth shape ratios (audio vocab 1024).
"""

from __future__ import annotations

import argparse
import time

import torch

from .gguf.ops import load_tensors
from .gguf.reader import compressed_from_torch
from .models.depth import RVQDepthDecoder
from .models.lm import Qwen3LM
from .prompt import Prompt, unconditional_ids
from .tokenizer import CodeSpace

CONFIGS = {
    "tiny": dict(lm=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16),
                 depth=dict(hidden_size=64, num_layers=2, num_attention_heads=4, intermediate_size=96,
                            audio_vocab_size=64),
                 text_tokens=266, codes=64, end=261, cfg=259),
    "medium": dict(lm=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=64),
                   depth=dict(hidden_size=512, num_layers=4, num_attention_heads=4, intermediate_size=768,
                              audio_vocab_size=1024),
                   text_tokens=151675, codes=16384, end=151670, cfg=151654),
}
PROMPT_TOKENS = 100


def build(name: str, seed: int = 0):
    """Reference modules with random weights, and this engine's models over the same tensors."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from diffusers import MiniMaxMusic3RVQDepthDecoder

    c = CONFIGS[name]
    vocab = c["text_tokens"] + c["codes"]
    torch.manual_seed(seed)
    lm_cfg = dict(vocab_size=vocab, max_position_embeddings=10240, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, **c["lm"])
    ref_lm = Qwen3ForCausalLM(Qwen3Config(**lm_cfg)).eval()
    ref_depth = MiniMaxMusic3RVQDepthDecoder(num_codebooks=8, max_position_embeddings=16, **c["depth"]).eval()
    with torch.no_grad():  # code logits of std ~4 and a zero END row, so a random model rarely stops
        head = ref_lm.lm_head.weight
        head[c["text_tokens"]:] = torch.randn_like(head[c["text_tokens"]:]) * 4 / c["lm"]["hidden_size"] ** 0.5
        head[c["end"]] = 0
        ref_lm.model.embed_tokens.weight[c["text_tokens"]:].normal_()
    lm = Qwen3LM({**lm_cfg, "rope_theta": 1e6})
    load_tensors(lm, {k: compressed_from_torch(k, v) for k, v in ref_lm.state_dict().items()}, source=name)
    depth = RVQDepthDecoder(dict(num_codebooks=8, max_position_embeddings=16, **c["depth"]))
    load_tensors(depth, {k: compressed_from_torch(k, v) for k, v in ref_depth.state_dict().items()}, source=name)
    g = torch.Generator().manual_seed(seed)
    cond = torch.randint(0, min(256, c["cfg"]), (1, PROMPT_TOKENS), generator=g)
    ids = torch.cat([cond, unconditional_ids(cond, c["cfg"])])
    prompt = Prompt(ids, "", "", CodeSpace(c["text_tokens"], c["codes"], c["end"], vocab))
    return ref_lm, ref_depth, lm.eval(), depth.eval(), prompt


def run_reference(ref_lm, ref_depth, prompt: Prompt, frames: int, seed: int):
    import diffusers.modular_pipelines.minimax_music3.encoders as enc

    cs = prompt.codes
    patch = {"_AUDIO_CFG_TOKEN_ID": int(prompt.uncond[1]), "_AUDIO_END_TOKEN_ID": cs.end_id,
             "_AUDIO_CODE_OFFSET": cs.code_offset}
    saved = {k: getattr(enc, k) for k in patch}
    codes = []
    original = enc._generate_depth_codes

    def recording(*a):
        out = original(*a)
        codes.append(out[0][0].clone())
        return out

    try:
        for k, v in patch.items():
            setattr(enc, k, v)
        enc._generate_depth_codes = recording
        step = enc.MiniMaxMusic3AutoregressiveStep().init_pipeline()
        step.update_components(language_model=ref_lm, rvq_depth_decoder=ref_depth)
        t = time.perf_counter()
        step(text_ids=prompt.ids, audio_duration=frames / 25, generator=torch.Generator().manual_seed(seed),
             output="frame_hiddens")
        return time.perf_counter() - t, torch.stack(codes)
    finally:
        enc._generate_depth_codes = original
        for k, v in saved.items():
            setattr(enc, k, v)


def main(argv=None) -> int:
    from .ar import plan

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each (interleaved); the best is shown")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU, {args.threads} thread(s), float32, torch {torch.__version__}, {args.frames} frames, "
          f"{PROMPT_TOKENS}-token prompt, best of {args.repeat}")

    def ours(lm, depth, prompt, frames, exact):
        t = time.perf_counter()
        (ac,) = plan(lm, depth, prompt, duration=frames / 25, lm_seed=args.seed, reference_numerics=exact)
        return time.perf_counter() - t, ac.codes

    for name in args.config:
        ref_lm, ref_depth, lm, depth, prompt = build(name, args.seed)
        runs = {"diffusers": lambda n: run_reference(ref_lm, ref_depth, prompt, n, args.seed),
                "ours (reference numerics)": lambda n: ours(lm, depth, prompt, n, True),
                "ours (fast)": lambda n: ours(lm, depth, prompt, n, False)}
        best, codes = {}, {}
        for label, fn in runs.items():
            fn(4)  # warm-up
        for _ in range(args.repeat):
            for label, fn in runs.items():
                dt, codes[label] = fn(args.frames)
                best[label] = min(best.get(label, dt), dt)
        ref_t = best["diffusers"]
        row = [f"{name:7s} diffusers {1000 * ref_t / args.frames:7.2f} ms/frame"]
        for label in list(runs)[1:]:
            same = "codes equal" if torch.equal(codes[label], codes["diffusers"]) else "CODES DIFFER"
            row.append(f"{label} {1000 * best[label] / args.frames:7.2f} ms/frame "
                       f"({ref_t / best[label]:.2f}x, {same})")
        print(" | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
