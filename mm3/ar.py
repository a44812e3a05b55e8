"""The autoregressive stage: prompt -> audio codes and frame hiddens (SPEC section 4).

`plan` samples frame by frame exactly as diffusers' `MiniMaxMusic3AutoregressiveStep`: the LM
(batch of [cond, uncond] rows per song) proposes the semantic code under CFG with a conditional
top-k pre-filter, the depth decoder samples the 7 acoustic codes under CFG, and the frame is fed
back as one summed embedding. Each song of a batch has its own generator (`lm_seed + i`), so a song
is the same alone or in a batch. `replay` rebuilds the frame hiddens of known codes by teacher
forcing (one LM pass over the fed-back frames, one depth pass per frame), without sampling.

Numerics: with `reference_numerics=True` every tensor op has the reference's shapes (full LM head,
depth decoder re-run over the whole sequence at each step), which on CPU float32 reproduces its
hidden states bit for bit, hence its codes for the same generator. The default computes only the
LM-head rows of candidates and keeps a depth KV cache: the same numbers up to float rounding.

Engines: "plain" is the loop below, written with the model's own layers; "fast" runs each frame as
one function over packed weights (`mm3.fast`: fused projections, decode-shaped products, END read
one frame late, no host wait inside a frame), same numbers up to float rounding; "auto" (default)
takes "fast" unless `reference_numerics` is set or the models use other `ops` layers.
"""

from __future__ import annotations

import torch

from .codes import AudioCodes
from .constants import DEFAULT_LM_CFG, DEFAULT_TOP_K, FRAME_RATE, MAX_AUDIO_FRAMES
from .errors import RunError
from .fast.onednn import onednn_matmul
from .models.depth import RVQDepthDecoder
from .models.lm import Qwen3LM
from .progress import Cancelled, Progress
from .prompt import Prompt
from .sampling import guide, make_generator, resolve_seed, sample_top_k, semantic_logits


class ZeroFramesError(RunError):
    """The LM chose END before emitting any frame."""


def max_frames_for(duration: float, prompt_tokens: int, lm_context: int, frame_rate: float = FRAME_RATE) -> int:
    """Frames to plan: `int(duration * frame_rate)`, at most MAX_AUDIO_FRAMES and what the LM context
    leaves after the prompt (minus one position, as minimaxmusic.cpp)."""
    if not duration > 0:
        raise ValueError(f"duration must be positive, got {duration}")
    wanted = int(duration * frame_rate)
    if wanted == 0:
        raise ValueError(f"duration {duration} s is shorter than one frame (1 / {frame_rate:g} s)")
    room = lm_context - prompt_tokens - 1
    if room <= 0:
        raise ValueError(f"the prompt's {prompt_tokens} tokens leave no room in the LM context of {lm_context}")
    return min(wanted, MAX_AUDIO_FRAMES, room)


def _check_pair(lm: Qwen3LM, depth: RVQDepthDecoder, prompt: Prompt):
    if lm.hidden_size != depth.hidden_size:
        raise ValueError(f"LM hidden_size {lm.hidden_size} does not match the depth decoder's {depth.hidden_size}")
    if prompt.codes.lm_vocab_size != lm.vocab_size:
        raise ValueError(f"the prompt was built for an LM vocabulary of {prompt.codes.lm_vocab_size}, "
                         f"this LM has {lm.vocab_size}")


class _Song:
    def __init__(self, generator, seed):
        self.generator, self.seed = generator, seed
        self.codes: list[torch.Tensor] = []  # [num_codebooks] per sampled frame (frame 0 included)
        self.hiddens: list[torch.Tensor] = []  # [num_codebooks, H] per emitted frame
        self.active, self.ended = True, False


def _frame_feedback(lm, depth, frame_codes: torch.Tensor, off: int, dtype) -> torch.Tensor:
    """[rows, num_codebooks] codes -> LM input [rows, 1, H]: (LM embedding of the semantic id + the
    acoustic embeddings) * num_codebooks ** -0.5, in the reference's operation order."""
    emb = lm.embed(frame_codes[:, :1] + off, dtype)  # [rows, 1, H]
    shift = torch.arange(depth.num_codebooks - 1, device=frame_codes.device)[None] * depth.audio_vocab
    extra = depth.audio_embeddings.lookup(frame_codes[:, 1:] + shift, dtype).sum(dim=1, keepdim=True)
    return (emb + extra.to(emb.dtype)) * depth.num_codebooks ** -0.5


