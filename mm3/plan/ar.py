"""The autoregressive stage: prompt -> audio codes and frame hiddens, as diffusers'
`MiniMaxMusic3AutoregressiveStep` samples them (LM rows [cond, uncond] per song under CFG with a
conditional top-k pre-filter, then the depth decoder's 7 acoustic codes, the frame fed back as one
summed embedding). Song i draws from its own generator (`lm_seed + i`), so a song is the same
alone or in a batch; `plan_and_replay` then rebuilds each song's hiddens from its codes
(`mm3.plan.replay`).

`FrameSampler.step` never waits for the host, so it can be compiled or graph-captured; the host
loop draws on the songs' CPU generators, as the reference does. The models' numerics decide the op
shapes: "reference" reproduces the reference's hiddens bit for bit on a CPU in float32, "fast"
fuses products and caches the depth decoder's keys, equal up to rounding.
"""

from __future__ import annotations

import torch

from ..backends.cpu import choice as cpu_choice
from ..backends.gpu import frame_graphs
from ..backends.gpu.emulation import cpu_path
from .codes import AudioCodes
from ..constants import FRAME_RATE, MAX_AUDIO_FRAMES
from ..backends.device import ar_weight_budget, keeps_ar_copies, model_device
from ..errors import RunError
from ..backends import steps
from ..weights.binding import indexed_device
from ..weights.layers import choose_products
from ..weights.copies import cache_dequantized, dequantized_nbytes, release_dequantized
from .lyrics_align import LyricHeads
from ..weights.scratch import CPU_SCRATCH
from ..models.depth import RVQDepthDecoder
from ..models.lm import KVCache, Qwen3LM
from ..models.lm import activation_bytes as lm_activation_bytes
from ..progress import Cancelled, Progress
from .prompt import Prompt
from .replay import check_pair, checked_codes, feed_frames, frame_feedback, replay
from .settings import PlanSettings
from .shaping import SemanticShaper
from .sampling import (
    draw, exponential_draws, exponential_tail, guide, kth_largest, make_generator, resolve_seed, skip_draws,
    top_k_probs)

_NEG_INF = -float("inf")
MIN_KV_BUCKET = 256  # shortest attention length of a compiled step (lengths go up in powers of two)


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


