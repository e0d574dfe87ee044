"""Configuration of ReFusion: a slot-based masked diffusion LM over an ordinary RoPE causal decoder.

The backbone keeps its own configuration (``text_config``); ReFusion adds the mask token and the slot sizes used by
the hybrid training objective. Decoding parameters (slot size, thresholds, block length, infill mode) live in the
generation config, as every `generate()` option does.
"""

from dataclasses import field

from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

try:
    from .adapter_refusion import DraftAdapterSettings
    from .settings_refusion import SUPPORTED_BACKBONES
except ImportError:  # installed as top-level modules rather than loaded as Hub remote code
    from adapter_refusion import DraftAdapterSettings
    from settings_refusion import SUPPORTED_BACKBONES

DEFAULT_AUTO_MAP = {
    "AutoConfig": "configuration_refusion.RefusionConfig",
    "AutoModel": "modeling_refusion.RefusionForCausalLM",
    "AutoModelForCausalLM": "modeling_refusion.RefusionForCausalLM",
}


class RefusionConfig(PreTrainedConfig):
    r"""
    Args:
        text_config (`dict` or `PreTrainedConfig`):
            Configuration of the causal decoder backbone (one of `SUPPORTED_BACKBONES`).
        mask_token_id (`int`, *optional*):
            Id of the `[MASK]` token that stands for a token still to be generated.
        train_slot_sizes (`list[int]`, defaults to `[4, 8, 16, 32]`):
            Slot sizes drawn from, one per example, by the hybrid training objective.
        mask_eps (`float`, defaults to 1e-3):
            Smallest noise level of the masked-diffusion loss: `p = (1 - eps) * t + eps`.
        mdm_loss_weight (`float`, defaults to 1.0):
            Weight of the masked-diffusion term in the hybrid loss: `ar_loss + mdm_loss_weight * mdm_loss`.
        draft_adapter (`dict`, *optional*):
            A draft-only adapter's `rank`, `alpha` and `target_modules` (see `adapter_refusion`): low-rank deltas
            that apply at `[MASK]` tokens only. None (the default): no adapter.
    """

    model_type = "refusion"
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="qwen3")}

    text_config: dict | PreTrainedConfig | None = None
    mask_token_id: int | None = None
    train_slot_sizes: list[int] = field(default_factory=lambda: [4, 8, 16, 32])
    mask_eps: float = 1e-3
    mdm_loss_weight: float = 1.0
    draft_adapter: dict | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if isinstance(self.text_config, dict) and self.text_config.get("model_type") not in (
            None,
            *SUPPORTED_BACKBONES,
        ):
            raise ValueError(_unsupported_message(self.text_config["model_type"]))
        super().__post_init__(**kwargs)
        if self.text_config.model_type not in SUPPORTED_BACKBONES:
            raise ValueError(_unsupported_message(self.text_config.model_type))
        # The backbone decides whether the output layer shares the input embeddings.
        self.tie_word_embeddings = bool(getattr(self.text_config, "tie_word_embeddings", False))
        self.train_slot_sizes = [int(size) for size in self.train_slot_sizes]
        self.validate_refusion_fields()
        # Remote-code entry points: AutoModel and AutoModelForCausalLM both give the causal LM.
        self.auto_map = {**DEFAULT_AUTO_MAP, **(getattr(self, "auto_map", None) or {})}

    def validate_refusion_fields(self) -> None:
        """Raise a `ValueError` naming the first ReFusion field that is out of range."""
        vocab_size = self.text_config.vocab_size
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {vocab_size}).")
        if not self.train_slot_sizes or min(self.train_slot_sizes) < 1:
            raise ValueError(
                f"train_slot_sizes must be a non-empty list of positive sizes, got {self.train_slot_sizes}."
            )
        if not 0.0 < self.mask_eps < 1.0:
            raise ValueError(f"mask_eps must lie in (0, 1), got {self.mask_eps}.")
        if not self.mdm_loss_weight > 0.0:
            raise ValueError(f"mdm_loss_weight must be positive, got {self.mdm_loss_weight}.")
        if self.draft_adapter is not None:
            if self.mask_token_id is None:
                raise ValueError("draft_adapter applies at the [MASK] token: set mask_token_id too.")
            self.draft_adapter = DraftAdapterSettings.from_dict(self.draft_adapter).to_dict()


def _unsupported_message(model_type: str) -> str:
    return (
        f"ReFusion needs a causal decoder with rotary position embeddings that honours caller-given position ids; "
        f"backbone model_type {model_type!r} is not supported. Supported backbones: {', '.join(SUPPORTED_BACKBONES)}."
    )


__all__ = ["RefusionConfig", "SUPPORTED_BACKBONES"]
