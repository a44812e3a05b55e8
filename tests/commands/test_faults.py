"""Faults during a run: Ctrl+C in each stage, a run that diverges to NaN/Inf, and out of device
memory. Each must stop promptly, say where it stopped, write nothing, keep no model loaded, and
leave the process able to run the next request to the same result as a fresh one.

Ctrl+C is a real SIGINT sent to this process from inside a progress report (the CLI's handler sets
the stop flag the engine polls); NaN comes from a DiT file whose weights are NaN (rewritten with
gguf-py) or a forward patched to return NaN at a chosen call; out of memory is a patched forward
raising `torch.OutOfMemoryError`, as CUDA does.
"""

import gc
import os
import signal
import weakref

import numpy as np
import pytest
import torch

from mm3.commands import jobs as jobs_cli
from mm3.commands.main import main as cli_main
from mm3.synth.flow import NonFiniteError
from mm3.models.dit import FlowDiT
from mm3.models.lm import Qwen3LM
from mm3.models.vocoder import Vocoder
from mm3.song.pipeline import DeviceOutOfMemory, Pipeline
from mm3.song.request import MM3Request
from tests.helpers.gguf_util import models_with, rewrite

FAST = ["--steps", "2", "--seed", "1", "--lm-seed", "1", "--quiet"]
pytestmark = pytest.mark.usefixtures("one_thread")  # thread count: stable timing on a shared CPU


def codes_text(frames: int, seed: int = 0) -> str:
    """`frames` + 1 random code rows within the tiny model's ranges (64 semantic, 64 acoustic)."""
    return ",".join(map(str, np.random.default_rng(seed).integers(0, 64, size=(frames + 1) * 8)))


@pytest.fixture
def spy(monkeypatch):
    """The Pipeline each CLI command builds, to check what it still holds afterwards."""
    made = []
    real = Pipeline.__init__

    def capture(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Pipeline, "__init__", capture)
    return made


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


# -- Ctrl+C -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage, frames, extra", [
    ("ar", None, ["--duration", "2"]),  # 50 frames to plan
    ("replay", 40, []),  # replayed in chunks of 16 frames here, so replay has several units
    ("dit", 12, ["--steps", "4"]),
    ("vae", 201, []),  # two windows
])
def test_ctrl_c_in_each_stage(tiny, tmp_path, capsys, monkeypatch, spy, stage, frames, extra):
    """SIGINT after the first unit of `stage`: no further unit of anything runs, exit 130, nothing
    written, no model left loaded; the next command in the same process works."""
    if stage == "replay":
        monkeypatch.setattr("mm3.plan.replay.REPLAY_CHUNK", 16)
    events = []
    real = jobs_cli.Console.on_progress

    def on_progress(self, st, done, total, info):
        events.append(st)
        if st == stage and events.count(st) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode
            events.append("SIGINT")
        real(self, st, done, total, info)

    monkeypatch.setattr(jobs_cli.Console, "on_progress", on_progress)
    out = tmp_path / "out"
    out.mkdir()
    common = ["--models", str(tiny.gguf), "--out", str(out / "x.wav"), "--quiet"]
    if frames is None:
        argv = ["generate", "--caption", "a", "--lyrics", "b", *common, *FAST, *extra]
        again = ["generate", "--caption", "a", "--lyrics", "b", "--duration", "0.5", *common, *FAST]
    else:
        for name, n in (("long.json", frames), ("short.json", 12)):
            (tmp_path / name).write_text(MM3Request(caption="a", lyrics="b", audio_codes=codes_text(n), steps=2,
                                                    seed=1, lm_seed=1).to_json())
        argv = ["render", "--request", str(tmp_path / "long.json"), *common, *extra]
        again = ["render", "--request", str(tmp_path / "short.json"), *common]
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 130, err
    assert "cancelled:" in err and "nothing was written" in err and "Traceback" not in err
    assert "SIGINT" in events and events[-1] == "SIGINT"  # stopped before the next frame / chunk / step / window
    assert listing(out) == []
    assert spy[-1].store.resident() == []
    monkeypatch.setattr(jobs_cli.Console, "on_progress", real)
    assert cli_main(again) == 0  # the process is fine: the next command runs to the end
    assert listing(out) == ["x.json", "x.wav"]


# -- NaN / Inf ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_models(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("nan")
    nan = np.float32("nan")

    def nan_tensor(name, shape):
        return lambda s, d: rewrite(s, d, tensors={name: np.full(shape, nan, np.float32)})

    return {
        "dit": models_with(tiny, root / "dit", "dit", nan_tensor("proj_out.weight", (16, 64))),
        "lm": models_with(tiny, root / "lm", "lm", nan_tensor("model.norm.weight", (64,))),
        "vae": models_with(tiny, root / "vae", "vae", nan_tensor("blocks.0.conv_t1.bias", (32,))),
    }