@torch.no_grad()
def plan(lm: Qwen3LM, depth: RVQDepthDecoder, prompt: Prompt, *, duration: float, lm_seed: int | None = None,
         lm_cfg: float = DEFAULT_LM_CFG, top_k: int = DEFAULT_TOP_K, lm_batch_size: int = 1,
         generators: list[torch.Generator] | torch.Generator | None = None, progress: Progress | None = None,
         dtype: torch.dtype = torch.float32, reference_numerics: bool = False,
         frame_rate: float = FRAME_RATE, engine: str = "auto", cache_budget: int | None = None,
         compile: bool = False) -> list[AudioCodes]:
    """Sample `lm_batch_size` songs for `prompt`; returns one AudioCodes per song (codes [F+1, ncb],
    frame hiddens [F, ncb, H] in `dtype`, `ended_naturally` when the LM chose END before the cap).

    Song i draws from `generators[i]` if given, else from a CPU generator seeded `lm_seed + i`
    (`lm_seed` None or negative: random, recorded in the result); a CPU generator reproduces the
    reference's draws, and the same generator can go on to draw the DiT noise afterwards. `duration` caps the frames
    (see `max_frames_for`). `progress.on_progress("ar", frames, max_frames, info)` runs after every
    frame and `progress.should_stop()` before every frame (True raises `Cancelled`). `engine`:
    "auto", "fast" or "plain" (module docstring); `cache_budget` (bytes of dequantized weight
    copies, None = automatic) and `compile` (torch.compile the frame step) apply to "fast".
    """
    if top_k < 1:
        raise ValueError(f"lm_top_k must be at least 1, got {top_k}")
    if lm_batch_size < 1:
        raise ValueError(f"lm_batch_size must be at least 1, got {lm_batch_size}")
    _check_pair(lm, depth, prompt)
    fast = _use_fast(engine, reference_numerics, lm, depth)
    progress = progress or Progress()
    n_songs = lm_batch_size
    if generators is not None:
        gens = [generators] if isinstance(generators, torch.Generator) else list(generators)
        if len(gens) != n_songs:
            raise ValueError(f"{len(gens)} generators for lm_batch_size {n_songs}")
        seeds = [None if lm_seed is None else lm_seed + i for i in range(n_songs)]
    else:
        base = resolve_seed(lm_seed)
        seeds = [base + i for i in range(n_songs)]
        gens = [make_generator(s) for s in seeds]
    songs = [_Song(g, s) for g, s in zip(gens, seeds)]

    cs = prompt.codes
    device = lm.device
    n_prompt = prompt.num_tokens
    max_frames = max_frames_for(duration, n_prompt, lm.max_positions, frame_rate)

    # Prefill [cond, uncond] once; a batch of songs starts from copies (rows cond_i = 2i, uncond_i = 2i + 1).
    # One spare position: the fast engine feeds back the last frame too.
    cache = lm.new_cache(2, n_prompt + max_frames + 1, dtype)
    last = lm(lm.embed(prompt.ids.to(device), dtype), cache)[:, -1]  # [2, H], final-normed
    if n_songs > 1:
        cache, last = cache.repeat(n_songs), last.repeat(n_songs, 1)
    if fast:
        from .fast.plan import sample_frames

        results = sample_frames(lm, depth, cs, cache, last, gens, max_frames=max_frames, lm_cfg=lm_cfg, top_k=top_k,
                                dtype=dtype, progress=progress, cache_budget=cache_budget, compile=compile)
        for song, (codes, hiddens, ended) in zip(songs, results):
            song.codes, song.hiddens, song.ended = codes, hiddens, ended  # whole tensors: nothing to stack
        return _results(songs, prompt)

    if reference_numerics:
        mask = torch.ones(lm.vocab_size, dtype=torch.bool, device=device)
        mask[cs.code_offset:cs.code_offset + cs.num_semantic] = False
        mask[cs.end_id] = False
        columns, ranges, candidate_ids = None, None, None
    else:  # only END and the code rows of the head: same candidates, ~12x fewer rows for the released LM
        ranges = sorted([(cs.end_id, cs.end_id + 1), (cs.code_offset, cs.code_offset + cs.num_semantic)])
        columns = torch.cat([torch.arange(a, b) for a, b in ranges])  # CPU: it indexes the CPU draws
        candidate_ids = columns.tolist()
        mask = None
    depth_cache = None if reference_numerics else depth.new_cache(2 * n_songs, dtype)

    for fi in range(max_frames + 1):
        if progress.should_stop():
            raise Cancelled(f"AR cancelled before frame {fi} of {max_frames}")
        # 1. semantic code per song
        if reference_numerics:
            logits = lm.logits(last).float()
        else:
            logits = lm.logits_rows(last, ranges).float()
        sem = torch.zeros(2 * n_songs, dtype=torch.long, device=device)
        for i, song in enumerate(songs):
            if not song.active:
                continue
            guided = semantic_logits(logits[2 * i:2 * i + 1], logits[2 * i + 1:2 * i + 2], mask, lm_cfg, top_k)
            tok = int(sample_top_k(guided, top_k, song.generator, columns, lm.vocab_size).item())
            if columns is not None:
                tok = candidate_ids[tok]
            if tok == cs.end_id:
                song.active, song.ended = False, True
                continue
            sem[2 * i:2 * i + 2] = tok - cs.code_offset
        if not any(s.active for s in songs):
            break

        # 2. acoustic codes c1..c7 with the depth decoder (all rows; inactive songs carry dummy codes)
        frame_codes, depth_hidden = _depth_frame(lm, depth, last, sem, cs.code_offset, songs, lm_cfg, top_k, dtype,
                                                depth_cache)

        # 3. record; frame 0 is fed back but not emitted
        for i, song in enumerate(songs):
            if not song.active:
                continue
            song.codes.append(frame_codes[2 * i])
            if fi > 0:
                song.hiddens.append(torch.cat([last[2 * i:2 * i + 1], depth_hidden[2 * i]]))  # [ncb, H]
                if len(song.hiddens) >= max_frames:
                    song.active = False
        progress.on_progress("ar", max(len(s.hiddens) for s in songs), max_frames,
                             {"frame": fi, "songs": n_songs, "active": sum(s.active for s in songs)})
        if not any(s.active for s in songs):
            break

        # 4. feedback: the frame's summed embedding at the next position of every row
        last = lm(_frame_feedback(lm, depth, frame_codes, cs.code_offset, dtype), cache)[:, -1]

    return _results(songs, prompt)