class FrameSampler:
    """One AR frame of every song of a batch: rows [cond_0, uncond_0, cond_1, ...] of `cache`.

    `last` [rows, H] is the state between frames (the final-normed LM hidden of every row).
    `step(q_sem [songs, C], q_dep [songs, ncb - 1, audio_vocab])` samples a frame for every song
    from those Exponential(1) draws (`torch.multinomial`'s draw, `mm3.plan.sampling.draw`), feeds it back
    through the LM and returns (codes [songs, ncb] int64, end [songs] bool, hidden [songs, ncb, H]:
    the LM hidden that predicted the frame, then the 7 conditional depth states). C = the head rows
    `lm.head_ids`; ids there that are neither END nor a semantic code are never drawn.
    """

    def __init__(self, lm: Qwen3LM, depth: RVQDepthDecoder, codes, cache: KVCache, settings: PlanSettings,
                 dtype: torch.dtype, device: torch.device, max_frames: int = 0, prefix: torch.Tensor | None = None):
        self.lm, self.depth, self.cache, self.dtype = lm, depth, cache, dtype
        self.cfg, self.top_k = float(settings.lm_cfg), int(settings.top_k)
        self.r = cache.rows // settings.songs  # LM rows per song: [cond, uncond], or [cond] (`rows_per_song`)
        self.code_offset, self.end_id = codes.code_offset, codes.end_id
        self.head_start, head_stop = lm.head_ids
        ids = torch.arange(self.head_start, head_stop)
        candidate = (ids == codes.end_id) | ((ids >= codes.code_offset) & (ids < codes.code_offset + codes.num_semantic))
        self.not_candidate = None if bool(candidate.all()) else (~candidate).to(device)
        rows = cache.rows
        self.ncb = depth.num_codebooks
        # The reference re-runs the depth decoder over the whole sequence at every step.
        self.depth_cache = None if depth.numerics == "reference" else depth.new_cache(rows, dtype, device)
        # The fast numerics' draws: a back end's one call each where it serves (`steps.top_k_draw`).
        self.library_draws = depth.numerics == "fast"
        self.last = torch.zeros(rows, lm.hidden_size, dtype=dtype, device=device)
        self.shaper = None
        if not settings.shaping.is_reference:
            end_col = codes.end_id - self.head_start
            start = codes.code_offset - self.head_start
            history = None if prefix is None else prefix[:, 0].expand(settings.songs, -1)
            self.shaper = SemanticShaper(settings.shaping, settings.songs, max_frames + 1, codes.num_semantic,
                                         slice(start, start + codes.num_semantic),
                                         end_col if 0 <= end_col < head_stop - self.head_start else None, device,
                                         history)

    def _semantic(self, q_sem: torch.Tensor):
        """CFG over the head rows, kept where the conditional logit is in its top-k (ties kept) ->
        (c0 codes [songs], END flags [songs]); an END row carries code 0 (the host drops it)."""
        head = self.lm.head(self.last)  # [rows, C], the compute dtype
        mask, shaper = self.not_candidate, self.shaper
        if self.library_draws and shaper is None:
            drawn = steps.semantic_draw(head, self.r, self.cfg, self.top_k, q_sem, mask, self.head_start,
                                        self.code_offset, self.end_id)
            if drawn is not None:
                return drawn
            token = steps.top_k_draw(head, self.r, self.cfg, self.top_k, q_sem, mask, gate=True)
            if token is not None:
                return self._coded(token + self.head_start)
        logits = head.float()
        c, u = (logits[0::2], logits[1::2]) if self.r == 2 else (logits, logits)
        if mask is not None:
            c, u = c.masked_fill(mask, _NEG_INF), u.masked_fill(mask, _NEG_INF)
        if shaper is not None:
            c, u = shaper.block_end(c, u)
        guided = (guide(c, u, self.cfg) if self.r == 2 else c).masked_fill(c < kth_largest(c, self.top_k), _NEG_INF)
        if mask is not None:  # guidance of two -inf values is NaN
            guided = guided.masked_fill(mask, _NEG_INF)
        if shaper is None:
            return self._coded(_draw(top_k_probs(guided, self.top_k), q_sem) + self.head_start)
        probs = shaper.probs(top_k_probs(shaper.logits(guided), self.top_k))
        return self._coded(_draw(probs, q_sem) + self.head_start)

    def _coded(self, token: torch.Tensor):
        """(code, END flag) of drawn LM ids."""
        return (token - self.code_offset).clamp_min(0), token == self.end_id

    def _rows(self, table, codes: torch.Tensor, add: int, dt: torch.dtype) -> torch.Tensor:
        """Rows codes[i // r] + add of an embedding layer [rows, H]: one kernel of a back end where
        one serves (the ids made on the device), else the layer's lookup."""
        rows = steps.code_rows(table.stored("weight"), table.qtype("weight"), codes, table.embedding_dim, dt,
                               self.r, add)
        return table.lookup(codes.repeat_interleave(self.r) + add, dt, codes.device) if rows is None else rows

    def _depth(self, x: torch.Tensor, seq: list[torch.Tensor]) -> torch.Tensor:
        """The depth state after appending x [rows, s, H] to the sequence: [rows, H]."""
        if self.depth_cache is None:
            seq.append(x)
            return self.depth(torch.cat(seq, dim=1))[:, -1]
        return self.depth(x, self.depth_cache)[:, -1]

    def _feedback(self, frame: torch.Tensor) -> torch.Tensor:
        """The LM input of frame [songs, ncb] at every row [rows, 1, H] (`frame_feedback`): one
        kernel of a back end where one serves."""
        lm, depth, dt = self.lm, self.depth, self.dtype
        table, audio = lm.model.embed_tokens, depth.audio_embeddings
        fed = steps.frame_feedback(table.stored("weight"), table.qtype("weight"), audio.stored("weight"),
                                   audio.qtype("weight"), frame, self.code_offset, depth.audio_vocab,
                                   table.embedding_dim, dt, self.r)
        return frame_feedback(lm, depth, frame.repeat_interleave(self.r, dim=0), self.code_offset, dt) \
            if fed is None else fed

    def step(self, q_sem: torch.Tensor, q_dep: torch.Tensor):
        lm, depth, dt, last = self.lm, self.depth, self.dtype, self.last
        sem, end = self._semantic(q_sem)
        if self.shaper is not None:
            self.shaper.observe(sem)
        # Acoustic codes c1..c7: the depth sequence [proj(last), proj(c0 embedding), proj(c1), ...].
        r = self.r
        sem_emb = self._rows(lm.model.embed_tokens, sem, self.code_offset, dt)  # [rows, H]
        if self.depth_cache is None:  # two products, as the reference makes them
            x = torch.cat((depth.projection(last)[:, None], depth.projection(sem_emb)[:, None]), dim=1)
        else:  # one product of both positions
            x = depth.projection(torch.stack((last, sem_emb), dim=1))
        seq: list[torch.Tensor] = []
        if self.depth_cache is not None:
            self.depth_cache.reset()
        codes, hiddens = [sem], []
        for j in range(1, self.ncb):
            h = self._depth(x, seq)  # [rows, H]
            hiddens.append(h[0::r])
            lg = depth.audio_heads[j - 1](h)  # [rows, audio_vocab], the compute dtype
            code = steps.top_k_draw(lg, r, self.cfg, self.top_k, q_dep[:, j - 1]) if self.library_draws else None
            if code is None:
                lg = lg.float()
                guided = guide(lg[0::2], lg[1::2], self.cfg) if r == 2 else lg
                code = _draw(top_k_probs(guided, self.top_k), q_dep[:, j - 1])  # [songs]
            codes.append(code)
            if j < self.ncb - 1:
                x = depth.projection(self._rows(depth.audio_embeddings, code, (j - 1) * depth.audio_vocab, dt))[:, None]
        frame = torch.stack(codes, dim=1)  # [songs, ncb]
        hidden = torch.stack([last[0::r]] + hiddens, dim=1)  # [songs, ncb, H]
        # Feedback at the next position of every row.
        fed = self._feedback(frame)
        self.last = lm(fed, self.cache)[:, -1]
        return frame, end, hidden


