"""The flow-VAE vocoder: a DAC-style decoder (latents -> stereo 44.1 kHz) and its encoder mirror.

Diffusers' `MiniMaxMusic3Vocoder` for the decoder; the file holds weight-norm-folded convolutions
and Snake alphas as [C], and every size is read from the tensor shapes. Each side of the stereo pair
is its own mono stream: latent channels 0..C/2-1 are the left channel, C/2..C-1 the right. The
encoder (`encoder.*`, from the training checkpoint) returns the posterior mean: encoding is deterministic.
"""

from __future__ import annotations

import math
import re
import threading

import torch
import torch.nn as nn

from ..weights import layers as default_ops
from ..formats.gguf.errors import ComponentError
from ..weights.layers import WeightSlots, load_tensors

SNAKE_EPS = 1e-9  # MiniMaxMusic3Snake1d (diffusers 0.42.1)
DILATIONS = (1, 3, 9)  # residual units of every block, decoder and encoder alike


class OutputSlot(threading.local):
    """One reusable output tensor for the Snakes of a model, on the CPU. Each Snake's output is read
    only by the convolution right after it, so the next Snake may overwrite it; the activations of
    the last blocks are tens of MB, and a fresh CPU tensor of that size is paid again in page faults
    at every Snake (the README's Speed section has the timing; the samples are the same)."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None

    def like(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # accelerators' caching allocators reuse memory already
            return torch.empty_like(x)
        t = self.tensor
        if t is not None and t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            # x is (part of) the previous Snake's output: write elsewhere, never over the input
            return torch.empty_like(x)
        if t is None or t.shape != x.shape or t.dtype != x.dtype or t.stride() != x.stride():
            t = self.tensor = torch.empty_like(x)
        return t

    def clear(self) -> None:
        self.tensor = None

    def __reduce__(self):  # copies and pickles of a model get an empty slot of their own
        return (OutputSlot, ())


class Snake(WeightSlots):
    """x + sin(alpha x)^2 / (alpha + 1e-9), alpha per channel (GGUF `<name>.alpha`, [C])."""

    def __init__(self, channels: int):
        super().__init__()
        self.declare("alpha", channels)
        self.slot: OutputSlot | None = None  # set by the model that owns it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.get("alpha", x.dtype, x.device).view(1, -1, *(1,) * (x.dim() - 2))
        inverse = (alpha + SNAKE_EPS).reciprocal()
        if x.requires_grad or self.slot is None:
            return x + inverse * torch.sin(alpha * x).pow(2)
        # The same operations in the same order (the same samples), in place in the slot's tensor.
        out = torch.mul(x, alpha, out=self.slot.like(x))
        return out.sin_().square_().mul_(inverse).add_(x)


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int, ops):
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = ops.Conv1d(channels, channels, 7, padding=3 * dilation, dilation=dilation)
        self.snake2 = Snake(channels)
        self.conv2 = ops.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.snake2(self.conv1(self.snake1(x))))  # a new tensor: added to in place
        return y.add_(x) if not y.requires_grad else x + y


class DecoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, ops):
        super().__init__()
        self.snake1 = Snake(c_in)
        self.conv_t1 = ops.ConvTranspose1d(c_in, c_out, 2 * stride, stride=stride, padding=math.ceil(stride / 2))
        self.res_unit1, self.res_unit2, self.res_unit3 = (ResidualUnit(c_out, d, ops) for d in DILATIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class EncoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, ops):
        super().__init__()
        self.res_unit1, self.res_unit2, self.res_unit3 = (ResidualUnit(c_in, d, ops) for d in DILATIONS)
        self.snake1 = Snake(c_in)
        self.conv1 = ops.Conv1d(c_in, c_out, 2 * stride, stride=stride, padding=math.ceil(stride / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_unit3(self.res_unit2(self.res_unit1(x)))
        return self.conv1(self.snake1(x))


def _shape(shapes: dict, name: str, source: str) -> tuple[int, ...]:
    if name not in shapes:
        raise ComponentError(f"{source}: missing tensor {name}")
    return tuple(shapes[name])


class VocoderEncoder(nn.Module):
    """`forward(mono [N, 1, T]) -> posterior mean [N, C/2, T / hop]` (T a multiple of hop)."""

    def __init__(self, shapes: dict, ops=default_ops, source: str = "vocoder"):
        super().__init__()
        c0 = _shape(shapes, "encoder.conv_in.weight", source)[0]
        self.conv_in = ops.Conv1d(1, c0, 7, padding=3)
        n = 1 + max((int(m.group(1)) for m in (re.match(r"encoder\.blocks\.(\d+)\.", k) for k in shapes) if m),
                    default=-1)
        if n < 1:
            raise ComponentError(f"{source}: no encoder.blocks.* tensors")
        blocks, self.strides = [], []
        for i in range(n):
            c_out, c_in, k = _shape(shapes, f"encoder.blocks.{i}.conv1.weight", source)
            if k % 2:
                raise ComponentError(f"{source}: encoder.blocks.{i}.conv1 has kernel {k}, expected 2 x stride")
            blocks.append(EncoderBlock(c_in, c_out, k // 2, ops))
            self.strides.append(k // 2)
        self.blocks = nn.ModuleList(blocks)
        top = _shape(shapes, "encoder.conv_out.weight", source)[0]
        self.snake_out = Snake(top)
        self.conv_out = ops.Conv1d(top, top, 3, padding=1)
        self.mean_proj = ops.Conv1d(top, _shape(shapes, "encoder.mean_proj.weight", source)[0], 1)
        self.hop = math.prod(self.strides)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.blocks:
            x = block(x)
        return self.mean_proj(self.conv_out(self.snake_out(x)))


class Vocoder(nn.Module):
    """Decoder layers at the root (GGUF names as in diffusers) and the optional `encoder`.

    `decode(latents [B, C, L]) -> [B, 2, hop * L]` in [-1, 1];
    `encode(audio [B, 2, T]) -> [B, C, T / hop]` for T a multiple of `hop` at `sampling_rate`.
    """

    def __init__(self, hp: dict, shapes: dict, ops=default_ops, with_encoder: bool = True, source: str = "vocoder"):
        super().__init__()
        self.latent_channels = int(hp["latent_channels"])
        self.sampling_rate = int(hp["sampling_rate"])
        ratios = [int(r) for r in hp["upsampling_ratios"]]
        if self.latent_channels % 2:
            raise ComponentError(f"{source}: latent_channels {self.latent_channels} must be even (two sides)")
        half = self.latent_channels // 2
        d_in = _shape(shapes, "dec_in_proj.weight", source)[0]
        d_hidden = _shape(shapes, "conv_in.weight", source)[0]
        self.dec_in_proj = ops.Conv1d(half, d_in, 1)
        self.conv_in = ops.Conv1d(d_in, d_hidden, 7, padding=3)
        blocks, c = [], d_hidden
        for i, s in enumerate(ratios):
            c_in, c_out, k = _shape(shapes, f"blocks.{i}.conv_t1.weight", source)
            if k != 2 * s or c_in != c:
                raise ComponentError(f"{source}: blocks.{i}.conv_t1.weight is {[c_in, c_out, k]}, expected "
                                     f"[{c}, C_out, {2 * s}] for upsampling ratio {s}")
            blocks.append(DecoderBlock(c_in, c_out, s, ops))
            c = c_out
        self.blocks = nn.ModuleList(blocks)
        self.snake_out = Snake(c)
        self.conv_out = ops.Conv1d(c, 1, 7, padding=3)
        self.hop = math.prod(ratios)
        self.encoder = None
        if with_encoder:
            self.encoder = VocoderEncoder(shapes, ops, source)
            mean_ch = _shape(shapes, "encoder.mean_proj.weight", source)[0]
            if self.encoder.hop != self.hop or mean_ch != half:
                raise ComponentError(f"{source}: the encoder downsamples by {self.encoder.hop} to {mean_ch} "
                                     f"channels, the decoder expects {self.hop} and {half}")
        self.source = source
        self.slot = OutputSlot()
        for m in self.modules():
            if isinstance(m, Snake):
                m.slot = self.slot

    @classmethod
    def load(cls, component, ops=default_ops, with_encoder: bool | None = None) -> "Vocoder":
        """`with_encoder`: None loads the encoder when the file has one, True requires it, False skips it."""
        shapes = {name: t.shape for name, t in component.tensors.items()}
        has = "encoder.conv_in.weight" in shapes
        if with_encoder and not has:
            raise ComponentError(f"{component.path} carries no encoder.* tensors (the vocoder encoder)")
        use = has if with_encoder is None else bool(with_encoder)
        model = cls(component.hparams, shapes, ops, with_encoder=use, source=component.path)
        if use:
            load_tensors(model, component.tensors, source=component.path)
        else:
            load_tensors(model, component.tensors, source=component.path, strict=False)
            used = set(load_names(model))
            extra = sorted(n for n in component.tensors if not n.startswith("encoder.") and n not in used)
            if extra:
                raise ComponentError(f"{component.path}: unexpected tensor(s) {', '.join(extra[:5])}")
        return model

    def decode(self, latents: torch.Tensor, exact: bool = False) -> torch.Tensor:
        b, c, length = latents.shape
        if c != self.latent_channels:
            raise ValueError(f"latents have {c} channels, the vocoder expects {self.latent_channels}")
        x = latents.reshape(b * 2, c // 2, length)  # row 2b = left (channels 0..C/2-1), 2b+1 = right
        return self.decode_sides(x, exact).reshape(b, 2, -1)

    def decode_sides(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """Mono streams [N, C/2, L] -> waveforms [N, 1, hop * L]; each row is independent.

        On the CPU the signals run as channels-last images [N, C, 1, L] (`channels_last`), unless
        `exact` asks for the reference's convolutions (the same samples, bit for bit)."""
        image = not exact and channels_last(x.device)
        try:
            if image:
                x = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
            x = self.conv_in(self.dec_in_proj(x))
            for block in self.blocks:
                x = block(x)
            y = torch.tanh(self.conv_out(self.snake_out(x)))
            return y.squeeze(2).contiguous() if image else y
        finally:
            self.slot.clear()

    forward = decode

    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        if self.encoder is None:
            raise ComponentError(f"{self.source}: the vocoder encoder was not loaded (file without encoder.*?)")
        b, sides, t = audio.shape
        if sides != 2 or t % self.hop:
            raise ValueError(f"audio is {list(audio.shape)}, expected [B, 2, T] with T a multiple of {self.hop}")
        try:
            z = self.encoder(audio.reshape(b * 2, 1, t))  # [2B, C/2, T / hop]
        finally:
            self.slot.clear()
        return z.reshape(b, self.latent_channels, -1)  # left side -> channels 0..C/2-1


