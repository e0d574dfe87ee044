"""ReFusion: parallel autoregressive slot decoding over an ordinary RoPE causal decoder.

`RefusionForCausalLM` is the backbone causal LM unchanged (same modules, same parameter names:
`model.*` and `lm_head.weight`) with two differences that the method relies on:

* Tokens may be stored out of reading order. Attention follows storage order (causal over the index
  in the sequence and the KV cache) while RoPE follows the caller-given `position_ids`, so slots that
  were decoded later can sit before earlier ones without invalidating the cache.
* Given a hybrid-objective batch, `forward` returns the ReFusion training loss: an autoregressive
  loss on clean slots plus a masked-diffusion loss on masked slots (see `refusion_hybrid_loss`).

Attention implementations: `sdpa` (default) and `eager` are correct for out-of-order position ids.
Flash-attention and flex-attention are refused: the former treats non-monotone position ids as packed
sequences and would silently change attention.
"""

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

try:
    from .adapter_refusion import DraftAdapterSettings, add_draft_adapter
    from .configuration_refusion import RefusionConfig
    from .generation_refusion import RefusionGenerateOutput, write_custom_generate
    from .generation_refusion import generate as slot_generate
    from .kernels_refusion import prepack_linears, unpack_linears, use_grouped_attention
    from .settings_refusion import check_model, documents_settings, fastest_settings
except ImportError:  # installed as top-level modules rather than loaded as Hub remote code
    from adapter_refusion import DraftAdapterSettings, add_draft_adapter
    from configuration_refusion import RefusionConfig
    from generation_refusion import RefusionGenerateOutput, write_custom_generate
    from generation_refusion import generate as slot_generate
    from kernels_refusion import prepack_linears, unpack_linears, use_grouped_attention
    from settings_refusion import check_model, documents_settings, fastest_settings

IGNORE_INDEX = -100


@dataclass
class RefusionCausalLMOutput(ModelOutput):
    """Output of `RefusionForCausalLM.forward`: logits and cache, plus the hybrid loss and its two parts."""

    loss: torch.FloatTensor | None = None
    ar_loss: torch.FloatTensor | None = None
    mdm_loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: object | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


