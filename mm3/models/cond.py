"""The condition encoder: per-frame AR hidden states -> DiT conditioning on the latent timeline.

Each AR frame carries `num_condition_layers` hidden states (the LM's, then one per depth step),
layer-major in one vector. As diffusers' `MiniMaxMusic3ConditionEncoder`, they are mixed by
`softmax(layer_weight_logits)` (computed once at load), scaled by `layer_scale`, projected by a k=3
Conv1d and stretched from the frame rate to the latent rate by nearest-neighbour resampling. The
scale comes after the weighted sum, in the reference's order, which keeps the output bit-identical
to the reference on CPU; folding it into the weights would not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..weights import layers as default_ops
from ..formats.gguf.errors import ComponentError
from ..weights.layers import WeightSlots, load_tensors


def latent_length(num_frames: int, hp: dict) -> int:
    """Latents for `num_frames` AR frames: evaluated left to right in Python float exactly as the
    reference does (factor 3.4453125 for the released rates: 200 -> 689, 100 -> 344)."""
    return max(1, int(num_frames * hp["output_sampling_rate"] / hp["input_sampling_rate"]
                      * hp["input_hop_length"] / hp["output_hop_length"]))


class ConditionEncoder(WeightSlots):
    """`forward(frame_hiddens [B, F, layers * hidden]) -> [B, L, out_dim]`, L = `latent_length(F)`.

    The two mixing tensors are bare names in the file (`layer_weight_logits`, `layer_scale`), so
    they are slots of this module itself; `proj` is a layer of the `ops` namespace.
    """

    def __init__(self, hp: dict, ops=default_ops):
        super().__init__()
        self.hp = dict(hp)
        self.num_layers = int(hp["num_condition_layers"])
        self.hidden_dim = int(hp["condition_hidden_dim"])
        self.out_dim = int(hp["out_dim"])
        self.declare("layer_weight_logits", self.num_layers)
        self.declare("layer_scale", 1)
        self.proj = ops.Conv1d(self.hidden_dim, self.out_dim, 3, padding=1)
        self.register_buffer("layer_weights", torch.empty(0), persistent=False)  # softmax(logits), at load
        self.register_buffer("scale", torch.empty(0), persistent=False)

    @classmethod
    def load(cls, component, ops=default_ops) -> "ConditionEncoder":
        """Build from an opened `mm3-cond` component and fold the layer mix."""
        model = cls(component.hparams, ops)
        load_tensors(model, component.tensors, source=component.path)
        model.fold_mix()
        return model

    def fold_mix(self) -> None:
        """Compute the mixing constants from the loaded slots (float32, as the reference)."""
        self.layer_weights = torch.softmax(self.get("layer_weight_logits", torch.float32), dim=0)
        self.scale = self.get("layer_scale", torch.float32)

    def latent_length(self, num_frames: int) -> int:
        return latent_length(num_frames, self.hp)

    def forward(self, frame_hiddens: torch.Tensor) -> torch.Tensor:
        if self.layer_weights.numel() != self.num_layers:
            raise ComponentError("ConditionEncoder: fold_mix() was not called after loading the weights")
        b, f, width = frame_hiddens.shape
        if width != self.num_layers * self.hidden_dim:
            raise ValueError(f"frame hiddens have width {width}, expected num_condition_layers x hidden = "
                             f"{self.num_layers} x {self.hidden_dim}")
        x = frame_hiddens.transpose(1, 2).reshape(b, self.num_layers, self.hidden_dim, f)  # [B, layer, H, F]
        x = torch.einsum("blht,l->bht", x, self.layer_weights.to(device=x.device, dtype=x.dtype))  # [B, H, F]
        x = self.scale.to(device=x.device, dtype=x.dtype) * x
        x = self.proj(x)  # [B, out, F]; the k=3 conv sees only this window's frames
        # "nearest" (floor(i * F / L)), not "nearest-exact": the reference's choice.
        x = F.interpolate(x, size=self.latent_length(f), mode="nearest")
        return x.transpose(1, 2)  # [B, L, out]