def activation_bytes(shapes: dict, ratios: list[int], latent_len: int, rows: int = 2) -> int:
    """Bytes beyond the weights for decoding `rows` streams of `latent_len` frames: the widest
    upsampled activation (channels x samples at each stage, from the tensor shapes), float32, a
    few temporaries deep."""
    widest, length = 0, latent_len
    for i, s in enumerate(ratios):
        length *= int(s)
        c_out = shapes.get(f"blocks.{i}.conv_t1.weight", (0, 0, 0))[1]
        widest = max(widest, c_out * length)
    return int(4 * rows * widest * 4)


def channels_last(device) -> bool:
    """Whether the decoder's convolutions run as channels-last images on `device`: on the CPU
    with oneDNN, whose convolutions read [N, L, C] as they are, where the [N, C, L] layout is
    reordered into oneDNN's blocked one and back around every convolution (timing: the README, Speed).
    The convolutions then sum in another order: float32 rounding, about twice the reference layout's
    distance from a float64 decode."""
    return torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()


def load_names(module: nn.Module) -> list[str]:
    """GGUF tensor names a module's slots expect (`<module path>.<slot>`)."""
    names = []
    for path, sub in module.named_modules():
        if isinstance(sub, WeightSlots):
            names += [f"{path}.{slot}" if path else slot for slot in sub._slot_shapes]
    return names