ENGINES = ("auto", "fast", "plain")


def _use_fast(engine: str, reference_numerics: bool, lm, depth) -> bool:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "plain" or (engine == "auto" and reference_numerics):
        return False
    from .fast.frame import supports

    why = supports(lm, depth)
    if engine == "fast" and (reference_numerics or why):
        raise ValueError("engine 'fast' cannot run " + ("with reference_numerics" if reference_numerics else why))
    return why is None


def _results(songs: list[_Song], prompt: Prompt) -> list[AudioCodes]:
    out = []
    for i, song in enumerate(songs):
        if len(song.hiddens) == 0:
            raise ZeroFramesError(f"song {i} (lm_seed {song.seed}) generated zero audio frames: the LM ended "
                                  "the song at once; try another seed or prompt")
        stack = (lambda x: x) if isinstance(song.codes, torch.Tensor) else torch.stack
        codes = stack(song.codes).cpu()  # [F + 1, ncb]
        out.append(AudioCodes(codes, stack(song.hiddens), prompt, song.seed, song.ended))
    return out


def _depth_frame(lm, depth, last, sem, off, songs, lm_cfg, top_k, dtype, cache):
    """Acoustic codes of one frame for every row pair. Returns codes [rows, ncb] (rows of a pair
    equal) and the conditional depth hiddens [rows, ncb - 1, H] (valid at even rows)."""
    rows, ncb = last.shape[0], depth.num_codebooks
    codes = torch.zeros(rows, ncb, dtype=torch.long, device=last.device)
    codes[:, 0] = sem
    seq = [depth.projection(last)[:, None], depth.projection(lm.embed(sem + off, dtype))[:, None]]
    if cache is not None:
        cache.reset()
        new = torch.cat(seq, dim=1)
    hiddens = []
    for j in range(1, ncb):
        if cache is None:
            h = depth(torch.cat(seq, dim=1))[:, -1]  # the reference re-runs the whole sequence
        else:
            h = depth.extend(new, cache)[:, -1]
        hiddens.append(h)
        logits = depth.audio_heads[j - 1](h)
        for i, song in enumerate(songs):
            if song.active:
                c, u = logits[2 * i:2 * i + 1].float(), logits[2 * i + 1:2 * i + 2].float()
                codes[2 * i:2 * i + 2, j] = sample_top_k(guide(c, u, lm_cfg), top_k, song.generator)
        if j < ncb - 1:
            new = depth.projection(depth.code_embedding(codes[:, j], j, dtype))[:, None]
            seq.append(new)
    return codes, torch.stack(hiddens, dim=1)


