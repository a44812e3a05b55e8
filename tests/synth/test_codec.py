"""`python -m mm3 encode | decode`: the latents equal MM3 Vocoder Encode's, a decode keeps the
length and the channel order, a vocoder file without its encoder is refused before any audio is
read, and the latents file is what the README documents."""

import math
import shutil
import wave

import numpy as np
import pytest
import torch

from mm3.synth.audio import decode_timeline, stitched_length, timeline_windows
from mm3.commands.main import main
from mm3.synth.codec import load_latents, read_audio
from mm3.files.opener import open_component
from mm3.formats.fingerprint import file_fingerprint
from mm3.models import build_model

RATE = 44100
CPU = ["--device", "cpu"]  # compared with the CPU engine calls, bit for bit


def write_wav(path, x: np.ndarray, rate: int = RATE):
    """16-bit PCM WAV of planar float [C, T]."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(x.shape[0])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.round(x.T * 32767).astype("<i2").tobytes())


def read_float_wav(path) -> tuple[np.ndarray, int]:
    """A 32-bit float WAV (as `decode` writes by default) -> planar [C, T] and its rate."""
    data = path.read_bytes()
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    tag, channels, rate = np.frombuffer(data[20:28], "<u2")[:2].tolist() + [int(np.frombuffer(data[24:28], "<u4")[0])]
    assert tag == 3  # IEEE float
    return np.frombuffer(data[44:], "<f4").reshape(-1, channels).T, rate


def tone(seconds: float, rate: int = RATE, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * math.pi * freq * t)).astype(np.float32)


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    """A models folder with only the tiny vocoder (which carries the encoder)."""
    folder = tmp_path_factory.mktemp("codec_models")
    shutil.copy(tiny.file("mm3-vae"), folder)
    return folder


@pytest.fixture(scope="module")
def decoder_only(tiny, tmp_path_factory):
    """A models folder whose vocoder was converted without the training checkpoint: no encoder."""
    from mm3.tools.convert import convert

    root = tmp_path_factory.mktemp("codec_no_encoder")
    shutil.copytree(tiny.diffusers / "vocoder", root / "src" / "vocoder")  # no dav.pth beside it
    convert(root / "src", root / "models", components=["vae"])
    return root / "models"


def vocoder(models, with_encoder=True):
    path = next(models.glob("*.gguf"))
    return build_model(open_component(path, "vae"), with_encoder=with_encoder), path


def test_latents_equal_the_nodes_encode(models, tmp_path):
    """Stereo at the vocoder's rate and mono at 32 kHz (resampled, doubled): the file's latents are
    those MM3 Vocoder Encode's engine call makes, and the metadata names the rate and length."""
    from mm3.song.stages import Conditions
    from nodes import logic
    from nodes.handles import handle_for

    path = next(models.glob("*.gguf"))
    cases = {"stereo.wav": (np.stack([tone(1.0), 0.3 * tone(1.0, freq=1000.0)]), RATE),
             "mono.wav": (tone(0.7, 32000)[None], 32000)}
    for name, (x, rate) in cases.items():
        write_wav(tmp_path / name, x, rate)
        out = tmp_path / (name + ".safetensors")
        assert main(["encode", str(tmp_path / name), str(out), "--models", str(models), "--quiet", *CPU]) == 0
        latents, meta = load_latents(out)
        length = math.ceil(x.shape[-1] * RATE / rate)
        assert meta["sample_rate"] == RATE and meta["length"] == length and meta["hop"] == 512
        assert float(meta["latent_rate"]) == RATE / 512 and meta["channels"] == "2"
        assert meta["source_channels"] == str(x.shape[0]) and meta["source_sample_rate"] == str(rate)
        assert meta["vocoder"] == path.name and meta["vocoder_fingerprint"] == file_fingerprint(path)
        assert latents.shape == (16, math.ceil(length / 512))
        # the node: a ComfyUI AUDIO of the same recording, laid out as one window covering it
        wave_, sr = read_audio(tmp_path / name)
        handle = handle_for("vae", path.name, str(path))
        cond = Conditions(None, [torch.zeros(1, latents.shape[-1], 1)], 512, None)
        node = logic.encode_recording(handle.model(), handle, {"waveform": wave_[None], "sample_rate": sr}, cond,
                                      device="cpu")
        assert node.covered == latents.shape[-1]
        assert torch.equal(node.latents[0][0], latents)


