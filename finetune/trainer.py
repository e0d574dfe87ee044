"""The pieces `finetune.sft` assembles: ReFusion's options, the `SFTConfig` and `SFTTrainer` subclasses, and the
model (an autoregressive checkpoint converted on the fly, or a ReFusion one) with its LoRA config."""

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel
from transformers import AutoTokenizer, BitsAndBytesConfig, PretrainedConfig, PreTrainedTokenizerBase
from trl import ModelConfig, SFTConfig, SFTTrainer, get_peft_config

from finetune.convert import FORMATS, MASK_INITS, convert_to_refusion, load_causal_lm
from finetune.data import OVERLONG_POLICIES
from modeling_refusion import RefusionForCausalLM

QUANTIZATION_ATTRIBUTES = (
    "hf_quantizer",
    "is_quantized",
    "quantization_method",
    "is_loaded_in_4bit",
    "is_loaded_in_8bit",
)


class UsageError(ValueError):
    """A mistake in the command line, reported in one line."""


@dataclass
class RefusionArguments:
    """ReFusion's own options, next to TRL's `ScriptArguments`, `SFTConfig` and `ModelConfig`."""

    slot_sizes: list[int] | None = field(
        default=None,
        metadata={"help": "Slot sizes the hybrid objective draws from, one per example (default: 4 8 16 32)."},
    )
    mask_token: str | None = field(
        default=None,
        metadata={"help": "The [MASK] token: added when missing (default: the tokenizer's own, else <|mask|>)."},
    )
    mask_eps: float | None = field(
        default=None, metadata={"help": "Smallest masking probability of the MDM loss (default: 1e-3)."}
    )
    mdm_loss_weight: float | None = field(
        default=None, metadata={"help": "Weight of the MDM term: loss = ar_loss + weight * mdm_loss (default: 1)."}
    )
    mask_init: str = field(
        default="mean",
        metadata={
            "help": "Embedding of a newly added [MASK] token: 'mean' of the vocabulary's rows, or 'random' (normal, "
            "with the rows' spread). An existing mask row is never changed.",
            "choices": list(MASK_INITS),
        },
    )
    init_adapter: str | None = field(
        default=None,
        metadata={
            "help": "Continue training this saved LoRA adapter (a folder with adapter_config.json, e.g. an earlier "
            "run's adapter/) instead of a fresh one; needs --use_peft, and the adapter's own LoRA settings apply."
        },
    )
    gguf_file: str | None = field(
        default=None, metadata={"help": "GGUF file inside --model_name_or_path to load (dequantized) as the base."}
    )
    overlong: str = field(
        default="truncate",
        metadata={
            "help": "Rows longer than --max_length: 'truncate' cuts the response, 'drop' skips the row.",
            "choices": list(OVERLONG_POLICIES),
        },
    )
    format: str = field(
        default="refusion",
        metadata={
            "help": "Saved model: 'refusion' (our class; trains further with the hybrid loss) or 'native' (the "
            "backbone's own class and config, which serving engines load; ReFusion decoding with trust_remote_code).",
            "choices": list(FORMATS),
        },
    )


@dataclass
class RefusionSFTConfig(SFTConfig):
    """`SFTConfig` with defaults that suit the device and the hybrid-objective data pipeline.

    Without an accelerator the run uses the CPU (gloo across processes), fp32 and no activation checkpointing; on an
    accelerator bf16 (where supported) and activation checkpointing, as in TRL. The collator needs its own columns,
    so TRL's column removal and dataset preparation are always off.
    """

    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of --activation_checkpointing (on with an accelerator, off on CPU)."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision (default: on with a bf16-capable accelerator, off on CPU)."},
    )

    def __post_init__(self):
        accelerator = None if self.use_cpu else torch.accelerator.current_accelerator()
        self.use_cpu = accelerator is None
        if self.bf16 is None and not self.fp16:
            self.bf16 = accelerator is not None and (accelerator.type != "cuda" or torch.cuda.is_bf16_supported())
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = accelerator is not None
        self.remove_unused_columns = False
        self.dataset_kwargs = {**(self.dataset_kwargs or {}), "skip_prepare_dataset": True}
        super().__post_init__()


class RefusionSFTTrainer(SFTTrainer):
    """`SFTTrainer` whose loss is the model's own hybrid loss, logged with its AR and MDM parts.

    TRL's `compute_loss` routes around a model's loss (it asks for a fused next-token NLL), so it is replaced. The
    AR and MDM losses of every micro-batch are summed on the device and averaged over steps and processes only when
    the trainer logs, landing next to `loss` in `trainer_state.json`.
    """

    # The hybrid loss is a per-micro-batch mean: let `Trainer` divide it over the gradient accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loss_parts: dict[str, torch.Tensor] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Hybrid loss of a `HybridObjectiveCollator` batch; AR and MDM parts are kept for the next log.

        Replaced because `SFTTrainer.compute_loss` does not use the loss the model returns: it computes its own
        next-token loss (and token accuracy) from shifted `labels`, which for a hybrid batch is wrong twice over:
        labels are already aligned with the logits (no shift), and `[MASK]` positions carry the masked-diffusion
        term, weighted by each example's noise level. The model's `forward` computes `ar_loss + mdm_loss_weight *
        mdm_loss` (`refusion_hybrid_loss`); this method returns it and keeps its two parts for logging.
        """
        mode = "train" if model.training else "eval"
        batch = {name: value for name, value in inputs.items() if name != "slot_size"}
        outputs = model(**batch, use_cache=False)
        parts = torch.stack([outputs.ar_loss.detach(), outputs.mdm_loss.detach(), torch.ones_like(outputs.ar_loss)])
        self._loss_parts[mode] = self._loss_parts.get(mode, 0) + parts.float()
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluate the hybrid loss only, never gathering full-vocabulary logits."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add `ar_loss` and `mdm_loss` (or `eval_*`) to the logs that carry a loss."""
        prefix = "eval_" if "eval_loss" in logs else ""
        mode = "eval" if prefix else "train"
        if f"{prefix}loss" in logs and mode in self._loss_parts:
            ar_sum, mdm_sum, count = self.accelerator.reduce(self._loss_parts.pop(mode), reduction="sum").tolist()
            logs[f"{prefix}ar_loss"] = ar_sum / count
            logs[f"{prefix}mdm_loss"] = mdm_sum / count
        super().log(logs, start_time)


