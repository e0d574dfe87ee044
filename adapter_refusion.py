"""A draft-only adapter: low-rank deltas that apply at `[MASK]` tokens and nowhere else.

ReFusion drafts a slot's tokens from `[MASK]` queries and accepts a draft only where the model's causal prediction
from clean tokens agrees. A `DraftAdapter` trains the first without touching the second: it adds
`scale * up @ down @ x` to the output of chosen linear layers of the backbone, but only in the rows whose input token
is the `[MASK]` token. Every clean token (prompt, committed answer, a draft being checked) goes through the base
model's weights exactly, so its hidden states, keys, values and logits are the base model's bit for bit, and every
token a decode accepts is one the base model itself predicts.

The adapter lives inside the backbone (`model.model.draft_adapter`), so that any call of the backbone carries it
(eager, compiled, exported). Its one piece of state is the gate of the latest backbone call: a forward pre-hook on the
backbone sets it from `input_ids`, and forward hooks on the adapted linear layers read it. The layers of that call
(and their recomputation in a backward pass, under activation checkpointing) therefore see their own call's gate,
provided no other backbone call comes between a forward and its backward.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# Linear layers of a decoder layer in the supported backbones (Llama, Mistral, Qwen2, Qwen3).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class DraftAdapterSettings:
    """What `RefusionConfig.draft_adapter` records: the deltas' rank, their scale `alpha / rank`, and the names of
    the decoder layers' linear layers they adapt (the last part of the module name, e.g. `"q_proj"`)."""

    rank: int = 16
    alpha: float = 32.0
    target_modules: list[str] = field(default_factory=lambda: [*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS])

    @classmethod
    def from_dict(cls, settings: dict) -> "DraftAdapterSettings":
        unknown = set(settings) - {"rank", "alpha", "target_modules"}
        if unknown:
            raise ValueError(
                f"draft_adapter has unknown fields {sorted(unknown)}; it takes rank, alpha, target_modules."
            )
        adapter = cls(**settings)
        adapter.rank, adapter.alpha = int(adapter.rank), float(adapter.alpha)
        adapter.target_modules = list(adapter.target_modules)
        if adapter.rank < 1:
            raise ValueError(f"draft_adapter rank must be a positive integer, got {adapter.rank}.")
        if not adapter.alpha > 0:
            raise ValueError(f"draft_adapter alpha must be positive, got {adapter.alpha}.")
        if not adapter.target_modules:
            raise ValueError("draft_adapter target_modules must name at least one linear layer.")
        return adapter

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


class LowRankDelta(nn.Module):
    """`scale * up @ down`, the delta of one linear layer. `up` starts at zero: a new adapter changes nothing."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float):
        super().__init__()
        self.scale = scale
        self.down = nn.Parameter(torch.empty(rank, in_features))
        self.up = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))  # as nn.Linear (and LoRA's A) start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.down), self.up) * self.scale


class DraftAdapter(nn.Module):
    """The deltas of one backbone's adapted linear layers (`deltas`, keyed by the layer's name in the backbone with
    "." as "_") and the hooks that apply them where the input token is `mask_token_id`."""

    def __init__(self, backbone: nn.Module, mask_token_id: int, settings: DraftAdapterSettings):
        super().__init__()
        self.mask_token_id = mask_token_id
        self.gate: torch.Tensor | None = None  # [batch, seq, 1], True at [MASK] tokens of the latest backbone call
        targets = set(settings.target_modules)
        layers = {
            name: module
            for name, module in backbone.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
        }
        missing = targets - {name.rsplit(".", 1)[-1] for name in layers}
        if missing:
            raise ValueError(
                f"draft_adapter target_modules {sorted(missing)} name no linear layer of the {type(backbone).__name__}."
            )
        scale = settings.alpha / settings.rank
        self.deltas = nn.ModuleDict({
            name.replace(".", "_"): LowRankDelta(layer.in_features, layer.out_features, settings.rank, scale)
            for name, layer in layers.items()
        })  # fmt: skip
        backbone.register_forward_pre_hook(self._set_gate, with_kwargs=True)
        for name, layer in layers.items():
            layer.register_forward_hook(_DeltaHook(self, name.replace(".", "_")))

    def _set_gate(self, backbone, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError(
                "A model with a draft adapter needs input_ids: the adapter applies at [MASK] tokens, which "
                "inputs_embeds do not name."
            )
        self.gate = (input_ids == self.mask_token_id).unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"mask_token_id={self.mask_token_id}"


class _DeltaHook:
    """Forward hook of one adapted linear layer: its output plus the delta, in the rows the gate opens (elsewhere
    the output is returned as the layer computed it)."""

    def __init__(self, adapter: DraftAdapter, key: str):
        self.adapter, self.key = adapter, key

    def __call__(self, layer, args, output):
        gate = self.adapter.gate
        if gate is None:
            raise RuntimeError("A draft adapter's layer ran outside a call of its backbone.")
        delta = self.adapter.deltas[self.key](args[0])
        return torch.where(gate, output + delta.to(output.dtype), output)


def add_draft_adapter(backbone: nn.Module, mask_token_id: int, settings: DraftAdapterSettings) -> DraftAdapter:
    """Give `backbone` a `DraftAdapter` (as its `draft_adapter` submodule) and return it."""
    if hasattr(backbone, "draft_adapter"):
        raise ValueError("This backbone already has a draft adapter.")
    adapter = DraftAdapter(backbone, mask_token_id, settings)
    backbone.draft_adapter = adapter
    return adapter


__all__ = ["DraftAdapter", "DraftAdapterSettings", "LowRankDelta", "add_draft_adapter"]