@pytest.mark.parametrize("kind, message", [
    ("dit", "error: non-finite DiT velocity at window 1/1, step 1/2 (variations 0..0); nothing was written"),
    ("lm", "error: non-finite LM/depth hidden states in planning (LM + depth decoder) at frame 1 of"),
    ("vae", "error: non-finite vocoder output in window 1/1 (sample 0 of"),
])
def test_nan_weights_fail_naming_the_stage(nan_models, tmp_path, capsys, spy, kind, message):
    rc = cli_main(["generate", "--models", str(nan_models[kind]), "--caption", "a", "--lyrics", "b",
                   "--duration", "0.5", "--out", str(tmp_path / "x.wav"), *FAST])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert message in err and "Traceback" not in err
    assert listing(tmp_path) == []
    assert spy[-1].store.resident() == []


def test_nan_at_a_later_window_and_step(tiny, monkeypatch):
    """NaN from the 5th DiT call: with 3 steps per window that is window 2, step 2."""
    calls = []
    real = FlowDiT.forward

    def forward(self, x, t, cond):
        calls.append(1)
        v = real(self, x, t, cond)
        return v.fill_(float("nan")) if len(calls) == 5 else v

    monkeypatch.setattr(FlowDiT, "forward", forward)
    pipe = Pipeline(tiny.gguf, device="cpu")
    req = MM3Request(caption="a", lyrics="b", audio_codes=codes_text(250), steps=3, seed=1, lm_seed=1)
    with pytest.raises(NonFiniteError, match=r"non-finite DiT velocity at window 2/2, step 2/3"):
        pipe.run(req)
    assert pipe.store.resident() == [] and len(calls) == 5


# -- out of memory ------------------------------------------------------------------------------
def _oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


@pytest.fixture(scope="module")
def expected(tiny):
    """The audio of a fresh pipeline for the request the OOM tests retry."""
    req = MM3Request(caption="a", lyrics="b", duration=0.5, steps=2, seed=3, lm_seed=3)
    return req, Pipeline(tiny.gguf, device="cpu").run(req)[0].audio


@pytest.mark.parametrize("target, stage, where", [
    ((Qwen3LM, "forward"), "planning (LM + depth decoder)", "before its first frame"),
    ((FlowDiT, "forward"), "DiT sampling (condition encoder + DiT)", "before its first step"),
    ((Vocoder, "decode_sides"), "vocoder decoding", "before its first window"),
    (("mm3.models.build_model", None), "DiT sampling (condition encoder + DiT)", "while loading "),
])
@pytest.mark.parametrize("keep_loaded", [False, True])
def test_out_of_memory_names_the_stage_and_recovers(tiny, monkeypatch, expected, target, stage, where, keep_loaded):
    req, audio = expected
    pipe = Pipeline(tiny.gguf, device="cpu", keep_loaded=keep_loaded)
    if target[1] is None:  # loading: fail when the DiT is built
        from mm3.files import store
        real = store.build_model
        monkeypatch.setattr(store, "build_model", lambda c, **kw: _oom() if c.kind == "dit" else real(c, **kw))
    else:
        monkeypatch.setattr(*target, _oom)
    refs = []
    real_model = pipe.store.model

    def model(kind, name="", numerics="fast"):
        m = real_model(kind, name, numerics)
        refs.append(weakref.ref(m))
        return m

    monkeypatch.setattr(pipe.store, "model", model)
    with pytest.raises(DeviceOutOfMemory) as e:
        pipe.run(req)
    msg = str(e.value)
    assert msg.startswith(f"out of cpu memory in {stage} ({where}") and "CUDA out of memory" in msg
    assert "Every model was released. Try a lighter quant of the" in msg and "python -m mm3 quantize" in msg
    assert ("run without --keep-loaded" in msg) == keep_loaded
    assert pipe.store.resident() == []
    gc.collect()
    assert refs and all(r() is None for r in refs)  # nothing pins a model, even with the exception kept
    monkeypatch.undo()
    (track,) = pipe.run(req)  # the same pipeline runs the next request, to the same result
    assert torch.equal(track.audio, audio)


def test_out_of_memory_in_the_cli(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(FlowDiT, "forward", _oom)
    rc = cli_main(["generate", "--models", str(tiny.gguf), "--caption", "a", "--lyrics", "b", "--duration", "0.5",
                   "--keep-loaded", "--out", str(tmp_path / "x.wav"), *FAST])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: out of cpu memory in DiT sampling"), err
    assert "strict memory mode" in err and "nothing was written" in err and listing(tmp_path) == []