def test_decode_keeps_length_and_channel_order(models, tmp_path):
    """A left-only recording decodes with the tone on the left; its mirror image decodes to the
    same two channels swapped, exactly, at the recording's length in samples."""
    x = tone(1.3)
    n = x.shape[-1]
    outs = {}
    for name, pair in {"left": [x, 0 * x], "right": [0 * x, x]}.items():
        write_wav(tmp_path / f"{name}.wav", np.stack(pair))
        lat = tmp_path / f"{name}.safetensors"
        assert main(["encode", str(tmp_path / f"{name}.wav"), str(lat), "--models", str(models), "--quiet", *CPU]) == 0
        decoded = tmp_path / f"{name}_out.wav"
        assert main(["decode", str(lat), str(decoded), "--models", str(models), "--quiet", *CPU]) == 0
        outs[name], rate = read_float_wav(tmp_path / f"{name}_out.wav")
        assert rate == RATE and outs[name].shape == (2, n)
    np.testing.assert_array_equal(outs["left"][::-1], outs["right"])
    assert np.abs(outs["left"][0] - outs["left"][1]).max() > 1e-3  # the sides are not the same signal
    # what the file holds is the vocoder's decode of each side's latents, trimmed to the length
    voc, _ = vocoder(models, with_encoder=False)
    latents, meta = load_latents(tmp_path / "left.safetensors")
    want = voc.decode(latents[None])[0, :, :n].clamp(-1, 1).numpy()
    np.testing.assert_allclose(outs["left"], want, atol=1e-6)


def test_timeline_windows_cover_the_timeline(models):
    """Windows of any timeline stitch back to exactly its length; a long one decodes window by
    window to hop x latents samples."""
    for total in (1, 344, 689, 690, 1034, 1035, 2000, 12345):
        lengths = timeline_windows(total)
        assert max(lengths) <= 689 and stitched_length(lengths, 512) == 512 * total, total
    voc, _ = vocoder(models, with_encoder=False)
    latents = torch.randn(1, 16, 900, generator=torch.Generator().manual_seed(0))
    assert timeline_windows(900, 600) == [600, 600, 388]  # 256 + 256 + 388: neighbours share 344
    audio = decode_timeline(voc, latents, window=600)
    assert audio.shape == (1, 2, 512 * 900) and audio.abs().max() <= 1.0
    # the first window's kept part is its own decode
    first = voc.decode(latents[..., :600])[..., :512 * (600 - 258)].clamp(-1, 1)
    torch.testing.assert_close(audio[..., :first.shape[-1]], first, atol=1e-6, rtol=0)


def test_encode_refuses_a_vocoder_without_encoder_before_reading_audio(decoder_only, tmp_path, capsys):
    bad = tmp_path / "not_audio.wav"
    bad.write_bytes(b"not a wav file")  # never read: the vocoder is refused first
    out = tmp_path / "x.safetensors"
    name = next(decoder_only.glob("*.gguf")).name
    assert main(["encode", str(bad), str(out), "--models", str(decoder_only)]) == 2
    err = capsys.readouterr().err
    assert f"carries the encoder (encoder.* tensors): {name}" in err and "not_audio" not in err
    assert main(["encode", str(bad), str(out), "--models", str(decoder_only), "--vocoder", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {name} holds no encoder (encoder.* tensors)") and "not_audio" not in err
    assert not out.exists()


def test_decode_refuses_other_files_and_warns_of_another_vocoder(models, decoder_only, tmp_path, capsys):
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"latents": torch.zeros(16, 4)}, str(other))
    assert main(["decode", str(other), str(tmp_path / "o.wav"), "--models", str(models)]) == 2
    assert "not an MM3 latents file" in capsys.readouterr().err
    write_wav(tmp_path / "a.wav", tone(0.2)[None])
    lat = tmp_path / "a.safetensors"
    assert main(["encode", str(tmp_path / "a.wav"), str(lat), "--models", str(models), "--quiet", *CPU]) == 0
    assert main(["decode", str(lat), str(tmp_path / "a.mp3"), "--models", str(models)]) == 2
    assert "should end in .wav" in capsys.readouterr().err
    # the decoder-only file has the same decoder weights but another fingerprint: a warning, not a refusal
    assert main(["decode", str(lat), str(tmp_path / "a_out.wav"), "--models", str(decoder_only), "--quiet", *CPU]) == 0
    assert "was encoded with" in capsys.readouterr().err


def test_encode_reads_mp3_as_comfyui_does(models, tmp_path):
    """An MP3 is decoded with PyAV (ComfyUI's Load Audio reader): the latents are those of its
    decoded samples, at their length."""
    pytest.importorskip("av")
    from mm3.synth.audio import encode_audio
    from mm3.synth.output import mp3_bytes

    (tmp_path / "a.mp3").write_bytes(mp3_bytes(np.stack([tone(0.5), 0 * tone(0.5)])))
    out = tmp_path / "a.safetensors"
    assert main(["encode", str(tmp_path / "a.mp3"), str(out), "--models", str(models), "--quiet", *CPU]) == 0
    latents, meta = load_latents(out)
    wave_, rate = read_audio(tmp_path / "a.mp3")
    assert rate == RATE and wave_.shape[0] == 2 and meta["length"] == wave_.shape[-1] >= int(0.5 * RATE)
    voc, _ = vocoder(models)
    assert torch.equal(latents, encode_audio(voc, wave_, rate)[0])


