"""The AR frame step replayed from CUDA graphs (`GraphedStep`), checked against an eager step.

A frame step (LM head sampling, the 7 depth steps, the LM step that feeds the frame back) launches
hundreds of small kernels; replaying them as one CUDA graph removes the launch cost. One graph per
KV-cache bucket (the step's attention length, a power of two): the inputs are copied into the
graph's own buffers, the state between frames (`FrameSampler.last`) lives in a buffer the graph
reads and writes, the KV position on the device.

Graphs have been seen to give noise or NaN on some drivers and GPUs. So each new graph's first
frame is computed eagerly too, then rewound and replayed from the graph: when the two disagree
(codes differ, or the graph's hiddens are not finite or not close), the stage warns, naming the
device, and runs eagerly from then on: a bad graph costs speed, never the song.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

AGREEMENT = 1e-3  # relative difference of the hiddens a replay may show against the eager step


def wanted(device: torch.device, shaping: bool) -> bool:
    """Whether the frame step runs from CUDA graphs: on CUDA by default; `MM3_CUDA_GRAPHS=0` turns
    it off; never with a shaped semantic draw (its history is state a graph would freeze)."""
    setting = os.environ.get("MM3_CUDA_GRAPHS", "1").strip().lower()
    return device.type == "cuda" and setting not in ("0", "off", "false", "no") and not shaping


class GraphedStep:
    """`sampler.step` through one captured graph per KV bucket (`sampler.cache.bucket`), each
    checked against an eager step at its first frame. `capture(sampler, q_sem, q_dep)` returns a
    replay function (`CudaCapture` by default; tests pass their own)."""

    def __init__(self, sampler, device: torch.device, capture=None):
        self.sampler, self.device = sampler, torch.device(device)
        self.capture = capture or CudaCapture(self.device)
        self.graphs: dict = {}
        self.eager = False  # set when a graph disagreed: the rest of the run is eager
        self.checks: list[tuple] = []  # (bucket, agreed, why) of every check made

    def __call__(self, q_sem: torch.Tensor, q_dep: torch.Tensor):
        if self.eager:
            return self.sampler.step(q_sem, q_dep)
        bucket = self.sampler.cache.bucket
        replay = self.graphs.get(bucket)
        if replay is None:
            return self._first(bucket, q_sem, q_dep)
        return replay(q_sem, q_dep)

    def _first(self, bucket, q_sem, q_dep):
        """The bucket's first frame: eager, then the same frame from a new graph; keep the graph
        when they agree."""
        s = self.sampler
        last, pos = s.last.clone(), s.cache.pos.clone()
        with getattr(self.capture, "warm", contextlib.nullcontext)():  # on the capture's stream
            want = [t.clone() for t in s.step(q_sem, q_dep)]
            want_last = s.last.clone()
        s.last = last
        s.cache.pos.copy_(pos)
        try:
            replay = self.capture(s, q_sem, q_dep)
            got = replay(q_sem, q_dep)
            agreed, why = agree(want, want_last, got, s.last)
        except Exception as e:  # a capture the driver refuses
            replay, agreed, why = None, False, f"capture failed ({type(e).__name__}: {e})"
        self.checks.append((bucket, agreed, why))
        if agreed:
            self.graphs[bucket] = replay
            return got
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device)
        warnings.warn(f"CUDA graphs on {name} ({self.device}): the captured AR frame step differs from the eager one "
                      f"({why}); running the AR stage without graphs", stacklevel=3)
        self.eager = True
        self.graphs.clear()
        s.last = last  # the frame again, eagerly: the replay may have written garbage into the KV cache
        s.cache.pos.copy_(pos)
        return s.step(q_sem, q_dep)


def agree(want, want_last, got, got_last) -> tuple[bool, str]:
    """(whether a replayed frame matches the eager one, what differs): same codes and END flags,
    finite hiddens and state within AGREEMENT (relative) of the eager ones."""
    codes, end, hidden = want
    g_codes, g_end, g_hidden = got
    if not torch.equal(g_codes, codes) or not torch.equal(g_end, end):
        return False, "different codes"
    for name, a, b in (("hiddens", hidden, g_hidden), ("LM state", want_last, got_last)):
        if not bool(torch.isfinite(b).all()):
            return False, f"non-finite {name}"
        scale = a.float().norm().clamp_min(1e-30)
        diff = float((b.float() - a.float()).norm() / scale)
        if not diff <= AGREEMENT:
            return False, f"{name} {diff:.1e} apart"
    return True, ""


class CudaCapture:
    """Captures `sampler.step` as CUDA graphs on one side stream, all sharing one memory pool (a
    run replays one bucket's graph after another, never two at once)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def warm(self):
        """Run eager work on the capture's stream (what a capture after it needs warmed up)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def __call__(self, sampler, q_sem: torch.Tensor, q_dep: torch.Tensor):
        """The step captured; returns replay(q_sem, q_dep) -> its outputs (the graph's own
        tensors: copy them before the next replay). The products must have been chosen and the
        kernels compiled (the eager step in `warm` did both)."""
        static_sem, static_dep, static_last = q_sem.clone(), q_dep.clone(), sampler.last.clone()
        sampler.last = static_last
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = sampler.step(static_sem, static_dep)
            static_last.copy_(sampler.last)
        sampler.last = static_last

        def replay(q_sem: torch.Tensor, q_dep: torch.Tensor):
            static_sem.copy_(q_sem)
            static_dep.copy_(q_dep)
            graph.replay()
            return out

        return replay