@torch.no_grad()
def replay(lm: Qwen3LM, depth: RVQDepthDecoder, prompt: Prompt, codes: torch.Tensor, *,
           dtype: torch.dtype = torch.float32, chunk: int = 512, progress: Progress | None = None,
           lm_seed: int | None = None) -> AudioCodes:
    """Frame hiddens of known codes [F + 1, ncb] by teacher forcing: prefill the conditional prompt,
    one LM pass over the fed-back frames 0 .. F - 1 (the hidden after frame k - 1 predicted frame k),
    then for each frame k >= 1 one causal depth pass over [LM hidden, c0, c1 .. c6] whose positions
    1 .. 7 are the depth states. Processed in chunks of `chunk` frames (cancel check between them)."""
    _check_pair(lm, depth, prompt)
    progress = progress or Progress()
    cs, ncb = prompt.codes, depth.num_codebooks
    codes = codes.cpu().long()
    if codes.ndim != 2 or codes.shape[1] != ncb or codes.shape[0] < 2:
        raise ValueError(f"codes must be [frames + 1, {ncb}] with at least 2 rows, got {list(codes.shape)}")
    limits = torch.tensor([cs.num_semantic] + [depth.audio_vocab] * (ncb - 1))
    if ((codes < 0) | (codes >= limits)).any():
        raise ValueError(f"codes out of range (c0 < {cs.num_semantic}, c1.. < {depth.audio_vocab})")
    device, n = lm.device, codes.shape[0] - 1
    n_prompt = prompt.num_tokens
    if n_prompt + n > lm.max_positions:
        raise ValueError(f"{n} frames after a {n_prompt}-token prompt exceed the LM context {lm.max_positions}")
    codes_d = codes.to(device)
    with onednn_matmul(device):  # chunks of frames: GEMMs, where oneDNN beats MKL (mm3.fast.onednn)
        cache = lm.new_cache(1, n_prompt + n, dtype)
        lm(lm.embed(prompt.ids[:1].to(device), dtype), cache)

        out = torch.empty(n, ncb, lm.hidden_size, dtype=dtype, device=device)
        for a in range(0, n, chunk):
            if progress.should_stop():
                raise Cancelled(f"replay cancelled at frame {a} of {n}")
            b = min(a + chunk, n)
            fed = _frame_feedback(lm, depth, codes_d[a:b], cs.code_offset, dtype)  # frames a .. b-1: [m, 1, H]
            hid = lm(fed.transpose(0, 1), cache)[0]  # [m, H]: hidden after frame k predicts frame k + 1
            nxt = codes_d[a + 1:b + 1]  # the frames those hiddens predicted
            seq = [depth.projection(hid)[:, None],
                   depth.projection(lm.embed(nxt[:, 0] + cs.code_offset, dtype))[:, None]]
            seq += [depth.projection(depth.code_embedding(nxt[:, j], j, dtype))[:, None] for j in range(1, ncb - 1)]
            states = depth(torch.cat(seq, dim=1))  # [m, ncb, H]
            out[a:b, 0] = hid
            out[a:b, 1:] = states[:, 1:]
            progress.on_progress("replay", b, n, {"frames": n})
    return AudioCodes(codes.cpu(), out, prompt, lm_seed, False)