def refusion_hybrid_loss(
    logits: torch.Tensor,
    labels: torch.LongTensor,
    is_masked: torch.BoolTensor,
    noise_level: torch.Tensor,
    response_length: torch.Tensor,
    mdm_weight: float = 1.0,
    token_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return `(ar_loss + mdm_weight * mdm_loss, ar_loss, mdm_loss)` for an aligned hybrid-objective batch.

    `labels` are already aligned with `logits` (no shift): inside a clean slot a token's label is the next
    token of that slot, at a `[MASK]` position it is the original token there, elsewhere `IGNORE_INDEX`.
    The AR loss is the mean cross-entropy over clean-slot labels. The MDM loss weights each masked
    token's cross-entropy by `1 / (noise_level * response_length)` of its example, times `token_weight` at that
    position when given (`[batch, seq]`, e.g. the batch builder's `mdm_token_weight`), sums, and averages over the
    batch.
    """
    loss_dtype = torch.promote_types(logits.dtype, torch.float32)  # half precision up, float64 kept
    labelled = labels != IGNORE_INDEX
    token_loss = F.cross_entropy(logits[labelled].to(loss_dtype), labels[labelled], reduction="none")
    masked = is_masked[labelled]

    ar_count = (~masked).sum()
    ar_loss = torch.where(~masked, token_loss, 0.0).sum() / ar_count.clamp(min=1)

    weight = _mdm_token_weight(labels, noise_level, response_length, token_weight, loss_dtype)[labelled]
    mdm_loss = torch.where(masked, token_loss * weight, 0.0).sum() / labels.shape[0]
    return ar_loss + mdm_weight * mdm_loss, ar_loss, mdm_loss


def refusion_soft_target_loss(
    logits: torch.Tensor,
    is_masked: torch.BoolTensor,
    target_log_probs: torch.Tensor,
    noise_level: torch.Tensor,
    response_length: torch.Tensor,
    token_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(target || model) at every `[MASK]`, weighted and averaged over the batch as the MDM term is.

    `target_log_probs` (`[masked count, vocab]`) holds one target distribution per `[MASK]`, in the order of
    `is_masked.nonzero()`: for ReFusion's soft targets, the converted model's next-token distribution for that
    position given the true prefix. The term pulls the masked predictions toward what the model's own
    autoregressive function (the verifier of every draft) would accept, not only toward the text's one token.
    """
    loss_dtype = torch.promote_types(logits.dtype, torch.float32)
    log_probs = logits[is_masked].to(loss_dtype).log_softmax(dim=-1)
    target = target_log_probs.to(loss_dtype)
    divergence = (target.exp() * (target - log_probs)).sum(dim=-1)
    weight = _mdm_token_weight(is_masked, noise_level, response_length, token_weight, loss_dtype)[is_masked]
    return (divergence * weight).sum() / is_masked.shape[0]


def _mdm_token_weight(
    like: torch.Tensor,
    noise_level: torch.Tensor,
    response_length: torch.Tensor,
    token_weight: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`[batch, seq]` weight of a masked token's term: `token_weight / (noise_level * response_length)`."""
    weight = 1.0 / (noise_level.to(dtype) * response_length.to(dtype).clamp(min=1))
    weight = weight[:, None].expand(like.shape)
    return weight if token_weight is None else weight * token_weight.to(dtype)


class RefusionPreTrainedModel(PreTrainedModel):
    config: RefusionConfig
    config_class = RefusionConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True


class RefusionForCausalLM(RefusionPreTrainedModel, GenerationMixin):
    """A causal LM whose forward honours out-of-order storage and computes the ReFusion hybrid loss."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: RefusionConfig):
        super().__init__(config)
        text_config = config.text_config
        self.model = AutoModel.from_config(text_config)
        self.vocab_size = text_config.vocab_size
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        self._no_split_modules = self.model._no_split_modules
        if config.draft_adapter is not None:
            add_draft_adapter(self.model, config.mask_token_id, DraftAdapterSettings.from_dict(config.draft_adapter))
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        is_masked: torch.BoolTensor | None = None,
        noise_level: torch.Tensor | None = None,
        response_length: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> RefusionCausalLMOutput:
        r"""
        position_ids (`torch.LongTensor` of shape `(batch, seq)`):
            Original (reading-order) index of every stored token; RoPE uses these while attention follows
            storage order. Defaults to `past_length + arange(seq)` as in any causal LM.
        attention_mask (`torch.Tensor`):
            A 2D padding mask `(batch, past + seq)` or a prepared 4D additive/boolean mask
            `(batch, 1, seq, past + seq)`, used as given. When omitted, an all-ones 2D mask is used so that
            out-of-order position ids are never mistaken for packed sequences.
        labels (`torch.LongTensor` of shape `(batch, seq)`):
            Hybrid-objective labels, already aligned with the logits (no shift); see `refusion_hybrid_loss`.
        is_masked (`torch.BoolTensor` of shape `(batch, seq)`):
            True at `[MASK]` positions (MDM loss); required with `labels`.
        noise_level (`torch.FloatTensor` of shape `(batch,)`), response_length (`torch.LongTensor` of shape `(batch,)`):
            Per-example masking probability and response length that scale the MDM loss.
        """
        check_model(self)
        if labels is not None and logits_to_keep:
            raise ValueError("`logits_to_keep` cannot be combined with `labels`: the loss needs every position.")
        if labels is not None and (is_masked is None or noise_level is None or response_length is None):
            raise ValueError(
                "ReFusion labels are aligned hybrid-objective labels, not shifted next-token labels: pass `is_masked`, "
                "`noise_level` and `response_length` with them (the hybrid batch builder in finetune/ makes all four)."
            )
        reference = input_ids if input_ids is not None else inputs_embeds
        if attention_mask is None:
            past_length = cache.get_seq_length() if cache is not None else 0
            attention_mask = torch.ones(
                reference.shape[0], past_length + reference.shape[1], dtype=torch.long, device=reference.device
            )

        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states)

        loss = ar_loss = mdm_loss = None
        if labels is not None:
            loss, ar_loss, mdm_loss = refusion_hybrid_loss(
                logits, labels, is_masked, noise_level, response_length, self.config.mdm_loss_weight
            )

        return RefusionCausalLMOutput(
            loss=loss,
            ar_loss=ar_loss,
            mdm_loss=mdm_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def add_draft_adapter(self, rank: int = 16, alpha: float = 32.0, target_modules: list[str] | None = None) -> None:
        """Give the model a draft-only adapter (`adapter_refusion.DraftAdapter`): low-rank deltas on the decoder
        layers' `target_modules` (by default every projection of attention and MLP) that apply at `[MASK]` tokens
        only, so that clean tokens, and with them every causal prediction that verifies a draft, stay the base
        model's bit for bit. A new adapter's deltas are zero. The settings are recorded in `config.draft_adapter`,
        and the deltas are saved and loaded with the other weights."""
        if self.config.mask_token_id is None:
            raise ValueError("A draft adapter applies at the [MASK] token: the config has no mask_token_id.")
        settings = DraftAdapterSettings.from_dict(
            {"rank": rank, "alpha": alpha, **({"target_modules": target_modules} if target_modules else {})}
        )
        parameter = next(self.parameters())
        add_draft_adapter(self.model, self.config.mask_token_id, settings).to(parameter.device, parameter.dtype)
        self.config.draft_adapter = settings.to_dict()

    @property
    def draft_adapter(self):
        """The model's draft-only adapter (`add_draft_adapter`), or None."""
        return getattr(self.model, "draft_adapter", None)

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """`PreTrainedModel.save_pretrained`, plus `custom_generate/generate.py` (a copy of `generation_refusion.py`)
        so that the backbone's own class can decode the saved weights with ReFusion too."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_custom_generate(save_directory)

    def prepack_linears(self, dtypes=None) -> int:
        """On a CPU, make the linear layers compute inference forwards through oneDNN with prepacked weights, for the
        dtypes and widths where that measured faster on this kind of CPU (`kernels_refusion.packing_plan()`:
        bfloat16 with AMX or AVX512-BF16, float32 from 4 rows with AVX-512 and from 1 row with AVX2, bfloat16 from
        4 rows as float32 without bfloat16 arithmetic), or as `dtypes` says. Parameter
        names, `state_dict()` and saved files stay as they are; the logits equal the plain ones to float rounding;
        each packed weight is a second copy in memory. Call it after the model's last `.to(...)`, and again after
        changing weights in place. Returns how many layers compute packed (0 off a CPU or without oneDNN)."""
        if self.device.type != "cpu":
            return 0
        return prepack_linears(self, dtypes)

    def unpack_linears(self) -> int:
        """Undo `prepack_linears`: plain linear layers again, packed copies freed. Returns how many were packed."""
        return unpack_linears(self)

    def use_grouped_attention(self) -> None:
        """Switch attention to SDPA over the shared key/value heads as they are (`kernels_refusion.grouped_attention`,
        registered as "refusion_grouped"): the same outputs as SDPA to float rounding, and in compiled forwards on a
        CPU no copy of every layer's keys and values per query head over the whole static cache, which eager
        attention makes. Not saved with the model: a loaded one starts with its default attention."""
        use_grouped_attention(self)

    def fastest_generation_config(
        self, compile_cache_dir: str | None = None, compile_cache_max_gb: float | None = None, frozen: bool = True
    ) -> GenerationConfig:
        """A copy of the model's generation config set for the fastest decode measured on its device's kind
        (`settings_refusion.fastest_settings`): pass it as `generate(..., generation_config=...)`; options passed
        beside it still win. On a CPU the first decode compiles the forwards it meets (minutes each, kept as packages
        in `compile_cache_dir` for later processes, at most `compile_cache_max_gb` of them: the least recently used go
        first) and measures the forward-price table once; the answer is the greedy one of the model's other
        settings. Load the model in bfloat16 and call `use_grouped_attention()` and `prepack_linears()` first for the
        figures of the README's fastest path. `frozen=False` trades speed for memory: packages without the weights,
        which run on the model's own (frozen, each package holds a packed copy)."""
        config = copy.deepcopy(self.generation_config)
        for name, value in fastest_settings(self.device, compile_cache_dir, frozen).items():
            setattr(config, name, value)
        if compile_cache_max_gb is not None:
            config.compile_cache_max_gb = compile_cache_max_gb
        return config

    @torch.no_grad()
    @documents_settings
    def generate(
        self,
        inputs: torch.LongTensor | None = None,
        generation_config=None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.LongTensor | RefusionGenerateOutput:
        r"""ReFusion plan-and-infill decoding (see `generation_refusion`).

        Takes the usual `generate()` options (`max_new_tokens`/`max_length`, `eos_token_id`, `pad_token_id`,
        `do_sample` and the sampling warpers, `repetition_penalty`, `suppress_tokens`, `min_new_tokens` and the other
        logits processors, `logits_processor`, `stopping_criteria`, `stop_strings`, `streamer`, `use_cache`,
        `cache_implementation` ("dynamic" or "static"), `compile_config` and `disable_compile` (compiled forwards over
        the static cache: on any device when a `compile_config` is given, on CUDA by default),
        `num_return_sequences`, `return_dict_in_generate`) and the decoding parameters below. Defaults come from
        `generation_config` (the model's by default); an option passed here wins, and a configured option that does
        not apply to the chosen `infill_mode` is set aside. An option slot decoding cannot apply (beam search,
        assisted decoding, ...) raises a `ValueError` naming it. Returns prompt + answer, with `pad_token_id` after
        an EOS.

        {settings}
        """
        return slot_generate(self, inputs, generation_config, attention_mask=attention_mask, **kwargs)


# `save_pretrained` then copies these files next to the weights and records them in `auto_map`.
RefusionConfig.register_for_auto_class()
RefusionForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "RefusionForCausalLM",
    "RefusionPreTrainedModel",
    "RefusionCausalLMOutput",
    "refusion_hybrid_loss",
    "refusion_soft_target_loss",
]