def _draw(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`draw` over the frame's Exponential(1) draws `q`, or over raw 64-bit ones (the kernel
    library makes Exponential only those the candidates need)."""
    if q.dtype != torch.int64:
        return draw(probs, q)
    index = steps.draw_from_raw(probs, q)
    return draw(probs, steps.exponentials(q)) if index is None else index


def kv_bucket(n_keys: int, max_len: int) -> int:
    """Attention length of a compiled step for `n_keys` filled positions: a power of two >= it."""
    b = MIN_KV_BUCKET
    while b < n_keys:
        b *= 2
    return min(b, max_len)


class _EndFlags:
    """END flags of launched frames, copied to the host without waiting for them."""

    def __init__(self, device: torch.device):
        self.device, self.pending = device, {}

    def put(self, frame: int, end: torch.Tensor):
        if self.device.type == "cuda":
            host = torch.empty(end.shape, dtype=end.dtype, pin_memory=True)
            host.copy_(end, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending[frame] = (host, event)
        else:
            self.pending[frame] = (end.to("cpu"), None)

    def take(self, frame: int) -> list[bool]:
        host, event = self.pending.pop(frame)
        if event is not None:
            event.synchronize()
        return host.tolist()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class FrameDraws:
    """Each frame's Exponential(1) draws for every song, made on the songs' CPU generators exactly as
    the reference consumes them: one over the whole LM vocabulary for the semantic code (only the
    head rows' part is kept; the rest is skipped cheaply where that is exact) and one over the
    audio vocabulary per acoustic code. `raw`: as the generator's raw 64-bit values instead
    (`steps.raw_draws`; the library's draws make Exponential only the few that count)."""

    def __init__(self, generators: list[torch.Generator], vocab: int, head: tuple[int, int], ncb: int, audio_vocab: int,
                 raw: bool = False):
        self.generators, self.vocab, self.ncb, self.audio_vocab = generators, vocab, ncb, audio_vocab
        self.start, self.width = head[0], head[1] - head[0]
        self.raw = raw
        placeholder = dict(dtype=torch.int64, fill_value=1 << 52) if raw else dict(dtype=torch.float32, fill_value=1.0)
        self.ones_sem = torch.full((1, self.width), **placeholder)  # an ended song's rows
        self.ones_dep = torch.full((ncb - 1, audio_vocab), **placeholder)

    def semantic(self, g: torch.Generator) -> torch.Tensor:
        if not self.raw:
            return exponential_tail(self.vocab, self.start, g)[:, :self.width]
        if skip_draws(self.vocab, self.start, g):
            return steps.raw_draws(g, (1, self.vocab - self.start))[:, :self.width]
        return steps.raw_draws(g, (1, self.vocab))[:, self.start:self.start + self.width]

    def acoustic(self, g: torch.Generator) -> torch.Tensor:
        if self.raw:
            return steps.raw_draws(g, (self.ncb - 1, self.audio_vocab))
        return torch.cat([exponential_draws(self.audio_vocab, g) for _ in range(self.ncb - 1)])

    def frame(self, active: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        sem, dep = [], []
        for g, on in zip(self.generators, active):
            if not on:  # an ended song draws nothing; its rows compute on placeholders
                sem.append(self.ones_sem)
                dep.append(self.ones_dep)
                continue
            sem.append(self.semantic(g))
            dep.append(self.acoustic(g))
        return torch.cat(sem), torch.stack(dep)  # [songs, C], [songs, ncb - 1, audio_vocab]


def sample_frames(sampler: FrameSampler, draws: FrameDraws, *, max_frames: int, device: torch.device,
                   progress: Progress, compile: bool = False, static_shapes: bool = False,
                   emit_first: bool = False, on_frames=None,
                   graphs: bool | None = None) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Frames 0 .. max_frames (frame 0 is fed back, not emitted) of every song until it ends.
    Returns per song (codes [n + 1, ncb] on the CPU, frame hiddens [n, ncb, H], ended_naturally).
    `emit_first` (a continued song, its frame 0 already known): frames 0 .. max_frames - 1 are all
    emitted; returns codes [n, ncb] and hiddens [n, ncb, H].
    `static_shapes` (implied by `compile` and graphs): the LM attends over power-of-two lengths of its
    cache with the unfilled positions masked, so the step's shapes change only at those lengths.
    `graphs` (None: `frame_graphs.wanted`, on CUDA by default): the step replayed from CUDA graphs,
    each checked against an eager step (`mm3.backends.gpu.frame_graphs`); with `compile`, the compiled step is
    what they capture, each checked against the compiled step run outside the graph (torch's own
    CUDA graphs are not used: the step's state lives outside it).
    `on_frames(rows, final, read)` after each processed frame: per song the code rows recorded so
    far, whether the song is complete, and `read(i, n)`: song i's first n code rows on the CPU."""
    gens, cache = draws.generators, sampler.cache
    n_songs, ncb, hidden_size = len(gens), sampler.ncb, sampler.lm.hidden_size
    last_launch = max_frames - 1 if emit_first else max_frames
    codes_buf = torch.zeros(last_launch + 1, n_songs, ncb, dtype=torch.long, device=device)
    hid_buf = torch.zeros(last_launch + 1, n_songs, ncb, hidden_size, dtype=sampler.dtype, device=device)
    step = sampler.step
    if graphs is None:
        graphs = frame_graphs.wanted(device, sampler.shaper is not None)
    static = compile or static_shapes or graphs
    cache.host_counting = not static
    if compile or graphs:  # the step only calls products chosen now
        choose_products([sampler.lm, sampler.depth], sampler.dtype, device)
        sampler.depth.ready(sampler.dtype, device)
    if compile:  # during this run the sampler steps through the compiled step, also where graphs capture it
        step = sampler.step = torch.compile(sampler.step, dynamic=False)
    if graphs:
        step = frame_graphs.GraphedStep(sampler, device)

    active, ended = [True] * n_songs, [False] * n_songs
    emitted, last_frame = [0] * n_songs, [-1] * n_songs
    snaps: dict[int, list] = {}  # frame -> each song's generator state before that frame's draws
    flags = _EndFlags(device)

    def launch(f: int):
        snaps[f] = [g.get_state() if active[i] else None for i, g in enumerate(gens)]
        q_sem, q_dep = draws.frame(active)
        if static:
            cache.bucket = kv_bucket(cache.length + 1, cache.max_len)
        codes, end, hidden = step(_to_device(q_sem, device), _to_device(q_dep, device))
        if static:
            cache.length += 1
        codes_buf[f].copy_(codes)
        hid_buf[f].copy_(hidden)
        flags.put(f, end)

    def process(f: int):
        end = flags.take(f)
        recorded = False
        for i, g in enumerate(gens):
            if not active[i] or snaps[f][i] is None:
                continue
            if end[i]:  # undo this frame's depth draws and any later frame's, keep the semantic draw
                g.set_state(snaps[f][i])
                draws.semantic(g)
                active[i], ended[i] = False, True
                continue
            last_frame[i], recorded = f, True
            if f > 0 or emit_first:
                emitted[i] += 1
                active[i] = emitted[i] < max_frames
        snaps.pop(f - 1, None)
        if recorded:
            progress.on_progress("ar", max(emitted), max_frames,
                                 {"frame": f, "songs": n_songs, "active": sum(active)})
        if on_frames is not None:
            on_frames([n + 1 for n in last_frame], [not a for a in active], read)

    def read(i: int, n: int) -> torch.Tensor:
        return codes_buf[:n, i].cpu()

    launched = done = 0
    try:
        while True:
            can_launch = launched <= last_launch and any(active)
            if not can_launch and done >= launched:
                break
            if progress.should_stop():
                raise Cancelled(f"AR cancelled before frame {done} of {max_frames}")
            if can_launch:
                launch(launched)
                launched += 1
                if done < launched - 1:  # the previous frame's flags: one frame late
                    process(done)
                    done += 1
            else:
                process(done)
                done += 1
    finally:
        cache.bucket, cache.host_counting = None, True
        sampler.__dict__.pop("step", None)  # the compiled step holds the sampler: no cycle keeps its caches
    codes_cpu = codes_buf[:max(launched, 1)].cpu()
    out = []
    for i in range(n_songs):
        n = last_frame[i] + 1  # frames 0 .. last recorded
        hiddens = hid_buf[0 if emit_first else 1:n, i]
        whole = n_songs == 1 and n == hid_buf.shape[0]  # then a contiguous view of nearly all the buffer
        out.append((codes_cpu[:n, i].clone(), hiddens if whole else hiddens.clone(), ended[i]))
    return out


@torch.inference_mode()
def plan(lm: Qwen3LM, depth: RVQDepthDecoder, prompt: Prompt, settings: PlanSettings, *,
         device: torch.device | None = None, dtype: torch.dtype = torch.float32,
         generators: list[torch.Generator] | torch.Generator | None = None, progress: Progress | None = None,
         weight_budget: int | None = None, compile: bool = False, graphs: bool | None = None,
         prefix: torch.Tensor | None = None, keep_hiddens: bool = True, on_frames=None) -> list[AudioCodes]:
    """Sample `settings.songs` songs for `prompt`: one AudioCodes each (codes [F+1, ncb], hiddens
    [F, ncb, H] in `dtype` on `device`), song i from `generators[i]` (the reference's draws; the
    generator can go on to draw the DiT noise) or from a CPU generator seeded `lm_seed + i`.
    `prefix`: codes [P + 1, ncb] to continue (teacher forced; the duration counts them).
    `keep_hiddens` False: codes only, for a caller that replays them. `weight_budget`: bytes of
    dequantized weight copies kept for the call (None: `mm3.backends.device.ar_weight_budget`). `compile`:
    the frame step through torch.compile; `graphs`: from CUDA graphs (None: on CUDA, see
    `mm3.backends.gpu.frame_graphs`), of the compiled step with both. Progress after every frame; cancel before every frame.
    `on_frames(frames, final, codes)` after every frame: per song the frames emitted so far (a
    continued song's prefix counted), whether it is complete, and `codes(i)`: song i's code rows so
    far [frames + 1, ncb] on the CPU (prefix included), for a caller that renders as it plans.
    On the CPU the models first take their few-row product forms (`mm3.backends.cpu.choice`: by rule,
    or as `MM3_CPU_PRODUCT` names).
    """
    check_pair(lm, depth, prompt)
    device = model_device(lm) if device is None else indexed_device(device)
    progress = progress or Progress()
    n_songs = settings.songs
    if generators is not None:
        gens = [generators] if isinstance(generators, torch.Generator) else list(generators)
        if len(gens) != n_songs:
            raise ValueError(f"{len(gens)} generators for lm_batch_size {n_songs}")
        seeds = [None if settings.lm_seed is None else settings.lm_seed + i for i in range(n_songs)]
    else:
        base = resolve_seed(settings.lm_seed)
        seeds = [base + i for i in range(n_songs)]
        gens = [make_generator(s) for s in seeds]

    cs = prompt.codes
    n_prompt = prompt.num_tokens
    max_frames = max_frames_for(settings.duration, n_prompt, lm.max_positions, settings.frame_rate)
    known = 0
    if prefix is not None:
        prefix = checked_codes(prefix, cs, depth, "prior codes")
        known = prefix.shape[0]
        max_frames -= known - 1
        if max_frames < 1:
            raise ValueError(f"the prior codes already hold {known - 1} frames ({(known - 1) / settings.frame_rate:.2f} s): "
                             f"a duration of {settings.duration:g} s leaves no frame to add (within the LM context of "
                             f"{lm.max_positions} after the {n_prompt}-token prompt)")
    budget = ar_weight_budget(device) if weight_budget is None else int(weight_budget)
    if lm.numerics == "fast" and not keeps_ar_copies(device):
        budget = 0  # the fused kernels read the GGUF blocks themselves
    cpu_choice.serve({"lm": lm, "depth": depth}, device)
    own = budget > 0 and dequantized_nbytes([depth, lm]) == 0  # copies someone else keeps are left alone
    if own:  # the depth decoder runs 7 times a frame: its weights first
        cache_dequantized([depth, lm], dtype, budget, device)
    try:
        prior = None if prefix is None or not keep_hiddens else replay(
            lm, depth, prompt, prefix, device=device, dtype=dtype, progress=progress).frame_hiddens
        # Prefill [cond, uncond] once; a batch of songs starts from copies (rows cond_i = 2i, uncond_i = 2i + 1).
        # One spare position: the last frame is fed back too.
        r = rows_per_song(lm.numerics, settings.lm_cfg, device)
        cache = lm.new_cache(r, n_prompt + known + max_frames + 1, dtype, device)
        last = lm(lm.embed(prompt.ids[:r].to(device), dtype), cache)[:, -1]  # [r, H], final-normed
        if prefix is not None:
            last = feed_frames(lm, depth, prefix.to(device), cs.code_offset, dtype, cache)
        if n_songs > 1:
            cache, last = cache.repeat(n_songs), last.repeat(n_songs, 1)
        sampler = FrameSampler(lm, depth, cs, cache, settings, dtype, device, max_frames, prefix)
        sampler.last = last.contiguous()  # the layout of every later frame's (a compiled step guards on it)
        # Raw draws where the library makes the draws in the frame's own thread (a CUDA frame's
        # are made while the device runs the one before).
        raw = sampler.library_draws and cpu_path(sampler.last) and not compile and \
            steps.raw_draws_exact(lm.vocab_size) and steps.raw_draws_exact(depth.audio_vocab)
        draws = FrameDraws(gens, lm.vocab_size, lm.head_ids, depth.num_codebooks, depth.audio_vocab, raw)
        results = sample_frames(sampler, draws, max_frames=max_frames, device=device, progress=progress,
                                 compile=compile, graphs=graphs, emit_first=prefix is not None,
                                 on_frames=None if on_frames is None else _song_so_far(on_frames, prefix))
    finally:
        if own:
            release_dequantized([depth, lm])
        CPU_SCRATCH.clear()
    out = []
    for i, (codes, hiddens, ended) in enumerate(results):
        if hiddens.shape[0] == 0:
            what = "the continuation" if prefix is not None else "the song"
            raise ZeroFramesError(f"song {i} (lm_seed {seeds[i]}) generated zero audio frames: the LM ended "
                                  f"{what} at once; try another seed or prompt")
        if prefix is not None:
            codes = torch.cat([prefix, codes])
            hiddens = None if prior is None else torch.cat([prior, hiddens.to(prior.device)])
        out.append(AudioCodes(codes, hiddens if keep_hiddens else None, prompt, seeds[i], ended))
    return out


def _song_so_far(on_frames, prefix: torch.Tensor | None):
    """`sample_frames`' per-frame report as `plan`'s `on_frames` sees it: whole songs, a
    continued song's prefix in front."""
    def report(rows: list[int], final: list[bool], read):
        if prefix is None:
            on_frames([max(0, n - 1) for n in rows], final, lambda i: read(i, rows[i]))
        else:
            known = prefix.shape[0]
            on_frames([known - 1 + n for n in rows], final, lambda i: torch.cat([prefix, read(i, rows[i])]))
    return report


def activation_bytes(lm_hp: dict, prompt_tokens: int, frames: int, songs: int, lm_cfg: float, device,
                     elem: int, numerics: str = "fast") -> int:
    """Bytes the AR stage needs beyond the weights (what a memory manager must keep free): the
    LM's activations for the rows its songs take (`rows_per_song`)."""
    rows = songs * rows_per_song(numerics, lm_cfg, device)
    bits = steps.kv_cache_bits(device, lm_hp["head_dim"]) if numerics == "fast" else 16
    return lm_activation_bytes(lm_hp, prompt_tokens, frames, rows, elem, bits)


def rows_per_song(numerics: str, lm_cfg: float, device: torch.device) -> int:
    """LM rows each song needs: [cond, uncond], or [cond] with guidance exactly 1, fast numerics and
    an accelerator (u + (c - u) * 1 is c up to the last bit, so the unconditional row is work thrown
    away: half the KV cache and its reads, for a guidance-distilled LM). Reference numerics keep both
    rows, as the reference computes them; so does the CPU, where MKL multiplies one row by a large
    weight more slowly than two."""
    one = float(lm_cfg) == 1.0 and numerics == "fast" and torch.device(device).type != "cpu"
    return 1 if one else 2


def plan_and_replay(lm: Qwen3LM, depth: RVQDepthDecoder, prompt: Prompt, settings: PlanSettings, *,
                    device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                    progress: Progress | None = None, weight_budget: int | None = None,
                    prefix: torch.Tensor | None = None, lyric_heads: LyricHeads | None = None) -> list[AudioCodes]:
    """Sample the songs, then rebuild each one's hiddens from its codes by teacher forcing (with
    `lyric_heads`, also their lyric attention: `replay`).

    The synthesis then depends on the codes alone (sampled and replayed hiddens differ by float
    rounding of the batch shape only), so a song's codes, saved and rendered again, give the same
    audio bit for bit."""
    songs = plan(lm, depth, prompt, settings, device=device, dtype=dtype, progress=progress,
                 weight_budget=weight_budget, prefix=prefix, keep_hiddens=False)
    return [replay(lm, depth, prompt, s.codes, device=device, dtype=dtype, progress=progress, lm_seed=s.lm_seed,
                   ended=s.ended_naturally, lyric_heads=lyric_heads) for s in songs]