def test_auto_encodes_with_a_file_that_carries_the_encoder(models, decoder_only, tmp_path):
    """`--vocoder auto` for encode chooses among the vocoder files with the encoder, even where a
    decoder-only file of the same precision comes first."""
    folder = tmp_path / "both"
    folder.mkdir()
    shutil.copy(next(decoder_only.glob("*.gguf")), folder / "a_decoder_only.gguf")
    shutil.copy(next(models.glob("*.gguf")), folder / "b_with_encoder.gguf")
    write_wav(tmp_path / "a.wav", tone(0.2)[None])
    out = tmp_path / "a.safetensors"
    assert main(["encode", str(tmp_path / "a.wav"), str(out), "--models", str(folder), "--quiet", *CPU]) == 0
    assert load_latents(out)[1]["vocoder"] == "b_with_encoder.gguf"


def write_float_wav(path, x: np.ndarray, rate: int = RATE):
    """32-bit IEEE float WAV of planar [C, T], the samples as given (NaN and Inf too)."""
    import struct

    data = np.ascontiguousarray(x.T, dtype="<f4").tobytes()
    channels, block = x.shape[0], 4 * x.shape[0]
    header = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, 3, channels, rate, rate * block, block, 32)
    path.write_bytes(header + b"data" + struct.pack("<I", len(data)) + data)


@pytest.mark.parametrize("value, at, channel", [(np.nan, 22050, 1), (np.inf, 100, 0), (-np.inf, 44099, 1)])
def test_encode_refuses_non_finite_samples_naming_where(models, tmp_path, capsys, value, at, channel):
    """NaN or Inf in a float recording: refused with its time, sample and channel, nothing written
    (they gave NaN latents, and a decode of them silence, both with exit 0)."""
    x = np.stack([tone(1.0), tone(1.0, freq=220.0)])
    x[channel, at] = value
    write_float_wav(tmp_path / "a.wav", x)
    out = tmp_path / "a.safetensors"
    assert main(["encode", str(tmp_path / "a.wav"), str(out), "--models", str(models), *CPU]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: the recording has a non-finite sample ({value}) at {at / RATE:.3f} s (sample {at} of channel "
        f"{channel}); 1 in all: repair or trim it"]
    assert not out.exists()


def test_the_encoders_own_entry_refuses_non_finite_audio(models):
    """The node's path (`encode_audio` on audio in memory) refuses it too, before the encoder runs."""
    from mm3.synth.audio import encode_audio
    from mm3.errors import InputError

    vocoder = build_model(open_component(next(models.glob("*.gguf")), expect="vae"), with_encoder=True)
    audio = torch.zeros(2, 1000)
    audio[0, 10] = float("nan")
    with pytest.raises(InputError, match=r"non-finite sample \(nan\) at 0\.000 s \(sample 10 of channel 0\)"):
        encode_audio(vocoder, audio, RATE)


@pytest.mark.parametrize("reader", ["PyAV", "the standard library"])
def test_encode_refuses_a_two_hour_recording_before_reading_it(models, tmp_path, capsys, monkeypatch, reader):
    """A 2-hour WAV (sparse: its header and no disk) is refused from its header, naming the limit,
    before its samples are read (it ended out of memory)."""
    import builtins
    import struct
    import time

    if reader != "PyAV":
        real = builtins.__import__
        monkeypatch.setattr(builtins, "__import__",
                            lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name)) if name == "av" else
                            real(name, *a, **k))
    seconds, block = 2 * 3600, 4
    data = seconds * RATE * block
    path = tmp_path / "long.wav"
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 36 + data) + b"WAVE" + b"fmt " +
                struct.pack("<IHHIIHH", 16, 1, 2, RATE, RATE * block, block, 16) + b"data" + struct.pack("<I", data))
        f.truncate(44 + data)
    out = tmp_path / "long.safetensors"
    start = time.perf_counter()
    assert main(["encode", str(path), str(out), "--models", str(models), *CPU]) == 2
    assert time.perf_counter() - start < 30
    assert capsys.readouterr().err.splitlines() == [
        f"error: {path} is 7200 s long; the encoder takes at most 720 s (twice the longest song): trim it"]
    assert not out.exists()