def is_refusion_checkpoint(name_or_path: str, revision: str | None = None) -> bool:
    """Whether a folder or Hub id already holds a ReFusion model (its config's `model_type`)."""
    config, _ = PretrainedConfig.get_config_dict(name_or_path, revision=revision)
    return config.get("model_type") == "refusion"


def load_model(
    model_args: ModelConfig,
    refusion_args: RefusionArguments,
    training_args: RefusionSFTConfig,
    quantization_config: BitsAndBytesConfig | None = None,
) -> tuple[RefusionForCausalLM, PreTrainedTokenizerBase]:
    """Load a ReFusion checkpoint, or an autoregressive one converted on the fly, with ReFusion's overrides.

    `--model_init_kwargs` go to `from_pretrained` as in TRL; a quantized model is loaded straight onto the process's
    own device.
    """
    overrides = {}
    if refusion_args.slot_sizes is not None:
        overrides["train_slot_sizes"] = refusion_args.slot_sizes
    if refusion_args.mask_eps is not None:
        overrides["mask_eps"] = refusion_args.mask_eps
    if refusion_args.mdm_loss_weight is not None:
        overrides["mdm_loss_weight"] = refusion_args.mdm_loss_weight
    path, revision = model_args.model_name_or_path, model_args.model_revision
    load_kwargs = {
        "revision": revision,
        "dtype": model_args.dtype,
        "trust_remote_code": training_args.trust_remote_code,
    }
    if model_args.attn_implementation is not None:
        load_kwargs["attn_implementation"] = model_args.attn_implementation
    load_kwargs.update(training_args.model_init_kwargs or {})
    if quantization_config is not None:
        load_kwargs.update(quantization_config=quantization_config, device_map={"": training_args.device})

    if refusion_args.gguf_file is None and is_refusion_checkpoint(path, revision):
        model = RefusionForCausalLM.from_pretrained(path, **load_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
        if refusion_args.mask_token not in (None, tokenizer.mask_token):
            raise UsageError(
                f"{path} already uses the mask token {tokenizer.mask_token!r}; --mask_token cannot change it."
            )
        for name, value in overrides.items():
            setattr(model.config, name, value)
        model.config.validate_refusion_fields()
        return model, tokenizer

    base, tokenizer = load_causal_lm(path, gguf_file=refusion_args.gguf_file, **load_kwargs)
    model, tokenizer = convert_to_refusion(
        base, tokenizer, refusion_args.mask_token, mask_init=refusion_args.mask_init, **overrides
    )
    if quantization_config is not None:
        # The wrapper shares the quantized modules, so it must be seen as quantized by PEFT and the Trainer. (A GGUF
        # base is fully dequantized: its GGUF marker is not carried over, so the model stays serializable.)
        for name in QUANTIZATION_ATTRIBUTES:
            if hasattr(base, name):
                setattr(model, name, getattr(base, name))
    return model, tokenizer


def lora_config(model_args: ModelConfig, mask_token_id: int) -> LoraConfig | None:
    """TRL's LoRA config, on every linear layer by default, with the mask token's embedding row trainable."""
    peft_config = get_peft_config(model_args)
    if peft_config is None:
        return None
    if peft_config.target_modules is None:
        peft_config.target_modules = "all-linear"
    peft_config.trainable_token_indices = {"embed_tokens": [mask_token_id]}
    return peft_config


def continued_adapter(model: RefusionForCausalLM, adapter: str | os.PathLike) -> PeftModel:
    """`model` with the saved LoRA `adapter` loaded trainable, to continue its training.

    The adapter must train the model's own `[MASK]` row (its `trainable_token_indices`), which every adapter this
    package saves does; an adapter made for another mask id would silently train the wrong row.
    """
    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise UsageError(f"--init_adapter {str(adapter)!r} holds no adapter_config.json.")
    config = LoraConfig.from_pretrained(adapter)
    trained_rows = (config.trainable_token_indices or {}).get("embed_tokens", [])
    if model.config.mask_token_id not in trained_rows:
        raise UsageError(
            f"--init_adapter {str(adapter)!r} does not train the mask token's embedding row "
            f"(id {model.config.mask_token_id}); it was made for another model or mask token."
        )
    return PeftModel.from_pretrained(model, adapter, is_trainable=True)
